"""Simulator against device, stage by stage: which bits agree, and which model is responsible for the others.

A capture (``.npz``) holds the inputs, the kernel's settings and the device's per-block stages; replaying it needs
no GPU. The simulator runs the same algorithm on the ``sm90-triton-exact`` machine (kernel exp mode ``poly``, IEEE
division) or ``sm90-triton`` (hardware ex2.approx and div.full, from measured MUFU tables), both modelled bit for
bit, with its trace on, and each stage is compared bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from .algorithms import ALGORITHMS
from .testing import ulp_distance

STAGES = {
    "base": ("S", "m", "P", "l", "O", "out"),
    "amla": ("S", "m", "P", "l", "n", "N", "O", "out"),
    "snapmla": ("S", "m", "P", "l", "O", "out"),
    "etap": ("S", "m", "P", "O", "out"),
}
RESPONSIBLE = {
    "S": "the matrix-multiply model of Q K^T (T-FDPA for sm90; the device library's order for torch)",
    "m": "row max",
    "P": "exp model (kernel exp mode); for SnapMLA also the division and the FP8 cast of P",
    "l": "row-sum order (wgmma accumulator layout) and the FMA in l = l alpha + sum P",
    "n": "n = round(-m log2 e)",
    "N": "AMLA's N: exp and division models (c, c16, cof), int rounding",
    "O": "the matrix-multiply model of P V, and the atomics on the output buffer",
    "out": "division model and the BF16 cast",
}
MACHINE_FOR_MODE = {"poly": "sm90-triton-exact", "hw": "sm90-triton"}
_HIST_EDGES = (0, 1, 2, 4, 16, 256)


def simulate(algorithm: str, q: np.ndarray, kv: np.ndarray, *, scale: float | None, exp_mode: str) -> dict:
    """The simulator's stages, stacked per block like the kernel's debug output: (n_blocks, b, R, ...)."""
    if algorithm not in STAGES:
        raise ValueError(f"algorithm: the cross-check covers {sorted(STAGES)}, got {algorithm!r}")
    if exp_mode not in MACHINE_FOR_MODE:
        raise ValueError(f"exp_mode: expected one of {sorted(MACHINE_FOR_MODE)}, got {exp_mode!r}")
    return run_stages(algorithm, q, kv, machine=MACHINE_FOR_MODE[exp_mode], scale=scale)


def run_stages(algorithm: str, q: np.ndarray, kv: np.ndarray, *, machine, scale: float | None = None) -> dict:
    """Run `algorithm` on any machine with its trace on; the stages stacked per block, and the output."""
    res = ALGORITHMS[algorithm](q, kv, machine=machine, scale=scale, trace=True)
    stages = {k: np.stack(v) for k, v in res.trace.items() if k in STAGES[algorithm]}
    if "N" in stages:  # the first block adds no N
        stages["N"] = np.concatenate([np.zeros_like(stages["N"][:1]), stages["N"]]).astype(np.int32)
    stages["out"] = res.out
    return stages


def _histogram(d: np.ndarray) -> dict[str, int]:
    hist = {}
    for lo, hi in zip(_HIST_EDGES, _HIST_EDGES[1:] + (None,)):
        key = f"{lo}" if hi == lo + 1 else (f">={lo}" if hi is None else f"{lo}-{hi - 1}")
        sel = (d >= lo) if hi is None else ((d >= lo) & (d < hi))
        hist[key] = int(sel.sum())
    hist["nan"] = int((d < 0).sum())
    return hist


def compare(algorithm: str, device: dict, sim: dict) -> dict:
    """Per stage: fraction of bit-identical elements, max ULP, an ULP histogram; the first stage that differs
    and the model responsible for it."""
    rows = []
    first = None
    for name in STAGES[algorithm]:
        if name not in device or name not in sim:
            continue
        d, s = np.asarray(device[name]), np.asarray(sim[name])
        if d.shape != s.shape:
            raise ValueError(f"device: stage {name} has shape {d.shape}, the simulator's {s.shape}")
        if d.dtype.kind in "iu":
            dist = np.abs(d.astype(np.int64) - s.astype(np.int64))
        else:
            dist = ulp_distance(d, s.astype(d.dtype))
        exact = float(np.mean(dist == 0))
        rows.append({"name": name, "bit_exact": exact, "max_ulp": int(dist.max()), "histogram": _histogram(dist)})
        if first is None and exact < 1.0:
            first = name
    out_row = next((r for r in rows if r["name"] == "out"), None)
    return {
        "algorithm": algorithm,
        "stages": rows,
        "output_bit_exact": out_row["bit_exact"] if out_row else None,
        "first_difference": first,
        "responsible": RESPONSIBLE.get(first) if first else None,
    }


def save_capture(path: str | Path, *, algorithm: str, q: np.ndarray, kv: np.ndarray, scale: float | None,
                 exp_mode: str, div_mode: str, device_name: str, device: dict) -> None:
    """Write inputs, settings and the device's stages to an .npz (inputs as raw BF16 bits)."""
    meta = {"algorithm": algorithm, "scale": scale, "exp_mode": exp_mode, "div_mode": div_mode,
            "device": device_name}
    arrays = {f"device_{k}": (v.view(np.uint16) if v.dtype == np.dtype(ml_dtypes.bfloat16) else v)
              for k, v in device.items()}
    np.savez_compressed(path, q=q.view(np.uint16), kv=kv.view(np.uint16), meta=np.array(json.dumps(meta)),
                        **arrays)


def replay(path: str | Path) -> dict:
    """Redo the comparison of a saved capture on the CPU."""
    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    q = z["q"].view(ml_dtypes.bfloat16)
    kv = z["kv"].view(ml_dtypes.bfloat16)
    device = {k[len("device_"):]: z[k] for k in z.files if k.startswith("device_")}
    device["out"] = device["out"].view(ml_dtypes.bfloat16)
    sim = simulate(meta["algorithm"], q, kv, scale=meta["scale"], exp_mode=meta["exp_mode"])
    report = compare(meta["algorithm"], device, sim)
    report.update({"device": meta["device"], "exp_mode": meta["exp_mode"], "machine": MACHINE_FOR_MODE[meta["exp_mode"]],
                   "shape": list(q.shape), "context": int(kv.shape[1])})
    return report


def format_report(report: dict) -> str:
    lines = [f"{report['algorithm']} on {report.get('device', 'device')} (exp mode {report.get('exp_mode')}) "
             f"against {report.get('machine', 'the simulator')}:"]
    lines.append(f"  {'stage':6s} {'bit-exact':>10s} {'max ulp':>8s}  histogram")
    for r in report["stages"]:
        hist = " ".join(f"{k}:{v}" for k, v in r["histogram"].items() if v)
        lines.append(f"  {r['name']:6s} {100 * r['bit_exact']:9.3f}% {r['max_ulp']:8d}  {hist}")
    if report["first_difference"]:
        lines.append(f"  first difference at {report['first_difference']}: {report['responsible']}")
    else:
        lines.append("  every stage bit-identical")
    return "\n".join(lines)
