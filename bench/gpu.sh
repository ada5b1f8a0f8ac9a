#!/bin/sh
# bench/gpu.sh - the GPU benchmark, one command on a machine with a CUDA GPU:
#   bench/gpu.sh [shapes="1b 8b"] [steps=20] [warmup=3]
# 1. builds with CUDA (make CUDA=1 BUILD=build/cuda: the tools in the checkout then have it;
#    NO_BUILD=1: the tools in the checkout are already built with CUDA, use them as they are);
# 2. makes random llamas of Llama-3.2-1B's shape (dim 2048, 16 layers, 32/8 heads, ffn 8192) and
#    Llama-3-8B's (dim 4096, 32 layers, 32/8 heads, ffn 14336), vocab 128256, NF4 linear
#    weights, bf16 embedding and output (make-model streams them: each byte written once);
# 3. ./finetune: LoRA r16 alpha 32 on all seven linear targets, seq 2048, micro-batch 1, bf16,
#    --checkpointing block, warmup + steps steps; tokens/s from the median step after warm-up,
#    MFU = useful FLOPs per token x tokens/s / the card's dense bf16 peak (PEAK_TFLOPS overrides
#    the table below). Useful FLOPs per token (recompute not counted): forward 2N + input
#    gradient 2N (N: the matmul weights, the output head included), attention 3 x 2 x 2 x T/2 x
#    n_head x head_dim per layer (causal: half the keys; forward 2 matmuls, backward 4), LoRA
#    6 r (in + out) per adapted matrix (forward, input gradient, weight gradient).
#    Peak device memory: the card's use after step 1 (cudaMemGetInfo, the context included)
#    and qlora's own high-water mark, beside the plan printed before step one.
# 4. the same shapes through PyTorch + PEFT (bench/torch_peft.py: transformers'
#    LlamaForCausalLM from a config, bitsandbytes NF4 when importable - else bf16 LoRA, said so -
#    SDPA attention, gradient checkpointing), when python3 has torch, transformers and peft.
# Output: one table (markdown) on stdout, the logs in $KEEP (default: a temporary directory).
set -e
cd "$(dirname "$0")/.."
SHAPES=${1:-"1b 8b"}
STEPS=${2:-20}
WARM=${3:-3}
W=${KEEP:-$(mktemp -d /tmp/qlora-gpu-bench-XXXXXX)}
mkdir -p "$W"
[ -n "$NO_BUILD" ] || make CUDA=1 BUILD=build/cuda -j"$(nproc)" all > "$W/build.log" 2>&1 || { tail -20 "$W/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$W/gpu.txt" 2>/dev/null || echo "unknown GPU" > "$W/gpu.txt"
GPU=$(head -1 "$W/gpu.txt")
# dense bf16 (fp32 accumulate) tensor-core peaks, TFLOPS (vendor datasheets)
peak_of() {
    case "$1" in
    *H200*|*H100*SXM*|*"H100 80GB HBM3"*) echo 989 ;;
    *H100*PCIe*|*"H100 PCIe"*) echo 756 ;;
    *H100*) echo 989 ;;
    *A100*) echo 312 ;;
    *L40S*) echo 362 ;;
    *L4*) echo 121 ;;
    *4090*) echo 165 ;;
    *3090*) echo 71 ;;
    *A10G*|*A10*) echo 125 ;;
    *T4*) echo 65 ;;
    *) echo 0 ;;
    esac
}
PEAK=${PEAK_TFLOPS:-$(peak_of "$GPU")}
awk 'BEGIN { srand(1); split("the a little dog cat ran sun happy big tree said to and was he she it in on play", w, " ");
             for (i = 0; i < 24; i++) { s = ""; for (j = 0; j < 2400; j++) s = s (j ? " " : "") w[int(rand() * 20) + 1];
                                        printf "{\"text\": \"%s\"}\n", s } }' > "$W/data.jsonl"
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# useful FLOPs per token: dim layers heads kv ff vocab r T
flops_per_token() {
    awk -v E=$1 -v L=$2 -v H=$3 -v KV=$4 -v F=$5 -v V=$6 -v r=$7 -v T=$8 'BEGIN {
        d = E / H; q = H * d; kv = KV * d
        N = L * (E * q + 2 * E * kv + q * E + 3 * E * F) + E * V
        lora = L * r * ((E + q) + 2 * (E + kv) + (q + E) + 2 * (E + F) + (F + E))
        att = L * 6 * (T / 2) * H * d * 2
        printf "%.6e", 4 * N + att + 6 * lora }'
}
echo "| shape | stack | tokens/s | MFU | peak device memory | plan | notes |"
echo "|---|---|---:|---:|---:|---:|---|"
for shape in $SHAPES; do
    case $shape in
    1b) A="2048 16 32 8 8192 128256" ;;
    8b) A="4096 32 32 8 14336 128256" ;;
    *) echo "bench/gpu.sh: unknown shape '$shape' (1b, 8b)" >&2; exit 2 ;;
    esac
    set -- $A
    M="$W/$shape.gguf"
    if [ ! -f "$M" ]; then
        /usr/bin/time -f "%e s" ./make-model --threads "$(nproc)" -o "$M" --dim $1 --layers $2 --heads $3 --kv-heads $4 --ff $5 --vocab $6 --ctx 4096 \
            --type nf4 --embd-type bf16 --output-type bf16 > "$W/$shape.make.log" 2>&1
    fi
    FPT=$(flops_per_token $1 $2 $3 $4 $5 $6 16 2048)
    ./finetune --overwrite -m "$M" -d "$W/data.jsonl" -o "$W/$shape.out" --device cuda --seq-len 2048 -b 1 --lora-r 16 \
        --lora-alpha 32 --lora-targets all --max-steps $((STEPS + WARM)) --precision bf16 --checkpointing block \
        > "$W/$shape.qlora.log" 2>&1 || { tail -20 "$W/$shape.qlora.log"; exit 1; }
    med=$(grep -o '"step_seconds": [0-9.]*' "$W/$shape.out/metrics.jsonl" | awk -v w=$WARM 'NR > w { print $2 }' | median)
    tps=$(awk -v m=$med 'BEGIN { printf "%.0f", 2048 / m }')
    mfu=$(awk -v t=$tps -v f=$FPT -v p=$PEAK 'BEGIN { if (p > 0) printf "%.1f%%", 100 * t * f / (p * 1e12); else print "?" }')
    mem=$(grep -o 'the card in use [0-9.]* MiB' "$W/$shape.qlora.log" | head -1 | grep -o '[0-9.]* MiB')
    plan=$(grep -o 'total device memory *[0-9.]*' "$W/$shape.qlora.log" | head -1 | grep -o '[0-9.]*$')
    echo "| $shape | qlora (NF4, bf16, block) | $tps | $mfu | $mem | $plan MiB | $(grep -o 'ours [0-9.]* MiB peak' "$W/$shape.qlora.log" | head -1) |"
    if python3 -c "import torch, transformers, peft" > /dev/null 2>&1; then
        if python3 bench/torch_peft.py --dim $1 --layers $2 --heads $3 --kv-heads $4 --ff $5 --vocab $6 --seq 2048 \
            --steps $STEPS --warmup $WARM > "$W/$shape.torch.log" 2>&1; then
            tt=$(grep -o 'tokens_per_s [0-9.]*' "$W/$shape.torch.log" | grep -o '[0-9.]*$')
            tm=$(grep -o 'peak_mib [0-9.]*' "$W/$shape.torch.log" | grep -o '[0-9.]*$')
            how=$(grep -o 'stack .*' "$W/$shape.torch.log" | head -1 | cut -c7-)
            tmfu=$(awk -v t=$tt -v f=$FPT -v p=$PEAK 'BEGIN { if (p > 0) printf "%.1f%%", 100 * t * f / (p * 1e12); else print "?" }')
            echo "| $shape | $how | $tt | $tmfu | $tm MiB (max allocated) | | ratio qlora/torch $(awk -v a=$tps -v b=$tt 'BEGIN { printf "%.2f", a / b }') |"
        else
            echo "| $shape | PyTorch + PEFT | failed | | | | $(tail -1 "$W/$shape.torch.log") |"
        fi
    else
        echo "| $shape | PyTorch + PEFT | - | | | | python3 lacks torch/transformers/peft: no yardstick |"
    fi
done
echo
echo "GPU: $GPU; bf16 peak $PEAK TFLOPS; logs in $W"
