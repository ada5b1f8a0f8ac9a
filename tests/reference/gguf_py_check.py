#!/usr/bin/env python3
# Dev-side only: llama.cpp's own GGUF reader (gguf-py) on files qlora writes. Every tensor of
# every file must be listed with the shape and byte size the header says, and - for the types it
# knows - dequantise. NF4 (our type ids 100/101) is ours alone: gguf-py refuses those files, as
# llama.cpp does (./quantize turns an NF4 base into a type they read).
#   /tmp/qv/bin/python tests/reference/gguf_py_check.py FILE.gguf ...
import sys
import numpy as np
import gguf
from gguf import quants

ok = True
for path in sys.argv[1:]:
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:  # NF4 files
        print(f'{path}: gguf-py refuses it: {type(e).__name__}: {e}')
        ok = False
        continue
    n_deq = 0
    for t in r.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I32):
            x = quants.dequantize(t.data, t.tensor_type)
            assert np.all(np.isfinite(x)), (path, t.name)
            n_deq += 1
    arch = r.fields.get('general.architecture')
    print(f'{path}: {len(r.fields)} keys, {len(r.tensors)} tensors ({n_deq} dequantised), types',
          sorted({t.tensor_type.name for t in r.tensors}))
sys.exit(0 if ok else 1)
