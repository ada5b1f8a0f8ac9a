#!/bin/sh
# bench/gpu-ab.sh - on a machine with a CUDA GPU: the step and decode with each of this round's
# GPU changes switched off in turn, on the same card in one call (dev-side; the numbers in
# bench/RESULTS.md "GPU speed, session 8" came from it):
#   bench/gpu-ab.sh [out=gpu-ab-out]     BASE=DIR: another source tree's decode beside
# Models are `make-model --zero` files (every weight 0: the work, bytes and launches of a real
# model of the shape; the loss is meaningless): the 1B and 8B bench shapes (NF4, bf16 embedding
# and head) and a 1B decode shape (vocab 32000) in q4_K and nf4.
# Switches: QLORA_CUDA_GRAPHS=0 (no CUDA graphs), QLORA_CUDA_FA=fused (attention by the fused
# WMMA kernels instead of the chunked cuBLAS products; the default was the fused kernels when
# the session-8 numbers were taken, and the runs named "chunkedfa" set QLORA_CUDA_FA=chunked).
cd "$(dirname "$0")/.."
OUT=${1:-gpu-ab-out}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT"
J=$(nproc)
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
ARCHS="-gencode arch=compute_$CC,code=sm_$CC"
make CUDA=1 CUDA_ARCHS="$ARCHS" -j"$J" all tools/bench build/test-qlora > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
if [ -n "$BASE" ]; then (cd "$BASE" && make CUDA=1 CUDA_ARCHS="$ARCHS" -j"$J" all > "$OUT/base-build.log" 2>&1) & fi
./build/test-qlora -tc="backend ops cuda: mul_mat*" 2>&1 | tail -2
./tools/bench attn -r 5 2>&1 | tail -3
M=$OUT/m
mkdir -p "$M"
./make-model --zero -o "$M/1b.gguf" --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192 --vocab 128256 --ctx 4096 --type nf4 \
    --embd-type bf16 --output-type bf16 > /dev/null
./make-model --zero -o "$M/8b.gguf" --dim 4096 --layers 32 --heads 32 --kv-heads 8 --ff 14336 --vocab 128256 --ctx 4096 --type nf4 \
    --embd-type bf16 --output-type bf16 > /dev/null
for ty in q4_K nf4; do
    ./make-model --zero -o "$M/d-$ty.gguf" --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192 --vocab 32000 --type $ty \
        --embd-type f16 --output-type q6_K > /dev/null
done
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 24; i++) { s = ""; for (j = 0; j < 2400; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > "$M/data.jsonl"
step() {  # name shape steps [env...]: the median step after 2, tokens/s
    name=$1; shape=$2; n=$3; shift 3
    env "$@" ./finetune --overwrite -m "$M/$shape.gguf" -d "$M/data.jsonl" -o "$M/$name.out" --device cuda --seq-len 2048 -b 1 --lora-r 16 \
        --lora-alpha 32 --lora-targets all --max-steps "$n" --precision bf16 --checkpointing block > "$OUT/$name.log" 2>&1 || { echo "$name: FAILED"; tail -3 "$OUT/$name.log"; return; }
    grep -o '"step_seconds": [0-9.]*' "$M/$name.out/metrics.jsonl" | awk 'NR > 2 { print $2 }' | sort -g |
        awk -v w="$name" '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
                           printf "%-28s median step %.4f s  %6.0f tokens/s\n", w, m, 2048 / m }'
}
step 1b 1b 8
step 1b-nographs 1b 8 QLORA_CUDA_GRAPHS=0
step 1b-fusedfa 1b 8 QLORA_CUDA_FA=fused
step 1b-nographs-fusedfa 1b 8 QLORA_CUDA_GRAPHS=0 QLORA_CUDA_FA=fused
step 8b 8b 6
step 8b-fusedfa 8b 6 QLORA_CUDA_FA=fused
grep -h 'card in use' "$OUT/8b.log" | tail -1
decode() {  # name file generate [env...]
    name=$1; f=$2; g=$3; shift 3
    for i in 1 2 3; do
        env "$@" "$g" -m "$f" -p "Once upon a time" -n 128 --temp 0 --device cuda 2>&1 > /dev/null |
            sed -n 's/.*generated \([0-9]*\) tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\2 \1/p'
    done | sort -g | sed -n 2p | awk -v w="$name" -v mib=$(($(stat -c %s "$f") / 1048576)) \
        '{ printf "%-28s %7.1f tokens/s (%d tokens)  %.0f GB/s of weights\n", w, $1, $2, mib * 1.048576 * $1 / 1000 }'
}
[ -n "$BASE" ] && wait
for ty in q4_K nf4; do
    decode "decode $ty" "$M/d-$ty.gguf" ./generate
    decode "decode $ty, no graphs" "$M/d-$ty.gguf" ./generate QLORA_CUDA_GRAPHS=0
    [ -n "$BASE" ] && decode "decode $ty, base" "$M/d-$ty.gguf" "$BASE/generate"
done
command -v nsys > /dev/null && nsys profile -o "$OUT/decode" --stats=true ./generate -m "$M/d-q4_K.gguf" -p "Once" -n 32 --temp 0 \
    --device cuda > "$OUT/nsys.log" 2>&1 && grep -A 14 'cuda_gpu_kern_sum' "$OUT/nsys.log" | head -16
echo done
