#!/bin/sh
# bench/gpu-attn.sh - on a machine with a CUDA GPU: the fused attention kernels against the chunked
# cuBLAS products - correctness (the op suite's attention cases), tools/bench attn in each variant
# (register path with 4 or 8 forward warps, the shared-memory path), and the 1B training step with
# each. Dev-side; numbers go to bench/RESULTS.md.
#   bench/gpu-attn.sh [out=gpu-attn-out]   (MODELS=DIR for the model files, default /tmp/qlora-prof;
#   SKIP_BUILD=1: built already; STEP=0: no training steps; SHAPES="1b 8b": the step's shapes)
cd "$(dirname "$0")/.."
OUT=${1:-gpu-attn-out}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT"
J=$(nproc)
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
[ -n "$SKIP_BUILD" ] || make CUDA=1 CUDA_ARCHS="-gencode arch=compute_$CC,code=sm_$CC" -j"$J" finetune make-model tools/bench build/test-qlora \
    > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
./build/test-qlora -tc="backend ops cuda: flash_attn*" > "$OUT/test.log" 2>&1; echo "attention tests: rc $?"; grep -E 'path|assertions' "$OUT/test.log"
for v in "" "QLORA_CUDA_FA2_WARPS=8" "QLORA_CUDA_FA2_REG=0"; do
    env $v ./tools/bench attn -r 5 2>&1 | tee -a "$OUT/attn.log" | grep -v '^$'
done
[ "${STEP:-1}" = 0 ] && exit 0
M=${MODELS:-/tmp/qlora-prof}
mkdir -p "$M"
for s in ${SHAPES:-1b}; do
    case $s in
    1b) [ -f "$M/1b.gguf" ] || ./make-model --zero -o "$M/1b.gguf" --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192 \
            --vocab 128256 --ctx 4096 --type nf4 --embd-type bf16 --output-type bf16 > /dev/null ;;
    8b) [ -f "$M/8b.gguf" ] || ./make-model --zero -o "$M/8b.gguf" --dim 4096 --layers 32 --heads 32 --kv-heads 8 --ff 14336 \
            --vocab 128256 --ctx 4096 --type nf4 --embd-type bf16 --output-type bf16 > /dev/null ;;
    esac
done
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 24; i++) { s = ""; for (j = 0; j < 2400; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > "$M/data.jsonl"
run() {  # name shape steps [env...]: the median step after 2, tokens/s
    name=$1; shape=$2; n=$3; shift 3
    env "$@" ./finetune --overwrite -m "$M/$shape.gguf" -d "$M/data.jsonl" -o "$M/$name.out" --device cuda --seq-len 2048 -b 1 \
        --lora-r 16 --lora-alpha 32 --lora-targets all --max-steps "$n" --precision bf16 --checkpointing block > "$OUT/$name.log" 2>&1 ||
        { echo "$name: FAILED"; tail -3 "$OUT/$name.log"; return; }
    grep -o '"step_seconds": [0-9.]*' "$M/$name.out/metrics.jsonl" | awk 'NR > 2 { print $2 }' | sort -g |
        awk -v w="$name" '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
                           printf "%-24s median step %.4f s  %6.0f tokens/s\n", w, m, 2048 / m }'
    grep -o '"loss": [0-9.]*' "$M/$name.out/metrics.jsonl" | tail -1
}
for s in ${SHAPES:-1b}; do
    run "$s-chunked" "$s" 8 QLORA_CUDA_FA=chunked
    run "$s-fused" "$s" 8 QLORA_CUDA_FA=fused
    run "$s-fused-w8" "$s" 8 QLORA_CUDA_FA=fused QLORA_CUDA_FA2_WARPS=8
done
echo done
