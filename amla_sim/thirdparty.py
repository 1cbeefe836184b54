"""The cross-check for kernels people deploy: SGLang's Triton MLA decode, FlashMLA's sm90 dense decode and
FlashMLA-ETAP (the ETAP paper's own kernel).

A capture (``.npz``) holds, per case, the device's output bits and the case's recipe: shapes, seqlens, splits,
the distribution and seed that :func:`amla_sim.experiments.inputs.make_inputs` rebuilds the inputs from, and the
inputs' CRC to prove it did. :func:`replay` simulates every case on the CPU and compares bit for bit;
:func:`capture` runs the kernel on a GPU (:mod:`amla_sim.gpu.thirdparty`) and writes such a file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from ._files import atomic_savez
from ._validate import check_int
from .algorithms._common import D_V, check_scale
from .algorithms.flashmla import FLASHMLA_COMMIT, flashmla
from .algorithms.flashmla_etap import ETAP_COMMIT, flashmla_etap
from .algorithms.splitkv_decode import SGLANG_VERSION, splitkv_decode
from .captures import input_crc
from .crosscheck import CaptureError, read_capture
from .experiments.inputs import make_inputs
from .resources import check_fits, run_bytes
from .testing import ulp_distance

__all__ = ["KERNELS", "SGLANG_CASES", "FLASHMLA_CASES", "ETAP_CASES", "capture", "replay", "format_report"]

KERNELS = ("sglang-triton", "flashmla", "flashmla-etap")

# (batch, heads, seqlens, num_kv_splits, max_kv_splits, dist, seed, scale): what scripts/capture_thirdparty.py ran
SGLANG_CASES = [
    (1, 128, (4096,), (8,), 8, "flashmla", 1, None),
    (1, 128, (4096,), (8,), 8, "normal:1", 2, None),
    (1, 128, (1000,), (4,), 8, "normal:1", 3, 0.1352),
    (2, 128, (64, 3001), (1, 8), 8, "flashmla", 4, None),
    (3, 64, (8192, 77, 5000), (16, 2, 7), 16, "normal:1", 5, None),
    (4, 128, (513, 2048, 4097, 129), (3, 8, 8, 1), 8, "flashmla", 6, None),
    (1, 64, (8192,), (32,), 32, "flashmla", 7, 0.1352),
    (2, 128, (2000, 6000), (5, 11), 16, "uniform:3", 8, None),
]
# (batch, s_q, heads, seqlens, dist, seed): what scripts/capture_thirdparty.py ran
FLASHMLA_CASES = [
    (1, 1, 128, (4096,), "flashmla", 11),
    (1, 1, 128, (4096,), "normal:1", 12),
    (1, 2, 128, (1000,), "flashmla", 13),
    (2, 1, 64, (64, 3001), "flashmla", 14),
    (3, 2, 128, (8192, 77, 5000), "normal:1", 15),
    (4, 1, 128, (513, 2048, 4097, 129), "flashmla", 16),
]
# (batch, s_q, heads, seqlens, format, dist, seed, scale): what scripts/capture_thirdparty.py ran; s_q = 2 is causal
ETAP_CASES = [
    (1, 1, 16, (4096,), "fp16", "normal:1", 21, None),
    (1, 1, 128, (2048,), "bf16", "flashmla", 22, None),
    (2, 2, 64, (1, 1000), "bf16", "flashmla", 23, 0.1352),
    (4, 1, 32, (63, 64, 65, 3001), "fp16", "normal:1", 24, None),
    (2, 2, 16, (16500, 129), "fp16", "flashmla", 25, None),
    (16, 1, 16, (512, 1, 2048, 777, 64, 1500, 65, 3000, 100, 2500, 63, 1024, 4096, 300, 129, 2000), "fp16",
     "normal:1", 26, None),
    (3, 1, 64, (3000, 77, 2049), "bf16", "normal:1", 27, 0.1352),
    (8, 2, 32, (1, 63, 64, 65, 700, 2500, 4097, 129), "bf16", "flashmla", 28, None),
]
ETAP_PAGE_SIZE = 64  # the kernel's only page size (kBlockN)
_SGLANG_LAUNCH = {"block_n": 32, "block_h": 16, "num_warps": 4, "num_stages": 2, "min_block_kv": 32,
                  "page_size": 1, "logit_cap": 0.0}


def _case_inputs(case: dict) -> tuple[np.ndarray, np.ndarray]:
    q, kv = make_inputs(case["dist"], batch=case["batch"], heads=case["heads"], sq=case.get("sq", 1),
                        context=max(case["seqlens"]), seed=case["seed"], fmt=case.get("format", "bf16"))
    if "input_crc" in case and input_crc(q, kv) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return q, kv


def _check_case(path: Path, kernel: str, i: int, case: object, arrays: dict) -> None:
    """A case's recipe and arrays against the format (before any work): its sizes, and its memory."""
    where = f"replay: {path}: case {i}"
    if not isinstance(case, dict):
        raise CaptureError(f"{where} is not a JSON object")
    try:
        b, H = check_int(case["batch"], "batch", lo=1), check_int(case["heads"], "heads", lo=1)
        sq = check_int(case.get("sq", 1), "sq", lo=1)
        check_int(case["seed"], "seed", lo=0)
        seqlens = [check_int(n, "seqlens", lo=1) for n in case["seqlens"]]
        if len(seqlens) != b:
            raise ValueError(f"seqlens: {len(seqlens)} lengths for batch {b}")
        if case.get("scale") is not None:
            check_scale(case["scale"])
        if not isinstance(case["dist"], str):
            raise TypeError(f"dist: expected a string, got {case['dist']!r}")
        if kernel == "sglang-triton":
            splits = [check_int(n, "num_kv_splits", lo=1) for n in case["num_kv_splits"]]
            top = check_int(case["max_kv_splits"], "max_kv_splits", lo=max(splits, default=1))
            shapes = {"o": ((b, H, D_V), np.uint16), "lse": ((b, H, top), np.uint32),
                      "mid": ((b, H, top, D_V), np.uint32)}
        else:
            shapes = {"out": ((b, sq, H, D_V), np.uint16), "lse": ((b, H, sq), np.uint32)}
        if kernel == "flashmla-etap":
            _check_etap_recipe(case)
    except KeyError as e:
        raise CaptureError(f"{where} has no {e.args[0]!r}") from None
    except (ValueError, TypeError) as e:
        raise CaptureError(f"{where}: {e}") from None
    for name, (shape, dtype) in shapes.items():
        arr = arrays.get(f"c{i}_{name}")
        if arr is None:
            if name == "mid":
                continue  # partial outputs are optional
            raise CaptureError(f"{where} has no c{i}_{name} array")
        if arr.shape != shape or arr.dtype != dtype:
            raise CaptureError(f"{where}: c{i}_{name} should be {np.dtype(dtype)} {shape}, got {arr.dtype} {arr.shape}")
    check_fits(run_bytes(batch=b, sq=sq, heads=H, context=max(seqlens), mufu_tables=True), what=where,
               lower="the capture's sizes")


