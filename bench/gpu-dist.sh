#!/bin/sh
# bench/gpu-dist.sh - on a machine with one CUDA GPU: data parallel through NCCL with one rank
# (issue 33 item 4). Builds ./finetune with MPI=1 CUDA=1, then trains a small NF4 llama twice on
# the GPU, the same flags: once plainly, once with QLORA_DIST_ALWAYS=1 (each step's gradients
# all-reduced by NCCL, its id over MPI) started as an MPI singleton - OpenMPI 4 needs no mpirun for
# one process. The losses must be equal (a sum over one rank). NCCL_DEBUG=INFO shows NCCL's start.
#   bench/gpu-dist.sh [out=gpu-dist-out]
#   OMPI_BUNDLE=file.tgz: an OpenMPI runtime + headers packed on a Debian 12 machine (dpkg -L of
#   libopenmpi3 openmpi-bin openmpi-common libopenmpi-dev and their libraries), unpacked at / first,
#   for a machine without OpenMPI. Dev-side; the numbers go to bench/RESULTS.md.
cd "$(dirname "$0")/.."
OUT=${1:-gpu-dist-out}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT"
if [ -n "$OMPI_BUNDLE" ]; then
    tar xzf "$OMPI_BUNDLE" -C / && ldconfig || { echo "gpu-dist: cannot unpack $OMPI_BUNDLE"; exit 1; }
fi
MPICXX=${MPICXX:-$(command -v mpicxx || command -v mpicxx.openmpi)}
[ -n "$MPICXX" ] || { echo "gpu-dist: no mpicxx (OMPI_BUNDLE=...)"; exit 1; }
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
make MPI=1 MPICXX="$MPICXX" CUDA=1 CUDA_ARCHS="-gencode arch=compute_$CC,code=sm_$CC" -j"$(nproc)" finetune make-model \
    > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
M=$OUT/m
mkdir -p "$M"
./make-model -o "$M/m.gguf" --dim 512 --layers 4 --heads 8 --kv-heads 4 --ff 1376 --vocab 4096 --type nf4 > /dev/null || exit 1
awk 'BEGIN { srand(2); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 64; i++) { s = ""; for (j = 0; j < 300; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > "$M/data.jsonl"
# PMIX_MCA_preg=raw: on an H200 host (not Debian) the singleton's daemon crashed in PMIx's native
# regex generator (pmix_preg_base_generate_ppn) with Debian 12's OpenMPI 4.1.4 carried there
export PMIX_MCA_preg=raw OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
LAUNCH=${LAUNCH:-}  # e.g. "mpirun.openmpi -np 1": through mpirun instead of a singleton
run() {  # name [env...]: the steps' losses into OUT/name.losses
    name=$1; shift
    env "$@" $LAUNCH ./finetune -m "$M/m.gguf" -d "$M/data.jsonl" --device cuda \
        --seq-len 256 -b 4 --grad-accum 2 --lora-targets all --precision bf16 --max-steps 6 -o "$OUT/$name" > "$OUT/$name.log" 2>&1
    echo "$name: rc $?"
    sed -n 's/.*"loss": *\([0-9.e+-]*\).*/\1/p' "$OUT/$name/metrics.jsonl" > "$OUT/$name.losses"
}
run plain
run nccl QLORA_DIST_ALWAYS=1 NCCL_DEBUG=INFO
grep -m3 "NCCL INFO" "$OUT/nccl.log"
grep -m2 "data parallel\|all-reduce" "$OUT/nccl.log"
paste "$OUT/plain.losses" "$OUT/nccl.losses"
if [ -s "$OUT/plain.losses" ] && cmp -s "$OUT/plain.losses" "$OUT/nccl.losses"; then echo "gpu-dist: equal losses"; else echo "gpu-dist: the losses differ or are missing"; fi
