"""FlashAttention-3's MLA decode in the invariance study (``fa3-mla``), as vLLM calls it: the launch's split bound
(the caller's ``num_splits``, else FA3's heuristic) and each request's count from the whole batch's blocks
(:mod:`~amla_sim.algorithms.deployed.fa3.scheduler`). Its bound: ``num_splits`` at most 256
(``flash_api.cpp``'s check, as :func:`~amla_sim.algorithms.deployed.fa3.fa3_mla` makes it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from .._validate import check_int
from ..algorithms.deployed.fa3.mla import fa3_mla
from ..algorithms.deployed.fa3.scheduler import KBLOCK_M, KBLOCK_N, MAX_SPLIT_BATCH, Fa3Schedule, fa3_schedule
from .kernel import RCP_NORMALISE, DenseDecode, Plan, Request, query_rows
from .launches import Launch

__all__ = ["Fa3MLA", "Fa3SplitCount", "MAX_NUM_SPLITS", "split_bounds", "split_count"]

#: The most splits FA3 takes (``num_splits <= 256`` in ``mha_fwd``; the combine kernel's bound).
MAX_NUM_SPLITS = 256
_HEURISTIC_MAX = 128  # num_splits_heuristic's max_splits


def split_bounds(launch: Launch) -> tuple[int, int]:
    """FA3's most splits of one request of `launch` and of the whole launch (``mha_fwd``'s num_splits checked as
    the study's ``num_kv_splits``; none past 992 requests; a split holds a block at least)."""
    if launch.num_kv_splits is not None:
        check_int(launch.num_kv_splits, "num_kv_splits", lo=1, hi=MAX_NUM_SPLITS)
    most = 1 if launch.batch > MAX_SPLIT_BATCH else (launch.num_kv_splits or _HEURISTIC_MAX)
    return min(most, -(-launch.length // KBLOCK_N)), most * launch.batch


def split_count(plan: Plan, cut: Callable[[int], Plan]) -> int:
    """The split count whose cut (`cut`, count -> plan) is `plan`: FA3 cuts a request's blocks into a count of equal
    splits, so a plan handed in must be one of those cuts."""
    want = [tuple(r) for r in plan]
    count = next((n for n in range(len(plan), MAX_NUM_SPLITS + 1) if cut(n) == want), None)
    if count is None:
        raise ValueError(f"plan: FA3 cuts a request's blocks into a count of equal splits; {plan} is not such a cut")
    return count


class Fa3SplitCount:
    """What FA3's kernels share in the study: a split count a request (a token, for the sparse call: `unit`), at
    most 256 (a plan handed in is one of its cuts, :func:`split_count`), and one split a request as the
    batch-invariant plan (``num_splits`` 1)."""

    unit = "request"

    def max_splits(self, launch: Launch, *, heads: int) -> int:
        return MAX_NUM_SPLITS

    def check_split_tokens(self, split_tokens: int | None) -> None:
        if split_tokens is not None:
            raise ValueError("split_tokens: FA3 takes a split count, not a split size; its batch-invariant mode is "
                             f"one split a {self.unit} ('one')")

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        self.check_split_tokens(split_tokens)
        return [[(0, n)] for n in launch.lengths]


class Fa3MLA(Fa3SplitCount, DenseDecode):
    """FA3's MLA decode, vLLM's call: a split count per request from the launch's blocks."""

    name = "fa3-mla"
    summary = "FlashAttention-3's MLA decode (vLLM's FLASH_ATTN_MLA, SGLang's fa3), vLLM's call"
    row_tile = 64
    formats = ("bf16", "fp16")
    stages = {"out": "bf16", "lse": "fp32"}
    takes_num_kv_splits = True
    what_if = "vLLM's batch-invariant mode, num_splits = 1: one split a request"
    numerics = {
        "keys": ("bf16", "BF16 (or FP16)"),
        "schedule": ("fa3-prepare-scheduler", "the launch's split bound (num_splits, or FA3's heuristic), each "
                                              "request cdiv(n_blocks, ceilf(total_blocks 1.1 / SMs)) splits over "
                                              "the whole batch, cdiv(n_block_max, splits) blocks a split"),
        "scores": ("wgmma rope + nope", "wgmma: Q_rope K_rope^T (k 512..575), then += Q_nope V^T (k 0..511) in one "
                                       "accumulator, blocks walked last to first"),
        "max": ("raw scores", "running max of the raw scores, scaled after"),
        "exp": ("ex2(fma(S, c, -fl(M c)))", "ex2.approx.ftz of fma(S, c, -fl(M c)), c = fl32(double(scale) log2 e)"),
        "P": ("bf16", "the input format (BF16 or FP16), rounded once for both warpgroups"),
        "row sum": ("4 lanes: 16 columns each", "4 lanes a row, 16 columns each in order (2t, 2t + 1, 2t + 8, ...); "
                                                "fma(l, s, .); the lanes met xor 2, then xor 1"),
        "normalise": RCP_NORMALISE,
        "LSE": ("fma(M, fl(c ln 2), __logf L)", "fma(M, fl(c ln 2), fl(lg2(L) ln 2)), natural log"),
        "combine": ("fa3-combine", "a warp a row: 32 lanes sum expf(lse_s - M), xor butterfly; lse = logf(sum) + M; "
                                   "out = sum fma(expf(lse_s - M) rcp(sum), O_s, .)"),
    }

    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        return split_bounds(launch)

    def _schedule(self, req: Request, launch: Launch) -> Fa3Schedule:
        return fa3_schedule(list(launch.lengths), s_q=launch.s_q, heads=req.heads,
                            num_splits=launch.num_kv_splits or 0, causal=launch.s_q > 1, num_sms=launch.num_sms)

    def _cut(self, req: Request, launch: Launch, sched: Fa3Schedule, i: int, n: int) -> Plan:
        m = (launch.s_q * req.heads - 1) // KBLOCK_M  # the m-block of the row of interest's last head
        return [(lo * KBLOCK_N, min(hi * KBLOCK_N, n))
                for lo, hi in sched.blocks(i, n, m, s_q=launch.s_q, heads=req.heads) if hi > lo]  # an empty
        # split writes O = 0 and LSE = -inf, which the combine skips: it changes no bit

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        sched = self._schedule(req, launch)
        return [self._cut(req, launch, sched, i, n) for i, n in enumerate(launch.lengths)]

    def reason(self, req: Request, launch: Launch) -> str:
        sched = self._schedule(req, launch)
        blocks = sum(-(-n // KBLOCK_N) for n in launch.lengths) * -(-(launch.s_q * req.heads) // KBLOCK_M)
        bound = (f"num_splits = {launch.num_kv_splits} handed to the kernel" if launch.num_kv_splits else
                 f"FA3's heuristic bound {sched.bound} (the longest request, {max(launch.lengths)} tokens)")
        return (f"{bound}; {blocks} blocks of 64 rows x 64 keys in {launch.batch} request"
                f"{'s' * (launch.batch > 1)} on {launch.num_sms} SMs: {sched.splits[launch.position]} split"
                f"{'s' * (sched.splits[launch.position] > 1)}")

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        one = Launch("alone", (req.length,), s_q=launch.s_q, num_sms=launch.num_sms)
        sched = self._schedule(req, one)
        count = split_count(plan, lambda n: self._cut(req, one, replace(sched, splits=(n,)), 0, req.length))
        res = fa3_mla(query_rows(req, launch.s_q)[None], req.arrays["kv"][None], seqlens=[req.length],
                      num_sms=launch.num_sms, splits=[count])
        return {"out": res.out[0, -1], "lse": res.lse[:, -1]}

