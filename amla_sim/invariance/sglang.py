"""SGLang's Triton MLA decode in the invariance study (``sglang-triton``), with the split counts its Triton backend
chooses over the batch (:mod:`~amla_sim.algorithms.deployed.sglang.scheduler`); its ``max_kv_splits`` follows the
model's context length (``--max-context-len``) and the SM count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._validate import check_int
from ..algorithms.deployed.sglang.decode import SGLANG_VERSION, splitkv_decode
from ..algorithms.deployed.sglang.scheduler import mla_max_kv_splits, num_kv_splits
from .kernel import Request
from .launches import Launch
from .splitkv import MAX_GRID, SHARED_NUMERICS, SplitKVDecode

__all__ = ["SGLangTriton", "DEEPSEEK_CONTEXT"]

#: DeepSeek-V3's max_position_embeddings: SGLang's max_context_len for it (the default).
DEEPSEEK_CONTEXT = 163840


class SGLangTriton(SplitKVDecode):
    """SGLang's decode with its backend's split counts: ``get_num_kv_splits`` over the launch's lengths."""

    name = "sglang-triton"
    summary = f"SGLang's Triton MLA decode (sglang {SGLANG_VERSION}) with its backend's split counts"
    min_block_kv = 32  # _MLA_DECODE_MIN_BLOCK_KV
    stages = {"out": "bf16"}  # the decode returns no LSE
    what_if = "SGLang's deterministic inference: cdiv(length, split_tokens) splits (split_tile_size, 256 by default)"
    numerics = {
        **SHARED_NUMERICS,
        "schedule": ("sglang-num-kv-splits", "SGLang's get_num_kv_splits over the batch; equal splits of a multiple "
                                             "of 32 tokens"),
        "LSE": ("m + logf(l)", "m + logf(l) (libdevice), per split"),
    }

    def options(self, **given: Any) -> dict[str, Any]:
        ctx = given.pop("max_context_len", DEEPSEEK_CONTEXT)
        super().options(**given)
        return {"max_context_len": check_int(ctx, "max_context_len", lo=1)}

    def check_request(self, *, length: int, heads: int, s_q: int, options: Mapping[str, Any]) -> int:
        tokens = super().check_request(length=length, heads=heads, s_q=s_q, options=options)
        if tokens > options["max_context_len"]:
            raise ValueError(f"length, max_context_len: {tokens} tokens, past the model's context length "
                             f"({options['max_context_len']})")
        return tokens

    def max_kv_splits(self, launch: Launch, options: Mapping[str, Any]) -> int:
        return mla_max_kv_splits(options.get("max_context_len", DEEPSEEK_CONTEXT), sms=launch.num_sms)

    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        most = self.max_kv_splits(launch, options)
        if launch.num_kv_splits is None and most > MAX_GRID:  # the backend sizes stage 1's grid by it
            raise ValueError(f"num_sms, max_context_len: {launch.num_sms} SMs and a context of "
                             f"{options.get('max_context_len', DEEPSEEK_CONTEXT)} tokens give max_kv_splits = {most}, "
                             f"more than stage 1's grid holds in CUDA's z extent ({MAX_GRID})")
        return super().bounds(launch, heads=heads, options=options)

    def split_counts(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> np.ndarray:
        if launch.num_kv_splits is not None:
            return np.full(launch.batch, launch.num_kv_splits, np.int64)
        return num_kv_splits(np.array(launch.lengths), heads=heads, max_kv_splits=self.max_kv_splits(launch, options),
                             sms=launch.num_sms)

    def reason(self, req: Request, launch: Launch) -> str:
        if launch.num_kv_splits is not None:
            return f"num_kv_splits = {launch.num_kv_splits} handed to the kernel"
        n = int(self.split_counts(launch, heads=req.heads, options=req.recipe)[launch.position])
        return (f"get_num_kv_splits over {launch.batch} request{'s' * (launch.batch > 1)} (longest "
                f"{max(launch.lengths)}, shortest {min(launch.lengths)}, {launch.num_sms} SMs, max_kv_splits "
                f"{self.max_kv_splits(launch, req.recipe)}): {n} splits")

    def run(self, req: Request, launch: Launch, plan: list[tuple[int, int]]) -> dict[str, np.ndarray]:
        res = splitkv_decode(req.arrays["q"][None, -1:], req.arrays["kv"][None], seqlens=[req.length],
                             num_kv_splits=[self._count(req, plan)])
        return {"out": res.out[0, 0]}

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        return {**super().batch(req, launch),
                "num_kv_splits": self.split_counts(launch, heads=req.heads, options=req.recipe).tolist(),
                "max_kv_splits": self.max_kv_splits(launch, req.recipe)}

