"""vLLM's Triton MLA decode in the invariance study (``vllm-triton-mla``), with its backend's split count
(``_compute_num_kv_splits``): one count for the whole launch, from its longest request
(:mod:`~amla_sim.algorithms.deployed.vllm.triton_mla`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..algorithms.deployed.vllm.triton_mla import VLLM_VERSION, vllm_num_kv_splits, vllm_triton_mla
from .kernel import Request
from .launches import Launch
from .splitkv import SHARED_NUMERICS, SplitKVDecode

__all__ = ["VllmTritonMLA"]


class VllmTritonMLA(SplitKVDecode):
    """vLLM's decode: every request of a launch in the same count of splits of cdiv(length, n) tokens."""

    name = "vllm-triton-mla"
    summary = f"vLLM's Triton MLA decode (vLLM {VLLM_VERSION}, TRITON_MLA) with its backend's split count"
    min_block_kv = 1
    stages = {"out": "bf16", "lse": "bf16"}
    what_if = "VLLM_BATCH_INVARIANT: one split a request (or, with split_tokens, cdiv(length, split_tokens) splits)"
    numerics = {
        **SHARED_NUMERICS,
        "schedule": ("vllm-num-kv-splits", "vLLM's _compute_num_kv_splits: one count for the launch, next_pow2("
                                           "longest // 512) up to 2 x SMs; splits of cdiv(length, n) tokens"),
        "LSE": ("m + logf(l), bf16", "m + logf(l) (libdevice) per split; the final LSE stored in BF16"),
    }

    def split_counts(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> np.ndarray:
        n = launch.num_kv_splits or vllm_num_kv_splits(max(launch.lengths), launch.num_sms)
        return np.full(launch.batch, n, np.int64)

    def reason(self, req: Request, launch: Launch) -> str:
        if launch.num_kv_splits is not None:
            return f"num_kv_splits = {launch.num_kv_splits} handed to the kernel"
        n = int(self.split_counts(launch, heads=req.heads, options=req.recipe)[0])
        return (f"_compute_num_kv_splits of the launch's longest request ({max(launch.lengths)} tokens, "
                f"{launch.num_sms} SMs): {n} splits for every request")

    def run(self, req: Request, launch: Launch, plan: list[tuple[int, int]]) -> dict[str, np.ndarray]:
        res = vllm_triton_mla(req.arrays["q"][None, -1:], req.arrays["kv"][None], seqlens=[req.length],
                              num_kv_splits=self._count(req, plan))
        return {"out": res.out[0, 0], "lse": res.lse[0, 0]}

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        out = super().batch(req, launch)
        return {"q": out["q"], "kv": out["kv"], "seqlens": out["seqlens"],
                "num_kv_splits": int(self.split_counts(launch, heads=req.heads, options=req.recipe)[0])}

