"""The engines' chained MLA prefills, vLLM's (:mod:`amla_sim.algorithms.deployed.vllm.mla_prefill`) and SGLang's
(:mod:`amla_sim.algorithms.deployed.sglang.mha_prefill`): the device checks' cases and their inputs
(``scripts/capture_prefill.py``, ``scripts/capture_sglang_prefill.py``), and the replay of a capture.

A case is a batch of prefill requests, each with new tokens (``qlens``) and a cached context (``context_lens``),
and vLLM's settings that shape the chain: the chunked-prefill workspace's rows, the page size that aligns a cut
context, ``num_splits``. Its inputs are drawn by :func:`~amla_sim.experiments.inputs.make_inputs` (q at the seed, the
new tokens' k and v at seed + 1000 and + 2000, the contexts' at + 3000 and + 4000) and checked against the CRC the
capture recorded; the capture holds the final output's bits for the first ``keep_heads`` heads (the heads are
independent; the replay computes those under the whole layer's split choices).
"""

from __future__ import annotations

import numpy as np

from ..algorithms.deployed.sglang.mha_prefill import sglang_mla_prefill
from ..algorithms.deployed.vllm.mla_prefill import vllm_mla_prefill
from ..comparison import compare
from .fa3_prefill import draw_heads
from .files import CaptureError, input_crc
from .report import ReplayReport

__all__ = ["CHAIN_CASES", "CHAIN_KERNEL", "SGLANG_CHAIN_KERNEL", "CHAIN_KERNELS", "SGLANG_CHAIN_CASES", "chain_inputs",
           "sglang_chain_inputs", "replay_chain"]

#: the names a chain capture's meta gives its kernel
CHAIN_KERNEL = "vllm-prefill-chain"
SGLANG_CHAIN_KERNEL = "sglang-prefill-chain"
CHAIN_KERNELS = (CHAIN_KERNEL, SGLANG_CHAIN_KERNEL)

_DS = 0.1352337788608801

#: (heads, qlens, context_lens, workspace rows, page size, num_splits, dist, seed)
CHAIN_CASES = [
    # a request of no context between two; the third's context cut at the workspace and continued twice
    {"heads": 16, "qlens": [300, 200, 100], "context_lens": [1000, 0, 2500], "workspace": 1024, "block_size": 16,
     "num_splits": 0, "dist": "normal:1", "seed": 401, "scale": _DS, "keep_heads": 4},
    # one chunk covers every request: the chunk's output is the context partial (batch-invariant mode)
    {"heads": 16, "qlens": [520], "context_lens": [300], "workspace": 65536, "block_size": 16, "num_splits": 1,
     "dist": "flashmla", "seed": 402, "scale": _DS, "keep_heads": 4},
    # TP16: splits; the first request continued into the second chunk beside the second request
    {"heads": 8, "qlens": [64, 513], "context_lens": [3000, 100], "workspace": 2048, "block_size": 64,
     "num_splits": 0, "dist": "normal:1", "seed": 403, "scale": _DS, "keep_heads": 4},
]


#: SGLang's MHA prefill of an extend batch: one shot, and chunked with a capacity small enough to cut these prefixes
#: into several chunks (SGLang's is 128K tokens), BF16 and E4M3
SGLANG_CHAIN_CASES = [
    {"heads": 16, "qlens": [300, 200], "prefix_lens": [1000, 0], "mode": "one-shot", "capacity": 131072,
     "format": "bf16", "dist": "normal:1", "seed": 421, "scale": _DS, "keep_heads": 2},
    # L = 1024 // 3 = 341 tokens a request a chunk: 5 chunks; the third request has none of its own
    {"heads": 16, "qlens": [200, 100, 300], "prefix_lens": [1500, 400, 0], "mode": "chunked", "capacity": 1024,
     "format": "bf16", "dist": "normal:1", "seed": 422, "scale": _DS, "keep_heads": 2},
    {"heads": 16, "qlens": [128], "prefix_lens": [2000], "mode": "chunked", "capacity": 600, "format": "e4m3",
     "dist": "normal:1", "seed": 423, "scale": _DS, "keep_heads": 2},
    {"heads": 8, "qlens": [513, 64], "prefix_lens": [700, 3000], "mode": "one-shot", "capacity": 131072,
     "format": "e4m3", "dist": "flashmla", "seed": 424, "scale": _DS, "keep_heads": 2},
]


def sglang_chain_inputs(case: dict) -> tuple[tuple[np.ndarray, ...], int]:
    """q, k (T, h, 192), v (T, h, 128), k_prefix (P, h, 192), v_prefix (P, h, 128) as BF16 (an E4M3 case casts them
    on the device and in the replay), and their CRC; checked against the case's ``input_crc``."""
    return chain_inputs({**case, "context_lens": case["prefix_lens"]})


