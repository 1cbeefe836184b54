"""The fp8-mla table's FlashMLA sparse FP8 column on the device: for the first samples of each distribution,
the table's own draw (same seed derivation as `amla-sim reproduce fp8-mla`) quantized with FlashMLA's V3.2
quantizer, every token selected, run through the kernel, and compared bit for bit with the simulator's run of the
same sweep algorithm. Runs on an H100/H200 from the repository root:

    python scripts/fp8_table_device.py [--flashmla .third_party/FlashMLA] [--samples 2]
"""

from __future__ import annotations

import argparse

import numpy as np

from amla_sim import compare
from amla_sim._seeds import derive_seed
from amla_sim.algorithms import flashmla_sparse_fp8_decode, golden
from amla_sim.algorithms.deployed.flashmla.fp8_cache import pages, quantize_kv_cache
from amla_sim.experiments.inputs import make_inputs
from amla_sim.experiments.tables import TABLES
from amla_sim.gpu.adapters import flashmla as adapters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flashmla", default=".third_party/FlashMLA", help="a FlashMLA checkout")
    p.add_argument("--samples", type=int, default=2)
    a = p.parse_args()
    t = TABLES["fp8-mla"]
    mod = adapters.build_sparse_fp8(a.flashmla)
    for dist, label in t.distributions:
        for sample in range(a.samples):
            q, kv = make_inputs(dist, heads=t.heads, sq=t.sq, context=t.context,
                                seed=derive_seed(0, t.name, dist, sample))
            paged, base = pages(kv)
            idx = np.arange(t.context, dtype=np.int32)[None, None]
            got = adapters.run_sparse_fp8(mod, q, quantize_kv_cache(paged), idx, None, None, 576 ** -0.5)
            sim = flashmla_sparse_fp8_decode(q, kv)
            report = compare({"lse": got["lse"], "out": got["out"]}, {"lse": sim.lse, "out": sim.out})
            rmse = np.sqrt(np.mean((got["out"].view(q.dtype).astype(np.float64) - golden(q, kv).out) ** 2))
            print(f"{label}, sample {sample}: out bits equal {100 * report['out'].bit_exact:.3f}%, "
                  f"lse {100 * report['lse'].bit_exact:.3f}%; device RMSE {rmse:.4e}", flush=True)


if __name__ == "__main__":
    main()
