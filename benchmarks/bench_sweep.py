"""Benchmark: a sweep on a Dask LocalCluster of 2 workers against 1 worker, in one run.

    python benchmarks/bench_sweep.py [--samples 200] [--context 2048] [--heads 64]

Runs the same 200-sample grid (base and AMLA on ieee32-fast, N(0, 1)) into two fresh folders, on one worker and
on two, prints each wall time, the throughput ratio, and whether the two results files are byte-identical.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from amla_sim.experiments.grid import Grid, run_grid


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--machine", default="ieee32-fast")
    args = ap.parse_args()
    grid = Grid(algorithms=("base", "amla"), machines=(args.machine,), distributions=("normal:1",),
                contexts=(args.context,), heads=(args.heads,), blocks=(64,), samples=args.samples)
    seconds, files = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            out = Path(tmp) / f"w{workers}"
            t0 = time.perf_counter()
            run_grid(grid, out_dir=out, scheduler="dask", jobs=workers, progress=False, log=lambda s: None)
            seconds[workers] = time.perf_counter() - t0
            files[workers] = (out / "results.csv").read_bytes()
            print(f"{workers} worker(s): {args.samples} samples in {seconds[workers]:6.1f} s "
                  f"({args.samples / seconds[workers]:.2f} samples/s, cluster start included)")
    print(f"throughput 2 workers / 1 worker: {seconds[1] / seconds[2]:.2f}x")
    print(f"results byte-identical: {files[1] == files[2]}")


if __name__ == "__main__":
    main()
