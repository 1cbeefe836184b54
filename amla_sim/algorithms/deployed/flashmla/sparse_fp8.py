"""FlashMLA's sm90 sparse FP8 decode, the MLA decode DeepSeek V3.2 ships, written against a machine.

Upstream: deepseek-ai/FlashMLA 9241ae3, ``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``, ``csrc/smxx/decode/
combine/combine.cu``, ``csrc/smxx/decode/get_decoding_sched_meta/``.
On ``sm90-cuda`` it predicts the kernel's output and LSE bit for bit.

Each query (request i, position j) attends to the ``topk`` cache tokens its indices name (-1: none; with
``topk_length``, MODEL1 only, the slots from ``topk_length[i]`` on are none too). Rows are the query's heads, 64
to a CTA, every row independent. The scheduler (:mod:`~amla_sim.algorithms.deployed.flashmla.scheduler`, each
request ``topk_length`` or ``topk`` tokens long, 0 counted as 1) cuts a request's blocks of 64 slots into splits. A split walks its blocks in order;
per block (keys dequantized as :mod:`.fp8_cache` says, empty slots zero):

- ``S = Q K^T`` on the tensor cores, k in order; empty slots -inf;
- ``m' = max(m, fl(rowmax(S) c))`` with ``c = fl(fl(scale) fl(log2 e))``, m from -1e30; ``s = exp2(m - m')``;
  ``O = fl(O s)``, ``P = exp2(fma(S, c, -m'))``, ``O += bf16(P) V`` (both warpgroups: V's two halves);
- each of the four lanes of a row sums its 16 columns (``2t, 2t + 1, 2t + 8, 2t + 9, ...``) in order from 0, and
  ``l = fma(l, s, sum)``.

At the end ``L = (l0 + l1) + (l2 + l3)``. A request in one split writes ``bf16(O fl(1 / (L + exp2(sink - m))))``
(``sink = fl(attn_sink log2 e)``, -inf without; ``1 / x`` is MUFU.RCP) and LSE ``fma(log2 L, ln 2, fl(m ln 2))``
(+inf where L = 0), the sink left out. Otherwise each split writes ``fl(O rcp(L))`` and ``log2 L + m`` (-inf
where L = 0), and the combine kernel merges them as for the dense decode (:func:`.combine.combine_sum`), the
sink entering after the LSE is written: ``g += log2(1 + exp2(fma(attn_sink, log2 e, -g)))``. exp2 and log2 are
``ex2.approx.ftz`` and ``lg2.approx.ftz`` (``--use_fast_math``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....machines import Machine
from ....schedules import Schedule
from ..._common import D_V, AttentionResult, _check_storage, check_kernel_inputs, check_kernel_layout
from ..scalars import scale_log2_f32, softmax_scale
from .builds import DEFAULT_BUILD, resolve_build
from .combine import combine_sum, combine_width
from .fp8_cache import dequantize_kv_cache, layout_of, pages, quantize_kv_cache
from .scheduler import BLOCK_SIZE_N, SchedPart, block_ranges, check_splits, decoding_schedule, num_sm_parts, request_splits

__all__ = ["flashmla_sparse_fp8", "flashmla_sparse_fp8_decode", "sparse_schedule"]

_MAX_INIT = -1e30  # the running max before the first block
_LOG2E = math.log2(math.e)  # LOG_2_E and CUDART_L2E_F: fl32(log2 e) on FP32 machines, exact on golden
_HEADS = (64, 128)


def _slots(lengths: list[int]) -> list[int]:
    """Each request's length as the scheduler counts it: its topk_length or topk, 0 counted as 1 (the scheduler
    never leaves a request empty)."""
    return [max(int(n), 1) for n in lengths]


def sparse_schedule(lengths: list[int], *, s_q: int, heads: int, num_sms: int = 132
                    ) -> tuple[list[SchedPart], np.ndarray]:
    """FlashMLA's split schedule for a sparse decode (its parts and cumulative split counts), request i being
    ``lengths[i]`` slots long (its topk_length, or topk)."""
    parts = num_sm_parts(s_q=s_q, heads_q=heads, num_sms=num_sms)
    combine_width(parts, num_sms)
    return decoding_schedule(_slots(lengths), parts)


def _check(q, kv_cache, indices, topk_length, attn_sink, scale, num_sms, double=False):
    qa = _check_storage(q, "q", ("bf16",))
    c = np.asarray(kv_cache)
    if c.dtype != np.uint8 or c.ndim != 4 or c.shape[2] != 1 or min(c.shape) < 1:
        raise ValueError(f"kv_cache: expected uint8 pages (num_blocks, page, 1, 656 or 584), got {c.dtype} {c.shape}")
    lay = layout_of(c.shape[-1], "kv_cache")
    if qa.ndim != 4 or qa.shape[-1] != lay.d or qa.shape[2] not in _HEADS or min(qa.shape) < 1:
        raise ValueError(f"q: expected (b, s_q, 64 or 128, {lay.d}) for a {lay.bytes_per_token}-byte ({lay.name}) "
                         f"cache, got {qa.shape}")
    b, s_q, H, _ = qa.shape
    idx = np.asarray(indices)
    n_tok = c.shape[0] * c.shape[1]
    if idx.dtype.kind not in "iu" or idx.ndim != 3 or idx.shape[:2] != (b, s_q) or idx.shape[2] < 1 \
            or idx.shape[2] % BLOCK_SIZE_N:
        raise ValueError(f"indices: expected ints ({b}, {s_q}, topk), topk a multiple of {BLOCK_SIZE_N}, got "
                         f"{idx.dtype} {idx.shape}")
    bad = (idx < -1) | (idx >= n_tok)
    if bad.any():
        raise ValueError(f"indices: expected -1 or a token of the cache (0..{n_tok - 1}), got {idx[bad].flat[0]}")
    topk = idx.shape[2]
    if topk_length is not None:
        if lay.name != "model1":
            raise ValueError("topk_length: the V3.2 kernel takes none (its host check aborts); only MODEL1 caches")
        tl_ = np.asarray(topk_length)
        if tl_.dtype.kind not in "iu" or tl_.shape != (b,) or tl_.min() < 0 or tl_.max() > topk:
            raise ValueError(f"topk_length: expected {b} ints in 0..{topk}, got {topk_length!r}")
        lengths = [int(v) for v in tl_]
    else:
        lengths = [topk] * b
    sink = None
    if attn_sink is not None:
        sink = np.asarray(attn_sink)
        if sink.dtype != np.float32 or sink.shape != (H,) or np.isnan(sink).any():
            raise ValueError(f"attn_sink: expected float32 ({H},) without NaN, got {sink.dtype} {sink.shape}")
    sm = softmax_scale(scale, default=lay.d ** -0.5, double=double)  # FlashMLA's default: d_qk^-0.5
    check_int(num_sms, "num_sms", lo=1)
    return qa, c, lay, idx.astype(np.int64), lengths, topk_length is not None, sink, sm


@quiet_fp
def flashmla_sparse_fp8(
    q: npt.ArrayLike,
    kv_cache: npt.ArrayLike,
    indices: npt.ArrayLike,
    *,
    topk_length: npt.ArrayLike | None = None,
    attn_sink: npt.ArrayLike | None = None,
    scale: float | None = None,
    num_sms: int = 132,
    splits: Sequence[Sequence[tuple[int, int]]] | None = None,
    build: str = DEFAULT_BUILD,
    machine: str | Machine | None = None,
    trace: bool = False,
) -> AttentionResult:
    """FlashMLA's sparse FP8 decode as `build` compiles it (see the module docstring; ``vllm``, the default,
    ``sglang`` or ``upstream``, as :mod:`.builds` says; `machine`: other arithmetic instead, a what-if).

    q: (b, s_q, 64 or 128, 576 or 512) BF16; kv_cache: uint8 pages (num_blocks, page, 1, 656 or 584), the V3.2
    or MODEL1 layout (:func:`.fp8_cache.quantize_kv_cache`; q's head dim must match); indices: (b, s_q,
    topk) ints, ``block * page + offset`` or -1, topk a multiple of 64; topk_length: (b,) ints (MODEL1 only);
    attn_sink: (h_q,) float32; scale: the softmax scale (default d_qk^-0.5, as FlashMLA's interface).
    Returns ``.out`` (b, s_q, h_q, 512) BF16 and ``.lse`` (b, h_q, s_q), natural log, the sink left out, as the
    kernel returns them; with `trace`, per request the splits' block ranges. splits: per request, slot ranges to
    run as its splits in place of the scheduler's (a what-if; each request is its topk_length or topk slots, 0
    counted as 1; :func:`.scheduler.check_splits` says what a plan may be).
    """
    mc, double = resolve_build("sparse_fp8", build, machine)
    mc.require(kernel="flashmla-sparse-fp8", log2=True, suggest="sm90-cuda")
    qa, cache, _lay, idx, lengths, has_len, sink, sm = _check(q, kv_cache, indices, topk_length, attn_sink, scale,
                                                             num_sms, double)
    b, s_q, H, _ = qa.shape
    keys = mc.cast(_keys(cache), "bf16")  # the kernel's BF16 keys, on every machine: the cache is the input
    c = scale_log2_f32(mc, sm)  # sparse_decode.h:387, params.sm_scale_div_log2 = sm_scale * LOG_2_E
    ln2 = mc.f(math.log(2.0))
    parts = num_sm_parts(s_q=s_q, heads_q=H, num_sms=num_sms)
    max_splits = combine_width(parts, num_sms)
    Q = mc.cast(qa, "bf16")
    out = np.zeros((b, s_q, H, D_V), mc.dtype)
    lse = np.zeros((b, s_q, H), mc.dtype)
    tr: dict[str, list] = {}
    plan = request_splits(_slots(lengths), parts) if splits is None else \
        check_splits(splits, _slots(lengths), max_splits)
    splits = block_ranges(plan)
    for i in range(b):
        for j in range(s_q):
            ok = idx[i, j] != -1
            if has_len:
                ok &= np.arange(idx.shape[2]) < lengths[i]
            K = np.where(ok[:, None], keys[np.where(ok, idx[i, j], 0)], 0).astype(keys.dtype)
            # the scores do not depend on the softmax state: every block's at once where that changes no bit
            S = mc.f(mc.matmul_blocks(mc.operand(Q[i, j]), mc.operand(np.ascontiguousarray(K.T)), block=BLOCK_SIZE_N))
            res = _splits(mc, S, K, ok, splits[i], c)
            if len(res) == 1:
                O, L, m = res[0]
                r = mc.div_approx(mc.f(1.0), L if sink is None else _with_sink(mc, L, m, sink))  # __fdividef
                out[i, j] = np.where((L == 0)[:, None], mc.f(0.0), mc.mul(O, r[:, None]))
                lse[i, j] = np.where(L == 0, np.inf, _lse(mc, L, m, ln2))
            else:
                out[i, j], lse[i, j] = _combine(mc, res, max_splits, sink, ln2)
        if trace:
            tr.setdefault("split_blocks", []).append(np.array(splits[i]))
    hazards = Counter()
    if np.isnan(out).any():
        hazards["nan_outputs"] += int(np.isnan(out).sum())
    return AttentionResult(mc.cast(out, "bf16"), np.transpose(lse, (0, 2, 1)), tr, hazards)


def flashmla_sparse_fp8_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine | None = None,
    schedule: str | Schedule = "reference",
    block: int = BLOCK_SIZE_N,
    scale: float | None = None,
    num_sms: int = 132,
    build: str = DEFAULT_BUILD,
    trace: bool = False,
) -> AttentionResult:
    """:func:`flashmla_sparse_fp8` as the papers' algorithms are called (``run``, ``reproduce``, ``sweep``): kv
    (b, S, 576) BF16 quantized by FlashMLA's V3.2 quantizer into pages of 64 tokens, and every query attending to
    all S tokens of its request (topk = S rounded up to 64, the rest empty): the keys a dense decode sees. The
    kernel lays its work out itself: `block` must be its 64 and `schedule` is checked, not used; the softmax
    scale defaults to 576^-0.5 as for every decode here."""
    check_kernel_layout(schedule, block, BLOCK_SIZE_N)
    qa, kva, _ = check_kernel_inputs(q, kv, None)
    b, s_q, _, _ = qa.shape
    S = kva.shape[1]
    paged, base = pages(kva, BLOCK_SIZE_N)
    idx = np.full((b, s_q, -(-S // BLOCK_SIZE_N) * BLOCK_SIZE_N), -1, np.int32)
    idx[..., :S] = (base[:, None, None] + np.arange(S)).astype(np.int32)
    return flashmla_sparse_fp8(qa, quantize_kv_cache(paged, "v32"), idx, scale=scale, num_sms=num_sms,
                               build=build, machine=machine, trace=trace)


def _splits(mc: Machine, scores: np.ndarray, K: np.ndarray, ok: np.ndarray, ranges: list,
            c: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every split (blocks [lo, hi) of the slots' scores Q K^T (R, topk)) of a query: (O, L, m) per row and split,
    O not yet divided by L. V is K's first 512 columns (V3.2: the dequantized FP8 part; MODEL1: its 448 and the 64
    BF16 RoPE values). The splits run in lockstep, a block of each at a time (rows and splits are independent, so
    each split's bits are those of running it alone); a split past its last block keeps its state."""
    dt = mc.dtype
    R, n = scores.shape[0], len(ranges)
    lo, hi = np.array([r[0] for r in ranges], np.int64), np.array([r[1] for r in ranges], np.int64)
    m = np.full((n, R), mc.f(_MAX_INIT), dt)
    O = np.zeros((n, R, D_V), dt)
    lanes = np.zeros((n, R, 4), dt)
    for t in range(int((hi - lo).max(initial=0))):
        live = lo + t < hi  # (n,)
        blk = np.maximum(np.minimum(lo + t, hi - 1), 0)  # a finished split repeats a block (its result unused)
        cols = blk[:, None] * BLOCK_SIZE_N + np.arange(BLOCK_SIZE_N)  # (n, 64)
        S = np.where(ok[cols][:, None, :], np.moveaxis(scores[:, cols], 0, 1), -np.inf).astype(dt)  # (n, R, 64)
        m_new = np.maximum(m, mc.mul(np.max(S, axis=-1), c))
        s = mc.exp2(mc.f(m - m_new))
        P = mc.exp2(mc.mul_add(S, c, -m_new[..., None]))
        O_new = mc.matmul(mc.operand(mc.cast(P, "bf16")), mc.operand(K[cols, :D_V]), mc.mul(O, s[..., None]))
        lanes_new = mc.mul_add(lanes, s[..., None], _lane_sums(mc, P))
        if live.all():
            O, lanes, m = O_new, lanes_new, m_new
        else:
            O = np.where(live[:, None, None], O_new, O)
            lanes = np.where(live[:, None, None], lanes_new, lanes)
            m = np.where(live[:, None], m_new, m)
    return [(O[k], _row_total(mc, lanes[k]), m[k]) for k in range(n)]


