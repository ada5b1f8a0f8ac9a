#!/bin/sh
# examples/demo.sh - the main job on an embedded default (run by `make demo`; no network, no fixtures):
# a tiny random llama with NF4 base weights, QLoRA-fine-tuned on examples/demo.jsonl, then asked
# the same questions without and with the adapter it learned.
set -e
cd "$(dirname "$0")/.."
D=demo-out
mkdir -p $D
./make-model -o $D/base.gguf --dim 256 --layers 4 --heads 4 --ff 768 --type nf4 --seed 7 --std 0.05
./finetune --overwrite -m $D/base.gguf -d examples/demo.jsonl -o $D --lora-targets all --lr 2e-3 --epochs 40 -b 4 --seq-len 64
echo
ok=0
for qa in "Who lights the lamp?|The lamp keeper." "What is the keeper's rule?|One light, one night, one ship safe home." \
          "Is the book large?|No, it is small."; do
    q=${qa%%|*} want=${qa#*|}
    p="Q: $q
A:"
    printf '%s\n  without the adapter:   ' "Q: $q"
    ./generate -m $D/base.gguf -p "$p" -n 24 --temp 0 2>/dev/null | tail -n 1 | cut -c 3- | tr -cd '[:print:]'
    got=$(./generate -m $D/base.gguf --lora $D/adapter.gguf -p "$p" -n 48 --temp 0 2>/dev/null | tail -n 1 | cut -c 4-)
    printf '\n  with the adapter:      %s\n' "$got"
    [ "$got" = "$want" ] && ok=$((ok + 1))
done
echo
echo "demo: $ok of 3 answers reproduced exactly as trained"
echo "demo: the adapter is in $D/adapter.gguf (llama.cpp) and $D/peft/ (PEFT); loss curve $D/loss.png, metrics $D/metrics.jsonl"
[ $ok -eq 3 ]
