#!/bin/sh
# bench/finetune.sh - ./finetune tokens/s and peak RSS on random llama-shaped models, F32 and NF4
# bases, LoRA r16 on q,k,v,o, seq 256, micro-batch 4; then the PyTorch fp32 yardstick
# (bench/finetune_torch.py) on the same shapes when python3-torch is installed.
#   bench/finetune.sh [threads=2] [steps=10]          (make bench-finetune)
# tokens/s = 4 x 256 / the median step time over the steps after the first two; peak RSS from
# /usr/bin/time -v (GNU time), or ru_maxrss where it is missing.
set -e
cd "$(dirname "$0")/.."
T=${1:-2}
STEPS=${2:-10}
W=$(mktemp -d /tmp/qlora-bench-XXXXXX)
trap 'rm -rf "$W"' EXIT
# text that tokenizes to more than 256 tokens per line: random words
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 64; i++) { s = ""; for (j = 0; j < 120; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > $W/data.jsonl
peak() { sed -n 's/.*Maximum resident set size (kbytes): \([0-9]*\).*/\1/p' "$1" | awk '{ printf "%.0f", $1 / 1024 }'; }
TIME=""
[ -x /usr/bin/time ] && TIME="/usr/bin/time -v"
echo "| shape | base | plan MiB | median step s | tokens/s | peak RSS MiB |"
echo "|---|---|---:|---:|---:|---:|"
for shape in "15M:--dim 288 --layers 6 --heads 6 --ff 768" "110M:--dim 768 --layers 12 --heads 12 --ff 2048"; do
    name=${shape%%:*} dims=${shape#*:}
    for type in f32 nf4; do
        ./make-model -o $W/m.gguf $dims --vocab 32000 --ctx 256 --type $type > /dev/null
        $TIME ./finetune --overwrite -m $W/m.gguf -d $W/data.jsonl -o $W/out --seq-len 256 -b 4 --lora-r 16 --lora-alpha 32 \
            --max-steps $STEPS -t $T > $W/log 2> $W/time
        plan=$(sed -n 's/^  total *\([0-9.]*\).*/\1/p' $W/log)
        med=$(grep -o '"step_seconds": [0-9.]*' $W/out/metrics.jsonl | awk 'NR > 2 { print $2 }' | sort -g |
              awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
        rss=$(peak $W/time)
        [ -n "$rss" ] || rss=$(sed -n 's/.*peak memory of training: \([0-9.]*\) MiB.*/\1/p' $W/log)
        echo "| $name | $type | $plan | $med | $(awk -v m=$med 'BEGIN { printf "%.0f", 1024 / m }') | $rss |"
    done
done
if /usr/bin/python3 -c "import torch" 2> /dev/null; then
    echo
    echo "PyTorch fp32 (bench/finetune_torch.py, $T threads, BLAS: $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2> /dev/null)):"
    for shape in "15M:--dim 288 --layers 6 --heads 6 --ff 768" "110M:--dim 768 --layers 12 --heads 12 --ff 2048"; do
        name=${shape%%:*} dims=${shape#*:}
        OPENBLAS_NUM_THREADS=$T OMP_NUM_THREADS=$T $TIME /usr/bin/python3 bench/finetune_torch.py $dims --vocab 32000 \
            --seq 256 --batch 4 --threads $T --steps $STEPS > $W/log 2> $W/time || true
        echo "  $name: $(cat $W/log); GNU time peak RSS $(peak $W/time) MiB"
    done
else
    echo "(PyTorch yardstick skipped: python3-torch is not installed)"
fi
