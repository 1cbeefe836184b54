"""This project's Triton kernels (:mod:`amla_sim.gpu.kernels`) against the simulator, stage by stage: which bits
agree, and which model is responsible for the others.

A capture (``.npz``, :mod:`.files`) holds the inputs (or names a shared inputs file), the kernel's settings and the
device's per-block stages; replaying it needs no GPU. The simulator runs the same algorithm on the
``sm90-triton-exact`` machine (kernel exp mode ``poly``, IEEE division) or ``sm90-triton`` (hardware ex2.approx
and div.full, from measured MUFU tables), both modelled bit for bit, with its trace on, and each stage is
compared bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np

from .._files import atomic_savez
from .._validate import quiet_fp
from ..algorithms import ALGORITHMS
from ..algorithms._common import D_V
from ..comparison import ComparisonReport, compare
from ..machines import Machine
from ..resources import check_fits, run_bytes
from ..schedules import Schedule
from .files import CaptureError, inputs_digest, read_capture
from .report import ReplayReport

__all__ = ["STAGES", "RESPONSIBLE", "MACHINE_FOR_MODE", "device_run", "simulate_stages", "run_stages", "compare_stages",
           "save_capture", "save_inputs", "load_capture", "replay_own"]

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
KERNEL_SCHEDULE = "amla-sim-gpu"  # how amla_sim.gpu's kernels lay the blocks out


def device_run(algorithm: str, q: np.ndarray, kv: np.ndarray, **kwargs) -> dict[str, np.ndarray]:
    """:func:`amla_sim.gpu.run.run_kernel`, with SnapMLA's cache and query quantized here, by the simulator's
    quantizer, as the kernel expects them."""
    from ..gpu.run import BLOCK_N, run_kernel

    quantized = None
    if algorithm == "snapmla":
        from ..algorithms.snapmla import kernel_inputs

        quantized = kernel_inputs(q, kv, scale=kwargs.get("scale"), block=BLOCK_N)
    return run_kernel(algorithm, q, kv, quantized=quantized, **kwargs)


def simulate_stages(algorithm: str, q: np.ndarray, kv: np.ndarray, *, scale: float | None, exp_mode: str) -> dict:
    """The simulator's stages, stacked per block like the kernel's debug output: (n_blocks, b, R, ...)."""
    if algorithm not in STAGES:
        raise ValueError(f"algorithm: the cross-check covers {sorted(STAGES)}, got {algorithm!r}")
    if exp_mode not in MACHINE_FOR_MODE:
        raise ValueError(f"exp_mode: expected one of {sorted(MACHINE_FOR_MODE)}, got {exp_mode!r}")
    return run_stages(algorithm, q, kv, machine=MACHINE_FOR_MODE[exp_mode], schedule=KERNEL_SCHEDULE, scale=scale)


@quiet_fp
def run_stages(algorithm: str, q: np.ndarray, kv: np.ndarray, *, machine: str | Machine,
               schedule: str | Schedule = "reference", scale: float | None = None) -> dict:
    """Run `algorithm` on any machine and schedule with its trace on; the stages stacked per block, and the
    output."""
    res = ALGORITHMS[algorithm](q, kv, machine=machine, schedule=schedule, scale=scale, trace=True)
    stages = {k: np.stack(v) for k, v in res.trace.items() if k in STAGES[algorithm]}
    if "N" in stages:  # the first block adds no N
        stages["N"] = np.concatenate([np.zeros_like(stages["N"][:1]), stages["N"]]).astype(np.int32)
    stages["out"] = res.out
    return stages


def compare_stages(algorithm: str, device_stages: dict, sim: dict, **meta) -> ComparisonReport:
    """:func:`amla_sim.compare` over every stage the device dumped, in `algorithm`'s pipeline order, each
    explained by the model it depends on (``RESPONSIBLE``). A device stage that is not one of `algorithm`'s, or
    that the simulation lacks, is an error: never left out; a stage of `algorithm` the device lacks is reported as
    not compared (the report is then not bit-exact)."""
    unknown = [n for n in device_stages if n not in STAGES[algorithm]]
    if unknown:
        raise ValueError(f"device: {unknown} are not stages of {algorithm} ({list(STAGES[algorithm])})")
    names = [n for n in STAGES[algorithm] if n in device_stages]
    if not names:
        raise ValueError(f"device: no stage of {algorithm} ({list(STAGES[algorithm])}) to compare")
    report = compare(device_stages, sim, stages=names, explanations=RESPONSIBLE,
                     meta={"algorithm": algorithm, **meta})
    missing = {n: "the device dumped no such stage" for n in STAGES[algorithm] if n not in device_stages}
    return replace(report, skipped={**report.skipped, **missing}) if missing else report


def save_capture(path: str | Path, *, algorithm: str, q: np.ndarray, kv: np.ndarray, scale: float | None,
                 exp_mode: str, div_mode: str, device_name: str, device: dict, inputs: str | None = None) -> None:
    """Write inputs, settings and the device's stages to an .npz (inputs as raw BF16 bits).

    inputs: the name of an inputs file beside `path` (:func:`save_inputs`) that already holds q and kv: the
    capture then records its name and the inputs' SHA-256 instead of the arrays (captures of one draw share it).
    """
    meta = {"algorithm": algorithm, "scale": scale, "exp_mode": exp_mode, "div_mode": div_mode,
            "device": device_name}
    arrays = {f"device_{k}": (v.view(np.uint16) if v.dtype == np.dtype(ml_dtypes.bfloat16) else v)
              for k, v in device.items()}
    if inputs is None:
        arrays.update(q=q.view(np.uint16), kv=kv.view(np.uint16))
    elif Path(inputs).name != inputs:
        raise ValueError(f"inputs: the name of a file beside the capture, got {inputs!r}")
    else:
        meta["inputs"] = {"file": inputs, "sha256": inputs_digest(q.view(np.uint16), kv.view(np.uint16))}
    atomic_savez(path, meta=np.array(json.dumps(meta)), **arrays)


def save_inputs(path: str | Path, q: np.ndarray, kv: np.ndarray) -> None:
    """The q and kv that several captures share (raw BF16 bits)."""
    atomic_savez(path, q=q.view(np.uint16), kv=kv.view(np.uint16), meta=np.array(json.dumps({"kind": "inputs"})))


def _shared_inputs(path: Path, ref: object) -> dict[str, np.ndarray]:
    """q and kv from the inputs file a capture names, checked against the SHA-256 it recorded."""
    if not (isinstance(ref, dict) and isinstance(ref.get("file"), str) and isinstance(ref.get("sha256"), str)) \
            or Path(ref["file"]).name != ref["file"]:
        raise CaptureError(f"replay: {path}: 'inputs' must name a file beside the capture and its sha256")
    where = path.parent / ref["file"]
    _, arrays = read_capture(where)
    other = sorted(set(arrays) - {"q", "kv"})
    if other:
        raise CaptureError(f"replay: {where}: member {other[0]!r} is not an input (an inputs file holds q and kv)")
    q, kv = arrays.get("q"), arrays.get("kv")
    if q is None or kv is None or inputs_digest(q, kv) != ref["sha256"]:
        raise CaptureError(f"replay: {path}: the inputs in {where} are not the ones it was captured with "
                           "(their SHA-256 differs)")
    return {"q": q, "kv": kv}


def load_capture(path: str | Path, *, read: tuple[dict, dict[str, np.ndarray]] | None = None
                 ) -> tuple[dict, np.ndarray, np.ndarray, dict]:
    """(meta, q, kv, device stages) of a capture, every array checked against the format before any work:
    q (b, s_q, G, d_k) and kv (b, S, d_k) raw BF16 bits (uint16), in the capture or in the inputs file it names,
    device_out (b, s_q, G, d_v) BF16 bits, each stage (n_blocks, b, s_q G, ...) FP32 (N: int32), the arrays at
    most MAX_CAPTURE_BYTES uncompressed. Any other member, and q or kv beside an inputs file, is refused by name."""
    path = Path(path)
    meta, arrays = read_capture(path) if read is None else read
    if "inputs" in meta:
        if "q" in arrays or "kv" in arrays:
            raise CaptureError(f"replay: {path} holds {'q' if 'q' in arrays else 'kv'} and names an inputs file "
                               "too: which inputs did the device see?")
        arrays = {**arrays, **_shared_inputs(path, meta["inputs"])}
    for key in ("q", "kv", "device_out"):
        if key not in arrays:
            raise CaptureError(f"replay: {path} has no {key!r} array")
    alg, mode, scale = meta.get("algorithm"), meta.get("exp_mode"), meta.get("scale")
    if not isinstance(alg, str) or alg not in STAGES:
        raise CaptureError(f"replay: {path}: algorithm {alg!r} is not one of {sorted(STAGES)}")
    if not isinstance(mode, str) or mode not in MACHINE_FOR_MODE:
        raise CaptureError(f"replay: {path}: exp_mode {mode!r} is not one of {sorted(MACHINE_FOR_MODE)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not 0 < scale < float(np.finfo(np.float32).max)):
        raise CaptureError(f"replay: {path}: scale {scale!r} is not a positive FP32 number")
    q, kv = arrays["q"], arrays["kv"]
    if q.dtype != np.uint16 or q.ndim != 4 or kv.dtype != np.uint16 or kv.ndim != 3:
        raise CaptureError(f"replay: {path}: q and kv must be BF16 bits (uint16) of shapes (b, s_q, G, d_k) and "
                           f"(b, S, d_k), got {q.dtype} {q.shape} and {kv.dtype} {kv.shape}")
    b, sq, G, d_k = q.shape
    L = kv.shape[1]
    if min(q.shape) < 1 or L < sq or kv.shape[0] != b or kv.shape[2] != d_k or d_k <= D_V:
        raise CaptureError(f"replay: {path}: q {q.shape} and kv {kv.shape} do not describe an MLA decode")
    nb, R = -(-L // 64), sq * G
    expected = {"out": ((b, sq, G, D_V), np.uint16)}
    for name in dict.fromkeys(n for stages in STAGES.values() for n in stages[:-1]):  # the kernels share a layout
        tail = {"S": (64,), "P": (64,), "O": (D_V,)}.get(name, ())
        expected[name] = ((nb, b, R, *tail), np.int32 if name == "N" else np.float32)
    device = _device_stages(path, alg, arrays, expected)
    check_fits(run_bytes(batch=b, sq=sq, heads=G, context=L, d_k=d_k, mufu_tables=True),
               what=f"replaying {path}", lower="the capture's size")
    return meta, q.view(ml_dtypes.bfloat16), kv.view(ml_dtypes.bfloat16), device


def _device_stages(path: Path, alg: str, arrays: dict[str, np.ndarray], expected: dict) -> dict[str, np.ndarray]:
    """The device's stages of `alg`, every member checked: q, kv, or ``device_{stage}`` of the format's shape and
    dtype; a buffer of a stage `alg` does not have must be unwritten (zeros). Anything else is refused by name."""
    device = {}
    for key, arr in arrays.items():
        if key in ("q", "kv"):
            continue
        name = key.removeprefix("device_")
        if name == key or name not in expected:
            raise CaptureError(f"replay: {path}: member {key!r} is not an array of the capture format (q, kv, "
                               f"{', '.join('device_' + n for n in expected)}): nothing would compare it")
        shape, dtype = expected[name]
        if arr.shape != shape or arr.dtype != dtype:
            raise CaptureError(f"replay: {path}: {key} should be {np.dtype(dtype)} {shape}, got {arr.dtype} "
                               f"{arr.shape}")
        if name in STAGES[alg]:
            device[name] = arr
        elif arr.any():  # the kernels write one set of debug buffers, zeroed: another algorithm's stay zero
            raise CaptureError(f"replay: {path}: {key} holds data, but {alg} has no stage {name} "
                               f"({', '.join(STAGES[alg])}): nothing would compare it")
    return device


def _unwritten(alg: str, arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """The zeroed buffers of stages `alg` does not have, held by the capture and not compared."""
    return {k: f"a buffer {alg} does not write, all zero" for k in arrays
            if k.startswith("device_") and k.removeprefix("device_") not in STAGES[alg]}


def replay_own(path: str | Path, *, read: tuple[dict, dict[str, np.ndarray]] | None = None) -> ReplayReport:
    """Redo the comparison of a saved capture of this project's kernels on the CPU (`read`: the capture's meta
    and arrays, where the caller has read them already). A stage of the algorithm that the capture lacks is
    reported as not compared."""
    read = read_capture(path) if read is None else read
    meta, q, kv, device = load_capture(path, read=read)
    device["out"] = device["out"].view(ml_dtypes.bfloat16)
    sim = simulate_stages(meta["algorithm"], q, kv, scale=meta["scale"], exp_mode=meta["exp_mode"])
    name, where, machine = str(meta.get("device", "unknown")), meta["exp_mode"], MACHINE_FOR_MODE[meta["exp_mode"]]
    report = compare_stages(meta["algorithm"], device, sim, device=name, exp_mode=where, machine=machine,
                            shape=list(q.shape), context=int(kv.shape[1]))
    return ReplayReport(kernel="amla-sim", version=meta["algorithm"], device=name, cases=[report],
                        title=f"{meta['algorithm']} on {name} (exp mode {where}) against {machine}:",
                        held_not_compared=_unwritten(meta["algorithm"], read[1]))
