"""The cross-check for kernels people deploy: SGLang's Triton MLA decode, FlashMLA's sm90 dense decode, its sparse
FP8 decode (DeepSeek V3.2's and MODEL1's caches) and FlashMLA-ETAP (the ETAP paper's own kernel).

A capture (``.npz``) holds, per case, the device's output bits and the case's recipe: shapes, seqlens, splits,
the distribution and seed that :func:`amla_sim.experiments.inputs.make_inputs` rebuilds the inputs from (for the
sparse decode also the cache layout, indices, topk_length and sink drawn from that seed: :func:`sparse_inputs`),
and the inputs' CRC to prove it did. :func:`replay` simulates every case on the CPU and compares bit for bit;
:func:`capture` runs the kernel on a GPU (:mod:`amla_sim.gpu.thirdparty`) and writes such a file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from ._files import atomic_savez
from ._validate import check_int, dumps_strict
from .algorithms._common import D_V, check_scale
from .algorithms.flashmla import FLASHMLA_COMMIT, flashmla
from .algorithms.flashmla_cache import layout_of, pages, quantize_kv_cache
from .algorithms.flashmla_etap import ETAP_COMMIT, flashmla_etap
from .algorithms.flashmla_sparse_fp8 import flashmla_sparse_fp8, sparse_schedule
from .algorithms.splitkv_decode import SGLANG_VERSION, splitkv_decode
from .captures import input_crc
from .comparison import compare
from .crosscheck import CaptureError, read_capture
from .experiments.inputs import make_inputs
from .formats import round_to
from .resources import check_fits, run_bytes

__all__ = ["KERNELS", "SGLANG_CASES", "FLASHMLA_CASES", "ETAP_CASES", "SPARSE_FP8_CASES", "sparse_inputs", "capture",
           "replay", "format_report"]

#: The third-party kernels the cross-check covers.
KERNELS = ("sglang-triton", "flashmla", "flashmla-etap", "flashmla-sparse-fp8")

#: (batch, heads, seqlens, num_kv_splits, max_kv_splits, dist, seed, scale): what scripts/capture_thirdparty.py ran
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
#: (batch, s_q, heads, seqlens, dist, seed): what scripts/capture_thirdparty.py ran
FLASHMLA_CASES = [
    (1, 1, 128, (4096,), "flashmla", 11),
    (1, 1, 128, (4096,), "normal:1", 12),
    (1, 2, 128, (1000,), "flashmla", 13),
    (2, 1, 64, (64, 3001), "flashmla", 14),
    (3, 2, 128, (8192, 77, 5000), "normal:1", 15),
    (4, 1, 128, (513, 2048, 4097, 129), "flashmla", 16),
]
#: (batch, s_q, heads, seqlens, format, dist, seed, scale): what scripts/capture_thirdparty.py ran; s_q = 2 is causal
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
#: FlashMLA's sparse FP8 decode: (batch, s_q, heads, layout, seqlens (tokens each request's cache holds), topk,
#: topk_length, share of empty (-1) slots, attention sink, dist, seed, scale, power-of-two scales, num_sms); slots
#: past a request's tokens are empty; a sink "normal" is N(6, 4) per head, "edge" that with heads 0-2 at -inf, +inf,
#: 0; num_sms (None: the GPU's) sets the split schedule the kernel is handed (fewer SMs: requests in one split)
SPARSE_FP8_CASES = [
    (1, 1, 128, "v32", (4096,), 2048, None, 0.0, None, "flashmla", 31, None, True, None),
    (1, 1, 64, "v32", (1000,), 512, None, 0.1, "normal", "normal:1", 32, None, True, 1),
    (2, 2, 128, "v32", (300, 5000), 384, None, 0.0, None, "normal:1", 33, 0.1352, True, None),
    (3, 1, 64, "v32", (100, 2000, 64), 128, None, 0.0, "edge", "rope-outliers", 34, None, False, 2),
    (2, 1, 128, "model1", (4096, 700), 1024, (1024, 300), 0.0, None, "flashmla", 35, None, True, None),
    (4, 2, 64, "model1", (64, 1500, 3000, 200), 256, (0, 256, 100, 65), 0.05, "normal", "normal:1", 36, None, True,
     None),
    (1, 2, 128, "model1", (2048,), 2048, None, 0.3, "edge", "normal:4", 37, None, True, None),
    (2, 1, 128, "v32", (3000, 3000), 128, None, 0.5, "normal", "normal:1", 38, 0.1352, False, 16),
]
SPARSE_PAGE_SIZE = 64
# FlashMLA's cache quantizer: (layout, pages of 64 tokens, dist, seed, edge rows written over the first tokens)
QUANT_CASES = [
    ("v32", 2, "normal:1", 41, True),
    ("v32", 2, "rope-outliers", 42, False),
    ("v32", 2, "normal:3000", 43, True),
    ("model1", 2, "normal:1", 44, True),
    ("model1", 2, "flashmla", 45, False),
    ("model1", 2, "uniform:1e-3", 46, True),
]
_SGLANG_LAUNCH = {"block_n": 32, "block_h": 16, "num_warps": 4, "num_stages": 2, "min_block_kv": 32,
                  "page_size": 1, "logit_cap": 0.0}


def sparse_inputs(case: dict) -> dict[str, np.ndarray | None]:
    """A sparse FP8 case's inputs from its recipe: q (b, s_q, h, d) BF16, the packed cache (pages of 64 tokens,
    request i owning the pages from i * ceil(S_max / 64)), indices (b, s_q, topk), topk_length, attn_sink."""
    lay = layout_of(case["layout"], "layout")
    b, sq, H, topk = case["batch"], case.get("sq", 1), case["heads"], case["topk"]
    q, kv = make_inputs(case["dist"], batch=b, heads=H, sq=sq, context=max(case["seqlens"]), d_k=lay.d,
                        d_v=lay.d_nope, seed=case["seed"])
    kpages, base = pages(kv, SPARSE_PAGE_SIZE)
    cache = quantize_kv_cache(kpages, lay.name, power_of_two=case.get("power_of_two", True))
    rng = np.random.default_rng([case["seed"], 7])
    idx = np.full((b, sq, topk), -1, np.int32)
    for i, n in enumerate(case["seqlens"]):
        for j in range(sq):
            k = min(topk, n)
            idx[i, j, :k] = base[i] + rng.choice(n, k, replace=False)
            idx[i, j, rng.random(topk) < case.get("invalid", 0.0)] = -1
    tl_ = None if case.get("topk_length") is None else np.array(case["topk_length"], np.int32)
    sink = None
    if case.get("sink") is not None:
        sink = rng.normal(6.0, 2.0, H).astype(np.float32)
        if case["sink"] == "edge":
            sink[:3] = [-np.inf, np.inf, 0.0]
    got = {"q": q, "kv_cache": cache, "indices": idx, "topk_length": tl_, "attn_sink": sink}
    if "input_crc" in case and _sparse_crc(got) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return got


def quant_inputs(case: dict) -> np.ndarray:
    """A quantizer case's BF16 pages (pages, 64, 1, d); with `edges`, the first tokens hold a zero token, tiny,
    subnormal, huge and exactly-448 * 2^k amaxes, and a tile of equal values."""
    lay = layout_of(case["layout"], "layout")
    _, kv = make_inputs(case["dist"], batch=1, heads=1, context=case["pages"] * SPARSE_PAGE_SIZE, d_k=lay.d,
                        d_v=lay.d_nope, seed=case["seed"])
    x = kv[0].astype(np.float32)
    if case.get("edges"):
        x[0] = 0.0
        x[1, :lay.tile] *= np.float32(1e-30)
        x[2, :lay.tile] = np.float32(2.0**-133) * np.sign(x[2, :lay.tile])  # BF16 subnormals
        x[3, lay.tile:2 * lay.tile] = np.float32(3e38)
        x[4, :lay.tile] = np.float32(448.0)
        x[5, :] = np.float32(1.75 * 2.0**-20) * np.sign(x[5])
        x[6, :lay.tile] = np.float32(-0.3)
    return round_to(x, "bf16").astype(np.float32).reshape(case["pages"], SPARSE_PAGE_SIZE, 1, lay.d)


def _sparse_crc(inputs: dict) -> int:
    return input_crc(*(a for a in inputs.values() if a is not None))


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
        if kernel == "flashmla-sparse-fp8":
            _check_sparse_recipe(case)
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


def _check_sparse_recipe(case: dict) -> None:
    """What the sparse FP8 model covers, as the kernel's own checks say (a recipe outside them is refused)."""
    lay = layout_of(case["layout"], "layout")
    topk = check_int(case["topk"], "topk", lo=64)
    if topk % 64 or case["heads"] not in (64, 128):
        raise ValueError(f"topk, heads: the kernel takes topk a multiple of 64 and 64 or 128 heads, got "
                         f"{topk} and {case['heads']}")
    if case.get("topk_length") is not None:
        if lay.name != "model1":
            raise ValueError("topk_length: only MODEL1 caches take one")
        if len(case["topk_length"]) != case["batch"]:
            raise ValueError(f"topk_length: {len(case['topk_length'])} lengths for batch {case['batch']}")
        for n in case["topk_length"]:
            check_int(n, "topk_length", lo=0, hi=topk)
    if case.get("power_of_two", True) not in (True, False) or (lay.scale_type != "fp32" and not case["power_of_two"]):
        raise ValueError(f"power_of_two: true or false (false for V3.2's FP32 scales only), got "
                         f"{case['power_of_two']!r} for {lay.name}")
    if not 0 <= float(case.get("invalid", 0.0)) <= 1:
        raise ValueError(f"invalid: a share of empty slots in [0, 1], got {case['invalid']!r}")
    if case.get("sink") not in (None, "normal", "edge"):
        raise ValueError(f"sink: expected null, 'normal' or 'edge', got {case['sink']!r}")
    check_int(case.get("num_sms", 132), "num_sms", lo=1)
    if case.get("page_size", SPARSE_PAGE_SIZE) != SPARSE_PAGE_SIZE:
        raise ValueError(f"page_size: recipes use pages of {SPARSE_PAGE_SIZE} tokens, got {case['page_size']!r}")


