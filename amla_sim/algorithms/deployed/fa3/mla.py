"""FlashAttention-3's MLA decode (vLLM's FLASH_ATTN_MLA backend, SGLang's ``fa3``), written against a machine.

Upstream: vllm-project/flash-attention 617264c (vLLM 0.33 pins b273a02, which is not obtainable here; the kernel
headers last changed in the fork on 2026-05-05), ``hopper/``: ``mainloop_fwd_sm90_tma_gmma_ws.hpp`` (``mma`` without
intra-warpgroup overlap, ``mma_pv``), ``softmax.h``, ``epilogue_fwd.hpp``, ``flash_fwd_combine_kernel.h``; the
schedule is :mod:`amla_sim.algorithms.deployed.fa3.scheduler`. On ``sm90-cuda`` it predicts the kernel's output
and LSE bit for bit, BF16 and FP16.

The call puts q_rope (64) in ``q``, k_rope in ``k``, kv_c (512) in ``v`` and q_nope in ``q_v``: the scores of a
64 x 64 tile are ``S = Q_rope K_rope^T`` (wgmma, k 512..575 of the 576) and then ``+= Q_nope V^T`` (k 0..511) in the
same FP32 accumulator. One warpgroup computes S and the softmax; two warpgroups hold O, 256 columns each, and do
the same arithmetic (the second reads P from shared memory and the rescale factors from the first). A split walks
its 64-key blocks from the last; with ``c = fl32(double(fl32(scale)) log2 e)`` and the running max ``M`` of the raw
scores:

- masked keys (past the request, or after the row's query when causal) get -inf; ``M' = max(M, rowmax(S))``
  (the first block: ``rowmax(S)``); ``s = exp2(fl(fl(M - M') c))`` (``M'`` read as 0 where it is -inf);
- ``P = exp2(fma(S, c, -fl(M' c)))`` (0 in place of ``fl(M' c)`` where ``M'`` is -inf); each of the four lanes of
  a row sums its 16 columns ``8j + 2t, 8j + 2t + 1`` in order, the first onto ``fma(l, s, .)`` (from nothing on
  the first block);
- ``P`` rounded to the input format, ``O = fl(O s) + P V`` on the tensor cores (``O = P V`` on the first block).

At the end the four lanes meet in a butterfly (xor 2, then xor 1): ``L = (l0 + l2) + (l1 + l3)``; ``O = fl(O
rcp(L))`` (``1.f / sum``, MUFU.RCP; 0 where L is 0 or NaN) and ``lse = fma(M, fl(c ln 2), __logf(L))`` (-inf
where L is 0 or NaN). A request of one split writes O in the input format; otherwise every split writes FP32 O and
LSE (an empty one 0 and -inf), and the combine kernel, one warp a row, lane j over splits j, j + 32, ...: ``M =
max lse_s``, ``sum = sum expf(lse_s - M)`` (an xor butterfly over the lanes), ``lse = logf(sum) + M``, and
``O = sum_s fma(expf(lse_s - M) rcp(sum), O_s, .)`` from 0 over the splits whose weight is positive. ``exp2f``,
``expf`` and ``logf`` are MUFU's (``--use_fast_math``), and every FP32 multiply, FMA and division flushes subnormal
operands and results (``-ftz=true``, :meth:`~amla_sim.machines.Machine.mul`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....formats import get_format
from ....machines import Machine, get_machine
from ....schedules import Schedule
from ..._common import D_K, D_V, AttentionResult, check_kernel_inputs, check_kernel_layout
from ....arith.tanh import tanh_approx
from ..fast_math import ln2, logf
from ..scalars import api_float, scale_log2, softmax_scale
from ..row_sums import lane_sums as _lane_sum
from ..row_sums import quad_total as _row_total
from ..flashmla.combine import combine_sum
from .scheduler import KBLOCK_M, KBLOCK_N, Fa3Schedule, fa3_schedule, window

__all__ = ["fa3_mla", "fa3_mla_decode", "FA3_COMMIT"]

#: The vllm-project/flash-attention commit the model follows.
FA3_COMMIT = "617264c"
_COMBINE_LANES = 32


class _Units:
    """The machine's operations as the kernel uses them."""

    def __init__(self, mc: Machine, fmt: str, scale: float, softcap: np.float32 | None = None):
        self.mc = mc
        self.dt = mc.dtype
        self.fmt = fmt
        self.ln2 = ln2(mc)
        # flash_api.cpp: the host's float(softmax_scale * M_LOG2E), read by the kernel's FTZ instructions
        self.c = mc.ftz(scale_log2(mc, scale))
        self.c_ln2 = mc.mul(self.c, self.ln2)  # softmax_scale_log2 * float(M_LN2), on the device
        self.softcap: np.ndarray | None = None  # the scores' factor before tanh, where a softcap is on
        if softcap is not None and softcap > 0:  # SOFTCAP_SWITCH(params.softcap > 0): 0, below and NaN: no cap
            self.with_softcap(scale, softcap)

    def with_softcap(self, scale: np.float32, cap: np.float32) -> None:
        """A softcap's constants (mainloop_fwd_sm90_tma_gmma_ws.hpp:569-588): the scores are multiplied by
        ``softcap_val = fl32(scale / cap)`` (a host FP32 division) and go through MUFU.TANH before the mask
        (``apply_softcap``, utils.h:641-645), and the softmax's ``c`` is ``fl32(double(cap) log2 e)`` in place of the
        scale's: the cap is never multiplied back."""
        mc = self.mc
        self.softcap = mc.ftz(mc.f(np.float32(scale) / np.float32(cap)))  # read by the device's FMUL.FTZ
        self.c = mc.ftz(scale_log2(mc, cap))
        self.c_ln2 = mc.mul(self.c, self.ln2)

    def capped(self, S: np.ndarray) -> np.ndarray:
        """Scores through the softcap, ``fast_tanh(S softcap_val)``, where one is on (`softcap` of shape () or
        (h_k, 1) against S (h_k, R, n) or (R, n)). ``fast_tanh`` is inline PTX ``tanh.approx.f32`` whatever the
        build's flags: MUFU.TANH on every FP32 machine; the golden machine's exact tanh in FP64."""
        if self.softcap is None:
            return S
        cap = self.softcap if np.ndim(self.softcap) == 0 else self.softcap[..., None]
        x = self.mc.mul(S, cap)
        return np.tanh(x) if x.dtype == np.float64 else tanh_approx(x)

    def logf(self, x: np.ndarray, plus: np.ndarray | None = None) -> np.ndarray:
        """``__logf(x)``, or ``__logf(x) + plus`` with the multiply by ln 2 contracted into the add."""
        return logf(self.mc, x, plus)


