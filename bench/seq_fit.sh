#!/bin/sh
# bench/seq_fit.sh - the longest sequence whose device plan fits each card size (no GPU needed:
# --dry-run --device cuda --vram X plans for it), by bisection over --seq-len in steps of 256,
# and what that plan holds: device total, the host memory it needs (pinned offload included) and
# the policy the tool chose.
#   bench/seq_fit.sh model.gguf data.jsonl "8G 12G 16G 24G" [finetune flags...]
# data.jsonl must hold a text longer than the longest length tried (MAX, default 200192 tokens).
# The host's free memory bounds offload: a plan is made for this machine's RAM (or --host-mem).
# MIN (default 0) narrows the search from below when a length known to fit is given: each plan of
# a long sequence takes minutes on a small machine.
set -e
M=$1; D=$2; SIZES=$3; shift 3
MAX=${MAX:-200192}
MIN=${MIN:-0}
plan() {  # seq vram [flags]: the plan's JSON line
    s=$1; v=$2; shift 2
    ./finetune -m "$M" -d "$D" --dry-run --device cuda --vram $v --seq-len $s -b 1 --json "$@" 2>/dev/null | tail -1
}
fits() { plan "$@" | grep -q '"fits": true'; }
for v in $SIZES; do
    lo=$((MIN / 256)); hi=$((MAX / 256))
    while [ $lo -lt $hi ]; do
        mid=$(( (lo + hi + 1) / 2 ))
        if fits $((mid * 256)) $v "$@"; then lo=$mid; else hi=$((mid - 1)); fi
    done
    T=$((lo * 256))
    if [ $T -eq 0 ]; then echo "$v: nothing fits"; continue; fi
    plan $T $v "$@" | python3 -c '
import json, sys
d = json.load(sys.stdin); h = d.get("host", {}); G = 2**30
print("%s: %d tokens  device %.2f GiB  host %.1f GiB (pinned %.1f)  %s, optimizer %s" % (sys.argv[1], int(sys.argv[2]),
      d["total"] / G, (h.get("process", 0) + h.get("planned", 0)) / G, h.get("pinned", 0) / G, d["checkpointing"][:48],
      d.get("optimizer_name", "?")))' "$v" "$T"
done
