#!/bin/sh
# bench/gpu-variants.sh - on a machine with a CUDA GPU: the training step at bench/gpu.sh's 1B and 8B
# shapes (NF4 linears, bf16 embedding and head, `make-model --zero`; seq 2048, micro-batch 1, r16 on
# all seven linears, bf16, --checkpointing block) in named variants, each its median step after 2 of
# 8, tokens/s, the last loss and the card's memory against the plan. Dev-side; for bench/RESULTS.md.
#   bench/gpu-variants.sh OUT "name:shape:ENV=V,ENV=V:--flag v --flag v" ...
#   (MODELS=DIR for the model files, default /tmp/qlora-prof; SKIP_BUILD=1: built already;
#    TESTS="doctest filter": run ./build/test-qlora -tc=... first; ATTN=1: tools/bench attn too)
cd "$(dirname "$0")/.."
OUT=$1; shift
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
mkdir -p "$OUT"
J=$(nproc)
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
[ -n "$SKIP_BUILD" ] || make CUDA=1 CUDA_ARCHS="-gencode arch=compute_$CC,code=sm_$CC" -j"$J" finetune make-model tools/bench build/test-qlora \
    > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
if [ -n "$TESTS" ]; then
    ./build/test-qlora -tc="$TESTS" > "$OUT/test.log" 2>&1; echo "tests ($TESTS): rc $?"
    grep -E 'MESSAGE|ERROR|assertions' "$OUT/test.log" | head -20
fi
[ -n "$ATTN" ] && ./tools/bench attn -r 5 2>&1 | tee "$OUT/attn.log" | grep -v '^$'
M=${MODELS:-/tmp/qlora-prof}
mkdir -p "$M"
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 24; i++) { s = ""; for (j = 0; j < 2400; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > "$M/data.jsonl"
for v in "$@"; do
    name=$(echo "$v" | cut -d: -f1); shape=$(echo "$v" | cut -d: -f2); envs=$(echo "$v" | cut -d: -f3 | tr ',' ' ')
    flags=$(echo "$v" | cut -d: -f4-)
    case $shape in
    1b) [ -f "$M/1b.gguf" ] || ./make-model --zero -o "$M/1b.gguf" --dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192 \
            --vocab 128256 --ctx 4096 --type nf4 --embd-type bf16 --output-type bf16 > /dev/null ;;
    8b) [ -f "$M/8b.gguf" ] || ./make-model --zero -o "$M/8b.gguf" --dim 4096 --layers 32 --heads 32 --kv-heads 8 --ff 14336 \
            --vocab 128256 --ctx 4096 --type nf4 --embd-type bf16 --output-type bf16 > /dev/null ;;
    esac
    # shellcheck disable=SC2086
    env $envs ./finetune --overwrite -m "$M/$shape.gguf" -d "$M/data.jsonl" -o "$M/$name.out" --device cuda --seq-len 2048 -b 1 \
        --lora-r 16 --lora-alpha 32 --lora-targets all --max-steps 8 --precision bf16 --checkpointing block $flags > "$OUT/$name.log" 2>&1 ||
        { echo "$name: FAILED"; tail -3 "$OUT/$name.log"; continue; }
    grep -o '"step_seconds": [0-9.]*' "$M/$name.out/metrics.jsonl" | awk 'NR > 2 { print $2 }' | sort -g |
        awk -v w="$name" '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
                           printf "%-22s median step %.4f s  %6.0f tokens/s", w, m, 2048 / m }'
    printf "  %s" "$(grep -o '"loss": [0-9.]*' "$M/$name.out/metrics.jsonl" | tail -1)"
    printf "  %s\n" "$(grep -iE 'the card|peak' "$OUT/$name.log" | tail -1 | cut -c1-110)"
done
echo done
