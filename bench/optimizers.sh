#!/bin/sh
# bench/optimizers.sh - ./finetune tokens/s and optimizer-state memory for each --precision and
# --optim on the 110M shape (dim 768, 12 layers, ffn 2048, vocab 32000, NF4 base), LoRA r16 on
# all seven targets, seq 256 x micro-batch 4.
#   bench/optimizers.sh [threads=2] [steps=8]          (make bench-optimizers)
# tokens/s = 1024 / the median step time over the steps after the first two. The paged
# optimizers run in fp32 only (on the CPU backend they are the same computation).
set -e
cd "$(dirname "$0")/.."
T=${1:-2}
STEPS=${2:-8}
W=$(mktemp -d /tmp/qlora-bench-XXXXXX)
trap 'rm -rf "$W"' EXIT
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 64; i++) { s = ""; for (j = 0; j < 120; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > $W/data.jsonl
./make-model -o $W/m.gguf --dim 768 --layers 12 --heads 12 --ff 2048 --vocab 32000 --ctx 256 --type nf4 > /dev/null
echo "| precision | optimizer | state MiB (bytes/param) | median step s | tokens/s | final loss | saved activations MiB | peak MiB |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
for run in fp32:adamw fp32:adamw8bit fp32:paged_adamw fp32:paged_adamw8bit bf16:adamw bf16:adamw8bit fp16:adamw fp16:adamw8bit; do
    prec=${run%%:*} opt=${run#*:}
    ./finetune --overwrite -m $W/m.gguf -d $W/data.jsonl -o $W/out --seq-len 256 -b 4 --lora-r 16 --lora-alpha 32 \
        --lora-targets all --max-steps $STEPS -t $T --optim $opt --precision $prec > $W/log 2>&1
    state=$(sed -n 's/^  optimizer state ([a-z0-9_]*) *\([0-9.]*\) *\([0-9.]*\) bytes per parameter.*/\1 (\2)/p' $W/log)
    saved=$(sed -n 's/^  saved activations[^0-9]*\([0-9.]*\).*/\1/p' $W/log | head -1)
    med=$(grep -o '"step_seconds": [0-9.]*' $W/out/metrics.jsonl | awk 'NR > 2 { print $2 }' | sort -g |
          awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
    loss=$(sed -n 's/.*final loss \([0-9.]*\).*/\1/p' $W/log)
    peak=$(sed -n 's/.*peak memory of training: \([0-9.]*\) MiB.*/\1/p' $W/log)
    echo "| $prec | $opt | $state | $med | $(awk -v m=$med 'BEGIN { printf "%.0f", 1024 / m }') | $loss | $saved | $peak |"
done
