#!/usr/bin/env python3
# Dev-side only: writes tests/golden/quants_llama.bin - blocks that llama.cpp's own llama-quantize
# wrote (its mixes Q2_K Q3_K_M IQ4_NL IQ4_XS Q4_1 Q5_0 Q5_1 Q4_K_M Q5_K_M Q6_K of a make-model
# llama), the first blocks of one tensor of every type found, with gguf-py's dequantisation: the same
# record format as tests/golden/quants.bin (kind 0), which tests/test_quants.cpp reads.
#   ./make-model -o /tmp/m8.gguf --dim 256 --layers 8 --heads 4 --kv-heads 2 --ff 512 --seed 3
#   for p in Q2_K Q3_K_M IQ4_NL IQ4_XS Q4_1 Q5_0 Q5_1 Q4_K_M Q5_K_M Q6_K; do
#       $LLAMA/build/bin/llama-quantize /tmp/m8.gguf /tmp/lqt-$p.gguf $p 1; done
#   /tmp/qv/bin/python tests/reference/llama_quantize_golden.py /tmp/lqt-*.gguf
import struct, sys
import numpy as np
import gguf
from gguf import quants

out = bytearray()
seen = set()
for path in sys.argv[1:]:
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name in ('F32', 'F16', 'BF16') or t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        blck, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        row_bytes = int(t.shape[0]) // blck * size
        blocks = raw[:(8 if blck == 256 else 2) * row_bytes].tobytes()  # 8 blocks at least
        x = quants.dequantize(np.frombuffer(blocks, dtype=np.uint8), t.tensor_type).astype('<f4').reshape(-1)
        out += struct.pack('<5I', 0, int(t.tensor_type), len(blocks) // size, size, blck) + blocks + x.tobytes()
        print(path, t.name, t.tensor_type.name, len(blocks) // size, 'blocks')
open('tests/golden/quants_llama.bin', 'wb').write(bytes(out))
