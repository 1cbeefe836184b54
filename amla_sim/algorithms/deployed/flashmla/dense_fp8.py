"""vLLM's dense FP8 FlashMLA decode (the FLASHMLA backend with ``--kv-cache-dtype fp8`` on Hopper), written against a
machine. On ``sm90-cuda`` it predicts the kernel's output and LSE bit for bit.

Upstream: vllm-project/FlashMLA 46d64a8 (vLLM 0.33 pins e2afa5fd, which is not obtainable here),
``csrc/extension/sm90/dense_fp8/``: ``flash_fwd_mla_kernel.h`` (``compute_attn_1rowblock_splitkv_mla``, ``store``,
``flash_fwd_splitkv_mla_combine_kernel``), ``softmax.h``, ``fp8_transpose_v.h``, ``flash_fwd_mla_metadata.cu`` and
``pybind.cpp``: FlashMLA's first generation (``Flash_fwd_kernel_traits_mla<576, 64, 64, 8>``) with E4M3 operands.

Q (E4M3, ``descale_q``) and the paged cache (E4M3, ``descale_k``) enter the tensor cores as they are; the descales
go into the constants: ``sm = fl(fl(scale dq) dk)`` and ``c = fl(fl(fl32(scale log2 e) dq) dk)`` (the scale
rounded to float first, its product with log2 e taken in double). The rows are a request's (query position,
head) pairs, 64 to an m-block, all independent; the scheduler
(:func:`amla_sim.algorithms.deployed.flashmla.scheduler.etap_schedule`, the same ``get_mla_metadata``) cuts each
request's 64-token blocks into splits. A split walks its blocks from the last; per block, with the running max
``M`` of the raw scores:

- ``S = Q K^T``: FP8 wgmma m64n64k32, k in order 0..575, every instruction issued with its accumulator
  (``sm90-cuda``'s tensor cores, ``sm90-wgmma``: the 18 k32 steps chained through the 14-bit truncated sum);
- masked keys (past the request on the first block walked; after the row's query, causal, on the first two)
  get -inf; ``M' = max(M, rowmax(S))``; ``s = exp2(fl(fl(M - M') c))`` (none on the first block: O and the
  sums start from it); ``P = exp2(fma(S, c, -fl(M' c)))``;
- each of the four lanes of a row sums its 16 columns ``8j + 2t + e`` in (j, e) order, the first onto ``fma(l,
  s, .)``; ``P`` rounded to E4M3 (``cvt.rn.satfinite``), ``O = fl(O s)`` and then ``O += P8 V8`` on the tensor
  cores (V transposed in shared memory; the same fused FP8 chain over the block's 64 keys, two k32 steps).

At the end the lanes meet (xor 2, then xor 1), ``O = O fl(dk / L)`` (``dk * rcp(L)``: descale_k is V's
descale) and ``lse = fma(M, sm, __logf(L))``; L = 0 or NaN leaves O unscaled with lse +inf (-inf in a split). A
request of one split writes ``bf16(O)``; otherwise the splits' FP32 O and lse go through the combine kernel of
this generation (:func:`amla_sim.algorithms.deployed.flashmla.combine.splitkv_combine`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....machines import Machine
from ....schedules import Schedule
from ..._common import D_K, D_V, AttentionResult, check_kernel_inputs, check_kernel_layout
from ..scalars import api_float, scale_log2, softmax_scale
from .builds import DEFAULT_BUILD, resolve_build
from ..row_sums import lane_sums as _lane_sum
from ..row_sums import quad_total as _row_total
from ..vllm.fp8 import quantize_cache_fp8, quantize_query_fp8
from .combine import combine_width
from .etap import check_causal
from .first_generation import check_batch, run_plan, softmax_steps, split_scores, walk
from .first_generation import split_lse as _split_lse
from .scheduler import BLOCK_SIZE_N, block_ranges, check_splits, etap_num_sm_parts, etap_schedule, metadata_splits

__all__ = ["flashmla_dense_fp8", "flashmla_dense_fp8_decode", "DENSE_FP8_COMMIT"]

#: The vllm-project/FlashMLA commit the model follows.
DENSE_FP8_COMMIT = "46d64a8"


@quiet_fp
def flashmla_dense_fp8(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seqlens: npt.ArrayLike | None = None,
    descale_q: float = 1.0,
    descale_k: float = 1.0,
    scale: float | None = None,
    causal: bool | None = None,
    num_sms: int = 132,
    splits: Sequence[Sequence[tuple[int, int]]] | None = None,
    build: str = DEFAULT_BUILD,
    machine: str | Machine | None = None,
    trace: bool = False,
) -> AttentionResult:
    """vLLM's dense FP8 FlashMLA decode as `build` compiles it (see the module docstring): ``vllm`` (the default:
    vLLM 0.33's ``_flashmla_extension_C``, whose op takes the scale as a double), ``sglang`` (sgl-flash-mla
    1.0.0's copy) or ``upstream`` (vllm-project/FlashMLA's sources); every build with fast math. machine: other
    arithmetic instead (a what-if).

    q: (b, s_q, h_q, 576) and kv: (b, S_max, 576), both E4M3 (``float8_e4m3fn``, as vLLM quantizes them:
    :func:`~amla_sim.algorithms.deployed.vllm.fp8.quantize_query_fp8`, :func:`~amla_sim.algorithms.deployed.vllm.
    fp8.quantize_cache_fp8`); rows of kv past ``seqlens[i]`` ignored, V its first 512 columns. descale_q,
    descale_k: the per-tensor descales (vLLM's ``q_scale`` and ``k_scale``). causal: the MTP mask (query s sees
    keys up to ``seqlen - s_q + s``); None: causal when s_q > 1 (vLLM's call; the kernel ignores it for s_q = 1).
    Returns ``.out`` (b, s_q, h_q, 512) BF16 and ``.lse`` (b, h_q, s_q), the kernel's layouts; with `trace`, per
    request the splits' block ranges, partial outputs and LSEs. splits: per request, token ranges to run as its
    splits in place of the scheduler's (a what-if, as
    :func:`amla_sim.algorithms.deployed.flashmla.scheduler.check_splits` allows).
    """
    mc, double = resolve_build("dense_fp8", build, machine)
    mc.require(kernel="flashmla-dense-fp8", e4m3_products=True, suggest="sm90-cuda")
    qa, kva, lens = check_kernel_inputs(q, kv, seqlens, formats=("e4m3",))
    scale = softmax_scale(scale, double=double)
    dq, dk = api_float(descale_q, "descale_q"), api_float(descale_k, "descale_k")
    check_int(num_sms, "num_sms", lo=1)
    b, s_q, H, _ = qa.shape
    causal = check_causal(causal, s_q)  # a request shorter than its step: rows with no key get out 0, LSE +inf
    check_batch(b, "flashmla-dense-fp8")
    parts = etap_num_sm_parts(s_q=s_q, heads_q=H, num_sms=num_sms)
    max_splits = combine_width(parts, num_sms)
    lengths = [int(n) for n in lens]
    if splits is None:
        plan = metadata_splits(etap_schedule(lens, parts)[0], lengths)
    else:
        plan = block_ranges(check_splits(splits, lengths, max_splits))
    sm, c = _constants(mc, scale, dq, dk)
    shift = np.repeat(s_q - 1 - np.arange(s_q), H) if causal else None  # row r = s h_q + head
    rows = qa.reshape(b, s_q * H, D_K)
    return run_plan(mc, plan, (b, s_q, H), max_splits, lambda i, lo, hi, one: _split(
        mc, rows[i], kva[i], lengths[i], lo, hi, c, sm, mc.f(dk), shift, one), "bf16", trace)


def _constants(mc: Machine, scale: float, dq: float, dk: float) -> tuple[np.ndarray, np.ndarray]:
    """``scale_softmax = scale * descale_q * descale_k`` and ``scale_softmax_log2 = float(scale * M_LOG2E) *
    descale_q * descale_k``, each product rounded to float in that order by the kernel's FTZ multiplies
    (``flash_fwd_mla_kernel.h:566-572``), which read a subnormal operand as 0 and flush a subnormal product."""
    return mc.mul(mc.mul(scale, dq), dk), mc.mul(mc.mul(scale_log2(mc, scale), dq), dk)


def _split(mc: Machine, Q: np.ndarray, K: np.ndarray, seqlen: int, lo: int, hi: int, c: np.ndarray,
           sm: np.ndarray, dk: np.ndarray, shift: np.ndarray | None, alone: bool) -> tuple[np.ndarray, np.ndarray]:
    """One split over blocks [lo, hi), walked from hi - 1 down: (O, lse) per row, O normalised."""
    dt = mc.dtype
    R = Q.shape[0]
    O = np.zeros((R, D_V), dt)
    M = np.full(R, -np.inf, dt)
    part = None
    Ks, Ss = split_scores(mc, Q, K, seqlen, lo, hi)
    for cols, s, P, M in softmax_steps(mc, Ss, seqlen, lo, walk(lo, hi), c, shift):
        part = _lane_sum(mc, part, s, P)
        P8 = mc.operand(mc.cast(P, "e4m3", overflow="satfinite"))
        V8 = mc.operand(Ks[cols, :D_V])
        O = mc.matmul(P8, V8) if s is None else mc.matmul(P8, V8, mc.mul(O, s[:, None]))
    L = _row_total(mc, part)
    empty = (L == 0) | np.isnan(L)
    inv = np.where(empty, 1, mc.div(dk, L)).astype(dt)
    lse = np.where(empty, np.inf if alone else -np.inf, _split_lse(mc, M, sm, L)).astype(dt)
    return mc.mul(O, inv[:, None]), lse


def flashmla_dense_fp8_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "sm90-cuda",
    schedule: str | Schedule = "reference",
    block: int = BLOCK_SIZE_N,
    scale: float | None = None,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    num_sms: int = 132,
    trace: bool = False,
) -> AttentionResult:
    """:func:`flashmla_dense_fp8` as the papers' algorithms are called (``run``, ``reproduce``, ``sweep``): q and kv
    in BF16 (or any float format), quantized as vLLM does with `q_scale` and `k_scale` (1: a checkpoint without
    scales), every request the whole of kv, causal when s_q > 1; the LSE as (b, s_q, h). The kernel lays its work
    out itself: `block` must be its 64 and `schedule` is checked, not used."""
    check_kernel_layout(schedule, block, BLOCK_SIZE_N)
    q8, kv8 = quantize_query_fp8(q, q_scale), quantize_cache_fp8(kv, k_scale)
    res = flashmla_dense_fp8(q8, kv8, descale_q=q_scale, descale_k=k_scale, scale=scale, num_sms=num_sms,
                             machine=machine, trace=trace)
    return AttentionResult(res.out, np.swapaxes(res.lse, 1, 2), res.trace, res.hazards)
