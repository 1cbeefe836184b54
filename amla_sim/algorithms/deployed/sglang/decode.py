"""SGLang's Triton MLA decode (``decode_attention_fwd``, the grouped stage 1 + stage 2 path DeepSeek models take),
written against a machine.

Upstream: sgl-project/sglang 0.5.23 (the wheel), ``sglang/kernels/ops/attention/decode_attention.py``.

Stage 1, one program per (request, head tile of BLOCK_H, KV split): the request's L tokens are cut into splits of
``cdiv(cdiv(L, num_kv_splits), MIN_BLOCK_KV) * MIN_BLOCK_KV`` tokens; a split walks its tokens in blocks of
BLOCK_N. Per block:

- ``qk = dot(q[:, :512], K^T) + dot(q[:, 512:], K_rope^T)``: one FP32 accumulator chained through both dots
  (36 ``mma.sync.m16n8k16`` along K, the ``sm90`` T-FDPA row); ``qk *= sm_scale``; keys past the split masked to
  -inf;
- ``m' = max(m, rowmax(qk))``, ``alpha = tl.exp(m - m')``, ``p = tl.exp(qk - m')`` (``ex2.approx`` of
  ``fl32(x * log2 e)``);
- ``acc = dot(bf16(p), V)`` accumulated onto ``acc * alpha``; ``l = fma(l, alpha, tl.sum(p))``, the sum in the
  mma.sync accumulator layout (2 adjacent columns a thread, 4 threads, then min(num_warps, BLOCK_N / 8) warps).

The split writes ``acc / l`` (``div.full``) and ``m + tl.log(l)`` (libdevice's logf). Stage 2, one program per
(request, head): over the splits in order, ``m' = max(m, lse_s)``, ``a = tl.exp(m - m')``, ``w = tl.exp(lse_s - m')``,
``acc = fma(acc, a, w * o_s)``, ``l = fma(l, a, w)``; the output is ``bf16(acc / l * v_scale)``. The FMA
contractions are the ones nvcc's default (Triton's ``enable_fp_fusion``) makes, read off the PTX.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....machines import Machine, get_machine
from ....resources import check_fits
from ..._common import D_V, check_kernel_inputs, check_scale

__all__ = ["splitkv_decode", "SplitKVResult", "split_ranges"]

SGLANG_VERSION = "0.5.23"


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


def _check(q, kv, seqlens, num_kv_splits, max_kv_splits, block_n, block_h, min_block_kv, page_size, logit_cap,
           num_warps, num_stages):
    qa, kva, lens = check_kernel_inputs(q, kv, seqlens, one_query=True)
    b = qa.shape[0]
    splits = np.broadcast_to(np.asarray(num_kv_splits), (b,)) if np.ndim(num_kv_splits) == 0 else \
        np.asarray(num_kv_splits)
    if isinstance(num_kv_splits, bool) or splits.shape != (b,) or splits.dtype.kind not in "iu" or splits.min() < 1:
        raise ValueError(f"num_kv_splits: expected a positive int or {b} of them, got {num_kv_splits!r}")
    # stage 1's grid is (b, heads / block_h, max_kv_splits): CUDA's z extent is at most 65535
    max_splits = int(splits.max()) if max_kv_splits is None else check_int(max_kv_splits, "max_kv_splits", lo=1)
    if max_splits > _MAX_GRID_Z:
        raise ValueError(f"max_kv_splits: at most {_MAX_GRID_Z} (stage 1's grid holds it in CUDA's z extent), "
                         f"got {max_splits}")
    if splits.max() > max_splits:
        raise ValueError(f"max_kv_splits: {max_splits} is below num_kv_splits ({int(splits.max())})")
    check_int(block_n, "block_n", lo=8)
    if block_n % 8:
        raise ValueError(f"block_n: a multiple of 8 (mma.sync's n), got {block_n}")
    if check_int(block_h, "block_h", lo=1) != 16:
        raise ValueError(f"block_h: only SGLang's 16 is modelled (others change the tensor-core instruction), got "
                         f"{block_h}")
    check_int(min_block_kv, "min_block_kv", lo=1)
    check_int(page_size, "page_size", lo=1)
    check_int(num_stages, "num_stages", lo=1)
    check_int(num_warps, "num_warps", lo=1)
    if logit_cap != 0:
        raise ValueError(f"logit_cap: only 0 (no cap, DeepSeek's setting) is modelled, got {logit_cap!r}")
    check_fits(_BYTES_PER_SPLIT * b * qa.shape[2] * max_splits, what=f"splitkv_decode with max_kv_splits={max_splits}",
               lower="max_kv_splits")
    return qa, kva, lens, splits.astype(np.int64), max_splits


_MAX_GRID_Z = 65535
_BYTES_PER_SPLIT = 3 * 8 * (512 + 1)  # per row and split: mid and lse in float64, and the copies made of them


@quiet_fp
def splitkv_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seqlens: npt.ArrayLike | None = None,
    num_kv_splits: int | npt.ArrayLike = 8,
    max_kv_splits: int | None = None,
    scale: float | None = None,
    v_scale: float = 1.0,
    block_n: int = 32,
    block_h: int = 16,
    min_block_kv: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    page_size: int = 1,
    logit_cap: float = 0.0,
    machine: str | Machine = "sm90-triton",
    trace: bool = False,
) -> SplitKVResult:
    """SGLang's grouped MLA decode on `machine` (see the module docstring).

    q: (b, 1, heads, 576) BF16; kv: (b, S_max, 576) BF16, rows past ``seqlens[i]`` ignored, V its first 512
    columns. num_kv_splits: per request (or one for all), what SGLang's scheduler passes; max_kv_splits: the
    launch's maximum (default: the largest of them). num_stages and page_size change no bits (software
    pipelining; addressing) and are checked only.
    """
    mc = get_machine(machine)
    qa, kva, lens, splits, max_splits = _check(q, kv, seqlens, num_kv_splits, max_kv_splits, block_n, block_h,
                                               min_block_kv, page_size, logit_cap, num_warps, num_stages)
    sm = check_scale(scale)
    ranges = split_ranges(lens, splits, max_splits, min_block_kv)
    Q = mc.cast(qa, "bf16")[:, 0]  # (b, H, 576)
    K = mc.cast(kva, "bf16")
    tr: dict[str, list[np.ndarray]] = {}
    mid, lse = _stage1(mc, Q, K, ranges, mc.f(sm), block_n, num_warps, tr if trace else None)
    out = _stage2(mc, mid, lse, ranges, mc.f(v_scale))
    hazards = Counter()
    if np.isnan(out).any():
        hazards["nan_outputs"] += int(np.isnan(out).sum())
    return SplitKVResult(mc.cast(out, "bf16")[:, None], lse, mid, ranges, tr, hazards)


def _stage1(mc: Machine, Q: np.ndarray, K: np.ndarray, ranges: np.ndarray, sm: np.ndarray, block_n: int,
            num_warps: int, trace: dict | None) -> tuple[np.ndarray, np.ndarray]:
    """Every (request, split) at once, block by block; a split's state changes only inside its range."""
    b, H, _ = Q.shape
    S = ranges.shape[1]
    start, end = ranges[..., 0], ranges[..., 1]  # (b, S)
    n_blocks = int(max(0, (-(-(end - start) // block_n)).max()))
    layout = (2, 4, min(num_warps, block_n // 8))
    dt = mc.dtype
    m = np.full((b, S, H), -np.inf, dt)
    l = np.zeros((b, S, H), dt)
    acc = np.zeros((b, S, H, D_V), dt)
    Qn, Qr = mc.operand(Q[:, None, :, :D_V]), mc.operand(Q[:, None, :, D_V:])  # (b, 1, H, .)
    every = None
    if mc.block_width(b * H, block_n) > block_n:  # a key's scores do not depend on its block: every key's at once
        every = mc.by_blocks(lambda kt: mc.matmul(Qr, mc.operand(kt[..., D_V:, :]),
                                                  mc.matmul(Qn, mc.operand(kt[..., :D_V, :])))[:, 0],
                             np.ascontiguousarray(np.swapaxes(K, -1, -2))[:, None],  # K^T laid out once
                             rows=b * H, block=block_n)  # (b, H, L)
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
            KT = np.swapaxes(Kb, -1, -2)  # (b, S, 576, n)
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
        acc_new = mc.matmul(mc.operand(mc.cast(p_kept, "bf16")), mc.operand(Kb[..., :D_V]), scaled)
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


def _stage2(mc: Machine, mid: np.ndarray, lse: np.ndarray, ranges: np.ndarray, v_scale: np.ndarray) -> np.ndarray:
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
    return mc.f(mc.div(acc, l[..., None]) * v_scale)
