#!/usr/bin/env python3
# Dev-side only (never run by the build or `make test`): writes tests/golden/quants.bin, what
# tests/test_quants.cpp compares ggml's block types against bit for bit. The reference is
# llama.cpp's own Python implementation of the formats (gguf-py, gguf.quants), not ours:
#   python3 -m venv /tmp/qv && /tmp/qv/bin/pip install numpy==2.1.3 gguf==0.17.1
#   /tmp/qv/bin/python tests/reference/quants_golden.py
# Records, little-endian: u32 kind (0: blocks -> floats by gguf.quants.dequantize, 1: floats ->
# blocks by gguf.quants.quantize), u32 ggml type id, u32 blocks, u32 bytes per block, u32 elements
# per block; then kind 0: the block bytes, then the floats; kind 1: the floats, then the bytes.
import struct
import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
import gguf.quants as q

rng = np.random.default_rng(20261124)
out = bytearray()

# the fp16 fields of each block (byte offsets): made finite, of a weight's magnitude
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
              T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0]}

def record(kind, t, blocks, floats):
    blck, size = gguf.GGML_QUANT_SIZES[t]
    n = len(blocks) // size
    out.extend(struct.pack('<5I', kind, int(t), n, size, blck))
    if kind == 0:
        out.extend(blocks)
        out.extend(np.asarray(floats, dtype='<f4').tobytes())
    else:
        out.extend(np.asarray(floats, dtype='<f4').tobytes())
        out.extend(blocks)

for t, offs in F16_FIELDS.items():
    blck, size = gguf.GGML_QUANT_SIZES[t]
    n = 6
    raw = bytearray(rng.integers(0, 256, n * size, dtype=np.uint8).tobytes())
    for b in range(n):
        for o in offs:
            v = np.float16(rng.normal() * 0.02 if b else 0.0)  # block 0: zero scales
            raw[b * size + o: b * size + o + 2] = v.tobytes()
    deq = q.dequantize(np.frombuffer(bytes(raw), dtype=np.uint8), t).reshape(-1)
    assert deq.size == n * blck and np.all(np.isfinite(deq))
    record(0, t, bytes(raw), deq)

for t in (T.Q4_0, T.Q8_0, T.Q4_1, T.Q5_0, T.Q5_1):  # ggml's reference quantisers, ported by gguf-py
    blck, size = gguf.GGML_QUANT_SIZES[t]
    x = rng.normal(0, 0.05, (8, blck)).astype(np.float32)
    x[1] = 0.0                      # an all-zero block
    x[2] = 0.25                     # a constant block
    x[3, 5] = -1.0                  # one outlier, negative
    x[4] *= 1e-3                    # tiny values
    blocks = q.quantize(x, t).tobytes()
    record(1, t, blocks, x.reshape(-1))

with open('tests/golden/quants.bin', 'wb') as f:
    f.write(bytes(out))
print('tests/golden/quants.bin:', len(out), 'bytes')
