#!/bin/sh
# bench/gpu-fit-profile.sh - where the 8B step under --vram 8G goes, and where a decoded token goes:
# a short device call after bench/gpu-first.sh (session 35 measured the 8B step under --vram 8G at
# 3.2x the default step's time, where the plan predicted x1.32 against no recompute).
#   on the device (the device tool; carry [".gpu"] as for gpu-first):  sh bench/gpu-fit-profile.sh $OUT
# Models are all-zero (make-model --zero: seconds, not gpu-first's two minutes; the times do not
# depend on the values). Each run is one finetune under its own time limit; OUT gets runs.txt and logs.tgz.
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu-fit-profile-out}}
M=${WORK:-/tmp/gpu-fit-profile}
L=$M/logs  # (packed into OUT/logs.tgz at the end: the device tool returns at most 8 files)
mkdir -p "$OUT" "$M" "$L"
DEV=${DEV:-cuda}
if [ -f .gpu/bin.tar.xz ] && [ ! -x ./finetune ]; then
    xz -dc .gpu/bin.tar.xz | tar -x -C .gpu && for b in finetune generate make-model; do cp .gpu/bin/$b ./$b; done
fi
S8="--dim 4096 --layers 32 --heads 32 --kv-heads 8 --ff 14336"
[ "${SELFTEST:-0}" = 1 ] && S8="--dim 192 --layers 2 --heads 4 --kv-heads 2 --ff 512" DEV=cpu
V=${VOCAB:-128256}
[ "${SELFTEST:-0}" = 1 ] && V=1024
[ -f "$M/8b.gguf" ] || ./make-model --zero -o "$M/8b.gguf" $S8 --vocab $V --type nf4 --embd-type bf16 --output-type bf16 --ctx 131072 > "$L/models.log" 2>&1
[ -f "$M/d8b.gguf" ] || ./make-model --zero -o "$M/d8b.gguf" $S8 --vocab $V --type q4_K --embd-type f16 --output-type q6_K --ctx 4096 >> "$L/models.log" 2>&1
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 12; i++) { s = ""; for (j = 0; j < 2400; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > "$M/data.jsonl"
SEQ=2048
[ "${SELFTEST:-0}" = 1 ] && SEQ=128
FT="--device $DEV --seq-len $SEQ -b 1 --lora-r 16 --lora-alpha 32 --lora-targets all --precision bf16 --overwrite -m $M/8b.gguf -d $M/data.jsonl"
MEM="--vram 8G"
[ "${SELFTEST:-0}" = 1 ] && MEM="--mem-limit 1G"
# run NAME LIMIT flags...: one finetune, its log and metrics in L
run() {
    name=$1 lim=$2
    shift 2
    timeout -k 5 "$lim" ./finetune $FT -o "$M/$name.out" "$@" > "$L/$name.log" 2>&1
    echo "$name: exit $?" >> "$L/runs.txt"
    cp "$M/$name.out/metrics.jsonl" "$L/$name.jsonl" 2> /dev/null
}
: > "$L/runs.txt"
# the plan auto chose under 8 GiB, profiled (nodes timed by events)
run fit-profile 60 $MEM --max-steps 4 --profile
# the same options, no limit: the baseline the plan's "step time about" compares with, and one change each
run none-nocache 50 --checkpointing none --cache-weights off --max-steps 5
run block-nocache 50 --checkpointing block --cache-weights off --max-steps 5
run block-nocache-chunks 60 --checkpointing block --cache-weights off --loss-chunk 64 --ffn-chunk 512 --max-steps 5
run block-cache 50 --checkpointing block --cache-weights on --max-steps 5
# a decoded token by op (each node waited for: the op's share, not the graph's speed)
timeout -k 5 40 ./generate -m "$M/d8b.gguf" -p "Once upon a time" -n 32 --temp 0 --device $DEV --profile > "$L/decode-profile.log" 2>&1
echo "decode-profile: exit $?" >> "$L/runs.txt"
for f in "$L"/*.jsonl; do
    printf '%s: ' "$(basename "$f" .jsonl)"
    grep -o '"step_seconds": [0-9.]*' "$f" | awk 'NR > 2 { print $2 }' | sort -g | awk '{ v[NR] = $1 } END { if (NR) printf "median step %.4f s of %d\n", v[int((NR + 1) / 2)], NR; else print "no steps" }'
done | tee -a "$L/runs.txt"
cp "$L/runs.txt" "$OUT/runs.txt"
tar -C "$L" -czf "$OUT/logs.tgz" .
grep -E "profile of|census per|^ +[a-z_]+ +[0-9.]+%|nf4|bf16\.bf16|f32\.bf16|checkpointing auto|step time" "$L/fit-profile.log" | head -40
grep -A 24 "decoded token" "$L/decode-profile.log"
cat "$OUT/runs.txt"
