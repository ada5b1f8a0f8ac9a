#!/bin/sh
# tests/gpu-check.sh - the checks that need a real GPU (make CUDA=1 test-gpu); CI has none, so
# there the CUDA backend is tested through the shim only. On a machine with a GPU:
#   1. the op suite against the CPU oracle on the device (test-qlora's "backend ops cuda:" cases);
#   2. the demo with --device auto (so: the GPU), which must reproduce its 3 answers;
#   3. the same 30 fp32 steps on the CPU and the GPU: every loss within 1e-4 relative.
# Exit 0 only when all three ran and passed; no device (or no CUDA in the build) is an error:
# nothing was tested.
set -e
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
W=$(mktemp -d /tmp/qlora-gpu-check-XXXXXX)
trap 'rm -rf "$W"' EXIT
if ! ./make-model -o "$W/m.gguf" --dim 256 --layers 4 --heads 4 --kv-heads 2 --ff 768 --type nf4 --seed 7 --std 0.05 > /dev/null; then
    echo "test-gpu: make-model failed"; exit 1
fi
if ! ./finetune --dry-run -m "$W/m.gguf" -d examples/demo.jsonl --device cuda > "$W/probe.log" 2>&1; then
    echo "test-gpu: nothing tested: $(grep -m1 'device' "$W/probe.log")"; exit 1
fi
echo "test-gpu: 1/3 the op suite on the device"
./"$BUILD"/test-qlora -tc="backend ops cuda*" > "$W/ops.log" 2>&1 || { tail -30 "$W/ops.log"; exit 1; }
grep -q "skipped: no CUDA device" "$W/ops.log" && { echo "test-gpu: the suite found no device"; exit 1; }
tail -3 "$W/ops.log"
echo "test-gpu: 2/3 the demo on the GPU"
./examples/demo.sh > "$W/demo.log" 2>&1 || { tail -20 "$W/demo.log"; exit 1; }
grep -q "^finetune: cuda: " "$W/demo.log" || { echo "test-gpu: the demo did not run on the GPU"; exit 1; }
tail -2 "$W/demo.log"
echo "test-gpu: 3/3 30 fp32 steps, CPU and GPU"
for d in cpu cuda; do
    ./finetune --overwrite -m "$W/m.gguf" -d examples/demo.jsonl -o "$W/$d" --device $d --precision fp32 --lora-dropout 0 \
        --lr 2e-3 --max-steps 30 -b 4 --seq-len 64 > "$W/$d.log" 2>&1 || { tail -5 "$W/$d.log"; exit 1; }
    grep -o '"loss": [0-9.e+-]*' "$W/$d/metrics.jsonl" | awk '{ print $2 }' > "$W/$d.loss"
done
paste "$W/cpu.loss" "$W/cuda.loss" | awk '{ n++; r = ($1 - $2) / ($1 > 0 ? $1 : 1); if (r < 0) r = -r; if (r > w) w = r }
    END { printf "test-gpu: %d steps, largest relative loss difference %.2e\n", n, w; exit !(n == 30 && w <= 1e-4) }'
echo "test-gpu: ok"
