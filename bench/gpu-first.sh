#!/bin/sh
# bench/gpu-first.sh - the first thing to run on a lent GPU: one command that fits one short lease.
#   here, before the lease:  bench/gpu-prep.sh          (builds .gpu/: the binaries and wheels carried)
#   on the device:           bench/gpu-first.sh [out]   (the device tool: carry [".gpu"], OUT=$OUT)
# A lease here is 15 minutes of device time in all, the machine's start included, and 10 minutes a
# command: so nothing is built there when .gpu/ holds binaries that run (built here for sm_90, the
# H100/H200; otherwise the tools are built there for the card, minutes), and every phase runs
# under its own time limit inside BUDGET seconds (default 570), the most wanted first; a phase that
# no longer fits is skipped and says so. What each phase answers (the issue it measures):
#   ops       the op suite, CUDA graphs and decode cases on the device against the CPU oracle (all)
#   step-1b   the 1B training step with default options (checkpointing auto): tokens/s, MFU, the
#             plan against the card's measured use, the census, attention's backward as auto timed it (issues 31, 28, 30)
#   step-8b   the same at the 8B shape (issue 31's 40% MFU goal)
#   fit-8b    8B at seq 2048 under --vram 8G, default options: the measured peak against the plan
#             and the 6.0e9-byte goal (issue 30)
#   torch-8b  PyTorch + PEFT + bitsandbytes at 8B (issue 31's 2x goal; bitsandbytes carried)
#   decode-*  ./generate at 1B (q4_K, nf4) and 8B (q4_K): tokens/s and the card's bandwidth (issue 32)
#   llama-bench-*  llama.cpp's CUDA decode on the same q4_K files, when .gpu carries a build (issue 32)
#   lean-8b-16k, lean-8b-32k  8B at 16,384 and 32,768 tokens with auto's leanest options pinned (block,
#             offload, late, gradients parked, embedding on the host, paged 8-bit AdamW, dropout inside
#             A's multiply, the feed-forward in chunks of 512, attention's scores 32 MiB, no weight copies):
#             the measured peaks against the plans, and the device bytes a token between them (issue 30
#             item 3's goal: <= 64 KiB; planned 59.1 KiB at cc 9.0 in session 35). (Session 35 ran 32,768 under --vram 12G with
#             default options instead: the plan held within 0.02% after the context fix)
#   attn      tools/bench attn: fused attention (its backward streaming tiles in two buffers, and in one; dK/dV a block per query head, and over all of a group's) against the chunked products (issue 31 item 1)
#   fa-*-1b   the 1B step with the attention backward auto did not choose at step-1b's start (fused
#             kernels or products, each timed there on one layer): the census's largest term (issue 28)
#   pairs-off-1b  the 1B step with QLORA_CUDA_PAIRS=0: what the launch pairs (norms writing their casts and
#             the adapters' dropped copies, SwiGLU its copy, the rotations) are worth (issue 28)
#   torch-1b  the yardstick at 1B
#   profile   the 1B step's --profile (node times from events)
#   amx       tools/bench matmul on the host CPU, AVX-512 and AMX builds side by side, when it has AMX
#             (issue 31 item 5; the AMX kernel has run only through its shim)
# Models are random (make-model, 16 threads, in the background while ops runs): NF4 linears with
# bf16 embedding and head, vocab 128256 (bench/gpu.sh's shapes); the decode files q4_K / nf4 linears
# with a q6_K head (make-model's types: no quantize pass, so not llama.cpp's Q4_K_M mix).
# Output: OUT/summary.md (also printed last) and OUT/logs.tgz (every log); the device tool returns
# at most 8 files, so nothing else is left in OUT. Exit status: the number of failed phases.
# A second call on the still-warm machine (30 s) can go on where the first stopped: REUSE=1 keeps the
# first call's models (WORK/m), SKIP="ops step-1b ..." leaves those phases out (each says so).
# SELFTEST=1: the script's own check on a machine without a GPU (before a lease is spent on it):
# tiny shapes on the CPU through every phase that can run there, the same parsing and summary.
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-first-out}}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
BUDGET=${BUDGET:-570}
T0=$(date +%s)
W=${WORK:-/tmp/gpu-first}
M=$W/m
[ "${REUSE:-0}" = 1 ] || rm -rf "$W"  # (REUSE keeps the first call's logs too: fa-*-1b reads step-1b's)
mkdir -p "$OUT" "$W" "$M"
S=$W/summary.md
: > "$S"
J=$(nproc)
fail=0
MPID=
# the shapes (dim layers heads kv-heads ffn), the vocabularies, tokens a sequence, the device
S1="2048 16 32 8 8192" S8="4096 32 32 8 14336" VOC=128256 DVOC=32000 SEQ=2048 DEV=cuda FIT="--vram 8G"
LEAN="--vram 24G --pack --checkpointing block --offload-activations --offload-late --offload-grads --embd-on-host --optim paged_adamw8bit --lora-dropout-fused 16 --cache-weights off --ffn-chunk 512 --attn-score-mib 32"
L16=16384 L32=32768
OPS="backend ops cuda*,cuda graphs*,cuda decode*,optimizer multi-tensor*"
if [ "${SELFTEST:-0}" = 1 ]; then
    S1="128 2 4 2 384" S8="192 2 4 2 512" VOC=1024 DVOC=1024 SEQ=128 DEV=cpu FIT="--mem-limit 1G"
    LEAN="--mem-limit 1G --pack --checkpointing block" L16=512 L32=1024
    OPS="backend ops cpu: mul_mat*"
