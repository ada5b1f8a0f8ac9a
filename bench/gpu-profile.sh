#!/bin/sh
# bench/gpu-profile.sh - on a machine with a CUDA GPU: the training step at the 1B and 8B bench
# shapes (bench/gpu.sh's: NF4 linears, bf16 embedding and head; `make-model --zero` files), its
# tokens/s (CUDA graphs, the default) and where it goes (finetune --profile: node times from
# events, steps 2-4). Dev-side; numbers go to bench/RESULTS.md.
#   bench/gpu-profile.sh [out=gpu-profile-out]   (MODELS=DIR for the model files, default /tmp/qlora-prof)
#   SKIP_BUILD=1: the tree is built already (make CUDA=1 ... all)
cd "$(dirname "$0")/.."
OUT=${1:-gpu-profile-out}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT"
J=$(nproc)
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
[ -n "$SKIP_BUILD" ] || make CUDA=1 CUDA_ARCHS="-gencode arch=compute_$CC,code=sm_$CC" -j"$J" all > "$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log"; exit 1; }
M=${MODELS:-/tmp/qlora-prof}
mkdir -p "$M"
[ -f "$M/1b.gguf" ] || ./make-model --zero -o "$M/1b.gguf" --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192 --vocab 128256 \
    --ctx 4096 --type nf4 --embd-type bf16 --output-type bf16 > /dev/null
[ -f "$M/8b.gguf" ] || ./make-model --zero -o "$M/8b.gguf" --dim 4096 --layers 32 --heads 32 --kv-heads 8 --ff 14336 --vocab 128256 \
    --ctx 4096 --type nf4 --embd-type bf16 --output-type bf16 > /dev/null
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 24; i++) { s = ""; for (j = 0; j < 2400; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > "$M/data.jsonl"
run() {  # name shape steps [flags...]: the median step after 2, tokens/s
    name=$1; shape=$2; n=$3; shift 3
    ./finetune --overwrite -m "$M/$shape.gguf" -d "$M/data.jsonl" -o "$M/$name.out" --device cuda --seq-len 2048 -b 1 --lora-r 16 \
        --lora-alpha 32 --lora-targets all --max-steps "$n" --precision bf16 --checkpointing block "$@" > "$OUT/$name.log" 2>&1 ||
        { echo "$name: FAILED"; tail -3 "$OUT/$name.log"; return; }
    grep -o '"step_seconds": [0-9.]*' "$M/$name.out/metrics.jsonl" | awk 'NR > 2 { print $2 }' | sort -g |
        awk -v w="$name" '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
                           printf "%-20s median step %.4f s  %6.0f tokens/s\n", w, m, 2048 / m }'
}
for s in 1b 8b; do
    run "$s" "$s" 8
    run "$s-profile" "$s" 4 --profile
    grep -A 40 'profile of the training graph' "$OUT/$s-profile.log" | head -60
done
echo done