def _keys(cache: np.ndarray) -> np.ndarray:
    """Every token's keys as the kernel dequantizes them."""
    return dequantize_kv_cache(cache)


def _with_sink(mc: Machine, L: np.ndarray, m: np.ndarray, sink: np.ndarray) -> np.ndarray:
    """A request in one split: ``L + exp2(sink' - m)``, ``sink' = fl(attn_sink log2 e)`` computed once, before
    the request loop (no FMA across it)."""
    return mc.f(L + mc.exp2(mc.f(mc.f(mc.f(sink) * mc.f(_LOG2E)) - m)))


def _lse(mc: Machine, L: np.ndarray, m: np.ndarray, ln2: np.ndarray) -> np.ndarray:
    """``logf(L) + m / (float)M_LOG2E`` (splitkv_mla.cuh:340); under fast math ``fma(lg2(L), ln 2, fl(m ln 2))``
    (as the dense decode)."""
    return mc.log_plus(L, mc.div(m, mc.f(_LOG2E)))


def _row_total(mc: Machine, lanes: np.ndarray) -> np.ndarray:
    """The four lanes' sums met by two xor shuffles: ``(l0 + l1) + (l2 + l3)``."""
    return mc.f(mc.f(lanes[:, 0] + lanes[:, 1]) + mc.f(lanes[:, 2] + lanes[:, 3]))


