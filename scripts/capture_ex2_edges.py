"""Record tl.exp2 (ex2.approx.ftz.f32) and tl.exp on the inputs that pin down how MUFU.EX2 reads its argument.

Run on a CUDA machine with torch and triton:  python scripts/capture_ex2_edges.py OUTDIR

Writes ex2_edges.npz: ``x`` and both results on signed zeros, subnormals, tiny normals (many fraction bits below
2^-23), integers, the neighbourhoods of -126, -150 and 128, infinities, NaN and random values in the subnormal
result range; and ``neg_unit_diff``: tl.exp2 on every FP32 in (-2, -1], as the ulp difference from the
correctly rounded value (the counterpart of triton_exp2_unit.npz for negative arguments).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from capture_device import run_unary


def edge_inputs() -> np.ndarray:
    rng = np.random.default_rng(7)
    f32 = np.float32
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-149, -(2.0**-149), 2.0**-127, -(2.0**-127), 2.0**-126,
               -(2.0**-126), 2.0**-24, -(2.0**-24), 2.0**-23, -(2.0**-23), 1.5 * 2.0**-23, -1.5 * 2.0**-23,
               2.0**-22, -(2.0**-22), 1e-30, -1e-30, 1e3, -1e3, 1e30, -1e30]
    ints = np.arange(-160, 131, dtype=np.float64)
    around = []
    for c in (-126.0, -125.0, -127.0, -149.0, -150.0, -151.0, 128.0, 127.0, -1.0, 1.0, 0.5, -0.5):
        v = np.float32(c)
        for _ in range(6):
            v = np.nextafter(v, f32(np.inf))
            around.append(v)
        v = np.float32(c)
        for _ in range(6):
            v = np.nextafter(v, f32(-np.inf))
            around.append(v)
    tiny = [rng.uniform(-1, 1, 256) * 2.0**-k for k in range(0, 32)]  # many bits below 2^-23
    sub = rng.integers(1, 1 << 23, 256).astype(np.uint32).view(np.float32)  # subnormal inputs, both signs
    sub = np.concatenate([sub, -sub])
    deep = rng.uniform(-152.0, -120.0, 8192)  # exp2 results in and below FP32's subnormal range
    return np.concatenate([np.array(special), ints, np.array(around, dtype=np.float64), *tiny,
                           sub.astype(np.float64), deep]).astype(np.float32)


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    x = edge_inputs()
    res = {"x": x, "exp2": run_unary(x, 1), "exp": run_unary(x, 0)}
    neg = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0xBF800000)).view(np.float32)  # every FP32 in (-2, -1]
    y = run_unary(neg, 1)
    cr = np.exp2(neg.astype(np.float64)).astype(np.float32)
    diff = y.view(np.int32).astype(np.int64) - cr.view(np.int32).astype(np.int64)
    print("exp2 on (-2, -1]: ulp diff histogram", dict(zip(*np.unique(diff, return_counts=True))))
    res["neg_unit_diff"] = np.clip(diff, -127, 127).astype(np.int8)
    np.savez_compressed(os.path.join(out, "ex2_edges.npz"), **res)
    print("edges:", x.size, "inputs")


if __name__ == "__main__":
    main()
