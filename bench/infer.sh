#!/bin/sh
# bench/infer.sh - CPU inference: ./generate's tokens/s against llama.cpp's on the same files, with
# the same threads (issue 32 item 4). Random-weight Llamas with a 32000-token vocabulary, made by
# ./make-model in f16 and quantised by ./quantize to Q4_0, Q8_0, Q4_K_M and nf4 (ours alone:
# llama.cpp cannot read it):
#   110m: dim 768, 12 layers, 12 heads, ffn 2048;  1b: dim 2048, 16 layers, 32/8 heads, ffn 8192
# Three measures a file, each tokens/s:
#   decode  the prompt "Once upon a time", then N tokens greedily: tokens/s of those N;
#   prefill a prompt of ~530 tokens (140 random words) evaluated at once (ours: generate's prompt
#           time, the last token's logits; llama.cpp: llama_decode of the batch, the same);
#   long    decode of N tokens after that prompt (attention over ~530 cached keys).
# The tools take turns (before, ours, llama.cpp; R rounds) so that load on the shared machine falls
# on all of them alike, and each cell is the median of its R runs.
#   bench/infer.sh [threads=2] [tokens=64] [rounds=3]
# Environment: BEFORE=path/to/generate (another build, e.g. main's: the 'before' column; unset:
# n/a), LLAMA_PY=a python with llama_cpp (llama-cpp-python, a dev-side yardstick only; unset or
# without it: n/a), SHAPES="110m 1b", TYPES="Q4_0 Q8_0 Q4_K_M nf4", MEASURES="decode prefill long",
# DIR (the models; default a temporary directory, removed after), CHRT=1: every timed run under
# SCHED_FIFO (chrt -f 50, as root), so that other work on a shared machine waits for it.
set -e
cd "$(dirname "$0")/.."
T=${1:-2}
N=${2:-64}
R=${3:-3}
SHAPES=${SHAPES:-"110m 1b"}
TYPES=${TYPES:-"Q4_0 Q8_0 Q4_K_M nf4"}
MEASURES=${MEASURES:-"decode prefill long"}
if [ -z "$DIR" ]; then
    DIR=$(mktemp -d /tmp/qlora-infer-XXXXXX)
    trap 'rm -rf "$DIR"' EXIT
fi
PRIO=""
[ -z "$CHRT" ] || PRIO="chrt -f 50"
make -s -j2 ./make-model ./quantize ./generate
have_llama=0
if [ -n "$LLAMA_PY" ] && "$LLAMA_PY" -c 'import llama_cpp' 2> /dev/null; then have_llama=1; fi
# the long prompt: 140 words drawn from a fixed list (about 530 tokens with the Llama 2 vocabulary)
awk 'BEGIN { srand(3); split("the a cat dog ran sat on mat house tree big small red blue over under quickly slowly and then", w, " ");
             s = ""; for (i = 0; i < 140; i++) s = s (i ? " " : "") w[int(rand() * 20) + 1]; print s }' > "$DIR/prompt.txt"

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "n/a"; else print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# tokens/s a ./generate binary reports on stderr: measure file
ours() {
    case $1 in
    decode)  $PRIO "$2" -m "$3" -p "Once upon a time" -n $N --temp 0 -t $T 2>&1 > /dev/null |
                 sed -n 's/.*generated [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\1/p' ;;
    prefill) $PRIO "$2" -m "$3" -p "$(cat "$DIR/prompt.txt")" -n 1 --temp 0 -t $T 2>&1 > /dev/null |
                 sed -n 's/.*prompt [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\1/p' ;;
    long)    $PRIO "$2" -m "$3" -p "$(cat "$DIR/prompt.txt")" -n $N --temp 0 -t $T 2>&1 > /dev/null |
                 sed -n 's/.*generated [0-9]* tokens in [0-9.]* s (\([0-9.]*\) tokens\/s).*/\1/p' ;;
    esac
}
llama() { $PRIO "$LLAMA_PY" bench/infer_llama_cpp.py "$2" $T $N "$1" "$DIR/prompt.txt"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "n/a" || b == "n/a" || b == 0) print "n/a"; else printf "%.2f", a / b }'; }

echo "| model, file | measure | MiB | before tok/s | ours tok/s | llama.cpp tok/s | ours / before | ours / llama.cpp |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
for shape in $SHAPES; do
    case $shape in
    110m) dims="--dim 768 --layers 12 --heads 12 --ff 2048" ;;
    1b)   dims="--dim 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192" ;;
    *)    echo "infer.sh: unknown shape '$shape' (110m, 1b)" >&2; exit 2 ;;
    esac
    [ -f "$DIR/$shape-f16.gguf" ] || ./make-model -o "$DIR/$shape-f16.gguf" $dims --vocab 32000 --ctx 2048 --type f16 --threads $T > /dev/null
    for type in $TYPES; do
        f="$DIR/$shape-$type.gguf"
        [ -f "$f" ] || ./quantize "$DIR/$shape-f16.gguf" "$f" $type > /dev/null
        for m in $MEASURES; do
            : > "$DIR/before" ; : > "$DIR/ours" ; : > "$DIR/llama"
            for r in $(seq $R); do
                [ -z "$BEFORE" ] || ours $m "$BEFORE" "$f" >> "$DIR/before"
                ours $m ./generate "$f" >> "$DIR/ours"
                [ $have_llama = 0 ] || [ $type = nf4 ] || llama $m "$f" >> "$DIR/llama"
            done
            b=$(median < "$DIR/before") o=$(median < "$DIR/ours") l=$(median < "$DIR/llama")
            mib=$(du -mL "$f" | cut -f1)
            echo "| $shape, $type | $m | $mib | $b | $o | $l | $(ratio $o $b) | $(ratio $o $l) |"
        done
    done
done