def chain_inputs(case: dict) -> tuple[tuple[np.ndarray, ...], int]:
    """q, k (T, h, 192), v (T, h, 128), k_context (C, h, 192), v_context (C, h, 128) as BF16, and their CRC; checked
    against the case's ``input_crc`` where it has one."""
    H, seed, dist = case["heads"], case["seed"], case["dist"]
    T, C = sum(case["qlens"]), max(1, sum(case["context_lens"]))
    got = (draw_heads(dist, T, H, 192, seed), draw_heads(dist, T, H, 192, seed + 1000),
           draw_heads(dist, T, H, 128, seed + 2000), draw_heads(dist, C, H, 192, seed + 3000),
           draw_heads(dist, C, H, 128, seed + 4000))
    crc = input_crc(*got)
    if "input_crc" in case and crc != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of chain case {case} do not rebuild (CRC differs)")
    return got, crc


def _run_vllm(case: dict, inputs: tuple[np.ndarray, ...]):
    q, k, v, kc, vc = inputs
    return vllm_mla_prefill(q, k, v, kc, vc, case["qlens"], case["context_lens"], workspace=case["workspace"],
                            block_size=case["block_size"], scale=case["scale"], num_splits=case["num_splits"],
                            launch_heads=case["heads"])


def _run_sglang(case: dict, inputs: tuple[np.ndarray, ...]):
    if case["format"] == "e4m3":
        import ml_dtypes

        inputs = tuple(x.astype(ml_dtypes.float8_e4m3fn) for x in inputs)
    return sglang_mla_prefill(*inputs, case["qlens"], case["prefix_lens"], mode=case["mode"],
                              capacity=case["capacity"], scale=case["scale"], launch_heads=case["heads"])


def replay_chain(path: object, meta: dict, arrays: dict[str, np.ndarray]) -> ReplayReport:
    """Every case of a chain capture (vLLM's or SGLang's) simulated and compared with the device's final output
    (and, where the capture holds it, SGLang's merged LSE), bit for bit."""
    cases = meta.get("cases")
    if not isinstance(cases, list) or not cases:
        raise CaptureError(f"replay: {path}: 'meta' holds no chain case")
    sglang = meta.get("kernel") == SGLANG_CHAIN_KERNEL
    extra = sorted(set(arrays) - {f"c{i}_{k}" for i in range(len(cases)) for k in ("out", "lse")})
    if extra or (not sglang and any(k.endswith("_lse") for k in arrays)):
        raise CaptureError(f"replay: {path}: {(extra or sorted(arrays))[0]} is no array of a chain case: nothing "
                           "would compare it")
    rows, labels = [], []
    for i, case in enumerate(cases):
        try:
            keep = case["keep_heads"]
            inputs = (sglang_chain_inputs if sglang else chain_inputs)(case)[0]
            res = (_run_sglang if sglang else _run_vllm)(case, tuple(x[:, :keep] for x in inputs))
        except KeyError as e:
            raise CaptureError(f"replay: {path}: case {i}: its recipe has no {e}") from None
        if f"c{i}_out" not in arrays:
            raise CaptureError(f"replay: {path}: case {i} has no c{i}_out array")
        dev = arrays[f"c{i}_out"]
        if dev.dtype != np.uint16 or dev.shape != res.out.shape:
            raise CaptureError(f"replay: {path}: c{i}_out should be uint16 {res.out.shape}, got {dev.dtype} "
                               f"{dev.shape}")
        device, simulated = {"out": dev.view(res.out.dtype)}, {"out": res.out}
        if f"c{i}_lse" in arrays:
            lse = arrays[f"c{i}_lse"]
            if lse.dtype != np.uint32 or lse.shape != res.lse.shape:
                raise CaptureError(f"replay: {path}: c{i}_lse should be uint32 {res.lse.shape}, got {lse.dtype} "
                                   f"{lse.shape}")
            device["lse"], simulated["lse"] = lse.view(np.float32), res.lse.astype(np.float32)
        rows.append(compare(device, simulated, meta={"case": i, "batch": len(case["qlens"]), "heads": case["heads"]}))
        if sglang:
            labels.append(f"case {i}: {case['format']} {case['mode']} H={case['heads']} qlens={case['qlens']} "
                          f"prefix={case['prefix_lens']} capacity={case['capacity']} (heads 0-{keep - 1} kept)")
        else:
            labels.append(f"case {i}: H={case['heads']} qlens={case['qlens']} context={case['context_lens']} "
                          f"workspace={case['workspace']} page={case['block_size']} num_splits={case['num_splits']} "
                          f"(heads 0-{keep - 1} kept)")
    engine = f"SGLang {meta.get('sglang')}" if sglang else f"vLLM {meta.get('vllm')}"
    return ReplayReport(kernel=meta.get("kernel"), version=meta.get("sglang" if sglang else "vllm"),
                        device=meta.get("device"), cases=rows, case_labels=tuple(labels),
                        title=f"{engine}'s chained MLA prefill on {meta.get('device')} against the simulator:",
                        held_not_compared={}, not_replayed=())