fi
say() { echo "$*" >> "$S"; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }
# phase NAME MIN MAX CMD...: the program CMD (not a shell function: `timeout` runs it) for at most
# MAX s, and never past the budget less 20 s for packing up, when at least MIN s are left; its
# output in W/NAME.log, a line in the summary
phase() {
    name=$1 min=$2 max=$3
    shift 3
    case " $SKIP " in *" $name "*) say "- $name: skipped (SKIP)"; return 1 ;; esac
    l=$(($(left) - 20))
    if [ "$l" -lt "$min" ]; then say "- $name: skipped ($l s left of the budget, needs $min)"; return 1; fi
    [ "$l" -lt "$max" ] && max=$l
    t=$(date +%s)
    timeout -k 5 "$max" "$@" > "$W/$name.log" 2>&1
    rc=$?
    ran=$name  # (the last phase that ran: a REUSE call's old logs are not this call's)
    case $rc in
    0) r=ok ;;
    124 | 137) r="TIMED OUT at $max s"; fail=$((fail + 1)) ;;
    *) r="FAILED (exit $rc): $(tail -1 "$W/$name.log" | cut -c1-200)"; fail=$((fail + 1)) ;;
    esac
    say "- $name: $r, $(($(date +%s) - t)) s"
    return $rc
}
finish() {
    if [ -n "$MPID" ] && kill -0 "$MPID" 2> /dev/null; then
        pkill -P "$MPID" 2> /dev/null; kill "$MPID" 2> /dev/null
        say "- models: stopped at the end ($(ls "$M" | grep -c '\.ok$') made)"
    fi
    say ""
    say "failed phases: $fail; $(($(date +%s) - T0)) s of the $BUDGET s budget"
    cp "$S" "$OUT/summary.md"
    (cd "$W" && tar -czf "$OUT/logs.tgz" $(ls *.log */metrics.jsonl 2> /dev/null) summary.md)
    cat "$S"
    exit $fail
}