def _check_etap_recipe(case: dict) -> None:
    """What the FlashMLA-ETAP model covers: BF16 or FP16, pages of 64 tokens, one KV head of 576."""
    if case["format"] not in ("bf16", "fp16"):
        raise ValueError(f"format: the kernel takes bf16 or fp16 (q and kv alike), got {case['format']!r}")
    if case.get("page_size", ETAP_PAGE_SIZE) != ETAP_PAGE_SIZE:
        raise ValueError(f"page_size: the kernel takes pages of {ETAP_PAGE_SIZE} tokens, got {case['page_size']!r}")
    if case.get("head_dim", 576) != 576 or case.get("heads_k", 1) != 1:
        raise ValueError(f"head_dim: the model covers one KV head of 576 (V its first 512), got "
                         f"{case.get('heads_k', 1)} of {case.get('head_dim', 576)}")
    if not isinstance(case["causal"], bool):
        raise TypeError(f"causal: expected true or false, got {case['causal']!r}")


def _compare(name: str, device: np.ndarray, sim: np.ndarray, fmt: type) -> dict:
    d, s = device.view(fmt), sim.view(fmt)
    live = ~(np.isnan(d) & np.isnan(s))  # both NaN: a split that wrote nothing
    dist = ulp_distance(d[live], s[live])
    return {"name": name, "bit_exact": float(np.mean(dist == 0)) if dist.size else 1.0,
            "max_ulp": int(dist.max()) if dist.size else 0}


def _kernel_of(meta: dict) -> str:
    kernel = meta.get("kernel") or ("sglang-triton" if "sglang" in meta else
                                    "flashmla" if "flashmla_commit" in meta else None)
    if kernel not in KERNELS:
        raise CaptureError(f"replay: the capture names no kernel of {KERNELS}")
    return kernel


