"""Replay capture.npz on a CPU: rebuild each case's inputs, run split_fp16 with its trace, compare every stage.

    python examples/split_fp16/replay.py [CAPTURE]      # no GPU needed; exit status 0 when every bit agrees

The steps:
1. ``read_capture``: the capture's meta (the recipes) and its arrays, checked before anything is decompressed;
2. ``case_arrays``: every case's stages, checked before any work: a capture of no case, a stage missing or of
   another dtype or shape than its recipe says, and an array of no case are refused by name (nothing the file
   holds goes uncompared);
3. the inputs drawn again from each recipe, and their CRC checked against the one the capture recorded;
4. the model run with ``trace=True``, which records the same stages the kernel dumped;
5. ``amla_sim.compare``: stage by stage, in pipeline order, bit for bit (the device's BF16 bits viewed as BF16).
"""

import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from amla_sim import ComparisonReport, compare
from amla_sim.crosscheck.files import CaptureError, case_arrays, input_crc, read_capture
from amla_sim.experiments.inputs import make_inputs
from split_fp16 import split_fp16

STAGES = {"m": np.float32, "l": np.float32, "O": np.float32, "out": np.uint16}  # pipeline order, as captured


def shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """What kernel.py writes for a recipe: each split's m, l and O, and the output."""
    b, sq, G = c["batch"], c["sq"], c["heads"]
    return {"m": (2, b, sq * G), "l": (2, b, sq * G), "O": (2, b, sq * G, 512), "out": (b, sq, G, 512)}


def inputs(path: str | Path, i: int, c: dict) -> tuple[np.ndarray, np.ndarray]:
    """Case `i`'s inputs drawn again from its recipe `c`, checked against the CRC the capture recorded."""
    try:
        q, kv = make_inputs(c["dist"], batch=c["batch"], sq=c["sq"], heads=c["heads"], context=c["context"],
                            seed=c["seed"])
        crc = c["crc"]
    except KeyError as e:
        raise CaptureError(f"replay: {path}: case {i}: its recipe has no {e}") from None
    except (ValueError, TypeError, AttributeError, MemoryError) as e:
        raise CaptureError(f"replay: {path}: case {i}: its recipe draws no inputs ({e})") from None
    if input_crc(q.view(np.uint16), kv.view(np.uint16)) != crc:
        raise CaptureError(f"replay: {path}: case {i}: its recipe draws other inputs than the device's (CRC differs)")
    return q, kv


def replay(path: str | Path, cases: list[int] | None = None, model: Callable = split_fp16) -> list[ComparisonReport]:
    """One report per case of the capture at `path` (or of `cases`), of `model` (a variant, to see what a choice
    is worth) against the device."""
    meta, arrays = read_capture(path)  # 1.
    device = case_arrays(path, meta, arrays, STAGES, shapes=shapes)  # 2.
    todo = range(len(device)) if cases is None else cases
    if not todo or not set(todo) <= set(range(len(device))):
        raise ValueError(f"cases: {path} has cases 0 to {len(device) - 1}, not {cases}")
    reports = []
    for i in todo:
        c = meta["cases"][i]
        q, kv = inputs(path, i, c)  # 3.
        res = model(q, kv, trace=True)  # 4.
        sim = {k: np.stack(res.trace[k]) for k in ("m", "l", "O")} | {"out": res.out}
        dev = device[i] | {"out": device[i]["out"].view(ml_dtypes.bfloat16)}
        reports.append(compare(dev, sim, stages=list(STAGES), meta={**c, "device": meta.get("device")}))  # 5.
    return reports


if __name__ == "__main__":
    try:
        reports = replay(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("capture.npz"))
    except CaptureError as e:
        sys.exit(f"replay.py: error: {e}")  # exit status 1, and no traceback
    for r in reports:
        print(f"{r.meta['dist']} b={r.meta['batch']} s_q={r.meta['sq']} G={r.meta['heads']} L={r.meta['context']}"
              f" on {r.meta['device']}:\n{r}")
    print(f"{sum(r.bit_exact for r in reports)} of {len(reports)} cases bit-identical in every stage")
    sys.exit(0 if reports and all(r.bit_exact for r in reports) else 3)
