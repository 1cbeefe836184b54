"""FlashAttention-3's MHA-form MLA prefill in the invariance study (``fa3-prefill``): one context-chunk call as vLLM
makes it, every request `s_q` queries over its own context (q and k 192 wide, v 128, one KV head a query head,
non-causal), and the request's split count from the prepare kernel over the whole batch's blocks
(:func:`~amla_sim.algorithms.deployed.fa3.prefill.prefill_schedule`). A request's `length` is its context chunk's
keys; its row of interest its last query. The softmax scale is DeepSeek-V3's, 192^-0.5 mscale^2 with YaRN (what
vLLM passes for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from .._validate import check_int
from ..resources import run_bytes
from ..algorithms.deployed.fa3.prefill import cu_seqlens, fa3_prefill, prefill_schedule, prefill_tile
from ..algorithms.deployed.fa3.scheduler import split_blocks
from ..crosscheck.fa3_prefill import draw_heads
from .fa3 import Fa3MLA, Fa3SplitCount, split_bounds, split_count
from .kernel import BatchKernel, Plan, Request, mate_seed
from .launches import Launch

__all__ = ["Fa3Prefill"]

_D, _DV = 192, 128
_SCALE = 0.1352337788608801  # DeepSeek-V3's softmax scale: 192^-0.5 mscale^2 (YaRN)


class Fa3Prefill(Fa3SplitCount, BatchKernel):
    """FA3's varlen forward over a context chunk (vLLM's ``run_prefill_context_chunk``): a split count per request
    from the launch's blocks."""

    name = "fa3-prefill"
    summary = ("FlashAttention-3's MHA-form MLA prefill (vLLM's context-chunk call): s_q queries a request over its "
               "context chunk, q/k 192 and v 128")
    row_tile = 128
    formats = ("bf16", "e4m3")
    stages = {"out": "bf16", "lse": "fp32"}
    takes_num_kv_splits = True
    what_if = "vLLM's batch-invariant mode, num_splits = 1: one split a request"
    numerics = {
        **Fa3MLA.numerics,
        "keys": ("bf16", "per-head K and V (kv_b_proj's output), BF16 (or E4M3)"),
        "schedule": ("fa3-prepare-scheduler", "the launch's split bound (num_splits, or FA3's heuristic as if the "
                                              "batch were its longest request), each request's count from the "
                                              "whole batch's blocks"),
        "scores": ("wgmma q/k 192", "wgmma: Q K^T over 192 columns, zero-initialised, 128-key blocks walked last to "
                                    "first"),
        "P": ("bf16", "the input format (E4M3: offset by 8, satfinite)"),
        "row sum": ("4 lanes: 32 columns each", "4 lanes a row, 32 columns each; fma(l, s, .); xor 2, then xor 1"),
    }

    def check_request(self, *, length: int, heads: int, s_q: int, options: Mapping[str, Any]) -> int:
        check_int(heads, "heads", lo=1, hi=256)
        check_int(s_q, "s_q", lo=1)
        return check_int(length, "length", lo=1)

    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        opts = self.options(**options)
        self.check_request(length=length, heads=heads, s_q=s_q, options=opts)
        arrays = {"q": draw_heads(dist, s_q, heads, _D, seed), "k": draw_heads(dist, length, heads, _D, seed + 1000),
                  "v": draw_heads(dist, length, heads, _DV, seed + 2000)}
        return Request(arrays, heads, length, s_q, {"dist": dist, "seed": seed, "heads": heads, **opts})

    def from_arrays(self, q: np.ndarray, kv: np.ndarray, *, s_q: int, **options: Any) -> Request:
        raise ValueError("inputs: fa3-prefill takes per-head q, k and v (the MHA form), drawn by the study; a file of "
                         "q and a latent cache is a decode's request")

    def adopted_length(self, *, length: int, heads: int, s_q: int) -> int:
        raise ValueError("kernel: fa3-prefill's request is per-head q, k and v (the MHA form); a decode's latent "
                         "request does not compare with it")

    def adopt(self, req: Request) -> Request:
        if "k" not in req.arrays:
            self.adopted_length(length=req.length, heads=req.heads, s_q=req.s_q)
        return req

    def request_bytes(self, *, heads: int, s_q: int, tokens: int) -> int:
        """The request's q, k and v as drawn (FP32 draws rounded to 16 bits) and cast, the gathered keys and values
        of a split, an m-block's FP32 scores over every key and their temporaries, and the outputs."""
        inputs = tokens * heads * (_D + _DV) * (8 + 2 + 2 + 2)
        scores = heads * self.row_tile * tokens * 4 * 4
        return run_bytes(batch=1, sq=1, heads=1, context=1, mufu_tables=True) + inputs + scores + \
            s_q * heads * (_D * 10 + _DV * 16)

    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        check_int(heads, "heads", lo=1, hi=256)
        return split_bounds(launch)

    def _size(self, req: Request) -> int:
        return 1 if req.recipe.get("format") == "e4m3" else 2

    def _counts(self, req: Request, launch: Launch) -> tuple[int, list[int]]:
        lens = list(launch.lengths)
        bound, counts, _ = prefill_schedule([launch.s_q] * len(lens), lens, heads=req.heads, heads_k=req.heads, d=_D,
                                            dv=_DV, num_splits=launch.num_kv_splits or 0, causal=False,
                                            max_seqlen_q=launch.s_q, max_seqlen_k=max(lens), num_sms=launch.num_sms,
                                            element_size=self._size(req))
        return bound, counts

    def _cut(self, req: Request, n: int, count: int) -> Plan:
        block_n = prefill_tile(_D, _DV, self._size(req))[1]
        return [(lo * block_n, min(hi * block_n, n)) for lo, hi in split_blocks(-(-n // block_n), count) if hi > lo]

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        _, counts = self._counts(req, launch)
        return [self._cut(req, n, c) for n, c in zip(launch.lengths, counts)]

    def reason(self, req: Request, launch: Launch) -> str:
        bound, counts = self._counts(req, launch)
        n = counts[launch.position]
        cause = (f"num_splits = {launch.num_kv_splits} handed to the kernel" if launch.num_kv_splits else
                 f"FA3's heuristic bound {bound} (the longest request, {max(launch.lengths)} keys)")
        return (f"{cause}; the prepare kernel over the blocks of {launch.batch} request{'s' * (launch.batch > 1)} "
                f"on {launch.num_sms} SMs: {n} split{'s' * (n > 1)}")

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        count = split_count(plan, lambda c: self._cut(req, req.length, c))
        q, k, v = (self._cast(req, req.arrays[x]) for x in ("q", "k", "v"))
        res = fa3_prefill(q[-launch.s_q:], k, v, cu_seqlens([launch.s_q]), cu_seqlens([req.length]),
                          scale=_SCALE, num_sms=launch.num_sms, splits=[count])
        return {"out": res.out[-1], "lse": res.lse[:, -1]}

    def _cast(self, req: Request, x: np.ndarray) -> np.ndarray:
        return x.astype(ml_dtypes.float8_e4m3fn) if req.recipe.get("format") == "e4m3" else x

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        qs, ks, vs = [], [], []
        for j, n in enumerate(launch.lengths):
            if j == launch.position:
                q, k, v = req.arrays["q"][-launch.s_q:], req.arrays["k"], req.arrays["v"]
            else:
                s = mate_seed(req, j)
                q, k, v = (draw_heads(req.recipe["dist"], launch.s_q, req.heads, _D, s),
                           draw_heads(req.recipe["dist"], n, req.heads, _D, s + 1000),
                           draw_heads(req.recipe["dist"], n, req.heads, _DV, s + 2000))
            qs.append(q), ks.append(k), vs.append(v)
        return {"q": self._cast(req, np.concatenate(qs)), "k": self._cast(req, np.concatenate(ks)),
                "v": self._cast(req, np.concatenate(vs)), "cu_seqlens_q": cu_seqlens([launch.s_q] * launch.batch),
                "cu_seqlens_k": cu_seqlens(list(launch.lengths)), "scale": _SCALE,
                "num_splits": launch.num_kv_splits or 0,
                "num_sms": launch.num_sms}
