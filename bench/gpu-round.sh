#!/bin/sh
# bench/gpu-round.sh - one device call (under 10 minutes on an H100/H200) after a round of GPU
# work: each phase's log under OUT, the most wanted first, so that a call cut short still brings
# back what ran. Dev-side; the numbers go to bench/RESULTS.md.
#   bench/gpu-round.sh OUT
# Environment (each phase runs when its variable is set):
#   TESTS="doctest filter"   the device suite (./build/test-qlora -tc=...)
#   LLAMA_BENCH=path         bench/gpu-llamacpp.sh: decode against llama.cpp's llama-bench (gzipped is fine)
#   DECODE=1 DECODE_ENV="VAR=V"  decode of those files again with and without DECODE_ENV (an A/B), profiles
#   VARIANTS="name:shape:ENV=V:--flags ..."   bench/gpu-variants.sh's training steps
#   DIST=1                   bench/gpu-dist.sh (rebuilds ./finetune with MPI=1: last; OMPI_BUNDLE)
cd "$(dirname "$0")/.."
OUT=$1
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "gpu-round [$(($(date +%s) - t0))s]: $*"; }
J=$(nproc)
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$OUT/gpu.txt" 2>&1
stamp "build for sm_$CC"
make CUDA=1 CUDA_ARCHS="-gencode arch=compute_$CC,code=sm_$CC" -j"$J" all build/test-qlora tools/bench > "$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log"; exit 1; }
export SKIP_BUILD=1
if [ -n "$LLAMA_BENCH" ]; then
    stamp "decode against llama.cpp"
    bench/gpu-llamacpp.sh "$OUT/llamacpp" > "$OUT/llamacpp.log" 2>&1
    tail -12 "$OUT/llamacpp.log"
fi
if [ -n "$DECODE" ]; then  # the same files (gpu-llamacpp.sh's), each with DECODE_ENV too: an A/B
    stamp "decode A/B: $DECODE_ENV"
    for s in 1b 8b; do
        f=${MODELS:-/tmp/qlora-decode}/$s-q4_K.gguf
        [ -f "$f" ] || continue
        for e in "" "$DECODE_ENV"; do
            for i in 1 2 3; do
                env $e ./generate -m "$f" -p "Once upon a time" -n 128 --temp 0 --device cuda 2>&1 > /dev/null |
                    sed -n 's/.*generated [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\1/p'
            done | sort -g | sed -n 2p | awk -v n="$s q4_K ${e:-default}" '{ printf "%-40s %8.1f tokens/s\n", n, $1 }'
        done
        ./generate -m "$f" -p "Once upon a time" -n 64 --temp 0 --device cuda --profile > "$OUT/profile-decode-$s.txt" 2>&1
    done | tee "$OUT/decode-ab.txt"
fi
if [ -n "$VARIANTS" ]; then
    stamp "training step variants"
    # shellcheck disable=SC2086
    bench/gpu-variants.sh "$OUT/variants" $VARIANTS > "$OUT/variants.log" 2>&1
    tail -12 "$OUT/variants.log"
fi
if [ -n "$TESTS" ]; then
    stamp "device suite: $TESTS"
    ./build/test-qlora -tc="$TESTS" > "$OUT/tests.log" 2>&1
    echo "tests: rc $?"
    grep -E "ERROR|test cases|assertions" "$OUT/tests.log" | tail -8
fi
if [ -n "$DIST" ]; then
    stamp "data parallel through NCCL, one rank"
    bench/gpu-dist.sh "$OUT/dist" 2>&1 | tail -12
fi
stamp done
