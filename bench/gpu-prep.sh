#!/bin/sh
# bench/gpu-prep.sh - before a GPU lease, on a machine without one: builds what bench/gpu-first.sh's
# one device call carries, so that no lease time goes to compiling. Into .gpu/ (git-ignored):
#   .gpu/bin.tar.xz  finetune generate make-model quantize test-qlora bench, with CUDA for one
#               architecture (CC, default 90: the H100/H200), -march=x86-64-v3 (the device host's
#               processor is not known here), host debug info stripped (25 MB; 4.6 MB compressed)
#   .gpu/amx/   tools/bench built for Sapphire Rapids (AMX, no CUDA): run there only where the
#               host's /proc/cpuinfo has amx_tile
#   .gpu/py/    bitsandbytes (PyPI wheel BNB, default 0.50.2; only its CUDA 13 libraries: the
#               device image's torch is cu130 and has no bitsandbytes) for the PyTorch yardstick
#   .gpu/llama-bench.xz  llama.cpp's llama-bench for the same architecture (static, CUDA), from the
#               source tree LLAMA_SRC (e.g. llama-cpp-python's sdist's vendor/llama.cpp) when given:
#               its CUDA build takes about an hour on 2 cores (LLAMA_BUILD=DIR keeps and reuses it)
#   .gpu/REV, .gpu/CC   the commit the binaries are of, and their architecture
# Builds from a scratch worktree of HEAD: commit first (uncommitted changes are not in it).
# Then: the device tool's run with carry [".gpu"] and command "sh bench/gpu-first.sh $OUT".
#   bench/gpu-prep.sh            PIP=python3 -m pip (any pip that can download)   CC=90
set -e
cd "$(dirname "$0")/.."
ROOT=$PWD
CC=${CC:-90}
BNB=${BNB:-0.50.2}
PIP=${PIP:-python3 -m pip}
J=$(nproc)
T=$(mktemp -d /tmp/qlora-gpu-prep-XXXXXX)
trap 'cd "$ROOT"; git worktree remove --force "$T/src" > /dev/null 2>&1; git worktree remove --force "$T/amx" > /dev/null 2>&1; rm -rf "$T"' EXIT
# (an earlier run's llama-bench.xz is kept unless LLAMA_SRC builds it again: it does not depend on HEAD)
rm -rf .gpu/bin .gpu/bin.tar.xz .gpu/amx .gpu/py .gpu/REV .gpu/CC
[ -n "$LLAMA_SRC" ] && rm -f .gpu/llama-bench.xz
[ -f .gpu/llama-bench.xz ] && echo "gpu-prep: keeping .gpu/llama-bench.xz (LLAMA_SRC=... builds it again)"
mkdir -p .gpu/amx .gpu/py
git worktree add --detach "$T/src" HEAD > /dev/null
git worktree add --detach "$T/amx" HEAD > /dev/null
echo "gpu-prep: CUDA build for sm_$CC ($T/build.log)"
(cd "$T/src" && make CUDA=1 CUDA_ARCHS="-gencode arch=compute_$CC,code=sm_$CC" ARCH=-march=x86-64-v3 -j"$J" \
    finetune generate make-model quantize tools/bench build/test-qlora > "$T/build.log" 2>&1) || { tail -20 "$T/build.log"; exit 1; }
mkdir -p "$T/bin"
for b in finetune generate make-model quantize tools/bench build/test-qlora; do cp "$T/src/$b" "$T/bin/"; done
echo "gpu-prep: Sapphire Rapids build of tools/bench ($T/amx.log)"
(cd "$T/amx" && make ARCH=-march=sapphirerapids -j"$J" tools/bench > "$T/amx.log" 2>&1) || { tail -20 "$T/amx.log"; exit 1; }
cp "$T/amx/tools/bench" .gpu/amx/bench
strip "$T"/bin/* .gpu/amx/bench
tar -C "$T" -cJf .gpu/bin.tar.xz bin  # (xz: a fifth of the 25 MB; the carried tree's limit is 64 MiB)
echo "gpu-prep: bitsandbytes $BNB"
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$T/whl" "bitsandbytes==$BNB"
(cd .gpu/py && unzip -q "$T"/whl/bitsandbytes-*.whl && find . -name 'libbitsandbytes_*.so' ! -name '*cuda13*' ! -name '*cpu*' -delete)
if [ -n "$LLAMA_SRC" ]; then
    LB=${LLAMA_BUILD:-$T/llama}
    echo "gpu-prep: llama.cpp's llama-bench for sm_$CC in $LB ($LB.log)"
    (cmake -S "$LLAMA_SRC" -B "$LB" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$CC-real -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
        -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DGGML_CUDA_NCCL=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="${NVCC:-/usr/local/cuda/bin/nvcc}" &&
        cmake --build "$LB" --target llama-bench -j"$J") > "$LB.log" 2>&1 || { tail -20 "$LB.log"; exit 1; }
    strip -o "$T/llama-bench" "$LB/bin/llama-bench" && xz -9 -c "$T/llama-bench" > .gpu/llama-bench.xz
fi
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (the checkout had uncommitted changes: not in these binaries)')" > .gpu/REV
echo "$CC" > .gpu/CC
du -sh .gpu | sed 's/^/gpu-prep: /'
echo "gpu-prep: done; carry [\".gpu\"] and run: sh bench/gpu-first.sh \$OUT"
