#!/usr/bin/python3
# Dev-side only (never run by the build or `make test`): writes tests/golden/llama_logits.bin,
# the logits our llama forward is compared against (1e-4 relative). An independent float64
# torch implementation of the llama forward (RMSNorm, rope, GQA, causal softmax attention,
# SwiGLU), for
#   1. stories260K (../shared/fixtures/stories260K/stories260K.bin, llama2.c format)
#   2. a small random model with GQA, Qwen2-style q/k/v biases and neox rope, its weights drawn
#      from an integer generator the C++ test reproduces exactly.
#   /usr/bin/python3 tests/reference/llama_golden.py [fixtures dir]
import os, struct, sys
import numpy as np
import torch

torch.set_default_dtype(torch.float64)

def rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

def rope(x, pos, base, mode, n_rot):
    # x [T, H, d]; normal: pairs (2i, 2i+1); neox: pairs (i, i + n_rot/2)
    T, H, d = x.shape
    half = n_rot // 2
    inv = base ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / n_rot)
    ang = pos[:, None].double() * inv[None, :]            # [T, half]
    c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    y = x.clone()
    if mode == "normal":
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        y[..., 0:n_rot:2] = x0 * c - x1 * s
        y[..., 1:n_rot:2] = x0 * s + x1 * c
    else:
        x0, x1 = x[..., :half], x[..., half:n_rot]
        y[..., :half] = x0 * c - x1 * s
        y[..., half:n_rot] = x0 * s + x1 * c
    return y

def forward(cfg, W, tokens):
    T = len(tokens)
    E, H, Hkv = cfg["dim"], cfg["heads"], cfg["kv_heads"]
    d = E // H
    x = W["emb"][torch.tensor(tokens)]                     # [T, E]
    pos = torch.arange(T)
    mask = torch.full((T, T), float("-inf")).triu(1)
    for L in W["layers"]:
        h = rms_norm(x, L["attn_norm"], cfg["eps"])
        q = h @ L["wq"].T + (L["bq"] if "bq" in L else 0)
        k = h @ L["wk"].T + (L["bk"] if "bk" in L else 0)
        v = h @ L["wv"].T + (L["bv"] if "bv" in L else 0)
        q = rope(q.view(T, H, d), pos, cfg["base"], cfg["mode"], d)
        k = rope(k.view(T, Hkv, d), pos, cfg["base"], cfg["mode"], d)
        v = v.view(T, Hkv, d)
        rep = H // Hkv
        k = k.repeat_interleave(rep, dim=1)                  # query head h uses kv head h // rep
        v = v.repeat_interleave(rep, dim=1)
        att = torch.einsum("thd,shd->hts", q, k) / np.sqrt(d) + mask
        o = torch.einsum("hts,shd->thd", torch.softmax(att, dim=-1), v).reshape(T, E)
        x = x + o @ L["wo"].T
        h = rms_norm(x, L["ffn_norm"], cfg["eps"])
        g = h @ L["w1"].T
        x = x + (torch.nn.functional.silu(g) * (h @ L["w3"].T)) @ L["w2"].T
    x = rms_norm(x, W["out_norm"], cfg["eps"])
    return x @ W["out"].T                                    # [T, V]