def replay(path: str | Path, *, cases: list[int] | None = None, kernel: str | None = None) -> dict:
    """Simulate every case (or those listed) of a capture; per case and stage, the bit-exact fraction.

    kernel: the kernel the caller expects the capture to hold (checked before any work)."""
    path = Path(path)
    meta, arrays = read_capture(path)
    found = _kernel_of(meta)
    if kernel is not None and kernel != found:
        raise ValueError(f"--kernel: the capture holds {found}, not {kernel}")
    kernel = found
    if not isinstance(meta.get("cases"), list) or not meta["cases"]:
        raise CaptureError(f"replay: {path}: 'meta' has no list of cases")
    todo = range(len(meta["cases"])) if cases is None else cases
    for i in todo:
        if not 0 <= i < len(meta["cases"]):
            raise ValueError(f"cases: {path} has cases 0..{len(meta['cases']) - 1}, not {i}")
        _check_case(path, kernel, i, meta["cases"][i], arrays)
    rows = []
    for i in todo:
        case = meta["cases"][i]
        q, kv = _case_inputs(case)
        t0 = time.perf_counter()
        stages = {"sglang-triton": _sglang_stages, "flashmla": _flashmla_stages,
                  "flashmla-etap": _etap_stages}[kernel](case, i, q, kv, arrays)
        first = next((s["name"] for s in stages if s["bit_exact"] < 1), None)
        rows.append({"case": i, "batch": case["batch"], "sq": case.get("sq", 1), "heads": case["heads"],
                     "seqlens": case["seqlens"], "num_kv_splits": case.get("num_kv_splits"), "dist": case["dist"],
                     "format": case.get("format"),
                     "stages": stages, "first_difference": first, "seconds": round(time.perf_counter() - t0, 2)})
    version = {"sglang-triton": meta.get("sglang"), "flashmla": meta.get("flashmla_commit"),
               "flashmla-etap": meta.get("etap_commit")}[kernel]
    return {"kernel": kernel, "version": version, "device": meta.get("device"), "cases": rows}


def _sglang_stages(case: dict, i: int, q: np.ndarray, kv: np.ndarray, arrays: dict) -> list[dict]:
    res = splitkv_decode(q, kv, seqlens=np.array(case["seqlens"]), num_kv_splits=np.array(case["num_kv_splits"]),
                         max_kv_splits=case["max_kv_splits"], scale=case.get("scale"))
    stages = []
    if f"c{i}_mid" in arrays:
        stages.append(_compare("mid", arrays[f"c{i}_mid"], res.mid.view(np.uint32), np.float32))
    stages.append(_compare("lse", arrays[f"c{i}_lse"], res.lse.view(np.uint32), np.float32))
    stages.append(_compare("out", arrays[f"c{i}_o"], res.out[:, 0].view(np.uint16), ml_dtypes.bfloat16))
    return stages


def _flashmla_stages(case: dict, i: int, q: np.ndarray, kv: np.ndarray, arrays: dict) -> list[dict]:
    res = flashmla(q, kv, seqlens=np.array(case["seqlens"]), scale=case.get("scale"))
    return [_compare("lse", arrays[f"c{i}_lse"], res.lse.view(np.uint32), np.float32),
            _compare("out", arrays[f"c{i}_out"], res.out.view(np.uint16), ml_dtypes.bfloat16)]


def _etap_stages(case: dict, i: int, q: np.ndarray, kv: np.ndarray, arrays: dict) -> list[dict]:
    res = flashmla_etap(q, kv, seqlens=np.array(case["seqlens"]), scale=case.get("scale"), causal=case["causal"])
    fmt = np.float16 if case["format"] == "fp16" else ml_dtypes.bfloat16
    return [_compare("lse", arrays[f"c{i}_lse"], res.lse.view(np.uint32), np.float32),
            _compare("out", arrays[f"c{i}_out"], res.out.view(np.uint16), fmt)]


