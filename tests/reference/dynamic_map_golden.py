#!/usr/bin/env python3
# tests/reference/dynamic_map_golden.py - dev-side: writes tests/golden/dynamic_map.txt, the two
# 256-value maps of bitsandbytes' 8-bit optimizer states, computed with torch as
# bitsandbytes.functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) does
# (float32 linspace, midpoints, times 10^(i - 6); 0 and 1 added; sorted). Written out from that
# function's description (bitsandbytes/functional.py; Dettmers et al. 2021, 8-bit Optimizers via
# Block-wise Quantization, arXiv 2110.02861), not copied; one value per line as float.hex.
# Run: /usr/bin/python3 (Debian python3-torch) tests/reference/dynamic_map_golden.py > tests/golden/dynamic_map.txt
import torch


def dynamic_map(signed):
    data = []
    for i in range(7):
        f = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        b = torch.linspace(0.1, 1, f)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (i - 6)) * means).tolist()
        if signed:
            data += (-(10 ** (i - 6)) * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return sorted(torch.tensor(data).tolist())


for name, signed in (("signed", True), ("unsigned", False)):
    print("# " + name)
    for x in dynamic_map(signed):
        print(float(x).hex())