def load_llama2c(path):
    b = open(path, "rb").read()
    dim, hidden, nl, nh, nkv, vocab, seq = struct.unpack("<7i", b[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    f = np.frombuffer(b[28:], dtype="<f4").astype(np.float64)
    o = 0
    def take(*shape):
        nonlocal o
        n = int(np.prod(shape))
        r = torch.from_numpy(f[o:o + n].reshape(shape).copy())
        o += n
        return r
    hs = dim // nh
    kvd = nkv * hs
    W = {"emb": take(vocab, dim)}
    ra, wq, wk, wv, wo = take(nl, dim), take(nl, dim, dim), take(nl, kvd, dim), take(nl, kvd, dim), take(nl, dim, dim)
    rf, w1, w2, w3 = take(nl, dim), take(nl, hidden, dim), take(nl, dim, hidden), take(nl, hidden, dim)
    W["out_norm"] = take(dim)
    take(seq * hs)
    W["out"] = W["emb"] if shared else take(vocab, dim)
    W["layers"] = [dict(attn_norm=ra[l], wq=wq[l], wk=wk[l], wv=wv[l], wo=wo[l], ffn_norm=rf[l], w1=w1[l], w2=w2[l],
                        w3=w3[l]) for l in range(nl)]
    cfg = dict(dim=dim, heads=nh, kv_heads=nkv, eps=1e-5, base=10000.0, mode="normal", vocab=vocab)
    return cfg, W

class Gen:
    # splitmix64 -> uniform in [-1, 1) from 24 bits: exact in f32, the C++ test draws the same
    def __init__(self, seed): self.s = seed & 0xFFFFFFFFFFFFFFFF
    def next(self):
        M = 0xFFFFFFFFFFFFFFFF
        self.s = (self.s + 0x9E3779B97F4A7C15) & M
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        z ^= z >> 31
        return float(np.float32((z >> 40) * 2.0 ** -23 - 1.0))
    def tensor(self, n, scale, offset=0.0):
        return torch.tensor([float(np.float32(np.float32(self.next() * scale) + np.float32(offset))) for _ in range(n)])

def random_model():
    # the C++ test (tests/test_llama.cpp) draws in exactly this order and these scales
    cfg = dict(dim=96, heads=6, kv_heads=2, ff=160, vocab=101, layers=2, eps=1e-5, base=1000000.0, mode="neox")
    E, ff, V = cfg["dim"], cfg["ff"], cfg["vocab"]
    d = E // cfg["heads"]
    nq, nkv = cfg["heads"] * d, cfg["kv_heads"] * d
    g = Gen(4242)
    W = {"emb": g.tensor(V * E, 0.5).view(V, E), "layers": []}
    for _ in range(cfg["layers"]):
        L = {}
        L["attn_norm"] = g.tensor(E, 0.2, 1.0)
        L["wq"] = g.tensor(nq * E, 0.15).view(nq, E)
        L["wk"] = g.tensor(nkv * E, 0.15).view(nkv, E)
        L["wv"] = g.tensor(nkv * E, 0.15).view(nkv, E)
        L["bq"] = g.tensor(nq, 0.3)
        L["bk"] = g.tensor(nkv, 0.3)
        L["bv"] = g.tensor(nkv, 0.3)
        L["wo"] = g.tensor(E * nq, 0.1).view(E, nq)
        L["ffn_norm"] = g.tensor(E, 0.2, 1.0)
        L["w1"] = g.tensor(ff * E, 0.1).view(ff, E)
        L["w3"] = g.tensor(ff * E, 0.1).view(ff, E)
        L["w2"] = g.tensor(E * ff, 0.1).view(E, ff)
        W["layers"].append(L)
    W["out_norm"] = g.tensor(E, 0.2, 1.0)
    W["out"] = g.tensor(V * E, 0.3).view(V, E)
    return cfg, W

def main():
    fx = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "../../../shared/fixtures")
    cases = []
    cfg, W = load_llama2c(os.path.join(fx, "stories260K/stories260K.bin"))
    toks = [1] + [(i * 7919) % 511 + 1 for i in range(1, 24)]
    cases.append(("stories260K", toks, forward(cfg, W, toks)))
    cfg, W = random_model()
    toks = [(i * 37 + 11) % cfg["vocab"] for i in range(29)]
    cases.append(("random-gqa-bias-neox", toks, forward(cfg, W, toks)))
    out = os.path.join(os.path.dirname(__file__), "../golden/llama_logits.bin")
    with open(out, "wb") as f:
        f.write(b"QLLOGITS")
        f.write(struct.pack("<i", len(cases)))
        for name, toks, logits in cases:
            nb = name.encode()
            f.write(struct.pack("<i", len(nb)) + nb)
            f.write(struct.pack("<ii", len(toks), logits.shape[1]))
            f.write(np.array(toks, dtype="<i4").tobytes())
            f.write(logits.numpy().astype("<f4").tobytes())
            print(name, "T", len(toks), "V", logits.shape[1], "max |logit|", float(logits.abs().max()))

main()
