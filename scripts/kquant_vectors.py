#!/usr/bin/env python3
"""Test vectors for pdmesh's block dequantizers, made by the `gguf`
package's NumPy dequantizer (`pip install gguf==0.19.0`).

Writes kernels/tests/data/kquant_vectors.bin: for each type, a header of
three little-endian u32 (GGML type id, block count, bytes per block), the
blocks' raw bytes (random, with every f16 scale a small finite value), then
the dequantized values as little-endian f32. `cargo test -p pdmesh-kernels
--test kquant_vectors` checks the Rust dequantizers against them bit for
bit. Rerun only to regenerate (the output is committed):

    python3 scripts/kquant_vectors.py
"""
import os
import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

# type -> byte offsets of its f16 scale fields within a block
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
BLOCKS = 6


def main():
    rng = np.random.default_rng(20261207)
    out = bytearray()
    for ty, fields in F16_FIELDS.items():
        per_block, size = GGML_QUANT_SIZES[ty]
        raw = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
        for at in fields:
            d = (rng.standard_normal(BLOCKS) * 0.01).astype(np.float16)
            raw[:, at:at + 2] = d.view(np.uint8).reshape(BLOCKS, 2)
        values = dequantize(raw.reshape(-1), ty).astype(np.float32).reshape(-1)
        assert values.size == BLOCKS * per_block
        out += struct.pack("<III", int(ty), BLOCKS, size)
        out += raw.tobytes()
        out += values.astype("<f4").tobytes()
    path = os.path.join(os.path.dirname(__file__), "..", "kernels", "tests", "data", "kquant_vectors.bin")
    with open(path, "wb") as f:
        f.write(out)
    print(f"wrote {len(out)} bytes to {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