# ---- the card, the host, the binaries ----
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2> /dev/null | head -1)
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2> /dev/null | head -1 | tr -d '. ')
say "# gpu-first: ${GPU:-no GPU}, cc ${CC:-?}; host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $J threads,"
say "  $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo); AMX: $(grep -q amx_tile /proc/cpuinfo && echo yes || echo no);"
say "  prebuilt: $(cat .gpu/REV 2> /dev/null || echo none); $(date -u '+%Y-%m-%d %H:%M UTC')"
[ "${SELFTEST:-0}" = 1 ] && { say "  SELFTEST: tiny shapes on the CPU"; CC=${CC:-90}; }
[ -n "$CC" ] || { say "no GPU: nvidia-smi gave no compute capability"; finish; }
{ nvidia-smi; nvidia-smi -q -d CLOCK,POWER | head -60; } > "$W/nvidia-smi.log" 2>&1
ok_bins() { ./finetune --help > /dev/null 2>&1 && ./build/test-qlora -ltc > /dev/null 2>&1; }
# unxz FILE: to stdout (xz, or Python's lzma where the image has no xz)
unxz() { xz -dc "$1" 2> /dev/null || python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$1"; }
# libs_for PROGRAM: the folders of the shared libraries it lacks (found anywhere: PyTorch's wheels
# hold NCCL and cuBLAS), for LD_LIBRARY_PATH
libs_for() {
    ldd "$1" 2> /dev/null | awk '/not found/ { print $1 }' | while read -r lib; do
        find / \( -path /proc -o -path /sys \) -prune -o -name "$lib" -printf '%h\n' 2> /dev/null | head -1
    done | sort -u | tr '\n' ':'
}
[ -f .gpu/bin.tar.xz ] && unxz .gpu/bin.tar.xz | tar -x -C .gpu
# cuBLAS 13 where the toolkit is not at /usr/local/cuda (the binaries' rpath): PyTorch's wheels have it
if [ -x .gpu/bin/finetune ]; then
    LP=$(libs_for .gpu/bin/finetune)
    [ -n "$LP" ] && export LD_LIBRARY_PATH=$LP${LD_LIBRARY_PATH:-} && say "  the carried binaries' libraries from $LP"
fi
if [ -x .gpu/bin/finetune ] && [ "$(cat .gpu/CC 2> /dev/null)" = "$CC" ]; then
    mkdir -p build
    for b in finetune generate make-model quantize; do cp .gpu/bin/$b ./$b; done
    cp .gpu/bin/test-qlora build/test-qlora
    cp .gpu/bin/bench tools/bench
    ok_bins && say "- binaries: carried (.gpu, sm_$CC)" || say "- binaries: carried ones do not run here: $(./finetune --help 2>&1 | head -1)"
fi
if ! ok_bins; then
    phase build 60 400 make CUDA=1 CUDA_ARCHS="-gencode arch=compute_$CC,code=sm_$CC" -j"$J" finetune generate make-model quantize \
        build/test-qlora tools/bench || finish
fi

# ---- the models, in the background (ops needs none) ----
shape() { set -- $1; echo "--dim $1 --layers $2 --heads $3 --kv-heads $4 --ff $5"; }
# (the training files' context: 131072, Llama 3.1's, for fit-8b-long; the decode files' 4096: generate's KV cache)
MK="./make-model --threads $J --ctx 4096 --std 0.02"
mk() {  # OUT-FILE make-model flags...: unless REUSE=1 finds it made
    o=$1; shift
    [ -f "${o%.gguf}.ok" ] || { $MK -o "$o" "$@" && touch "${o%.gguf}.ok"; }
}
(
    mk "$M/1b.gguf" $(shape "$S1") --vocab $VOC --type nf4 --embd-type bf16 --output-type bf16 --ctx 131072
    mk "$M/8b.gguf" $(shape "$S8") --vocab $VOC --type nf4 --embd-type bf16 --output-type bf16 --ctx 131072
    for ty in q4_K nf4; do
        mk "$M/d1b-$ty.gguf" $(shape "$S1") --vocab $DVOC --type $ty --embd-type f16 --output-type q6_K
    done
    mk "$M/d8b-q4_K.gguf" $(shape "$S8") --vocab $VOC --type q4_K --embd-type f16 --output-type q6_K
) > "$W/models.log" 2>&1 &
MPID=$!
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 24; i++) { s = ""; for (j = 0; j < 2400; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > "$M/data.jsonl"
# have NAME: waits (within the budget) for the background's model NAME
have() {
    while [ ! -f "$M/$1.ok" ] && [ "$(left)" -gt 40 ] && kill -0 "$MPID" 2> /dev/null; do sleep 1; done
    [ -f "$M/$1.ok" ]
}

# ---- correctness first ----
phase ops 30 170 ./build/test-qlora -tc="$OPS"
if [ "$ran" = ops ]; then
    grep -q "skipped: no CUDA device" "$W/ops.log" && say "  (the suite found no device)"
    grep -E '^\[doctest\] (test cases|assertions)' "$W/ops.log" | sed 's/^/    /' >> "$S"
    grep -E 'ERROR|FAILED' "$W/ops.log" | head -8 | cut -c1-200 | sed 's/^/    /' >> "$S"
fi

# ---- the training step ----
# useful FLOPs per token (bench/gpu.sh's count) of shape "dim layers heads kv ff": LoRA r16, SEQ tokens
fpt() {
    set -- $1
    awk -v E=$1 -v L=$2 -v H=$3 -v KV=$4 -v F=$5 -v V=$VOC -v r=16 -v T=$SEQ 'BEGIN { d = E / H; q = H * d; kv = KV * d
        N = L * (E * q + 2 * E * kv + q * E + 3 * E * F) + E * V
        lora = L * r * ((E + q) + 2 * (E + kv) + (q + E) + 2 * (E + F) + (F + E))
        printf "%.6e", 4 * N + L * 6 * (T / 2) * H * d * 2 + 6 * lora }'
}
PEAK=${PEAK_TFLOPS:-989}  # dense bf16 of the H100 SXM / H200 (datasheet)
FT="--device $DEV --seq-len $SEQ -b 1 --lora-r 16 --lora-alpha 32 --lora-targets all --precision bf16"
# step NAME MODEL STEPS MIN MAX [finetune flags...]: the median step after 2, tokens/s, MFU, memory
# (STEP_ENV: variables for finetune, e.g. QLORA_CUDA_PAIRS=0)
step() {
    name=$1 model=$2 n=$3 min=$4 max=$5
    shift 5
    have "$model" || { say "- $name: skipped (no model: $(tail -1 "$W/models.log"))"; return; }
    phase "$name" "$min" "$max" env $STEP_ENV ./finetune --overwrite -m "$M/$model.gguf" -d "$M/data.jsonl" -o "$W/$name.out" $FT \
        --max-steps "$n" "$@" || return
    case $model in 1b) F=$(fpt "$S1") ;; *) F=$(fpt "$S8") ;; esac
    grep -o '"step_seconds": [0-9.]*' "$W/$name.out/metrics.jsonl" | awk 'NR > 2 { print $2 }' | sort -g |
        awk -v f=$F -v p=$PEAK -v T=$SEQ '{ v[NR] = $1 } END { if (!NR) exit; m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
            printf "    median step %.4f s (%d steps after 2), %.0f tokens/s, MFU %.1f%% of %d TFLOP/s\n", m, NR, T / m, 100 * T / m * f / (p * 1e12), p }' >> "$S"
    # (cuBLASLt's C != D - the residual read where it lives - has run only through the shim: a refusal is said here)
    grep -E "checkpointing auto ->|device memory after|peak memory after|census, one micro-batch|total device memory|cuBLASLt refused|attention's backward:" "$W/$name.log" |
        head -7 | cut -c1-220 | sed 's/^ */    /' >> "$S"
    grep -o '"loss": [0-9.]*' "$W/$name.out/metrics.jsonl" | sed -n '1p;$p' | awk '{ printf "%s%s", (NR > 1 ? " -> " : "    loss "), $2 } END { print "" }' >> "$S"
}
step step-1b 1b 10 30 90
step step-8b 8b 8 45 150
step fit-8b 8b 5 45 120 $FIT

