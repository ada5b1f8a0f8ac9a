#!/usr/bin/env python3
"""bench/finetune_torch.py - the yardstick for ./finetune on a CPU: the same LoRA training step in
PyTorch fp32 (a plain llama: RMSNorm, rope, SwiGLU, causal attention; LoRA r16 on q,k,v,o with PEFT's dropout 0.05; AdamW on
the adapter only). Not a dependency of anything: Debian's python3-torch (BLAS via the
libblas.so.3 alternative: install libopenblas0-pthread) is enough.

    python3 bench/finetune_torch.py --dim 288 --layers 6 --heads 6 --ff 768 --vocab 32000 \
        --seq 256 --batch 4 --threads 2 --steps 12

Prints one line: median seconds per step over the steps after the first two, tokens/s, and the
peak RSS of the process (ru_maxrss), which includes PyTorch's own footprint.
"""
import argparse, math, resource, statistics, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Module):
    def __init__(self, fin, fout, r, alpha, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.base = nn.Linear(fin, fout, bias=False)
        self.base.weight.requires_grad_(False)
        self.A = nn.Parameter(torch.empty(r, fin))
        self.B = nn.Parameter(torch.zeros(fout, r))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # PEFT's initialisation
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + (self.drop(x) @ self.A.t() @ self.B.t()) * self.scale  # PEFT's order


def frozen(fin, fout):
    l = nn.Linear(fin, fout, bias=False)
    l.weight.requires_grad_(False)
    return l


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d), requires_grad=False)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


def rope(x, cos, sin):  # x [B, H, T, D], pairs (2i, 2i+1) as GGUF's llama
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        d, hd = a.dim, a.dim // a.heads
        self.h, self.hd = a.heads, hd
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (LoRALinear(d, d, a.r, a.alpha, a.dropout) for _ in range(4))
        self.gate, self.up, self.down = frozen(d, a.ff), frozen(d, a.ff), frozen(a.ff, d)

    def forward(self, x, cos, sin, mask):
        B, T, D = x.shape
        h = self.n1(x)
        q = self.q(h).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k(h).view(B, T, self.h, self.hd).transpose(1, 2)
        v = self.v(h).view(B, T, self.h, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd) + mask
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, D)
        x = x + self.o(y)
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.dim)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.dim)
        self.out = frozen(a.dim, a.vocab)
        hd = a.dim // a.heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(a.seq).float(), inv)
        self.register_buffer("cos", ang.cos())
        self.register_buffer("sin", ang.sin())
        self.register_buffer("mask", torch.full((a.seq, a.seq), float("-inf")).triu(1))

    def forward(self, tok):
        x = self.emb(tok)
        for b in self.blocks:
            x = b(x, self.cos, self.sin, self.mask)
        return self.out(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    for k, v in dict(dim=288, layers=6, heads=6, ff=768, vocab=32000, seq=256, batch=4, threads=2, steps=12, r=16).items():
        p.add_argument("--" + k, type=int, default=v)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--dropout", type=float, default=0.05)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    m = Llama(a)
    with torch.no_grad():
        for n, w in m.named_parameters():
            if not w.requires_grad and w.dim() == 2:
                w.normal_(0, 0.02)
    params = [w for w in m.parameters() if w.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    times = []
    for s in range(a.steps):
        tok = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        t0 = time.perf_counter()
        logits = m(tok[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), tok[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[2:] if len(times) > 2 else times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    n_train = sum(w.numel() for w in params)
    print(f"torch {torch.__version__} threads {a.threads}: trainable {n_train}, loss {loss.item():.4f}, "
          f"median step {med:.4f} s, {a.batch * a.seq / med:.1f} tokens/s, peak RSS {rss:.1f} MiB")


if __name__ == "__main__":
    main()