@quiet_fp
def fa3_mla(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seqlens: npt.ArrayLike | None = None,
    scale: float | None = None,
    causal: bool | None = None,
    page_size: int | None = 16,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    varlen_q: bool = True,
    num_sms: int = 132,
    splits: Sequence[int] | None = None,
    max_seqlen_k: int | None = None,
    softcap: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    machine: str | Machine = "sm90-cuda",
    trace: bool = False,
) -> AttentionResult:
    """FlashAttention-3's MLA decode on `machine` (see the module docstring).

    q: (b, s_q, h, 576) BF16 or FP16 (q_nope the first 512 columns, q_rope the last 64); kv: (b, S_max, 576) of
    the same format (kv_c then k_rope), rows past ``seqlens[i]`` ignored. causal: None as vLLM calls it (causal,
    which matters when s_q > 1). page_size: the paged cache's page (None: not paged); it picks the TMA or the
    cp.async path, which move the same data. num_splits: what the caller passes (0: FA3's heuristic; vLLM with
    full CUDA graphs passes 32; 1: batch-invariant). pack_gqa: None, the kernel's choice. varlen_q: the call
    passes ``cu_seqlens_q`` (vLLM) rather than only ``cache_seqlens`` (SGLang's ``flash_attn_with_kvcache``).
    splits: per request, a split count in place of the prepare kernel's (a what-if; each m-block's blocks are cut
    into that many as the kernel cuts them). max_seqlen_k: the call's (None: the longest request; at least that);
    a request of 0 keys (``seqused_k`` 0) writes out 0 and LSE -inf. softcap: over 0, FA3's softcapping (the scores
    through MUFU.TANH, :meth:`_Units.with_softcap`; 0, below or NaN: none). window_size: (left, right), the keys a
    query sees before and after its own (-1: all), read with `causal` as :func:`.scheduler.window` says; a local
    m-block's blocks count from its first row's first key (``n_offset``; the trace's split ranges too). Returns
    ``.out`` (b, s_q, h, 512) in the input format and ``.lse`` in the kernel's layout, natural log: (h, b * s_q) with
    `varlen_q`, else (b, h, s_q); with `trace`, the schedule (``schedule``) and per request each m-block's split
    ranges (``split_blocks``).
    """
    mc = get_machine(machine)
    qa, kva, lens = check_kernel_inputs(q, kv, seqlens, formats=("bf16", "fp16"), empty=True)
    sm = softmax_scale(scale)
    if max_seqlen_k is not None:
        check_int(max_seqlen_k, "max_seqlen_k", lo=max(1, int(lens.max())))
    _check_launch(num_sms=num_sms, num_splits=num_splits, page_size=page_size, causal=causal, pack_gqa=pack_gqa,
                  varlen_q=varlen_q, softcap=softcap, window_size=window_size)
    fmt = get_format(qa.dtype).name
    b, s_q, H, _ = qa.shape
    lens = [int(n) for n in lens]  # a request shorter than its causal step: its first rows see no key (out 0,
    # LSE -inf: epilogue_fwd.hpp store_zero, softmax.h finalize), as the kernel computes them
    # mha_fwd's reading: causal is no mask when s_q = 1; a local window (left, right), its sides bounded by the call
    is_causal, is_local, left, right = window(causal is None or bool(causal), tuple(window_size), s_q,
                                              max_seqlen_k or max(lens))
    sched = fa3_schedule(lens, s_q=s_q, heads=H, num_splits=num_splits, causal=is_causal, pack_gqa=pack_gqa,
                         page_size=page_size, varlen_q=varlen_q, num_sms=num_sms, max_seqlen_k=max_seqlen_k,
                         local=(left, right) if is_local else None)
    if splits is not None:
        given = [check_int(n, "splits", lo=1, hi=256) for n in np.asarray(splits).ravel().tolist()]
        if len(given) != b:
            raise ValueError(f"splits: one split count a request ({b}), got {len(given)}")
        sched = replace(sched, bound=max(given), splits=tuple(given), pack_gqa=sched.pack_gqa or max(given) > 1)
    u = _Units(mc, fmt, sm, api_float(softcap, "softcap"))
    Q, K = mc.cast(qa, fmt), mc.cast(kva, fmt)
    out = np.zeros((b, s_q * H, D_V), mc.dtype)
    lse = np.zeros((b, s_q * H), mc.dtype)
    tr: dict[str, list] = {"schedule": [sched]} if trace else {}
    for i, n in enumerate(lens):
        plans = _request(u, Q[i].reshape(s_q * H, D_K), K[i], n, sched, i, s_q, out[i], lse[i])
        if trace:
            tr.setdefault("split_blocks", []).append([(ranges, np.flatnonzero(sel)) for ranges, sel in plans])
    hazards = Counter()
    if np.isnan(out).any():
        hazards["nan_outputs"] += int(np.isnan(out).sum())
    out = mc.cast(out.reshape(b, s_q, H, D_V), fmt)
    lse = lse.reshape(b, s_q, H)
    lse = lse.reshape(b * s_q, H).T if varlen_q else np.swapaxes(lse, 1, 2)  # (h, total_q) or (b, h, s_q)
    return AttentionResult(out, np.ascontiguousarray(lse), tr, hazards)


