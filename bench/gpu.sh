#!/bin/sh
# bench/gpu.sh - the first GPU benchmark: ./finetune on a 1B-shaped random llama (dim 2048, 22
# layers, 32 heads, 4 kv heads, ffn 5632, vocab 32000: TinyLlama's shape), NF4 base, LoRA r16 on
# all seven targets, seq 2048 x micro-batch 1, bf16, on the GPU.
#   bench/gpu.sh [steps=12] [device=cuda]      (needs a build with CUDA: make CUDA=1)
# tokens/s = 2048 / the median step time over the steps after the first two; peak device memory
# is what qlora allocated (the CUDA context, ~300-500 MiB, comes on top: nvidia-smi shows both).
set -e
cd "$(dirname "$0")/.."
STEPS=${1:-12}
DEV=${2:-cuda}
W=$(mktemp -d /tmp/qlora-gpu-bench-XXXXXX)
trap 'rm -rf "$W"' EXIT
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 32; i++) { s = ""; for (j = 0; j < 1600; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > $W/data.jsonl
./make-model -o $W/m.gguf --dim 2048 --layers 22 --heads 32 --kv-heads 4 --ff 5632 --vocab 32000 --ctx 2048 --type nf4 > /dev/null
./finetune --overwrite -m $W/m.gguf -d $W/data.jsonl -o $W/out --device $DEV --seq-len 2048 -b 1 --lora-r 16 --lora-alpha 32 \
    --lora-targets all --max-steps $STEPS --precision bf16 > $W/log 2>&1 || { cat $W/log; exit 1; }
grep -E "^finetune: (cuda|device memory|done)" $W/log
med=$(grep -o '"step_seconds": [0-9.]*' $W/out/metrics.jsonl | awk 'NR > 2 { print $2 }' | sort -g |
      awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
echo "median step ${med} s, $(awk -v m=$med 'BEGIN { printf "%.0f", 2048 / m }') tokens/s"
