"""Benchmark: formats.round_to toward zero and stochastic against ml_dtypes' nearest-even cast, in one run.

    python benchmarks/bench_round.py [--n 10000000] [--repeat 5] [--engines numpy,numba]

Prints, per target format and engine, the median time of round_to from N(0, 1) float32 in each mode and its
ratio to ``x.astype(target)`` (ml_dtypes' nearest-even cast of the same values) measured in the same run.
"""

from __future__ import annotations

import argparse

import numpy as np

from _timing import median_time  # benchmarks/, the script's own folder
from amla_sim.engine import ENGINES, numba_available, use_engine
from amla_sim.formats import get_format, round_to


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--engines", default=",".join(e for e in ENGINES if e != "numba" or numba_available()))
    args = ap.parse_args()
    x = np.random.default_rng(0).standard_normal(args.n).astype(np.float32)
    print(f"{args.n} N(0, 1) float32 values, median of {args.repeat}")
    for name in ("bf16", "fp16", "e4m3"):
        f = get_format(name)
        base = median_time(lambda f=f: x.astype(f.dtype), args.repeat)
        for engine in args.engines.split(","):
            for mode in ("toward-zero", "stochastic"):
                with use_engine(engine):
                    round_to(x[:100], f, mode=mode, seed=1)  # compiles, for numba
                    t = median_time(lambda f=f, mode=mode: round_to(x, f, mode=mode, seed=1), args.repeat)
                print(f"{name:5s} {engine:6s} {mode:12s} {t * 1e3:8.1f} ms   ml_dtypes cast {base * 1e3:6.1f} ms"
                      f"   ratio {t / base:6.1f}x")


if __name__ == "__main__":
    main()