def _combine_sink(mc: Machine, g: np.ndarray, sink: np.ndarray) -> np.ndarray:
    """The combine kernel's sink (log2 units): ``g + log2(1 + exp2(fma(sink, log2 e, -g)))``; with no tokens
    (g = +inf), ``sink log2 e`` (+inf for a sink of -inf)."""
    l2e = mc.f(_LOG2E)
    with_sink = mc.f(g + mc.log2(mc.f(1.0 + mc.exp2(mc.mul_add(sink, l2e, -g)))))
    none = np.where(np.isneginf(sink), np.inf, mc.f(sink * l2e))
    return np.where(np.isposinf(g), none, with_sink).astype(mc.dtype)


def _lane_sums(mc: Machine, P: np.ndarray) -> np.ndarray:
    """(..., 64) -> (..., 4): lane t adds columns 2t, 2t + 1, 2t + 8, 2t + 9, ..., 2t + 57 in order, from 0."""
    q = P.reshape(*P.shape[:-1], 8, 4, 2)  # (..., group of 8 columns, lane, pair)
    s = np.zeros(P.shape[:-1] + (4,), mc.dtype)
    for g in range(8):
        for e in range(2):
            s = mc.f(s + q[..., g, :, e])
    return s


def _combine(mc: Machine, res: list, max_splits: int, sink: np.ndarray | None,
             ln2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    dt = mc.dtype
    Ls = np.stack([r[1] for r in res], axis=1)
    lse_s = np.where(Ls == 0, -np.inf, mc.f(mc.log2(Ls) + np.stack([r[2] for r in res], axis=1))).astype(dt)
    M, total = combine_sum(mc, lse_s, max_splits, mc.exp2)
    g = np.where((total == 0) | np.isneginf(total), np.inf, mc.f(mc.log2(total) + M)).astype(dt)
    lse = mc.div(g, mc.f(_LOG2E))  # combine.cu:100, global_lse / (float)M_LOG2E
    if sink is not None:
        g = _combine_sink(mc, g, mc.f(sink))
    scales = mc.exp2(mc.f(lse_s - g[:, None]))
    acc = np.zeros((lse_s.shape[0], D_V), dt)
    for k, (O, L, _) in enumerate(res):
        Os = np.where((L == 0)[:, None], mc.f(0.0), mc.mul(O, mc.div_approx(mc.f(1.0), L)[:, None]))
        acc = mc.mul_add(scales[:, k:k + 1], Os, acc)
    return acc, lse
