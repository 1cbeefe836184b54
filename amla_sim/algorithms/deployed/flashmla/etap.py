"""FlashMLA-ETAP, the ETAP paper's own kernel (pengcuo/FlashMLA-ETAP, commit 39e6160: ``flash_fwd_mla_kernel.h``,
``softmax.h``, ``flash_fwd_mla_metadata.cu``), written against a machine. On ``sm90-cuda`` it predicts the
kernel's output and LSE bit for bit, in BF16 and in FP16.

The rows are the request's (query position, head) pairs, 16 to an m-block (``Flash_fwd_kernel_traits_mla<576,
16, 64, 8>``), all independent; the scheduler
(:func:`etap_schedule`) cuts each request's 64-token blocks into splits. A split walks its blocks from the last
to the first, transposed: one warpgroup computes ``S^T = K Q^T`` (wgmma m64n16, k in order 0..575), so each of
its 128 threads holds two keys (``16 w + g`` and ``16 w + g + 8`` for warp w and lane group g) of four queries.
Per block, with ``c = fl32(fl32(scale) log2 e)`` and the running maximum ``M`` of the *raw* scores:

- masked keys get -inf (past the sequence, or causal, on the first one or two blocks walked: the kernel's
  masking steps); ``M' = max(M, rowmax(S))``, reduced over the lane groups and then the warps (exact);
- the first block: ``P = exp2(fma(S, c, -fl(M' c)))``, the thread's partial sum ``P_g + P_{g+8}``, and a rescale
  factor of 0; later blocks: ``s = exp2(fl(fl(M - M') c))``, the partial sum ``fl(fma(l, s, P_g) + P_{g+8})``;
- ``P`` rounded to the input format, ``O = fl(O s) + P V`` on the tensor cores (O^T = V^T P^T: the same sums).

At the end the 32 partial sums of a query meet in a butterfly over the lane groups (xor 4, 2, 1) and then in warp
order from 0, ``L = ((((0 + W0) + W1) + W2) + W3)``; ``O = O fl(1 / L)`` (MUFU.RCP), ``lse = fma(M, scale,
fl(lg2(L) ln 2))`` in natural log (``__logf``, the max's multiply contracted); L = 0 or NaN gives ``lse`` = +inf
(-inf in a split) and ``O`` unscaled.
A request of one split writes ``O`` in the input format; otherwise each split writes FP32 ``O`` and ``lse`` and
the combine kernel computes ``M = max lse_s`` (0 if -inf), per lane ``sum_{s = lane mod 32} expf(lse_s - M)`` in
order, an xor butterfly over 32 lanes, ``g = fma(lg2(sum), ln 2, M)`` (+inf where the sum is 0 or NaN), and
``sum_s fma(expf(lse_s - g), O_s, .)`` from 0; ``expf`` = ``exp2(fl(x log2 e))``, all MUFU (``--use_fast_math``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....arith.reductions import _xor_tree
from ....formats import get_format
from ....machines import Machine, get_machine
from ....schedules import Schedule
from ..._common import D_K, D_V, AttentionResult, check_kernel_inputs, check_kernel_layout
from ..scalars import scale_log2, softmax_scale
from .combine import combine_width
from .first_generation import check_batch, run_plan, softmax_steps, split_scores
from .first_generation import split_lse as _split_lse
from .first_generation import walk as _walk
from .scheduler import BLOCK_SIZE_N, block_ranges, check_splits, etap_num_sm_parts, etap_schedule, metadata_splits

__all__ = ["flashmla_etap", "flashmla_etap_decode", "etap_schedule", "etap_num_sm_parts", "ETAP_COMMIT",
           "check_causal"]

#: The FlashMLA-ETAP commit (pengcuo/FlashMLA-ETAP) the model follows.
ETAP_COMMIT = "39e6160"
WARPS, GROUPS = 4, 8  # the S^T warpgroup: 4 warps of 8 lane groups, each holding keys 16 w + g and 16 w + g + 8


@quiet_fp
def flashmla_etap(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seqlens: npt.ArrayLike | None = None,
    scale: float | None = None,
    causal: bool | None = None,
    num_sms: int = 132,
    splits: Sequence[Sequence[tuple[int, int]]] | None = None,
    machine: str | Machine = "sm90-cuda",
    trace: bool = False,
) -> AttentionResult:
    """FlashMLA-ETAP's decode on `machine` (see the module docstring).

    q: (b, s_q, h_q, 576) and kv: (b, S_max, 576), both BF16 or both FP16; rows of kv past ``seqlens[i]`` ignored
    (None: every request S_max long), V its first 512 columns. causal: the MTP mask (query s sees keys up to
    ``seqlen - s_q + s``); None: causal when s_q > 1 (the kernel ignores it for s_q = 1). num_sms: the device's SM
    count (132 on H100 SXM and H200). Returns ``.out`` (b, s_q, h_q, 512) in q's format and ``.lse`` (b, h_q, s_q)
    natural log, the kernel's layouts; with `trace`, per request the splits' block ranges, partial outputs and
    LSEs (``split_blocks``, ``split_out``, ``split_lse``). splits: per request, token ranges to run as its splits
    in place of the scheduler's (a what-if; :func:`.scheduler.check_splits` says what a plan may be).
    """
    mc = get_machine(machine)
    qa, kva, lens = check_kernel_inputs(q, kv, seqlens, formats=("bf16", "fp16"))
    sm = softmax_scale(scale)
    check_int(num_sms, "num_sms", lo=1)
    fmt = get_format(qa.dtype).name
    b, s_q, H, _ = qa.shape
    causal = check_causal(causal, s_q)
    check_batch(b, "flashmla-etap")
    parts = etap_num_sm_parts(s_q=s_q, heads_q=H, num_sms=num_sms)
    max_splits = combine_width(parts, num_sms)
    sm, c = _scales(mc, sm)
    if splits is None:
        plan = metadata_splits(etap_schedule(lens, parts)[0], [int(n) for n in lens])
    else:
        plan = block_ranges(check_splits(splits, [int(n) for n in lens], max_splits))
    Q, K = mc.cast(qa, fmt), mc.cast(kva, fmt)
    # row r = s h_q + head; query position s sees keys t <= seqlen - s_q + s when causal
    shift = np.repeat(s_q - 1 - np.arange(s_q), H) if causal else None
    rows = Q.reshape(b, s_q * H, D_K)
    return run_plan(mc, plan, (b, s_q, H), max_splits, lambda i, lo, hi, one: _split(
        mc, fmt, rows[i], K[i], int(lens[i]), lo, hi, c, sm, shift, one), fmt, trace)


def check_causal(causal: bool | None, s_q: int) -> bool:
    """The first generation's ``is_causal``: None means causal when s_q > 1 (the callers' choice), and the API
    drops it for s_q = 1. A TypeError names `causal` if it is not a bool or None."""
    if causal is not None and not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected True, False or None, got {causal!r}")
    return s_q > 1 if causal is None else bool(causal) and s_q > 1


def _scales(mc: Machine, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The API's ``float softmax_scale`` and ``params.scale_softmax_log2 = float(softmax_scale * M_LOG2E)``, the
    product taken in double from the float, each as the kernel's FTZ instructions read it."""
    return mc.ftz(scale), mc.ftz(scale_log2(mc, scale))


