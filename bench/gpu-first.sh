#!/bin/sh
# bench/gpu-first.sh - what to run first on a machine with a CUDA GPU, in one command:
#   bench/gpu-first.sh [out=gpu-first-out]
# 1. build with CUDA for this card only (make CUDA=1, CUDA_ARCHS from nvidia-smi's compute
#    capability: minutes less than all of sm_75..sm_90);
# 2. the op suite on the device against the CPU oracle (test-qlora's "backend ops cuda*" cases);
# 3. micro-benchmarks: ./tools/bench's GPU modes where the build has them (`bench attn`: fused
#    attention against the chunked cuBLAS products, forward and backward TFLOP/s);
# 4. bench/gpu.sh at the 1B shape (and 8B when SHAPES says so), PyTorch + PEFT + bitsandbytes in
#    the same call when python3 has them;
# 5. the 1B step's profile (finetune --profile, steps 2..4);
# 6. decode: ./generate --device cuda at the 1B shape in Q4_K_M and nf4 (and BASE's, beside it).
# BASE=DIR (optional): a second source tree (e.g. `git archive <commit> | tar -x -C DIR`), built
# the same way, whose 1B step runs beside this one's on the same card - the before/after pair.
# Every part runs even when an earlier one failed; the logs and a summary go to OUT; the exit
# status is the number of failed parts.
cd "$(dirname "$0")/.."
OUT=${1:-gpu-first-out}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
SHAPES=${SHAPES:-1b}
STEPS=${STEPS:-10}
J=$(nproc)
mkdir -p "$OUT"
S="$OUT/summary.md"
: > "$S"
fail=0
say() { echo "$*" | tee -a "$S"; }
part() {  # part NAME CMD...: runs CMD, its output in OUT/NAME.log, a line in the summary
    name=$1; shift
    t0=$(date +%s)
    if "$@" > "$OUT/$name.log" 2>&1; then r=ok; else r="FAILED (exit $?)"; fail=$((fail + 1)); fi
    say "- $name: $r, $(($(date +%s) - t0)) s"
}
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
[ -n "$CC" ] || { say "no GPU (nvidia-smi gave no compute capability)"; exit 1; }
ARCHS="-gencode arch=compute_$CC,code=sm_$CC"
say "# gpu-first on $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1), cc $CC"
build() { make CUDA=1 CUDA_ARCHS="$ARCHS" -j"$J" all build/test-qlora tools/bench; }
part build build
if [ -n "$BASE" ]; then
    (cd "$BASE" && make CUDA=1 CUDA_ARCHS="$ARCHS" -j"$J" all > "$OUT/base-build.log" 2>&1) &
    base_pid=$!
fi
part ops ./build/test-qlora -tc="backend ops cuda*,cuda graphs*,optimizer multi-tensor cuda*"
tail -3 "$OUT/ops.log" | sed 's/^/    /' >> "$S"
if ./tools/bench --help 2>&1 | grep -q attn; then
    part bench-attn ./tools/bench attn -r 10
    grep -i 'tflop' "$OUT/bench-attn.log" | sed 's/^/    /' >> "$S"
fi
part gpu-bench env KEEP="$OUT/gpu" NO_BUILD=1 sh bench/gpu.sh "$SHAPES" "$STEPS" 2
grep '^|' "$OUT/gpu-bench.log" >> "$S"
M="$OUT/gpu/1b.gguf"
if [ -n "$BASE" ] && [ -f "$M" ]; then
    wait "$base_pid" || say "- base build FAILED"
    for who in base this; do
        dir=.; [ $who = base ] && dir=$BASE
        part "step-$who" "$dir/finetune" --overwrite -m "$M" -d "$OUT/gpu/data.jsonl" -o "$OUT/$who.out" --device cuda --seq-len 2048 -b 1 \
            --lora-r 16 --lora-alpha 32 --lora-targets all --max-steps $((STEPS + 2)) --precision bf16 --checkpointing block
        grep -o '"step_seconds": [0-9.]*' "$OUT/$who.out/metrics.jsonl" | awk 'NR > 2 { print $2 }' | sort -g |
            awk -v w=$who '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
                            printf "    %s: median step %.4f s, %.0f tokens/s\n", w, m, 2048 / m }' >> "$S"
    done
fi
if [ -f "$M" ]; then
    part profile ./finetune --overwrite -m "$M" -d "$OUT/gpu/data.jsonl" -o "$OUT/prof.out" --device cuda --seq-len 2048 -b 1 \
        --lora-r 16 --lora-alpha 32 --lora-targets all --max-steps 4 --precision bf16 --checkpointing block --profile
    grep -A 25 'profile of the training graph' "$OUT/profile.log" | sed 's/^/    /' >> "$S"
fi
# 6. decode (issue 32 item 3): ./generate --device cuda on a 1B shape (vocab 32000) in Q4_K_M and
#    nf4, 128 greedy tokens; the fraction of the card's memory bandwidth is the file's bytes x
#    tokens/s over the datasheet's figure (BW_GBS overrides)
bw_of() { case "$1" in *H200*) echo 4800 ;; *H100*PCIe*) echo 2000 ;; *H100*) echo 3350 ;; *A100*) echo 2039 ;; *4090*) echo 1008 ;;
          *L40S*) echo 864 ;; *) echo 0 ;; esac; }
BW=${BW_GBS:-$(bw_of "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)")}
D="$OUT/decode"
mkdir -p "$D"
part decode-models sh -c "./make-model --threads $J -o $D/f16.gguf --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192 --vocab 32000 \
    --type f16 --embd-type f16 --output-type f16 && ./quantize $D/f16.gguf $D/Q4_K_M.gguf Q4_K_M && ./quantize $D/f16.gguf $D/nf4.gguf nf4"
for ty in Q4_K_M nf4; do
    [ -f "$D/$ty.gguf" ] || continue
    mib=$(($(stat -c %s "$D/$ty.gguf") / 1048576))
    for who in base this; do
        g=./generate; [ $who = base ] && { [ -n "$BASE" ] || continue; g=$BASE/generate; }
        for i in 1 2 3; do
            "$g" -m "$D/$ty.gguf" -p "Once upon a time" -n 128 --temp 0 --device cuda 2>&1 > /dev/null |
                sed -n 's/.*generated [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\1/p'
        done > "$D/$ty.$who.tps"
        tps=$(sort -g "$D/$ty.$who.tps" | sed -n 2p)
        say "    decode 1B $ty ($mib MiB) $who: ${tps:-FAILED} tokens/s$( [ -n "$tps" ] && [ "$BW" != 0 ] &&
            awk -v m=$mib -v t=$tps -v b=$BW 'BEGIN { printf ", %.1f%% of %d GB/s", 100 * m * 1.048576 * t / 1000 / b, b }')"
    done
done
say "failed parts: $fail"
exit $fail
