#!/bin/sh
# bench/finetune.sh - ./finetune against the Python stack on the CPU: tokens/s and peak RSS on random
# llama-shaped models (F32 and NF4 bases), LoRA r16 alpha 32 dropout 0.05 on q,k,v,o, AdamW, clipping
# 1.0, seq 256 x micro-batch 4, fp32 and bf16; the yardstick is bench/finetune_torch.py (transformers'
# LlamaForCausalLM + PEFT, the newest PyTorch: bench/requirements-torch.txt) with the same settings
# (bf16: torch.autocast). Runs interleave (ours F32, ours NF4, torch; then again) so that a machine's
# drift touches all alike; a cell is the median over the repetitions of each run's median step.
#   bench/finetune.sh [threads=2] [steps=10] [reps=3] [shapes="15M 110M 1B"]     (make bench-finetune)
#   PYTHON=.venv-bench/bin/python (default; without it the torch columns are left empty)
# tokens/s = 4 x 256 / step seconds, the median over a run's steps after the first two; peak RSS from
# GNU time -v.
set -e
cd "$(dirname "$0")/.."
T=${1:-2}
STEPS=${2:-10}
REPS=${3:-3}
SHAPES=${4:-"15M 110M 1B"}
PY=${PYTHON:-.venv-bench/bin/python}
W=$(mktemp -d /tmp/qlora-bench-XXXXXX)
trap 'rm -rf "$W"' EXIT
# text that tokenizes to more than 256 tokens per line: random words
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 64; i++) { s = ""; for (j = 0; j < 120; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > $W/data.jsonl
peak() { sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\).*/\1/p' "$1" | awk '{ printf "%.0f", $1 / 1024 }'; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print ""; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
dims_of() {
    case $1 in
    15M) echo "--dim 288 --layers 6 --heads 6 --kv-heads 6 --ff 768" ;;
    110M) echo "--dim 768 --layers 12 --heads 12 --kv-heads 12 --ff 2048" ;;
    1B) echo "--dim 2048 --layers 22 --heads 32 --kv-heads 4 --ff 5632" ;;  # TinyLlama 1.1B
    *) echo "unknown shape $1" >&2; exit 2 ;;
    esac
}
have_torch=0
[ -x "$PY" ] && "$PY" -c "import torch, transformers, peft" 2> /dev/null && have_torch=1
ours() {  # shape type precision -> appends "seconds rss" to $W/r.<shape>.<type>.<precision>
    /usr/bin/time -v ./finetune --overwrite -m $W/$1-$2.gguf -d $W/data.jsonl -o $W/out --seq-len 256 -b 4 --lora-r 16 \
        --lora-alpha 32 --lora-dropout 0.05 --max-grad-norm 1.0 --precision $3 --max-steps $STEPS -t $T > $W/log 2> $W/time
    med=$(grep -o '"step_seconds": [0-9.]*' $W/out/metrics.jsonl | awk 'NR > 2 { print $2 }' | median)
    echo "$med $(peak $W/time)" >> $W/r.$1.$2.$3
}
theirs() {  # shape precision
    d=$(dims_of $1)
    OMP_NUM_THREADS=$T /usr/bin/time -v "$PY" bench/finetune_torch.py $d --vocab 32000 --seq 256 --batch 4 --threads $T \
        --steps $STEPS --precision $2 > $W/log 2> $W/time
    med=$(sed -n 's/.*median step \([0-9.]*\) s.*/\1/p' $W/log)
    [ -n "$med" ] && echo "$med $(peak $W/time)" >> $W/r.$1.torch.$2
    sed -n "s/^\(torch .* peft [^ ]*\) .*/\1/p" $W/log | head -1 > $W/torch.version
}
for s in $SHAPES; do
    for type in f32 nf4; do ./make-model -o $W/$s-$type.gguf $(dims_of $s) --vocab 32000 --ctx 256 --type $type > /dev/null; done
    r=0
    while [ $r -lt $REPS ]; do
        for p in fp32 bf16; do
            ours $s f32 $p
            ours $s nf4 $p
            [ $have_torch = 1 ] && theirs $s $p
        done
        r=$((r + 1))
    done
    rm -f $W/$s-*.gguf
done
cell() { [ -f $W/r.$1 ] && awk '{ print $1 }' $W/r.$1 | median; }   # median seconds
rss() { [ -f $W/r.$1 ] && awk '{ print $2 }' $W/r.$1 | median; }
tps() { [ -n "$1" ] && awk -v s=$1 'BEGIN { printf "%.0f", 1024 / s }'; }
ratio() { [ -n "$1" ] && [ -n "$2" ] && awk -v a=$1 -v b=$2 'BEGIN { printf "%.2f", a / b }'; }
echo "threads $T, $STEPS steps per run, $REPS interleaved runs; $(grep -o 'avx512f\|avx512_bf16\|amx_bf16\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
[ $have_torch = 1 ] && echo "yardstick: $(cat $W/torch.version)" || echo "yardstick: none ($PY with torch, transformers, peft not found)"
echo
echo "| shape | precision | ours F32 tok/s | ours NF4 tok/s | torch tok/s | F32 / torch | NF4 / torch | RSS MiB ours F32 / NF4 / torch | RSS F32 / torch |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|"
for s in $SHAPES; do
    for p in fp32 bf16; do
        a=$(cell $s.f32.$p) b=$(cell $s.nf4.$p) c=$(cell $s.torch.$p)
        ra=$(rss $s.f32.$p) rb=$(rss $s.nf4.$p) rc=$(rss $s.torch.$p)
        echo "| $s | $p | $(tps $a) | $(tps $b) | $(tps $c) | $(ratio $c $a) | $(ratio $c $b) | $ra / $rb / $rc | $(ratio $ra $rc) |"
    done
done
