#!/bin/sh
# bench/seq_fit.sh - the longest sequence whose device plan fits each card size (no GPU needed:
# --dry-run --device cuda --vram X plans for it), by bisection over --seq-len in steps of 256.
#   bench/seq_fit.sh model.gguf data.jsonl "8G 12G 16G 24G" [finetune flags...]
# data.jsonl must hold a text longer than the longest length tried (200k tokens).
set -e
M=$1; D=$2; SIZES=$3; shift 3
EXTRA="$*"  # (flag values without spaces)
fits() {  # seq vram
    ./finetune -m "$M" -d "$D" --dry-run --device cuda --vram $2 --seq-len $1 -b 1 --json $EXTRA 2>/dev/null | tail -1 |
        grep -q '"fits": true'
}
for v in $SIZES; do
    lo=0; hi=782   # in units of 256 tokens: 0 .. 200192
    while [ $lo -lt $hi ]; do
        mid=$(( (lo + hi + 1) / 2 ))
        if fits $((mid * 256)) $v "$@"; then lo=$mid; else hi=$((mid - 1)); fi
    done
    echo "$v: $((lo * 256)) tokens"
done
