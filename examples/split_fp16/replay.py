"""Replay capture.npz on a CPU: rebuild each case's inputs, run split_fp16 with its trace, compare every stage.

    python examples/split_fp16/replay.py [CAPTURE]      # no GPU needed; exit status 0 when every bit agrees

The steps:
1. ``read_capture``: the capture's meta (the recipes) and its arrays, checked before anything is decompressed;
2. the inputs drawn again from each recipe, and their CRC checked against the one the capture recorded;
3. the model run with ``trace=True``, which records the same stages the kernel dumped;
4. ``amla_sim.compare``: stage by stage, in pipeline order, bit for bit (the device's BF16 bits viewed as BF16).
"""

import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from amla_sim import ComparisonReport, compare
from amla_sim.crosscheck.files import input_crc, read_capture
from amla_sim.experiments.inputs import make_inputs
from split_fp16 import split_fp16

STAGES = ["m", "l", "O", "out"]  # pipeline order: the report names the first stage that differs


def replay(path: str | Path, cases: list[int] | None = None, model: Callable = split_fp16) -> list[ComparisonReport]:
    """One report per case of the capture at `path` (or of `cases`), of `model` (a variant, to see what a choice
    is worth) against the device."""
    meta, arrays = read_capture(path)  # 1.
    reports = []
    for i, c in enumerate(meta["cases"]):
        if cases is not None and i not in cases:
            continue
        q, kv = make_inputs(c["dist"], batch=c["batch"], sq=c["sq"], heads=c["heads"], context=c["context"],
                            seed=c["seed"])  # 2.
        assert input_crc(q.view(np.uint16), kv.view(np.uint16)) == c["crc"], f"case {i}: other inputs"
        res = model(q, kv, trace=True)  # 3.
        sim = {k: np.stack(res.trace[k]) for k in ("m", "l", "O")} | {"out": res.out}
        dev = {k: arrays[f"c{i}_{k}"] for k in ("m", "l", "O")} | {"out": arrays[f"c{i}_out"].view(ml_dtypes.bfloat16)}
        reports.append(compare(dev, sim, stages=STAGES, meta={**c, "device": meta["device"]}))  # 4.
    return reports


if __name__ == "__main__":
    reports = replay(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("capture.npz"))
    for r in reports:
        print(f"{r.meta['dist']} b={r.meta['batch']} s_q={r.meta['sq']} G={r.meta['heads']} L={r.meta['context']}"
              f" on {r.meta['device']}:\n{r}")
    print(f"{sum(r.bit_exact for r in reports)} of {len(reports)} cases bit-identical in every stage")
    sys.exit(0 if all(r.bit_exact for r in reports) else 3)