def format_report(report: dict) -> str:
    lines = [f"{report['kernel']} {report.get('version') or ''} on {report.get('device')} against the simulator:"]
    for r in report["cases"]:
        stages = "  ".join(f"{s['name']} {100 * s['bit_exact']:.3f}% (max {s['max_ulp']} ulp)" for s in r["stages"])
        tail = f"first difference: {r['first_difference']}" if r["first_difference"] else "bit-identical"
        splits = f" splits={r['num_kv_splits']}" if r.get("num_kv_splits") else ""
        fmt = f" {r['format']}" if r.get("format") else ""
        lines.append(f"  case {r['case']}:{fmt} b={r['batch']} s_q={r['sq']} H={r['heads']} "
                     f"seqlens={r['seqlens']}{splits}"
                     f"  {stages}  {tail}  ({r['seconds']} s)")
    return "\n".join(lines)


def capture(kernel: str, path: str | Path, *, source: str | None = None, seed: int = 0) -> None:
    """Run `kernel` on this machine's GPU over its cases (SGLANG_CASES, FLASHMLA_CASES) and write a capture.

    source: the sglang kernel file (default: the installed sglang package), or the folder holding FlashMLA's
    build_flashmla.py (FlashMLA-ETAP's build_etap.py). seed: added to every case's seed, for inputs no committed
    capture used."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    import torch

    from .gpu import thirdparty as adapters

    arrays, recipes = {}, []
    if kernel == "sglang-triton":
        mod = adapters.load_sglang(source)
        for i, (b, H, seqlens, splits, max_splits, dist, case_seed, scale) in enumerate(SGLANG_CASES):
            q, kv = make_inputs(dist, batch=b, heads=H, context=max(seqlens), seed=case_seed + seed)
            got = adapters.run_sglang(mod, np.ascontiguousarray(q[:, 0]).view(np.uint16), kv.view(np.uint16),
                                      list(seqlens), np.array(splits), max_splits, 576**-0.5 if scale is None else scale)
            arrays[f"c{i}_o"], arrays[f"c{i}_lse"] = got["o"], got["lse"]
            if i < 3:
                arrays[f"c{i}_mid"] = got["mid"]
            recipes.append({"batch": b, "heads": H, "seqlens": list(seqlens), "num_kv_splits": list(splits),
                            "max_kv_splits": max_splits, "dist": dist, "seed": case_seed + seed, "scale": scale,
                            "input_crc": input_crc(q, kv)})
        meta = {"kernel": kernel, "sglang": SGLANG_VERSION, **_SGLANG_LAUNCH}
    elif kernel == "flashmla":
        if source is None:
            raise ValueError("source: FlashMLA is built from a folder holding build_flashmla.py; name it")
        mod = adapters.load_flashmla(source)
        for i, (b, sq, H, seqlens, dist, case_seed) in enumerate(FLASHMLA_CASES):
            q, kv = make_inputs(dist, batch=b, heads=H, sq=sq, context=max(seqlens), seed=case_seed + seed)
            got = adapters.run_flashmla(mod, q.view(np.uint16), kv.view(np.uint16), list(seqlens), 576**-0.5)
            for k in ("out", "lse", "sched", "num_splits"):
                arrays[f"c{i}_{k}"] = got[k]
            recipes.append({"batch": b, "sq": sq, "heads": H, "seqlens": list(seqlens), "dist": dist,
                            "seed": case_seed + seed, "scale": None, "input_crc": input_crc(q, kv)})
        meta = {"kernel": kernel, "flashmla_commit": FLASHMLA_COMMIT}
    else:
        if source is None:
            raise ValueError("source: FlashMLA-ETAP is built from a folder holding build_etap.py; name it")
        mod = adapters.load_etap(source)
        for i, (b, sq, H, seqlens, fmt, dist, case_seed, scale) in enumerate(ETAP_CASES):
            q, kv = make_inputs(dist, batch=b, heads=H, sq=sq, context=max(seqlens), seed=case_seed + seed, fmt=fmt)
            causal = sq > 1
            got = adapters.run_etap(mod, q.view(np.uint16), kv.view(np.uint16), list(seqlens),
                                    576**-0.5 if scale is None else scale, causal, fmt)
            for k in ("out", "lse", "sched", "num_splits"):
                arrays[f"c{i}_{k}"] = got[k]
            recipes.append({"batch": b, "sq": sq, "heads": H, "seqlens": list(seqlens), "format": fmt, "dist": dist,
                            "seed": case_seed + seed, "scale": scale, "causal": causal, "page_size": ETAP_PAGE_SIZE,
                            "input_crc": input_crc(q, kv)})
        meta = {"kernel": kernel, "etap_commit": ETAP_COMMIT}
    meta.update({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": recipes})
    atomic_savez(path, meta=np.array(json.dumps(meta)), **arrays)
