"""Is MUFU.EX2's table the floor of a quadratic form in the fraction's bits? (needs SciPy, not a dependency)

    python scripts/analyze_ex2_structure.py [INTERVAL ...]      (default: 0 63; ~2 minutes each)

The unit's 24-bit significand M(f) of 2^(f / 2^23) (amla_sim's ex2_sm90.npz, measured on every f) is split
into 64 intervals by the top 6 bits of f. For each interval asked for, a linear program looks for a constant c,
weights w_j and q_jk (j <= k) over the 17 low bits x_j with

    M(f) <= c + sum_j w_j x_j + sum_{j <= k} q_jk x_j x_k < M(f) + 1   for all 2^17 fractions,

maximising the margin to both bounds. A positive margin means the interval is exactly the floor of such a form,
the shape a table-driven quadratic interpolator with truncated multipliers and squarer computes. For comparison
it also fits a plain quadratic in the fraction, which leaves a negative margin.
"""

from __future__ import annotations

import sys

import numpy as np
from scipy.optimize import linprog

from amla_sim.arith.elementwise import _ex2_table

W = 17  # low bits per interval


def margin(y: np.ndarray, features: np.ndarray) -> float:
    n, k = features.shape
    ones = np.ones((n, 1))
    A = np.vstack([np.hstack([-features, ones]), np.hstack([features, ones])])  # y + d <= P, P + d <= y + 1
    b = np.concatenate([-y, y + 1])
    res = linprog(np.r_[np.zeros(k), -1.0], A_ub=A, b_ub=b, bounds=[(None, None)] * k + [(None, 1)],
                  method="highs")
    return float(res.x[-1])


def main(intervals: list[int]) -> None:
    M = _ex2_table().astype(np.int64) | (1 << 23)
    xl = np.arange(1 << W)
    bits = ((xl[:, None] >> np.arange(W)) & 1).astype(np.float64)
    pairs = np.stack([bits[:, j] * bits[:, k] for j in range(W) for k in range(j, W)], axis=1)
    form = np.hstack([np.ones((1 << W, 1)), bits, pairs])
    t = xl / 2.0**W
    quadratic = np.stack([np.ones_like(t), t, t * t], axis=1)
    for i in intervals:
        y = (M[i << W:(i + 1) << W] - M[i << W]).astype(np.float64)
        print(f"interval {i:2d}: quadratic form in the bits: margin {margin(y, form):+.5f};"
              f" quadratic in the fraction: {margin(y, quadratic):+.5f}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [0, 63])
