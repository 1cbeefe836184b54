"""Probe ``tanh.approx.f32`` (MUFU.TANH, what FA3's softcap computes) on every FP32 of the binades 2^e, e in
-16..4, against the correctly rounded tanh: per binade whether the unit is odd, whether its output is constant over
blocks of 16 consecutive inputs (it reads only the top 19 fraction bits), and the range of its distance in ULPs.

Run on a CUDA machine with torch and triton:  python scripts/probe_tanh.py [OUT.json]

Measured on an H200 (``tests/data/mufu_tanh_h200.json``): odd everywhere; exact (the correctly rounded tanh) for
|x| < 2^-12 and from 16 up; constant over blocks of 16 for |x| in [2^-8, 1) and [8, 32), not below 2^-8 or in
[1, 8); up to 134 ULPs from the correctly rounded tanh in [1, 2).

``python scripts/probe_tanh.py dump OUTDIR`` writes OUTDIR/mufu_tanh_dump.npz instead: every output of the binades
2^-8 to 2^4 (each as its first value and steps), 4 million random inputs under 2^-8 (subnormals included) and the
special values, from which ``scripts/make_mufu_tables.py --tanh`` builds the model's table
(:mod:`amla_sim.arith.tanh`).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> None:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def unit(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n)
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
        tl.store(y_ptr + i, y, mask=i < n)

    def mufu(bits: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(bits.view(np.float32)).cuda()
        y = torch.empty_like(x)
        unit[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y.cpu().numpy().view(np.uint32)

    frac = np.arange(1 << 23, dtype=np.uint32)
    if len(sys.argv) > 2 and sys.argv[1] == "dump":  # every output of the binades 2^-8 .. 2^4, for the table
        out = sys.argv[2]
        tables = {}
        for e in range(-8, 5):
            y = mufu(frac | np.uint32((127 + e) << 23)).view(np.int32)
            tables[f"e{e}"] = np.diff(y, prepend=np.int32(0))  # first entry, then its steps (they compress)
        rng = np.random.default_rng(0)
        small = rng.integers(0, (127 - 8) << 23, 1 << 22, dtype=np.uint32)  # |x| < 2^-8, subnormals included
        specials = np.array([0, 1 << 31, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 0x7F800001, 0xFFC00000,
                             0x7F7FFFFF, 0x00000001, 0x007FFFFF, 0x00800000], np.uint32)
        tables["small_x"], tables["small_y"] = small, mufu(small)
        tables["special_x"], tables["special_y"] = specials, mufu(specials)
        np.savez_compressed(f"{out}/mufu_tanh_dump.npz", **tables)
        return
    summary = {}
    for e in range(-16, 5):
        bits = frac | np.uint32((127 + e) << 23)
        y = mufu(bits)
        odd = bool((mufu(bits | np.uint32(1 << 31)) == (y ^ np.uint32(1 << 31))).all())
        blocks = y.reshape(-1, 16)
        exact = np.tanh(bits.view(np.float32).astype(np.float64)).astype(np.float32).view(np.int32)
        ulps = y.view(np.int32).astype(np.int64) - exact
        summary[e] = {"odd": odd, "constant_over_16": bool((blocks == blocks[:, :1]).all()),
                      "ulps": [int(ulps.min()), int(ulps.max())]}
    text = json.dumps(summary, indent=1)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
