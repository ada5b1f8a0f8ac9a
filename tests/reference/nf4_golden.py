#!/usr/bin/python3
# Dev-side only (never run by the build or `make test`): writes tests/golden/nf4.bin, the
# reference the NF4 tests compare against bit for bit. Written from bitsandbytes' published
# algorithm (functional.py create_dynamic_map / quantize_4bit / quantize_blockwise, and the
# CUDA dQuantize binary search), with torch doing the f32 arithmetic.
#   /usr/bin/python3 tests/reference/nf4_golden.py   (Debian python3-torch)
import struct, sys
import numpy as np
import torch

NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0]

def dynamic_map_signed():
    # create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)
    data = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data.sort()
    return torch.tensor(data, dtype=torch.float32)

def dquantize(code, x):
    # the 7-step binary search with midpoint rounding (ties resolved by the search path)
    pivot, upper_pivot, lower_pivot = 127, 255, 0
    lower, upper = np.float32(-1.0), np.float32(1.0)
    val = code[pivot]
    i = 64
    while i > 0:
        if x > val:
            lower_pivot, lower = pivot, val
            pivot += i
        else:
            upper_pivot, upper = pivot, val
            pivot -= i
        val = code[pivot]
        i >>= 1
    if upper_pivot == 255: upper = code[upper_pivot]
    if lower_pivot == 0: lower = code[lower_pivot]
    if x > val:
        mid = np.float32((upper + val) * np.float32(0.5))
        return upper_pivot if x > mid else pivot
    mid = np.float32((lower + val) * np.float32(0.5))
    return lower_pivot if x < mid else pivot

def gen_input(n, seed):
    # splitmix64 -> 24-bit uniforms -> sum of four (Irwin-Hall), all exact f32 steps
    out = np.empty(n, dtype=np.float32)
    s = seed & 0xFFFFFFFFFFFFFFFF
    M = 0xFFFFFFFFFFFFFFFF
    for i in range(n):
        acc = np.float32(0)
        for _ in range(4):
            s = (s + 0x9E3779B97F4A7C15) & M
            z = s
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
            z ^= z >> 31
            acc = np.float32(acc + np.float32((z >> 40) * 2.0 ** -24))
        out[i] = np.float32(np.float32(acc - np.float32(2.0)) * np.float32(0.05))
    return out

def shape_input(x, rows, cols):
    w = x.reshape(rows, cols).copy()
    w[3, :] *= np.float32(40.0)        # an outlier row: large absmax spread for double quant
    w[5, 64:128] = 0.0                 # an all-zero block
    w[7, 10] = np.float32(3.5)         # a single outlier inside a block
    w[9, :64] = np.float32(-0.02)      # a constant block: every element at -absmax
    return w.reshape(-1)

def quantize(A, code):
    blocks = A.reshape(-1, 64)
    absmax = blocks.abs().max(dim=-1)[0]
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    bounds = (code[:-1] + code[1:]) / 2
    q = torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8)
    packed = (q[::2] << 4) | q[1::2]
    return packed, absmax

def main():
    rows, cols = 96, 512
    x = torch.from_numpy(shape_input(gen_input(rows * cols, 20261121), rows, cols))
    code = torch.tensor(NF4, dtype=torch.float32)
    packed, absmax = quantize(x, code)
    dyn = dynamic_map_signed()
    # double quantisation: offset = mean of the absmax (computed in double, rounded once - see
    # the C++ test: torch's own f32 reduction order is machine-dependent), 8-bit codes in
    # blocks of 256 of the centred values
    offset = np.float32(np.mean(absmax.numpy().astype(np.float64)))
    centred = (absmax - torch.tensor(offset)).numpy().astype(np.float32)
    dynn = dyn.numpy()
    codes, scales = [], []
    for g in range(0, len(centred), 256):
        blk = centred[g:g + 256]
        am = np.float32(np.abs(blk).max())
        scales.append(am)
        inv = np.float32(np.float32(1.0) / max(am, np.float32(1e-38)))
        codes += [dquantize(dynn, np.float32(v * inv)) for v in blk]
    codes = np.array(codes, dtype=np.uint8)
    scales = np.array(scales, dtype=np.float32)
    # reconstruction, in f32 as bitsandbytes' dequantize_blockwise + offset
    rec = np.array([np.float32(np.float32(dynn[c] * scales[i // 256]) + offset) for i, c in enumerate(codes)],
                   dtype=np.float32)
    q = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1).to(torch.int64)
    deq = (code[q].reshape(-1, 64) * torch.from_numpy(rec).view(-1, 1)).reshape(-1).numpy().astype(np.float32)
    deq_nodq = (code[q].reshape(-1, 64) * absmax.view(-1, 1)).reshape(-1).numpy().astype(np.float32)
    with open(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/nf4.bin", "wb") as f:
        f.write(b"QLNF4GLD")
        f.write(struct.pack("<iii", 1, rows, cols))
        f.write(dyn.numpy().astype("<f4").tobytes())
        f.write(packed.numpy().tobytes())
        f.write(absmax.numpy().astype("<f4").tobytes())
        f.write(struct.pack("<f", offset))
        f.write(scales.astype("<f4").tobytes())
        f.write(codes.tobytes())
        f.write(rec.astype("<f4").tobytes())
        f.write(deq_nodq.astype("<f4")[:2048].tobytes())  # dequantised samples (the first 2048)
        f.write(deq.astype("<f4")[:2048].tobytes())
        f.write(x.numpy().astype("<f4")[:1024].tobytes())  # the first inputs: checks the generator
    print("wrote", rows, "x", cols, "groups", len(scales))

main()