# ---- the yardstick: PyTorch + PEFT + bitsandbytes (carried in .gpu/py) ----
torch_step() {  # 8b | 1b
    case $1 in 8b) set -- 8b $S8 6 ;; *) set -- 1b $S1 10 ;; esac
    [ "${SELFTEST:-0}" = 1 ] && { say "- torch-$1: not in SELFTEST (a GPU's)"; return; }
    phase "torch-$1" 60 150 env PYTHONPATH="$PWD/.gpu/py${PYTHONPATH:+:$PYTHONPATH}" python3 bench/torch_peft.py --init cuda \
        --dim $2 --layers $3 --heads $4 --kv-heads $5 --ff $6 --vocab $VOC --seq $SEQ --steps $7 --warmup 2 &&
        grep -E '^(stack|tokens_per_s|peak_mib)' "$W/torch-$1.log" | sed 's/^/    /' >> "$S"
}
torch_step 8b

# ---- decode: 128 greedy tokens twice, the faster; GB/s of the file's bytes against 4.8 TB/s (H200) / 3.35 (H100) ----
BW=$(case "$GPU" in *H200*) echo 4800 ;; *) echo 3350 ;; esac)
for d in d1b-q4_K d1b-nf4 d8b-q4_K; do
    have $d || { say "- decode-$d: skipped (no model)"; continue; }
    phase "decode-$d" 10 40 sh -c "for i in 1 2; do ./generate -m $M/$d.gguf -p 'Once upon a time' -n 128 --temp 0 --device $DEV; done" &&
        sed -n 's/.*generated [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\1/p' "$W/decode-$d.log" | sort -g | tail -1 |
        awk -v b=$(stat -c %s "$M/$d.gguf") -v bw=$BW '{ printf "    %.1f tokens/s, %.0f GB/s of the file (%.0f MB), %.0f%% of %d GB/s\n",
            $1, b * $1 / 1e9, b / 1e6, 100 * b * $1 / 1e9 / bw, bw }' >> "$S"