def _check_launch(*, num_sms: int, num_splits: int, page_size: int | None, causal: object, pack_gqa: object,
                  varlen_q: object, softcap: float, window_size: tuple[int, int]) -> None:
    """The call's settings, or an error naming the one the kernel does not take."""
    check_int(num_sms, "num_sms", lo=1)
    check_int(num_splits, "num_splits", hi=256)  # <= 0: FA3's heuristic (flash_api.cpp:1059); > 256 raises
    if page_size is not None:
        check_int(page_size, "page_size", lo=1)
    for name, v in (("causal", causal), ("pack_gqa", pack_gqa)):
        if v is not None and not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name}: expected True, False or None, got {v!r}")
    if not isinstance(varlen_q, (bool, np.bool_)):
        raise TypeError(f"varlen_q: expected True or False, got {varlen_q!r}")
    api_float(softcap, "softcap")  # a float32 number; over 0 a cap (SOFTCAP_SWITCH(params.softcap > 0), :315)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in window_size):
        raise TypeError(f"window_size: expected (left, right) ints, got {window_size!r}")


def fa3_mla_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "sm90-cuda",
    schedule: str | Schedule = "reference",
    block: int = KBLOCK_N,
    scale: float | None = None,
    num_sms: int = 132,
    trace: bool = False,
) -> AttentionResult:
    """:func:`fa3_mla` as the papers' algorithms are called (``run``, ``reproduce``, ``sweep``): every request the
    whole of kv, pages of 16 and FA3's split heuristic, the LSE as (b, s_q, h). The kernel lays its
    work out itself: `block` must be its 64 and `schedule` is checked, not used."""
    check_kernel_layout(schedule, block, KBLOCK_N)
    res = fa3_mla(q, kv, scale=scale, num_sms=num_sms, machine=machine, varlen_q=False, trace=trace)
    return AttentionResult(res.out, np.swapaxes(res.lse, 1, 2), res.trace, res.hazards)


