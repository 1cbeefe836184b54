"""What FlashMLA's first generation computes alike in the decodes derived from it, FlashMLA-ETAP
(:mod:`amla_sim.algorithms.deployed.flashmla.etap`) and vLLM's dense FP8 decode
(:mod:`amla_sim.algorithms.deployed.flashmla.dense_fp8`): a split's keys and scores, and the walk over its blocks
from the last with FlashAttention-2's online softmax on the raw scores, and a launch's requests through their splits
and the combine.

Upstream: ``compute_attn_1rowblock_splitkv_mla`` and ``Softmax`` (``softmax.h``) of pengcuo/FlashMLA-ETAP 39e6160 and
of vllm-project/FlashMLA 46d64a8 (``csrc/extension/sm90/dense_fp8``). Per block walked, with ``c`` the scale in log2
units and the running max ``M``: masked keys (past the request on the first block walked, after the row's query
on the first two when causal) get -inf; ``M' = max(M, rowmax(S))``; ``s = exp2(fl(fl(M - M') c))`` (none on the
first block, whose ``scale_o`` is cleared; ``M'`` read as 0 where it is -inf on a causal masking step); ``P =
exp2(fma(S, c, -fl(M' c)))`` (0 in place of ``fl(M' c)`` where ``M'`` is -inf). What a thread sums, how P is
rounded and multiplied, and the epilogue stay with each decode.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from ....machines import Machine
from ..._common import D_V, AttentionResult
from ..fast_math import logf
from .combine import splitkv_combine
from .scheduler import BLOCK_SIZE_N

__all__ = ["walk", "split_scores", "softmax_steps", "split_lse", "run_plan", "MAX_BATCH_SIZE", "check_batch"]

MAX_BATCH_SIZE = 4096  # flash_fwd_mla_metadata.cu:3, MaxBatchSize: the metadata kernel's shared arrays


def check_batch(b: int, kernel: str) -> None:
    """Refuse, naming q, a batch the first generation's metadata kernel aborts on: ``FLASH_ASSERT(batch_size <
    MaxBatchSize)`` prints and exits the process (flash_fwd_mla_metadata.cu:74, static_switch.h:20-26)."""
    if b >= MAX_BATCH_SIZE:
        raise ValueError(f"q: a batch of {b} requests; {kernel}'s metadata kernel takes fewer than {MAX_BATCH_SIZE} "
                         "(FLASH_ASSERT(batch_size < MaxBatchSize) exits the process)")


def walk(lo: int, hi: int) -> range:
    """The blocks of a split in the order the kernel takes them: n_block from n_block_max - 1 down."""
    return range(hi - 1, lo - 1, -1)


def split_scores(mc: Machine, Q: np.ndarray, K: np.ndarray, seqlen: int, lo: int,
                 hi: int) -> tuple[np.ndarray, np.ndarray]:
    """The split's keys (64 (hi - lo), 576), rows past the request cleared as the kernel's loads clear them, and
    ``S = Q K^T`` for all its blocks (R, 64 (hi - lo)): the scores do not depend on the softmax state, so the
    blocks go in few products (the same bits, :meth:`Machine.matmul_blocks`)."""
    keys = np.arange(lo * BLOCK_SIZE_N, hi * BLOCK_SIZE_N)
    Ks = np.where((keys < seqlen)[:, None], K[np.minimum(keys, seqlen - 1)], 0).astype(K.dtype)
    Ss = mc.f(mc.matmul_blocks(mc.operand(Q), mc.operand(np.ascontiguousarray(Ks.T)), block=BLOCK_SIZE_N))
    return Ks, Ss


def softmax_steps(mc: Machine, Ss: np.ndarray, seqlen: int, lo: int, blocks: Iterable[int], c: np.ndarray,
                  shift: np.ndarray | None) -> Iterator[tuple[slice, np.ndarray | None, np.ndarray, np.ndarray]]:
    """Per block of `blocks` (in the order walked): its columns of `Ss`, the rescale factor ``s`` (None on the
    first), ``P`` and the running max after it. shift: per row, how many keys before the request's last it stops
    (causal MTP rows; None: not causal)."""
    dt = mc.dtype
    M = np.full(Ss.shape[0], -np.inf, dt)
    masking_steps = 2 if shift is not None else 1  # n_masking_steps = causal ? cdiv(kBlockM, 64) + 1 : 1
    for step, blk in enumerate(blocks):
        t = blk * BLOCK_SIZE_N + np.arange(BLOCK_SIZE_N)
        cols = slice((blk - lo) * BLOCK_SIZE_N, (blk - lo + 1) * BLOCK_SIZE_N)
        S = Ss[:, cols]
        if step < masking_steps:
            limit = seqlen - 1 - (shift[:, None] if shift is not None else 0)  # the last key a row sees
            S = np.where(t[None, :] <= limit, S, -np.inf).astype(dt)
        M_new = np.maximum(M, S.max(axis=1)) if step else S.max(axis=1)
        s = None
        if step:
            check_inf = shift is not None and step < masking_steps
            cur = np.where(check_inf & np.isneginf(M_new), 0, M_new).astype(dt)
            s = mc.exp2(mc.f(mc.f(M - cur) * c))
        M = M_new
        max_scaled = np.where(np.isneginf(M), 0, mc.f(M * c)).astype(dt)
        yield cols, s, mc.exp2(mc.mul_add(S, c, -max_scaled[:, None])), M


def split_lse(mc: Machine, M: np.ndarray, sm: np.ndarray, L: np.ndarray) -> np.ndarray:
    """``row_max * softmax_scale + __logf(sum)``: the max's multiply contracted, ``__logf`` rounded first."""
    return mc.mul_add(M, sm, logf(mc, L))


def run_plan(mc: Machine, plan: list[list[tuple[int, int]]], shape: tuple[int, int, int], max_splits: int,
             split: Callable[[int, int, int, bool], tuple[np.ndarray, np.ndarray]], fmt: str,
             trace: bool) -> AttentionResult:
    """Every request of a launch (b, s_q, h_q) `shape` through its splits: ``split(i, lo, hi, alone)`` gives a
    split's (O, lse) over blocks [lo, hi) of request i; a request of one split keeps its own, others go through the
    combine kernel. ``.out`` (b, s_q, h_q, 512) in `fmt`, ``.lse`` (b, h_q, s_q), the kernel's layouts; with `trace`,
    per request the splits' block ranges, partial outputs and LSEs."""
    b, s_q, H = shape
    out = np.zeros((b, s_q * H, D_V), mc.dtype)
    lse = np.zeros((b, s_q * H), mc.dtype)
    tr: dict[str, list] = {}
    for i, blocks in enumerate(plan):
        one = len(blocks) == 1
        res = [split(i, lo, hi, one) for lo, hi in blocks]
        out[i], lse[i] = res[0] if one else splitkv_combine(mc, res, max_splits)
        if trace:
            tr.setdefault("split_blocks", []).append(np.array(blocks))
            tr.setdefault("split_out", []).append(np.stack([r[0] for r in res]))
            tr.setdefault("split_lse", []).append(np.stack([r[1] for r in res]))
    hazards = Counter()
    if np.isnan(out).any():
        hazards["nan_outputs"] += int(np.isnan(out).sum())
    out = mc.cast(out.reshape(b, s_q, H, D_V), fmt)
    return AttentionResult(out, np.swapaxes(lse.reshape(b, s_q, H), 1, 2), tr, hazards)
