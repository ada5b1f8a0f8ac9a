#!/usr/bin/env python3
"""bench/torch_peft.py - the PyTorch + PEFT yardstick for bench/gpu.sh (dev-side; the build and
the tests never run it). A random LlamaForCausalLM of the given shape from a config, LoRA r16
alpha 32 on q,k,v,o,gate,up,down, SDPA attention, gradient checkpointing, bf16, micro-batch 1.
With bitsandbytes: the decoder's linear layers as NF4 (double quantisation, bf16 compute) - QLoRA
as the Python stack runs it; without: bf16 LoRA, and the output says so. Prints
"stack ...", "tokens_per_s X" (median step after warm-up) and "peak_mib Y"
(torch.cuda.max_memory_allocated)."""
import argparse
import statistics
import time

import torch
import transformers
import peft

p = argparse.ArgumentParser()
for k, v in [("dim", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8), ("ff", 8192), ("vocab", 128256), ("seq", 2048),
             ("steps", 20), ("warmup", 3)]:
    p.add_argument("--" + k, type=int, default=v)
# where the random weights are drawn: cpu (as before), or cuda in bf16 - seconds instead of minutes
# at 8B, which a short GPU lease needs (bench/gpu-first.sh); NF4 quantisation is the same either way
p.add_argument("--init", choices=["cpu", "cuda"], default="cpu")
# --device cpu: the script's own check where there is no GPU (tiny shapes; no NF4, no memory figure)
p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
a = p.parse_args()
cuda = a.device == "cuda"

try:
    import bitsandbytes as bnb
except Exception:  # noqa: BLE001 - any failure to import means: no NF4 here
    bnb = None
if not cuda:
    bnb = None

cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.ff, num_hidden_layers=a.layers,
                               num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                               torch_dtype=torch.bfloat16, attn_implementation="sdpa")
torch.manual_seed(0)
if a.init == "cuda" and cuda:
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
else:
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
if bnb is not None:
    # the decoder's linears as bitsandbytes NF4 (what from_pretrained(load_in_4bit) makes), quantised on .cuda()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in targets:
                lin = getattr(parent, name, None)
                if lin is None:
                    continue
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                                      compress_statistics=True, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4")
                setattr(parent, name, q)
    stack = "PyTorch + PEFT + bitsandbytes (QLoRA NF4, bf16)"
else:
    stack = "PyTorch + PEFT (bf16 LoRA: bitsandbytes missing)"
model = model.to(a.device)
model.config.use_cache = False
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.enable_input_require_grads()
model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets,
                                                   task_type="CAUSAL_LM"))
opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=2e-4)
print("stack", stack, f"(torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__})")
ids = torch.randint(0, a.vocab, (1, a.seq), device=a.device)
sync = torch.cuda.synchronize if cuda else (lambda: None)
if cuda:
    torch.cuda.reset_peak_memory_stats()
times = []
for step in range(a.steps + a.warmup):
    sync()
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    if step >= a.warmup:
        times.append(time.perf_counter() - t0)
print("tokens_per_s %.1f" % (a.seq / statistics.median(times)))
print("peak_mib %.1f" % (torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0))
