"""The split/merge Triton MLA decode that LightLLM wrote and SGLang and vLLM carry (``decode_attention.py``,
``triton_decode_attention.py``): stage 1 and stage 2 as every member computes them, each member's parameters
(its split boundaries and count, what it stores) with its own model
(:mod:`amla_sim.algorithms.deployed.sglang.decode`, :mod:`amla_sim.algorithms.deployed.vllm.triton_mla`).

Stage 1, one program per (row, head tile of BLOCK_H, KV split): a split walks its tokens in blocks of BLOCK_N.
Per block:

- ``qk = dot(q[:, :512], K^T) + dot(q[:, 512:], K_rope^T)``: one FP32 accumulator chained through both dots
  (36 ``mma.sync.m16n8k16`` along K, the ``sm90`` T-FDPA row); ``qk *= sm_scale``; keys past the split masked to
  -inf;
- ``m' = max(m, rowmax(qk))``, ``alpha = tl.exp(m - m')``, ``p = tl.exp(qk - m')`` (``ex2.approx`` of
  ``fl32(x * log2 e)``);
- ``acc = dot(bf16(p), V)`` accumulated onto ``acc * alpha``; ``l = fma(l, alpha, tl.sum(p))``, the sum in the
  mma.sync accumulator layout (2 adjacent columns a thread, 4 threads, then min(num_warps, BLOCK_N / 8) warps).

The split writes ``acc / l`` (``div.full``) and ``m + tl.log(l)`` (libdevice's logf). Stage 2, one program per
(row, head): over the splits in order, ``m' = max(m, lse_s)``, ``a = tl.exp(m - m')``, ``w = tl.exp(lse_s - m')``,
``acc = fma(acc, a, w * o_s)``, ``l = fma(l, a, w)``; the output is ``acc / l * v_scale`` and the LSE ``m +
tl.log(l)``. The FMA contractions are the ones nvcc's default (Triton's ``enable_fp_fusion``) makes, read off the
PTX.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ...machines import Machine
from .._common import D_V

__all__ = ["SplitKVResult", "split_ranges", "stage1", "stage2"]


@dataclass
class SplitKVResult:
    """out: (b, 1, H, 512) BF16 (float64 on golden); lse: (b, H, max_kv_splits) stage 1's partial LSEs, NaN where a
    split is empty; mid: (b, H, max_kv_splits, 512) stage 1's partial outputs; splits: (b, max_kv_splits, 2) the
    token range of every split."""

    out: np.ndarray
    lse: np.ndarray
    mid: np.ndarray
    splits: np.ndarray
    trace: dict[str, list[np.ndarray]] = field(default_factory=dict)
    hazards: Counter = field(default_factory=Counter)


def _cdiv(a: np.ndarray, b: np.ndarray | int) -> np.ndarray:
    return -(-a // b)


def split_ranges(seqlens: npt.ArrayLike, num_kv_splits: npt.ArrayLike, max_kv_splits: int,
                 min_block_kv: int = 32) -> np.ndarray:
    """(b, max_kv_splits, 2) [start, end) of every split, as both stages compute them (empty: start >= end)."""
    L = np.asarray(seqlens, np.int64)
    n = np.broadcast_to(np.asarray(num_kv_splits, np.int64), L.shape)
    per = _cdiv(_cdiv(L, n), min_block_kv) * min_block_kv  # as both stages compute kv_len_per_split
    start = per[:, None] * np.arange(max_kv_splits)[None, :]
    end = np.minimum(start + per[:, None], L[:, None])
    return np.stack([start, end], axis=-1)


def stage1(mc: Machine, Q: np.ndarray, K: np.ndarray, ranges: np.ndarray, sm: np.ndarray, block_n: int,
           num_warps: int, trace: dict | None, k_order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1 for Q (b, H, 576), K (b, S_max, 576) (BF16, V its first 512 columns) and the (b, S, 2) token ranges
    of the splits: (mid (b, H, S, 512), lse (b, H, S)), NaN for an empty split. Every (row, split) at once,
    block by block, rows that run as many blocks together; a split's state changes only inside its range.
    k_order: the order in which the tensor cores take k in each chunk of len(k_order), for both dots (None: in
    order), where the kernel's dot operands are laid out so (:data:`amla_sim.algorithms.deployed.vllm.triton_mla.FP8_CACHE_K_ORDER`)."""
    blocks = np.maximum(-(-(ranges[..., 1] - ranges[..., 0]) // block_n), 0).max(axis=1)  # (b,) a row's blocks
    if trace is None and len(set(blocks.tolist())) > 1:  # rows of other lengths: each group runs its own blocks
        mid = np.empty((Q.shape[0], Q.shape[1], ranges.shape[1], D_V), mc.dtype)
        lse = np.empty(mid.shape[:3], mc.dtype)
        for n in set(blocks.tolist()):
            g = np.flatnonzero(blocks == n)
            mid[g], lse[g] = stage1(mc, Q[g], K[g], ranges[g], sm, block_n, num_warps, None, k_order)
        return mid, lse
    b, H, _ = Q.shape
    S = ranges.shape[1]
    start, end = ranges[..., 0], ranges[..., 1]  # (b, S)
    n_blocks = int(max(0, blocks.max()))
    layout = (2, 4, min(num_warps, block_n // 8))
    dt = mc.dtype
    m = np.full((b, S, H), -np.inf, dt)
    l = np.zeros((b, S, H), dt)
    acc = np.zeros((b, S, H, D_V), dt)
    Ks, kp = K, slice(None)
    if k_order is not None:  # the dots' k in the order the tensor cores take it: both operands permuted alike
        cols = _permuted(Q.shape[-1], k_order)
        Q, Ks, kp = _columns(Q, cols), _columns(K, cols), _permuted(block_n, k_order)
    Qn, Qr = mc.operand(Q[:, None, :, :D_V]), mc.operand(Q[:, None, :, D_V:])  # (b, 1, H, .)
    every = None
    if mc.block_width(b * H, block_n) > block_n:  # a key's scores do not depend on its block: every key's at once
        every = _every_score(mc, Qn, Qr, Ks, end.max(axis=1), block_n)  # (b, H, L)
    bi, hi = np.arange(b)[:, None, None, None], np.arange(H)[None, None, :, None]
    Kg = K if every is None else K[..., :D_V]  # with every key's scores made, a block needs only its V
    for j in range(n_blocks):
        t = start[..., None] + j * block_n + np.arange(block_n)  # (b, S, n) token of every column
        valid = t < end[..., None]
        live = start + j * block_n < end  # (b, S): the split runs this block
        everywhere = bool(valid.all())  # no split past its end, no masked key: the masks change nothing
        Kb = Kg[np.arange(b)[:, None, None], np.minimum(t, K.shape[1] - 1)]
        if not everywhere:
            Kb = np.where(valid[..., None], Kb, 0).astype(K.dtype)  # keys past the split load as 0
        if every is not None:
            qk = every[bi, hi, np.minimum(t, K.shape[1] - 1)[:, :, None, :]]  # (b, S, H, n)
        else:
            Kc = Kb if k_order is None else Ks[np.arange(b)[:, None, None], np.minimum(t, K.shape[1] - 1)]
            if not everywhere and k_order is not None:
                Kc = np.where(valid[..., None], Kc, 0).astype(K.dtype)
            KT = np.swapaxes(Kc, -1, -2)  # (b, S, 576, n)
            qk = mc.matmul(Qr, mc.operand(KT[..., D_V:, :]), mc.matmul(Qn, mc.operand(KT[..., :D_V, :])))
        qk = mc.f(mc.f(qk) * sm)
        if not everywhere:
            qk = np.where(valid[:, :, None, :], qk, -np.inf).astype(dt)  # (b, S, H, n)
        m_new = np.maximum(m, mc.rowmax(qk))
        alpha = mc.exp(m - m_new)
        p = mc.exp(qk - m_new[..., None])
        keep = live[..., None]
        p_kept, scaled = p, mc.f(acc * alpha[..., None])
        if not everywhere:
            # a split past its range computes nothing that is kept: its NaN rows (-inf - -inf) zeroed here, so
            # that they do not send the whole product down the tensor-core model's path for non-finite operands
            rows = keep[..., None]
            p_kept, scaled = np.where(rows, p, 0), np.where(rows, scaled, 0)
        acc_new = mc.matmul(mc.operand(mc.cast(p_kept, "bf16")[..., kp]), mc.operand(Kb[..., kp, :D_V]), scaled)
        l_new = mc.mul_add(l, alpha, mc.rowsum(p, layout=layout))
        if everywhere:
            m, l, acc = m_new, l_new, acc_new
        else:
            m, l = np.where(keep, m_new, m), np.where(keep, l_new, l)
            acc = np.where(keep[..., None], acc_new, acc)
        if trace is not None:
            for name, v in (("S", qk), ("m", m), ("P", p), ("l", l)):
                trace.setdefault(name, []).append(v)
    ran = (end > start)[..., None]  # (b, S, 1): empty splits write nothing
    mid = np.where(ran[..., None], mc.div(acc, l[..., None]), np.nan).astype(dt)
    lse = np.where(ran, (m + mc.log(l)).astype(dt), np.nan).astype(dt)
    return np.swapaxes(mid, 1, 2), np.swapaxes(lse, 1, 2)  # (b, H, S, 512), (b, H, S)


def _every_score(mc: Machine, Qn: np.ndarray, Qr: np.ndarray, K: np.ndarray, ends: np.ndarray,
                 block_n: int) -> np.ndarray:
    """Every key's scores, (b, H, S_max): the rope product chained onto the nope product, on as many blocks at a time
    as the machine allows; with requests of different lengths, each up to its last split's end (0 past it)."""
    b, H = Qn.shape[0], Qn.shape[2]

    def scores(rows: slice, n: int) -> np.ndarray:
        kt = np.ascontiguousarray(np.swapaxes(K[rows, :n], -1, -2))[:, None]  # K^T laid out once
        return mc.by_blocks(lambda k: mc.matmul(Qr[rows], mc.operand(k[..., D_V:, :]),
                                                mc.matmul(Qn[rows], mc.operand(k[..., :D_V, :])))[:, 0],
                            kt, rows=kt.shape[0] * H, block=block_n)

    if (ends == ends[0]).all():
        return scores(slice(None), K.shape[1])
    out = np.zeros((b, H, K.shape[1]), mc.dtype)
    for i in range(b):
        n = -(-int(ends[i]) // block_n) * block_n  # whole blocks: the same products
        out[i, :, :n] = scores(slice(i, i + 1), min(n, K.shape[1]))[0]
    return out


def _columns(x: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``x[..., cols]``, moved as raw bits (several times faster than NumPy's gather of ml_dtypes' types)."""
    x = np.ascontiguousarray(x)
    return np.take(x.view(f"u{x.dtype.itemsize}"), cols, axis=-1).view(x.dtype)


def _permuted(n: int, k_order: np.ndarray) -> np.ndarray:
    """The indices 0..n-1 with each chunk of len(k_order) taken in `k_order`."""
    w = len(k_order)
    return (np.arange(n) // w * w + np.asarray(k_order)[np.arange(n) % w]).astype(np.int64)


def stage2(mc: Machine, mid: np.ndarray, lse: np.ndarray, ranges: np.ndarray,
           v_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stage 2 over stage 1's (b, H, S, 512) partial outputs and (b, H, S) LSEs: (out (b, H, 512), lse (b, H)) in
    the working type, before the store's cast; a row with no token gives NaN and -inf."""
    b, H, S, _ = mid.shape
    dt = mc.dtype
    m = np.full((b, H), -np.inf, dt)
    l = np.zeros((b, H), dt)
    acc = np.zeros((b, H, D_V), dt)
    for s in range(S):
        ran = (ranges[:, s, 1] > ranges[:, s, 0])[:, None]  # (b, 1)
        if not ran.any():
            continue
        lse_s = np.where(ran, lse[:, :, s], -np.inf).astype(dt)
        m_new = np.maximum(lse_s, m)
        a = mc.exp(m - m_new)
        w = mc.exp(lse_s - m_new)
        acc_new = mc.mul_add(acc, a[..., None], mc.f(w[..., None] * mc.f(mid[:, :, s])))
        l_new = mc.mul_add(l, a, w)
        acc = np.where(ran[..., None], acc_new, acc)
        m, l = np.where(ran, m_new, m), np.where(ran, l_new, l)
    return mc.f(mc.div(acc, l[..., None]) * v_scale), mc.f(m + mc.log(l))