def _request(u: _Units, rows: np.ndarray, K: np.ndarray, n: int, sched: Fa3Schedule, i: int, s_q: int,
             out: np.ndarray, lse: np.ndarray) -> list[tuple[list, np.ndarray]]:
    """Request `i`'s rows (s_q h, 576), row ``s h + head``, over its `n` keys into `out` and `lse`; returns its
    plans (each group of rows' split ranges). A row sees keys up to ``n - s_q + s`` when causal (``+ right`` in a
    local window, from ``- left``), all n otherwise; a local m-block's blocks count from its offset."""
    H = rows.shape[0] // s_q
    pos = np.repeat(np.arange(s_q), H)
    local = sched.local
    limit = n - s_q + pos + (0 if local is None else local[1]) if sched.causal or local else np.full(len(pos), n - 1)
    first = None if local is None else n - s_q + pos - local[0]
    plans = _row_groups(sched, i, n, s_q, H)
    for (ranges, off), sel in plans:
        res = [_split(u, rows[sel], K[off:], n - off, lo, hi, limit[sel] - off,
                      None if first is None else first[sel] - off) for lo, hi in ranges]
        out[sel], lse[sel] = res[0] if len(res) == 1 else _combine(u, res)
    return [(ranges, sel) for (ranges, _), sel in plans]


