"""Benchmark: the bit-exact MUFU models (tl.exp, tl.exp2, div.full) against their IEEE counterparts, in one run.

    python benchmarks/bench_elementwise.py [--n 1048576] [--repeat 10]

Prints the median time of each on n FP32 inputs (softmax-like arguments in [-30, 0] for the exponentials, divisors
in [10, 40]) and the ratio to the correctly rounded (IEEE) operation.
"""

from __future__ import annotations

import argparse

import numpy as np

from _timing import median_time  # benchmarks/, the script's own folder
from amla_sim.arith import elementwise as ew


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.uniform(-30.0, 0.0, args.n).astype(np.float32)
    b = rng.uniform(10.0, 40.0, args.n).astype(np.float32)
    ew.exp(x[:8], mode="sm90")  # load the tables once
    ew.div(x[:8], b[:8], mode="sm90")
    pairs = [("tl.exp", lambda: ew.exp(x, mode="sm90"), lambda: ew.exp(x)),
             ("tl.exp2", lambda: ew.exp2(x, mode="sm90"), lambda: ew.exp2(x)),
             ("a / b (div.full)", lambda: ew.div(x, b, mode="sm90"), lambda: ew.div(x, b))]
    print(f"{args.n} FP32 inputs, median of {args.repeat}")
    for name, model, ieee in pairs:
        t_model, t_ieee = median_time(model, args.repeat), median_time(ieee, args.repeat)
        print(f"{name:18s} model {t_model * 1e3:7.1f} ms   IEEE {t_ieee * 1e3:6.1f} ms   ratio {t_model / t_ieee:5.1f}x")


if __name__ == "__main__":
    main()
