#!/usr/bin/env python3
"""Writes tests/fixtures/kquants.json: 512 elements of each block format that llama.cpp's
K-quant files hold (Q4_K, Q5_K, Q6_K, and Q5_0 and Q5_1, which llama-quantize falls back to
for rows not a multiple of 256), as seeded random bytes with finite f16 scales, and their
values as gguf-py (llama.cpp's own Python package) dequantizes them, for the GGUF reader's
test.

    python3 -m venv /tmp/ggv && /tmp/ggv/bin/pip install gguf numpy
    /tmp/ggv/bin/python scripts/make_kquant_golden.py tests/fixtures/kquants.json
"""
import json
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# (type, elements and bytes of a block, offsets of the block's f16 scales)
FORMATS = [
    ("Q4_K", T.Q4_K, 256, 144, [0, 2]),
    ("Q5_K", T.Q5_K, 256, 176, [0, 2]),
    ("Q6_K", T.Q6_K, 256, 210, [208]),
    ("Q5_0", T.Q5_0, 32, 22, [0]),
    ("Q5_1", T.Q5_1, 32, 24, [0, 2]),
]
ELEMENTS = 512


def main():
    rng = np.random.default_rng(20261205)
    out = {"source": "gguf " + __import__("importlib.metadata").metadata.version("gguf"), "formats": []}
    for name, ty, per_block, size, scale_at in FORMATS:
        blocks = ELEMENTS // per_block
        raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
        for b in range(blocks):
            for at in scale_at:
                # Finite scales of either sign, as a quantizer writes them.
                raw[b, at:at + 2] = np.frombuffer(np.float16(rng.uniform(-0.05, 0.05)).tobytes(), np.uint8)
        values = dequantize(raw.reshape(-1), ty).reshape(-1)
        assert np.isfinite(values).all()
        out["formats"].append({"type": name, "bytes": raw.reshape(-1).tobytes().hex(),
                               "values": [float(v) for v in values.astype(np.float32)]})
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
