#!/bin/sh
# bench/checkpointing.sh - what recompute costs: ./finetune step time and peak memory with
# --checkpointing none, block, sqrt, and auto under a --mem-limit halfway between block's plan
# and none's, on the 110M shape (dim 768, 12 layers, ffn 2048, vocab 32000, NF4 base), LoRA r16
# on q,k,v,o, 1024 tokens per micro-batch (seq 512 x 2, seq 1024 x 1).
#   bench/checkpointing.sh [threads=2] [steps=6]          (make bench-checkpointing)
# step s = the median step time over the steps after the first; peak = VmHWM after step one's
# start (the plan's comparison line), planned = the plan's total.
set -e
cd "$(dirname "$0")/.."
T=${1:-2}
STEPS=${2:-6}
W=$(mktemp -d /tmp/qlora-bench-XXXXXX)
trap 'rm -rf "$W"' EXIT
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 16; i++) { s = ""; for (j = 0; j < 600; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > $W/data.jsonl
./make-model -o $W/m.gguf --dim 768 --layers 12 --heads 12 --ff 2048 --vocab 32000 --ctx 1024 --type nf4 > /dev/null
total() { sed -n 's/.*"total": \([0-9]*\),.*/\1/p'; }
echo "| seq x batch | checkpointing | planned MiB | peak MiB (VmHWM) | median step s | vs none | recomputed forward FLOPs |"
echo "|---|---|---:|---:|---:|---:|---:|"
for sb in "512 2" "1024 1"; do
    set -- $sb
    S=$1 B=$2
    run="./finetune --overwrite -m $W/m.gguf -d $W/data.jsonl -o $W/out --seq-len $S -b $B --lora-r 16 --lora-alpha 32 -t $T"
    none=$($run --dry-run --json | total)
    block=$($run --dry-run --json --checkpointing block | total)
    mid=$(( (none + block) / 2 ))
    base=""
    for cp in none block sqrt auto; do
        extra="--checkpointing $cp"
        [ $cp = auto ] && extra="$extra --mem-limit $mid"
        $run $extra --max-steps $STEPS > $W/log 2>&1
        planned=$(sed -n 's/^  total *\([0-9.]*\).*/\1/p' $W/log)
        peak=$(sed -n 's/.*peak memory of training: \([0-9.]*\) MiB measured.*/\1/p' $W/log)
        frac=$(sed -n 's/.*recomputes \([0-9]*%\) of the forward FLOPs.*/\1/p' $W/log)
        med=$(grep -o '"step_seconds": [0-9.]*' $W/out/metrics.jsonl | awk 'NR > 1 { print $2 }' | sort -g |
              awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
        [ -n "$base" ] || base=$med
        name=$cp
        [ $cp = auto ] && name="auto, limit $(awk -v m=$mid 'BEGIN { printf "%.0f", m / 1048576 }') MiB"
        echo "| $S x $B | $name | $planned | $peak | $med | $(awk -v m=$med -v b=$base 'BEGIN { printf "%+.0f%%", 100 * (m / b - 1) }') | ${frac:-0%} |"
    done
done