done
# the same with QLORA_CUDA_PAIRS=0 (sessions 30-32's decode launches: a norm's / SwiGLU's / attention's
# codes for the next product, q/k/v's and gate/up's products, q's and k's rotations with the two cache
# stores, the products' tails (norm, SwiGLU, rotations and stores), each launched apart - 19 launches
# a layer against 5; the residual stays folded)
for d in d1b-q4_K d8b-q4_K; do
    have $d || continue
    phase "decode-$d-apart" 10 30 env QLORA_CUDA_PAIRS=0 sh -c "for i in 1 2; do ./generate -m $M/$d.gguf -p 'Once upon a time' -n 128 --temp 0 --device $DEV; done" &&
        sed -n 's/.*generated [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\1/p' "$W/decode-$d-apart.log" | sort -g | tail -1 |
        awk '{ printf "    %.1f tokens/s with QLORA_CUDA_PAIRS=0\n", $1 }' >> "$S"
done

# ---- llama.cpp's llama-bench on the same q4_K files (issue 32: >= 1.0x llama.cpp CUDA), when .gpu holds
#      one (bench/gpu-prep.sh: LLAMA_SRC=... builds it for sm_$CC; xz-compressed) ----
if [ -f .gpu/llama-bench.xz ] && [ "$DEV" = cuda ]; then
    unxz .gpu/llama-bench.xz > "$W/llama-bench" && chmod +x "$W/llama-bench"
    LP=$(libs_for "$W/llama-bench")
    [ -n "$LP" ] && say "  llama-bench's libraries from $LP"
    for d in d1b-q4_K d8b-q4_K; do
        [ -f "$M/$d.ok" ] || continue
        phase "llama-bench-$d" 15 60 env LD_LIBRARY_PATH="$LP${LD_LIBRARY_PATH:-}" "$W/llama-bench" -m "$M/$d.gguf" -p 0 -n 128 -ngl 99 -fa on -r 3 &&
            grep -E 'tg128' "$W/llama-bench-$d.log" | sed 's/^/    /' >> "$S"
    done
