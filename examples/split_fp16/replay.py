"""Replay capture.npz on a CPU: rebuild each case's inputs, run split_fp16 with its trace, compare every stage."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from amla_sim import ComparisonReport, compare
from amla_sim.crosscheck.files import input_crc, read_capture
from amla_sim.experiments.inputs import make_inputs
from split_fp16 import split_fp16


def replay(path: str | Path, cases: list[int] | None = None) -> list[ComparisonReport]:
    meta, arrays = read_capture(path)
    reports = []
    for i, c in enumerate(meta["cases"]):
        if cases is not None and i not in cases:
            continue
        q, kv = make_inputs(c["dist"], batch=c["batch"], sq=c["sq"], heads=c["heads"], context=c["context"],
                            seed=c["seed"])
        assert input_crc(q.view(np.uint16), kv.view(np.uint16)) == c["crc"], f"case {i}: other inputs"
        res = split_fp16(q, kv, trace=True)
        sim = {k: np.stack(res.trace[k]) for k in ("m", "l", "O")} | {"out": res.out}
        dev = {k: arrays[f"c{i}_{k}"] for k in ("m", "l", "O")} | {"out": arrays[f"c{i}_out"].view(ml_dtypes.bfloat16)}
        reports.append(compare(dev, sim, stages=["m", "l", "O", "out"], meta={**c, "device": meta["device"]}))
    return reports


if __name__ == "__main__":
    for r in replay(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("capture.npz")):
        print(f"{r.meta['dist']} b={r.meta['batch']} s_q={r.meta['sq']} G={r.meta['heads']} L={r.meta['context']}"
              f" on {r.meta['device']}:\n{r}")