def _stage(name: str, device: np.ndarray, sim: np.ndarray, fmt: type) -> tuple[str, np.ndarray, np.ndarray]:
    """A stage as :func:`amla_sim.compare` takes it: the device's raw bits, the simulator's, in `fmt`."""
    return name, device.view(fmt), sim.view(fmt)


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
        t0 = time.perf_counter()
        if kernel == "flashmla-sparse-fp8":
            stages = _sparse_stages(case, i, arrays)
        else:
            q, kv = _case_inputs(case)
            stages = {"sglang-triton": _sglang_stages, "flashmla": _flashmla_stages,
                      "flashmla-etap": _etap_stages}[kernel](case, i, q, kv, arrays)
        rows.append(compare({n: d for n, d, _ in stages}, {n: s for n, _, s in stages}, meta={
            "case": i, "batch": case["batch"], "sq": case.get("sq", 1), "heads": case["heads"],
            "seqlens": case["seqlens"], "num_kv_splits": case.get("num_kv_splits"), "dist": case["dist"],
            "format": case.get("format") or case.get("layout"), "seconds": round(time.perf_counter() - t0, 2)}))
    version = {"sglang-triton": meta.get("sglang"), "flashmla": meta.get("flashmla_commit"),
               "flashmla-etap": meta.get("etap_commit"), "flashmla-sparse-fp8": meta.get("flashmla_commit")}[kernel]
    return {"kernel": kernel, "version": version, "device": meta.get("device"), "cases": rows}