def _thread_sum(mc: Machine, part: np.ndarray, s: np.ndarray | None, P: np.ndarray) -> np.ndarray:
    """A thread's partial row sum after a block, P (R, 64) -> its keys (R, warp, 2, group): ``row_sum *= s``, then
    its two keys added in order (``thread_reduce_``), the multiply contracted into the first add."""
    Pk = P.reshape(P.shape[0], WARPS, 2, GROUPS)  # key 16 w + 8 h + g -> (w, h, g)
    if s is None:  # the first block: zero_init
        return mc.f(Pk[:, :, 0] + Pk[:, :, 1])
    return mc.f(mc.mul_add(part, s[:, None, None], Pk[:, :, 0]) + Pk[:, :, 1])


def _row_total(mc: Machine, part: np.ndarray) -> np.ndarray:
    """``reduce_group_4x8_4_sum``: the butterfly over a warp's lane groups (xor 16, 8, 4 on the lane: 4, 2, 1 on
    g), then the four warps' sums added in order from 0."""
    warp = _xor_tree([part[:, :, g] for g in range(GROUPS)])
    L = np.zeros(part.shape[0], mc.dtype)
    for w in range(WARPS):
        L = mc.f(L + warp[:, w])
    return L


def flashmla_etap_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "sm90-cuda",
    schedule: str | Schedule = "reference",
    block: int = BLOCK_SIZE_N,
    scale: float | None = None,
    num_sms: int = 132,
    trace: bool = False,
) -> AttentionResult:
    """:func:`flashmla_etap` as the papers' algorithms are called (``run``, ``reproduce``, ``sweep``): every
    request the whole of kv, causal when s_q > 1. The kernel lays its work out itself: `block` must be its 64 and
    `schedule` is checked, not used."""
    check_kernel_layout(schedule, block, BLOCK_SIZE_N)
    return flashmla_etap(q, kv, scale=scale, num_sms=num_sms, machine=machine, trace=trace)


def _split(mc: Machine, fmt: str, Q: np.ndarray, K: np.ndarray, seqlen: int, lo: int, hi: int, c: np.ndarray,
           sm: np.ndarray, shift: np.ndarray | None, alone: bool) -> tuple[np.ndarray, np.ndarray]:
    """One split over blocks [lo, hi), walked from hi - 1 down: (O, lse) per row, O normalised."""
    dt = mc.dtype
    R = Q.shape[0]
    O = np.zeros((R, D_V), dt)
    M = np.full(R, -np.inf, dt)
    part = np.zeros((R, WARPS, GROUPS), dt)  # a thread's partial row sum: (warp, lane group)
    Ks, Ss = split_scores(mc, Q, K, seqlen, lo, hi)
    for cols, s, P, M in softmax_steps(mc, Ss, seqlen, lo, _walk(lo, hi), c, shift):
        Kb = Ks[cols]
        part = _thread_sum(mc, part, s, P)
        O = mc.mul(O, mc.f(0) if s is None else s[:, None])
        O = mc.matmul(mc.operand(mc.cast(P, fmt)), mc.operand(Kb[:, :D_V]), O)
    L = _row_total(mc, part)
    empty = (L == 0) | np.isnan(L)
    inv = np.where(empty, 1, mc.div(mc.f(1), L)).astype(dt)
    lse = np.where(empty, np.inf if alone else -np.inf, _split_lse(mc, M, sm, L)).astype(dt)
    return mc.mul(O, inv[:, None]), lse
