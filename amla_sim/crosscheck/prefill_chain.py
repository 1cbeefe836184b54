"""vLLM's chained MLA prefill (:mod:`amla_sim.algorithms.deployed.vllm.mla_prefill`): the device check's cases and
their inputs (``scripts/capture_prefill.py``), and the replay of a capture.

A case is a batch of prefill requests, each with new tokens (``qlens``) and a cached context (``context_lens``),
and vLLM's settings that shape the chain: the chunked-prefill workspace's rows, the page size that aligns a cut
context, ``num_splits``. Its inputs are drawn by :func:`~amla_sim.experiments.inputs.make_inputs` (q at the seed, the
new tokens' k and v at seed + 1000 and + 2000, the contexts' at + 3000 and + 4000) and checked against the CRC the
capture recorded; the capture holds the final output's bits for the first ``keep_heads`` heads (the heads are
independent; the replay computes those under the whole layer's split choices).
"""

from __future__ import annotations

import numpy as np

from ..algorithms.deployed.vllm.mla_prefill import vllm_mla_prefill
from ..comparison import compare
from .fa3_prefill import draw_heads
from .files import CaptureError, input_crc
from .report import ReplayReport

__all__ = ["CHAIN_CASES", "CHAIN_KERNEL", "chain_inputs", "replay_chain"]

#: the name a chain capture's meta gives its kernel
CHAIN_KERNEL = "vllm-prefill-chain"

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


def replay_chain(path: object, meta: dict, arrays: dict[str, np.ndarray]) -> ReplayReport:
    """Every case of a chain capture simulated and compared with the device's final output, bit for bit."""
    cases = meta.get("cases")
    if not isinstance(cases, list) or not cases:
        raise CaptureError(f"replay: {path}: 'meta' holds no chain case")
    extra = sorted(set(arrays) - {f"c{i}_out" for i in range(len(cases))})
    if extra:
        raise CaptureError(f"replay: {path}: {extra[0]} is no array of a chain case: nothing would compare it")
    rows, labels = [], []
    for i, case in enumerate(cases):
        try:
            inputs, _ = chain_inputs(case)
            keep = case["keep_heads"]
            q, k, v, kc, vc = (x[:, :keep] for x in inputs)
            res = vllm_mla_prefill(q, k, v, kc, vc, case["qlens"], case["context_lens"],
                                   workspace=case["workspace"], block_size=case["block_size"], scale=case["scale"],
                                   num_splits=case["num_splits"], launch_heads=case["heads"])
        except KeyError as e:
            raise CaptureError(f"replay: {path}: case {i}: its recipe has no {e}") from None
        if f"c{i}_out" not in arrays:
            raise CaptureError(f"replay: {path}: case {i} has no c{i}_out array")
        dev = arrays[f"c{i}_out"]
        if dev.dtype != np.uint16 or dev.shape != res.out.shape:
            raise CaptureError(f"replay: {path}: c{i}_out should be uint16 {res.out.shape}, got {dev.dtype} "
                               f"{dev.shape}")
        rows.append(compare({"out": dev.view(res.out.dtype)}, {"out": res.out},
                            meta={"case": i, "batch": len(case["qlens"]), "heads": case["heads"]}))
        labels.append(f"case {i}: H={case['heads']} qlens={case['qlens']} context={case['context_lens']} "
                      f"workspace={case['workspace']} page={case['block_size']} num_splits={case['num_splits']} "
                      f"(heads 0-{keep - 1} kept)")
    return ReplayReport(kernel=CHAIN_KERNEL, version=meta.get("vllm"), device=meta.get("device"), cases=rows,
                        case_labels=tuple(labels), title=f"vLLM {meta.get('vllm')}'s chained MLA prefill on "
                        f"{meta.get('device')} against the simulator:", held_not_compared={}, not_replayed=())
