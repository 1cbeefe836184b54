"""Benchmark: the table sampler of rounded distributions against drawing float64 values and rounding them.

    python benchmarks/bench_sampler.py [--repeat 7] [--dist normal:1]

Times ``make_inputs`` for one sample of the AMLA tables (q: 128 x 576, kv: 8192 x 576, BF16) both ways in one
run and prints the medians and their ratio.
"""

from __future__ import annotations

import argparse

from _timing import median_time  # benchmarks/, the script's own folder
from amla_sim.experiments.inputs import make_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dist", default="normal:1")
    args = ap.parse_args()
    make_inputs(args.dist, sampler="table")  # build the tables once, as a sweep worker does
    t_round = median_time(lambda: make_inputs(args.dist, sampler="round"), args.repeat)
    t_table = median_time(lambda: make_inputs(args.dist, sampler="table"), args.repeat)
    print(f"{args.dist}: G = 128, context 8192, d_k = 576, BF16")
    print(f"float64 draws, rounded   median {t_round * 1e3:8.1f} ms")
    print(f"table sampler            median {t_table * 1e3:8.1f} ms")
    print(f"ratio round / table             {t_round / t_table:8.2f} x")


if __name__ == "__main__":
    main()