def _row_groups(sched: Fa3Schedule, i: int, seqlen: int, s_q: int, H: int) -> list[tuple[tuple, np.ndarray]]:
    """The request's rows grouped by their m-block's split ranges and key offset (one group unless a causal step or
    a local window sets m-blocks apart)."""
    R = s_q * H
    if sched.pack_gqa:
        m_of_row = np.arange(R) // KBLOCK_M
    else:  # an m-block holds one head's query positions
        m_of_row = np.repeat(np.arange(s_q) // KBLOCK_M, H)
    groups: dict[tuple, np.ndarray] = {}
    for m in np.unique(m_of_row):
        key = (tuple(sched.blocks(i, seqlen, int(m), s_q=s_q, heads=H)),
               sched.offset(seqlen, int(m), s_q=s_q, heads=H))
        groups[key] = groups.get(key, np.zeros(R, bool)) | (m_of_row == m)
    return [((list(k[0]), k[1]), sel) for k, sel in groups.items()]


def _scores(u: _Units, Q: np.ndarray, Ks: np.ndarray) -> np.ndarray:
    """``S = Q_rope K_rope^T`` then ``+= Q_nope V^T``, one accumulator, for all of a split's blocks: (R, 64 n).
    The blocks' columns are independent, so they go in few products (:meth:`Machine.by_blocks`)."""
    mc = u.mc
    KT = np.ascontiguousarray(Ks.T)  # (576, 64 n)
    Qm = mc.operand(Q)

    def product(kt: np.ndarray) -> np.ndarray:
        kt = mc.operand(kt)
        return mc.matmul(Qm[:, :D_V], kt[:D_V], mc.matmul(Qm[:, D_V:], kt[D_V:]))

    return mc.f(mc.by_blocks(product, KT, rows=Q.shape[0], block=KBLOCK_N))


def _split(u: _Units, Q: np.ndarray, K: np.ndarray, seqlen: int, lo: int, hi: int, limit: np.ndarray,
           first: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One split over blocks [lo, hi), walked from hi - 1 down: (O normalised, lse) per row; each row's keys up to
    its `limit` (and from its `first`, in a local window: the kernel without intra-warpgroup overlap masks the edge
    blocks, and the blocks it leaves bare lie inside every row's window)."""
    mc, dt = u.mc, u.dt
    R = Q.shape[0]
    if hi <= lo:  # a split with no blocks: store_zero
        return np.zeros((R, D_V), dt), np.full(R, -np.inf, dt)
    keys = np.arange(lo * KBLOCK_N, hi * KBLOCK_N)
    Ks = np.where((keys < seqlen)[:, None], K[np.minimum(keys, seqlen - 1)], 0).astype(K.dtype)
    Ss = u.capped(_scores(u, Q, Ks))
    O = np.zeros((R, D_V), dt)
    M = np.full(R, -np.inf, dt)
    part = None
    for step, blk in enumerate(range(hi - 1, lo - 1, -1)):
        cols = slice((blk - lo) * KBLOCK_N, (blk - lo + 1) * KBLOCK_N)
        t = blk * KBLOCK_N + np.arange(KBLOCK_N)
        seen = (t[None, :] < seqlen) & (t[None, :] <= limit[:, None])
        if first is not None:
            seen &= t[None, :] >= first[:, None]
        S = np.where(seen, Ss[:, cols], -np.inf).astype(dt)
        M_new = S.max(axis=1) if step == 0 else np.maximum(M, S.max(axis=1))
        s = None
        if step:
            cur = np.where(np.isneginf(M_new), 0, M_new).astype(dt)
            s = mc.exp2(mc.f(mc.f(M - cur) * u.c))
        M = M_new
        max_scaled = np.where(np.isneginf(M), 0, mc.f(M * u.c)).astype(dt)
        P = mc.exp2(mc.mul_add(S, u.c, -max_scaled[:, None]))
        part = _lane_sum(mc, part, s, P)
        Pq = mc.operand(mc.cast(P, u.fmt))
        V = mc.operand(Ks[cols, :D_V])
        O = mc.matmul(Pq, V) if s is None else mc.matmul(Pq, V, mc.mul(O, s[:, None]))
    L = _row_total(mc, part)
    empty = (L == 0) | np.isnan(L)
    inv = np.where(empty, 0, mc.div(mc.f(1), L)).astype(dt)
    lse = np.where(empty, -np.inf, _split_lse(u, M, L)).astype(dt)
    return mc.mul(O, inv[:, None]), lse


def _split_lse(u: _Units, M: np.ndarray, L: np.ndarray) -> np.ndarray:
    """``row_max * (softmax_scale_log2 * M_LN2) + __logf(sum)``: the max's multiply contracted into the add."""
    return u.mc.mul_add(M, u.c_ln2, u.logf(L))


def _combine(u: _Units, res: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """``FlashAttnFwdCombine`` over a row's splits (empty ones: lse -inf)."""
    mc, dt = u.mc, u.dt
    lse_s = np.stack([r[1] for r in res], axis=1)  # (R, n)
    width = -(-lse_s.shape[1] // _COMBINE_LANES) * _COMBINE_LANES
    M0, total = combine_sum(mc, lse_s, width, mc.exp)  # M0: the max, 0 where every split is -inf
    lse = _combine_lse(u, total, np.max(lse_s, axis=1))
    w = _combine_weights(u, lse_s, M0, total, lse)
    acc = np.zeros_like(res[0][0], dt)
    for k, (O_s, _) in enumerate(res):
        acc = np.where((w[:, k] > 0)[:, None], mc.mul_add(w[:, k:k + 1], O_s, acc), acc).astype(dt)
    return acc, lse


def _combine_lse(u: _Units, total: np.ndarray, M: np.ndarray) -> np.ndarray:
    """``logf(lse_sum) + lse_max``: ``__logf``'s multiply by ln 2 contracted into the add."""
    return u.logf(total, M)


def _combine_weights(u: _Units, lse_s: np.ndarray, M0: np.ndarray, total: np.ndarray,
                     lse: np.ndarray) -> np.ndarray:
    """Each split's weight, ``expf(lse_s - M) * inv_sum`` with ``inv_sum = 1.f / sum`` (0 where the sum is 0 or
    NaN): the LSE just written is not used."""
    mc = u.mc
    inv = np.where((total == 0) | np.isnan(total), 0, mc.div(mc.f(1), total)).astype(u.dt)
    return mc.mul(mc.exp(mc.f(lse_s - M0[:, None])), inv[:, None])
