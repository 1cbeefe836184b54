"""Benchmark: the bit-exact sm90 MMA model against NumPy float32 matmul, in one run.

    python benchmarks/bench_mma.py [--repeat 3] [--engines numpy,numba]

Prints the median time of each and their ratio for a 128 x 576 by 576 x 8192 BF16 product (one MLA decode
step's Q K^T for 128 heads and 8192 tokens) on each engine (numba when installed, after one call to compile),
checks that the engines give the same bits, and prints the peak resident memory of the process.
"""

from __future__ import annotations

import argparse
import resource

import ml_dtypes
import numpy as np

from _timing import median_time  # benchmarks/, the script's own folder
from amla_sim import mma
from amla_sim.engine import ENGINES, numba_available, use_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--engines", default=",".join(e for e in ENGINES if e != "numba" or numba_available()))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((args.m, args.k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((args.k, args.n)).astype(ml_dtypes.bfloat16)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    t_blas = median_time(lambda: a32 @ b32, max(args.repeat, 10))
    print(f"shape {args.m}x{args.k} @ {args.k}x{args.n} bf16")
    print(f"numpy float32 matmul (BLAS)   median {t_blas * 1e3:9.2f} ms")
    outs = []
    for engine in args.engines.split(","):
        with use_engine(engine):
            outs.append(mma.matmul(a, b, model="sm90"))  # compiles, for numba
            t = median_time(lambda: mma.matmul(a, b, model="sm90"), args.repeat)
        print(f"sm90 bit-exact, {engine:6s} median {t * 1e3:9.2f} ms   ratio to BLAS {t / t_blas:6.1f} x")
    same = all(np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)) for o in outs)
    print(f"engines bit-identical           {same}")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory            {peak_mb:9.0f} MB")


if __name__ == "__main__":
    main()
