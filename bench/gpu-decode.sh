#!/bin/sh
# bench/gpu-decode.sh - on a machine with a CUDA GPU: decode tokens/s at the 1B and 8B shapes in
# q4_K (q6_K head) and nf4, this tree and BASE=DIR (another source tree) in the same call, then
# where a 1B token goes (generate --profile). Each decode also with QLORA_CUDA_DECODE_DP4A=0 (the
# f32 decode products instead of the 8-bit activations' __dp4a ones). Dev-side; numbers go to bench/RESULTS.md.
#   bench/gpu-decode.sh [out=gpu-decode-out]
# Models are `make-model --zero` files (every weight 0: the bytes, work and launches of a real model
# of the shape; the text is meaningless). Kept out of OUT (MODELS=DIR, default /tmp/qlora-decode).
cd "$(dirname "$0")/.."
OUT=${1:-gpu-decode-out}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT"
J=$(nproc)
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
ARCHS="-gencode arch=compute_$CC,code=sm_$CC"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv > "$OUT/gpu.txt" 2>&1
make CUDA=1 CUDA_ARCHS="$ARCHS" -j"$J" all build/test-qlora > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
if [ -n "$BASE" ]; then (cd "$BASE" && make CUDA=1 CUDA_ARCHS="$ARCHS" -j"$J" generate > "$OUT/base-build.log" 2>&1) & fi
./build/test-qlora -tc="backend ops cuda: mul_mat*" 2>&1 | tail -2 | tee "$OUT/tests.log"
M=${MODELS:-/tmp/qlora-decode}
mkdir -p "$M"
for ty in q4_K nf4; do
    ./make-model --zero -o "$M/1b-$ty.gguf" --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192 --vocab 32000 --type $ty \
        --embd-type f16 --output-type q6_K > /dev/null
    ./make-model --zero -o "$M/8b-$ty.gguf" --dim 4096 --layers 32 --heads 32 --kv-heads 8 --ff 14336 --vocab 128256 --type $ty \
        --embd-type f16 --output-type q6_K > /dev/null
done
decode() {  # name file generate [env...]: the median of 3, and the weight bytes read per second
    name=$1; f=$2; g=$3; shift 3
    for i in 1 2 3; do
        env "$@" "$g" -m "$f" -p "Once upon a time" -n 128 --temp 0 --device cuda 2>&1 > /dev/null |
            sed -n 's/.*generated \([0-9]*\) tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\2 \1/p'
    done | sort -g | sed -n 2p | awk -v w="$name" -v mib=$(($(stat -c %s "$f") / 1048576)) \
        '{ printf "%-28s %7.1f tokens/s (%d tokens)  %.0f GB/s of the file\n", w, $1, $2, mib * 1.048576 * $1 / 1000 }'
}
[ -n "$BASE" ] && wait
for s in 1b 8b; do
    for ty in q4_K nf4; do
        decode "$s $ty" "$M/$s-$ty.gguf" ./generate
        decode "$s $ty, f32 gemv" "$M/$s-$ty.gguf" ./generate QLORA_CUDA_DECODE_DP4A=0  # the f32 decode kernels (A/B)
        [ -n "$BASE" ] && decode "$s $ty, base" "$M/$s-$ty.gguf" "$BASE/generate"
    done
    for r in 1 2; do  # the decode product's rows a block (default 4)
        decode "$s q4_K, gemv rows $r" "$M/$s-q4_K.gguf" ./generate QLORA_CUDA_GEMV_ROWS=$r
    done
done | tee "$OUT/decode.txt"
for s in 1b 8b; do
    ./generate -m "$M/$s-q4_K.gguf" -p "Once upon a time" -n 64 --temp 0 --device cuda --profile > "$OUT/profile-$s.txt" 2>&1
    tail -25 "$OUT/profile-$s.txt"
done
echo done
