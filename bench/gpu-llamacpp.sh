#!/bin/sh
# bench/gpu-llamacpp.sh - on a machine with a CUDA GPU: decode tokens/s of ./generate against
# llama.cpp's llama-bench (a CUDA build made dev-side for this card, LLAMA_BENCH=path; it may be
# gzipped) on the same files: the 1B and 8B shapes in q4_K (q6_K head, f16 embedding), batch 1,
# 128 tokens. Dev-side; numbers go to bench/RESULTS.md (issue 32 item 4).
#   LLAMA_BENCH=devbin/llama-bench.gz bench/gpu-llamacpp.sh [out=gpu-llamacpp-out]
# Models are `make-model --zero` files (the bytes and work of a real model of the shape; both
# programs read the same file). MODELS=DIR (default /tmp/qlora-decode); SKIP_BUILD=1: built already.
cd "$(dirname "$0")/.."
OUT=${1:-gpu-llamacpp-out}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT"
J=$(nproc)
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
[ -n "$SKIP_BUILD" ] || make CUDA=1 CUDA_ARCHS="-gencode arch=compute_$CC,code=sm_$CC" -j"$J" generate make-model > "$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log"; exit 1; }
LB=${LLAMA_BENCH:?LLAMA_BENCH=path of llama-bench}
case $LB in *.gz) gunzip -c "$LB" > /tmp/llama-bench && chmod +x /tmp/llama-bench && LB=/tmp/llama-bench ;; esac
M=${MODELS:-/tmp/qlora-decode}
mkdir -p "$M"
for s in 1b 8b; do
    f="$M/$s-q4_K.gguf"
    case $s in
    1b) [ -f "$f" ] || ./make-model --zero -o "$f" --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192 --vocab 32000 --type q4_K \
            --embd-type f16 --output-type q6_K > /dev/null ;;
    8b) [ -f "$f" ] || ./make-model --zero -o "$f" --dim 4096 --layers 32 --heads 32 --kv-heads 8 --ff 14336 --vocab 128256 --type q4_K \
            --embd-type f16 --output-type q6_K > /dev/null ;;
    esac
    for i in 1 2 3; do
        ./generate -m "$f" -p "Once upon a time" -n 128 --temp 0 --device cuda 2>&1 > /dev/null |
            sed -n 's/.*generated \([0-9]*\) tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\2/p'
    done | sort -g | sed -n 2p | awk -v w="$s q4_K, ours (./generate, median of 3)" '{ printf "%-44s %7.1f tokens/s\n", w, $1 }'
    "$LB" -m "$f" -p 0 -n 128 -ngl 99 -fa on,off -r 3 > "$OUT/llama-bench-$s.md" 2> "$OUT/llama-bench-$s.err" ||
        { echo "$s: llama-bench failed"; tail -5 "$OUT/llama-bench-$s.err"; continue; }
    grep -E 'tg128|model' "$OUT/llama-bench-$s.md"
done
echo done