def _sglang_stages(case: dict, i: int, q: np.ndarray, kv: np.ndarray, arrays: dict) -> list[tuple]:
    res = splitkv_decode(q, kv, seqlens=np.array(case["seqlens"]), num_kv_splits=np.array(case["num_kv_splits"]),
                         max_kv_splits=case["max_kv_splits"], scale=case.get("scale"))
    stages = []
    if f"c{i}_mid" in arrays:
        stages.append(_stage("mid", arrays[f"c{i}_mid"], res.mid.view(np.uint32), np.float32))
    stages.append(_stage("lse", arrays[f"c{i}_lse"], res.lse.view(np.uint32), np.float32))
    stages.append(_stage("out", arrays[f"c{i}_o"], res.out[:, 0].view(np.uint16), ml_dtypes.bfloat16))
    return stages


def _flashmla_stages(case: dict, i: int, q: np.ndarray, kv: np.ndarray, arrays: dict) -> list[tuple]:
    res = flashmla(q, kv, seqlens=np.array(case["seqlens"]), scale=case.get("scale"))
    return [_stage("lse", arrays[f"c{i}_lse"], res.lse.view(np.uint32), np.float32),
            _stage("out", arrays[f"c{i}_out"], res.out.view(np.uint16), ml_dtypes.bfloat16)]


