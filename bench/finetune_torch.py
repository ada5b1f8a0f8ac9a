#!/usr/bin/env python3
"""bench/finetune_torch.py - the CPU yardstick for ./finetune: what a user of the Python stack runs.
transformers' LlamaForCausalLM built from a config (random weights, the frozen base in fp32), PEFT's
LoRA (get_peft_model: r 16, alpha 32, dropout 0.05 on q,k,v,o by default), torch.optim.AdamW on the
adapter (lr 2e-4, betas 0.9/0.999, eps 1e-8, no weight decay), gradient clipping at 1.0 - the
settings ./finetune uses by default - on random tokens, seq x batch per step, fp32 or bf16 autocast.
Dev-side only (the build and the tests never run it); the versions are pinned in
bench/requirements-torch.txt:

    python3 -m venv .venv-bench && .venv-bench/bin/pip install -r bench/requirements-torch.txt
    .venv-bench/bin/python bench/finetune_torch.py --dim 768 --layers 12 --heads 12 --ff 2048 \\
        --seq 256 --batch 4 --threads 2 --steps 10 --precision bf16

Prints one line: "torch X transformers Y peft Z precision P: median step S s, T tokens/s, peak RSS
M MiB" - the median over the steps after the first two; peak RSS is the process's ru_maxrss
(PyTorch's own footprint included).
"""
import argparse
import contextlib
import resource
import statistics
import time

import torch
import transformers
import peft


def main():
    p = argparse.ArgumentParser()
    for k, v in dict(dim=288, layers=6, heads=6, kv_heads=0, ff=768, vocab=32000, seq=256, batch=4, threads=2, steps=10,
                     r=16).items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.dim, intermediate_size=a.ff, num_hidden_layers=a.layers,
                                   num_attention_heads=a.heads, num_key_value_heads=a.kv_heads or a.heads,
                                   max_position_embeddings=max(a.seq, 256), rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"  # transformers' default on CPU too
    base = transformers.LlamaForCausalLM(cfg).float()
    m = peft.get_peft_model(base, peft.LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout,
                                                  target_modules=a.targets.split(","), task_type="CAUSAL_LM"))
    m.train()
    params = [w for w in m.parameters() if w.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    times = []
    for s in range(a.steps):
        tok = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        t0 = time.perf_counter()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if a.precision == "bf16" else contextlib.nullcontext()
        with ctx:
            loss = m(input_ids=tok, labels=tok).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[2:] if len(times) > 2 else times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(f"torch {torch.__version__} transformers {transformers.__version__} peft {peft.__version__} "
          f"precision {a.precision} threads {a.threads}: loss {loss.item():.4f}, median step {med:.4f} s, "
          f"{a.batch * a.seq / med:.1f} tokens/s, peak RSS {rss:.1f} MiB")


if __name__ == "__main__":
    main()
