"""How close can a bias table get to ex2.approx? (95.8% at 2^14 bins: the attempt before the bit-exact model of
amla_sim.arith.elementwise, kept for the record)

    python scripts/analyze_ex2.py

Reads tests/data/triton_exp2_unit.npz (tl.exp2 on every FP32 in [1, 2), as ulp differences from the correctly
rounded value) and prints: the fraction correctly rounded, the direction of the errors, and the agreement of a
model that rounds 2^x + delta(bin) ulp to nearest, delta fitted per bin of x, for bins of 2^-6 ... 2^-14.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def main() -> None:
    diff = np.load(Path(__file__).parent.parent / "tests" / "data" / "triton_exp2_unit.npz")["ulp_diff"].astype(np.int64)
    x = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32).astype(np.float64)
    y = np.exp2(x)
    ulp = np.ldexp(1.0, np.frexp(y)[1] - 24)
    lo = np.floor(y / ulp) * ulp
    t = (y - lo) / ulp  # where the exact value sits inside its ulp
    cr = y.astype(np.float32)
    dev = (cr.view(np.int32).astype(np.int64) + diff).astype(np.int32).view(np.float32).astype(np.float64)
    up = dev > lo
    print(f"correctly rounded: {np.mean(diff == 0):.4f}; errors upward: {np.mean(diff[diff != 0] > 0):.4f}")
    for bits in (6, 8, 10, 12, 14):
        nb = 1 << bits
        b = ((x - 1) * nb).astype(np.int64)
        delta = np.bincount(b, weights=up, minlength=nb) / np.bincount(b, minlength=nb) - t.mean()
        pred = np.where(t + delta[b] >= 0.5, lo + ulp, lo)
        print(f"bias table of 2^{bits} bins: {np.mean(pred == dev):.4f} bit-exact")


if __name__ == "__main__":
    main()