def _etap_stages(case: dict, i: int, q: np.ndarray, kv: np.ndarray, arrays: dict) -> list[tuple]:
    res = flashmla_etap(q, kv, seqlens=np.array(case["seqlens"]), scale=case.get("scale"), causal=case["causal"])
    fmt = np.float16 if case["format"] == "fp16" else ml_dtypes.bfloat16
    return [_stage("lse", arrays[f"c{i}_lse"], res.lse.view(np.uint32), np.float32),
            _stage("out", arrays[f"c{i}_out"], res.out.view(np.uint16), fmt)]


def _sparse_stages(case: dict, i: int, arrays: dict) -> list[tuple]:
    res = flashmla_sparse_fp8(**sparse_inputs(case), scale=case.get("scale"), num_sms=case.get("num_sms", 132))
    return [_stage("lse", arrays[f"c{i}_lse"], res.lse.view(np.uint32), np.float32),
            _stage("out", arrays[f"c{i}_out"], res.out.view(np.uint16), ml_dtypes.bfloat16)]


def format_report(report: dict) -> str:
    lines = [f"{report['kernel']} {report.get('version') or ''} on {report.get('device')} against the simulator:"]
    for r in report["cases"]:
        m = r.meta
        splits = f" splits={m['num_kv_splits']}" if m.get("num_kv_splits") else ""
        fmt = f" {m['format']}" if m.get("format") else ""
        lines.append(f"  case {m['case']}:{fmt} b={m['batch']} s_q={m['sq']} H={m['heads']} "
                     f"seqlens={m['seqlens']}{splits} ({m['seconds']} s)")
        lines.append(r.format(indent="    "))
    return "\n".join(lines)


def to_json(report: dict, **kwargs) -> str:
    """A replay's report as strict JSON (each case's comparison through its ``to_dict``)."""
    return dumps_strict({**report, "cases": [r.to_dict() for r in report["cases"]]}, **kwargs)


def capture(kernel: str, path: str | Path, *, source: str | None = None, seed: int = 0) -> None:
    """Run `kernel` on this machine's GPU over its cases (SGLANG_CASES, FLASHMLA_CASES, ETAP_CASES,
    SPARSE_FP8_CASES) and write a capture.

    source: the sglang kernel file (default: the installed sglang package), or the folder holding FlashMLA's
    build_flashmla.py (FlashMLA-ETAP's build_etap.py, the sparse decode's build_sparse_fp8.py). seed: added to
    every case's seed, for inputs no committed capture used."""
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
    elif kernel == "flashmla-sparse-fp8":
        if source is None:
            raise ValueError("source: FlashMLA's sparse FP8 decode is built from a folder holding "
                             "build_sparse_fp8.py; name it")
        mod = adapters.load_sparse_fp8(source)
        for i, (b, sq, H, layout, seqlens, topk, tlen, invalid, sink, dist, case_seed, scale, pow2, sms) in \
                enumerate(SPARSE_FP8_CASES):
            recipe = {"batch": b, "sq": sq, "heads": H, "layout": layout, "seqlens": list(seqlens), "topk": topk,
                      "topk_length": None if tlen is None else list(tlen), "invalid": invalid, "sink": sink,
                      "dist": dist, "seed": case_seed + seed, "scale": scale, "power_of_two": pow2,
                      "page_size": SPARSE_PAGE_SIZE, "num_sms": sms, "schedule": "given" if sms else "kernel"}
            inputs = sparse_inputs(recipe)
            given = None
            if sms is not None:  # FlashMLA's schedule for fewer SMs
                parts, cum = sparse_schedule(list(tlen or [topk] * b), s_q=sq, heads=H, num_sms=sms)
                given = (np.array([p.as_ints()[:7] for p in parts], np.int32), cum)
            got = adapters.run_sparse_fp8(mod, **inputs, scale=layout_of(layout).d ** -0.5 if scale is None else scale,
                                          schedule=given)
            recipe["num_sms"] = got["num_sms"] if sms is None else sms
            for k in ("out", "lse", "sched", "num_splits"):
                arrays[f"c{i}_{k}"] = got[k]
            recipes.append({**recipe, "input_crc": _sparse_crc(inputs)})
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