fi

# ---- 8B at two long sequences, the leanest options pinned (issue 30 item 3: device bytes a token) ----
step lean-8b-16k 8b 1 60 120 $LEAN --seq-len $L16
step lean-8b-32k 8b 1 90 200 $LEAN --seq-len $L32
# (the card's use and ours after step 1, each run's; the difference over the 16k tokens between)
used() { sed -n "s/.*device memory after step 1: ours \([0-9.]*\) MiB peak.*the card in use \([0-9.]*\) MiB.*/\\$1/p" "$W/$2.log" 2> /dev/null | head -1; }
[ "${SELFTEST:-0}" = 1 ] && used() { sed -n 's/.*peak memory after step 1: \([0-9.]*\) MiB measured.*/\1/p' "$W/$2.log" 2> /dev/null | head -1; }
a16=$(used 1 lean-8b-16k) a32=$(used 1 lean-8b-32k) c16=$(used 2 lean-8b-16k) c32=$(used 2 lean-8b-32k)
[ -n "$a16" ] && [ -n "$a32" ] && awk -v a=$a16 -v b=$a32 -v c=${c16:-0} -v d=${c32:-0} -v n=$((L32 - L16)) 'BEGIN {
    printf "    bytes a token from %d more tokens: ours %.1f KiB, the card %.1f KiB (issue 30 item 3: <= 64 KiB)\n", n, (b - a) * 1024 / n, (d - c) * 1024 / n }' >> "$S"

# ---- attention: fused against chunked ----
if [ "$DEV" = cuda ]; then
    phase attn 20 80 ./tools/bench attn -r 5 && grep -E '^(## attention|path|fused|chunked|auto)' "$W/attn.log" | head -14 | sed 's/^/    /' >> "$S"
fi
# the 1B step with the attention backward auto did not choose (step-1b's "attention's backward:"
# line: both timed at the start, one layer; here the whole step's time beside it)
OTHER=fused
grep -q "attention's backward: fused" "$W/step-1b.log" 2> /dev/null && OTHER=products
AB=
[ "$DEV" = cuda ] && AB="--attn-backward $OTHER"
step fa-$OTHER-1b 1b 10 30 60 $AB
# the 1B step with every launch pair off (QLORA_CUDA_PAIRS=0: the norms' casts and adapter copies,
# SwiGLU's copy, the rotations each launched apart; session 36 grouped the copies): against step-1b
STEP_ENV=QLORA_CUDA_PAIRS=0
step pairs-off-1b 1b 10 30 60
STEP_ENV=

torch_step 1b

# ---- where the 1B step goes ----
phase profile 30 60 ./finetune --overwrite -m "$M/1b.gguf" -d "$M/data.jsonl" -o "$W/profile.out" $FT --max-steps 4 --profile &&
    grep -A 24 'profile of the training graph' "$W/profile.log" | cut -c1-160 | sed 's/^/    /' >> "$S"

# ---- the host's AMX (issue 31 item 5), built for Sapphire Rapids in .gpu/amx ----
if grep -q amx_tile /proc/cpuinfo && [ -x .gpu/amx/bench ]; then
    phase amx 20 60 sh -c "./tools/bench matmul -r 5; .gpu/amx/bench matmul -r 5" && grep -i 'bf16' "$W/amx.log" | head -12 | sed 's/^/    /' >> "$S"
fi
finish
