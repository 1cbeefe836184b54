"""FlashAttention-3's standard forward as the MLA prefill calls it (the "MHA form": q = k = [k_nope, k_pe], 192
wide, v 128 wide, one head of K and V per query head), and at head dims 64, 96, 128 and 256 (every Llama- or
Qwen-class model on Hopper is 128) and 64 / 256 and 64 / 512 (a v wider than q), written against a machine.

vLLM 0.33 runs every MLA prefill chunk of more than 512 new tokens through it (one causal call over the new
tokens, one non-causal call returning the LSE per context chunk); SGLang 0.5.23 its MHA-path extends.

Upstream: vllm-project/flash-attention 617264c, ``hopper/``: ``tile_size.h`` (:data:`PREFILL_TILES`; the P V
product from registers, intra-warpgroup overlap), ``mainloop_fwd_sm90_tma_gmma_ws.hpp:1212-1341``, ``softmax.h``,
``utils.h:235-325`` (``flash::gemm``), ``epilogue_fwd.hpp``, ``flash_fwd_combine_kernel.h``; the split choice is
:func:`.scheduler.varlen_splits`. SGLang's build (sgl-flash-attn cb303cf) differs in FP8, in some tiles and in a
local window's bare blocks (below). The arithmetic is
the MLA decode's (:mod:`amla_sim.algorithms.deployed.fa3.mla`), on other tiles and in another order of issue:

- An m-block holds 128 query positions of one head (64 with one MMA warpgroup; with pack-GQA, rows of (position,
  query head of the group)). Its key blocks are walked from the last it sees (bottom-right causal: query s of a
  request of n_q queries and n_k keys sees keys up to ``n_k - n_q + s``) down to the first.
- ``S = Q K^T`` zero-initialised; masked keys -inf; the max, ``s`` and ``P = exp2(fma(S, c, -fl(M' c)))`` and the
  four lanes' row sums as in the decode.
- The block's ``P V`` waits for the next block's scores and goes onto O (the first onto a cleared O, ``+0``), then
  O is rescaled by the next block's ``s``: ``O = fl(acc(O, P V) s')``. (Head dims over 128 issue the rescale
  before the product, ``RescaleOBeforeGemm``: the same roundings in the same order.)
- FP8 E4M3: ``P = exp2(fma(S, c, -fma(M', c, -8)))``, in [0, 256], rounded to E4M3 (satfinite); the LSE from the
  sum times 2^-8; out in BF16; descales folded into ``c`` and the final scale. vLLM's fork adds each block's P V,
  a product of its own from a cleared accumulator, to O in FP32 (the two-level accumulation); SGLang's build
  accumulates in O on the tensor cores, on other tiles (:func:`sgl_tile`).
- A local window (``window_size``): each row's keys from ``n_k - n_q + s - left`` to ``... + right``, an m-block's
  key blocks counted from the first key its first row sees, on the window's tiles; the mainloop masks the blocks at
  the window's edges and leaves the others bare, with bounds that, in the fork's kernels with intra-warpgroup
  overlap, count the request's keys rather than the m-block's: a bare block can then hold keys outside a row's
  window, which the kernel reads (:func:`_unmasked`). SGLang's build counts the m-block's keys in every kernel, and
  takes one MMA warpgroup with a window too.
- The end, the split partials and the combine as the decode's. A k of no row makes ``mha_fwd`` launch nothing and
  write out 0 and LSE +inf for the whole call (``flash_api.cpp:1281-1309``); a request of no key (or a row that
  sees none) gets out 0 and LSE -inf.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....formats import get_format
from ....machines import Machine, get_machine
from ..._common import AttentionResult
from ..row_sums import lane_sums, quad_total
from ..scalars import api_float, softmax_scale
from .mla import _check_launch, _combine, _split_lse, _Units
from .scheduler import MAX_SPLIT_BATCH, num_splits_heuristic, split_blocks, varlen_splits, window

__all__ = ["fa3_prefill", "kernel_dims", "PREFILL_TILES", "PREFILL_BUILDS", "prefill_schedule", "prefill_tile",
           "sgl_tile", "use_one_mma_wg", "cu_seqlens"]

#: ``tile_size_fwd_sm90`` (tile_size.h) in vLLM's fork, 617264c: (d, dv, element size in bytes, causal, one MMA
#: warpgroup) -> (kBlockM, kBlockN). Head dims 192 / 128 (:47-48, 16-bit; :73-74, FP8 with the two-level
#: accumulation); 128 / 128 (:42-46 and :56-62, every Llama- or Qwen-class model on Hopper), one warpgroup of 64 rows
#: when the launch's longest query run times the heads a KV head is at most 64 (``use_one_mma_wg``); 64 / 64
#: (:21-30, three MMA warpgroups of 192 rows), 96 / 96 (:36), 192 / 192 (:47) and 256 / 256 (:50), with their FP8 tiles
#: (:58, :67-74); a v wider than q at q <= 64, 16-bit only: 64 / 256 (:20, P V from registers, no intra-warpgroup
#: overlap) and 64 / 512 (:18, v's columns over two MMA warpgroups), one tile each (``use_one_mma_wg`` is ignored).
#: A call's head dims run on the kernel :func:`kernel_dims` names, its columns past them read as zero.
PREFILL_TILES = {
    (192, 128, 2, False, False): (128, 128), (192, 128, 2, True, False): (128, 128),
    (192, 128, 1, False, False): (128, 96), (192, 128, 1, True, False): (128, 96),
    (128, 128, 2, False, False): (128, 160), (128, 128, 2, True, False): (128, 128),
    (128, 128, 2, False, True): (64, 176), (128, 128, 2, True, True): (64, 128),
    (128, 128, 1, False, False): (128, 192), (128, 128, 1, True, False): (128, 192),
    (128, 128, 1, False, True): (64, 96), (128, 128, 1, True, True): (64, 96),
    (64, 64, 2, False, False): (192, 192), (64, 64, 2, True, False): (192, 128),
    (64, 64, 2, False, True): (64, 192), (64, 64, 2, True, True): (64, 192),
    (64, 64, 1, False, False): (192, 128), (64, 64, 1, True, False): (192, 128),
    (64, 64, 1, False, True): (64, 128), (64, 64, 1, True, True): (64, 128),
    (96, 96, 2, False, False): (192, 144), (96, 96, 2, True, False): (192, 144),
    (96, 96, 1, False, False): (128, 128), (96, 96, 1, True, False): (128, 128),
    (256, 256, 2, False, False): (128, 80), (256, 256, 2, True, False): (128, 80),
    (256, 256, 1, False, False): (128, 128), (256, 256, 1, True, False): (128, 128),
    (64, 256, 2, False, False): (128, 96), (64, 256, 2, True, False): (128, 96),
    (64, 256, 2, False, True): (128, 96), (64, 256, 2, True, True): (128, 96),
    (64, 512, 2, False, False): (64, 64), (64, 512, 2, True, False): (64, 64),
    (64, 512, 2, False, True): (64, 64), (64, 512, 2, True, True): (64, 64),
    (192, 192, 2, False, False): (128, 96), (192, 192, 2, True, False): (128, 96),
    (192, 192, 1, False, False): (128, 96), (192, 192, 1, True, False): (128, 96),
}
#: a local window's tiles where they differ (tile_size.h: ``is_local``), (d, dv, element size) -> (kBlockM, kBlockN);
#: a local call never takes one MMA warpgroup (heuristics.h:10-13)
LOCAL_TILES = {(64, 64, 2): (192, 160), (96, 96, 2): (192, 128), (128, 128, 2): (128, 128),
               (192, 128, 2): (128, 96), (256, 256, 2): (128, 64), (256, 256, 1): (128, 64)}
#: the builds the model follows: vLLM's fork (its wheel's ``_vllm_fa3_C``) and SGLang's (sgl-flash-attn, compiled
#: into ``sglang-kernel``); they differ in FP8 (the fork accumulates FP8 ``P V`` in two levels), in some tiles
#: (:func:`sgl_tile`) and in a local window's unmasked blocks (:func:`_unmasked`)
PREFILL_BUILDS = ("vllm", "sglang")
_FORMATS = ("bf16", "fp16", "e4m3")
#: FP8's softmax: ``P = exp2(S c - (M c - 8))``, in [0, 256] (softmax.h:64-79, ``Max_offset`` 8)
FP8_MAX_OFFSET = 8


def kernel_dims(d: int, dv: int, element_size: int = 2, name: str = "q") -> tuple[int, int]:
    """The compiled head dims that run a call of head dims `d` (q and k) and `dv` (v), as ``mha_fwd`` picks them
    (flash_api.cpp:925-956, the dispatch of :319-353): each rounded up to 64, 96, 128, 192 or 256 (v to its own
    step when it differs from d). A ValueError naming `name` (or ``v``) where upstream raises: a head dim that is not
    a multiple of 8 (16 for FP8), over 256, or a v of another width than d outside d in (128, 192] with v in (96,
    128] and d <= 64 with v <= 512, or, FP8, over 256. An FP8 v wider than q at q <= 64 (to 256) runs the 64 / 64
    FP8 kernel (FP8 has no other at q <= 64), which reads v's first 64 columns and writes the output's first 64."""
    align = 16 if element_size == 1 else 8
    for what, n in ((name, d), ("v", dv)):
        if n < 1 or n % align:
            raise ValueError(f"{what}: head_size should be a multiple of {align} (mha_fwd), got {n}")
    if d > 256:
        raise ValueError(f"{name}: FlashAttention forward only supports head dimension at most 256, got {d}")
    if dv != d and not (128 < d <= 192 and 96 < dv <= 128 or d <= 64 and dv <= 512):
        raise ValueError(f"v: head dim {dv} with q's {d}: FA3 takes another V head dim only for q in (128, 192] "
                         f"and v in (96, 128], or q <= 64 and v <= 512")
    if element_size == 1 and d <= 64 < dv:
        if dv > 256:
            raise ValueError(f"v: head dim {dv} over 256 with FP8 inputs (mha_fwd: \"HeaddimV > 256 requires fp16 and "
                             "bf16 data type\")")
        return 64, 64  # flash_api.cpp's FP8 dispatch: the output's columns past 64 are left as allocated
    steps = (64, 96, 128, 192, 256)
    d_r = next(x for x in steps if d <= x)
    if d_r == 64 and dv > 64:
        return 64, 512 if dv > 256 else 256
    if d_r == 192:
        return 192, 128 if dv <= 128 else 192
    return d_r, d_r


def cu_seqlens(lens: list[int]) -> np.ndarray:
    """A varlen call's offsets from its requests' lengths: ``[0, n_0, n_0 + n_1, ...]``."""
    return np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64)


def prefill_schedule(qlens: list[int], klens: list[int], *, heads: int, heads_k: int, d: int, dv: int,
                     num_splits: int, causal: bool, max_seqlen_q: int, max_seqlen_k: int,
                     num_sms: int = 132, element_size: int = 2, build: str = "vllm",
                     local: tuple[int, int] | None = None, softcap: bool = False) -> tuple[int, list[int], bool]:
    """What ``mha_fwd`` decides for a varlen launch (flash_api.cpp:1053-1070): the split bound (the caller's
    `num_splits`, or ``get_num_splits`` as if the batch were its longest request: ``1 * h_k * cdiv(max_seqlen_q *
    h / h_k, kBlockM)`` m-blocks, a KV head's bytes at `element_size`, 1 for E4M3), each request's split count (the
    prepare kernel) and pack-GQA (on when split, or when the heads are grouped, or in vLLM's build when d = dv).
    build: whose tiles (FP8's differ). local: a local window's (left, right) as :func:`window` reads it (the
    heuristic weighs the keys it loads, ``min(seqlen_k, left + right + 1 + kBlockM)``)."""
    qpk = heads // heads_k
    one_wg = use_one_mma_wg(d, max_seqlen_q, qpk, local is not None, build)  # the call's d, not the kernel's
    dk, dvk = kernel_dims(d, dv, element_size)
    block_m, block_n = prefill_tile(dk, dvk, element_size, build, causal=causal, one_wg=one_wg,
                                    local=local is not None, softcap=softcap)
    b = len(qlens)
    if num_splits > 0:
        bound = num_splits
    else:
        m_blocks = -(-(max_seqlen_q * qpk) // block_m)
        loaded = max_seqlen_k if local is None else max(0, min(max_seqlen_k, sum(local) + 1 + block_m))
        bound = num_splits_heuristic(heads_k * m_blocks, num_sms, -(-loaded // block_n), m_blocks,
                                     max_seqlen_k * (d + dv) * element_size, causal or local is not None)
    if b > MAX_SPLIT_BATCH:
        bound = 1
    # get_pack_gqa: varlen with grouped heads packs; a split always does; vLLM's PACKGQA_ONLY on a square kernel
    pack = bound > 1 or qpk > 1 or (build == "vllm" and dk == dvk)
    rows = qpk if pack else 1
    splits = varlen_splits([-(-(n * rows) // block_m) for n in qlens], [-(-n // block_n) for n in klens],
                           num_head=heads_k if pack else heads, bound=bound, num_sms=num_sms)
    return bound, splits, pack


def use_one_mma_wg(d: int, max_seqlen_q: int, qpk: int, local: bool = False, build: str = "vllm") -> bool:
    """heuristics.h:10-14: one MMA warpgroup for head dims 64 and 128 when ``seqlen_q * h / h_k <= 64``; in vLLM's
    fork never with a local window, in SGLang's with one too (sgl-flash-attn cb303cf heuristics.h:10-15,
    flash_fwd_launch_template.h:215)."""
    return d in (64, 128) and max_seqlen_q * qpk <= 64 and (build == "sglang" or not local)


def prefill_tile(d: int, dv: int, element_size: int, build: str = "vllm", *, causal: bool = False,
                 one_wg: bool = False, local: bool = False, softcap: bool = False) -> tuple[int, int]:
    """``tile_size_fwd_sm90``'s (kBlockM, kBlockN) for a build (SGLang's: :func:`sgl_tile`; the fork's tiles do
    not depend on a softcap)."""
    if build == "sglang":
        return sgl_tile(d, dv, element_size, causal=causal, one_wg=one_wg, local=local, softcap=softcap)[:2]
    if local and (d, dv, element_size) in LOCAL_TILES:
        return LOCAL_TILES[(d, dv, element_size)]
    return PREFILL_TILES[(d, dv, element_size, bool(causal), bool(one_wg))]


def sgl_tile(d: int, dv: int, element_size: int, *, causal: bool = False, one_wg: bool = False,
             local: bool = False, softcap: bool = False) -> tuple[int, int, bool]:
    """SGLang's ``tile_size_fwd_sm90`` (sgl-flash-attn cb303cf tile_size.h:10-70) for the kernel of head dims
    (`d`, `dv`), V row-major, not paged: (kBlockM, kBlockN, intra-warpgroup overlap). It differs from
    the fork's at 64 (192-key blocks, with overlap, in a local window), at 128 (176-key blocks unless causal or
    local), at 192 / 192 (112) and in FP8 (one-level accumulation: 128 x 224 at 128, 128 x 160 at 192)."""
    if element_size == 2:
        if d <= 64:
            if dv == 512:
                return 64, 64, False
            if dv == 256:
                return 128, 96, False
            return (64, 192, True) if one_wg else (192, 128 if causal else 192, True)
        if d <= 96:
            return 192, 128 if local else 144, True
        if d <= 128:
            return 64 if one_wg else 128, 128 if causal or local else 176, True
        if d <= 192:
            return 128, 96 if local else (128 if dv <= 128 else 112), True
        return 128, 64 if local else 80, True
    if d <= 64:
        return (64, 128, True) if one_wg else (192, 160, True)
    if d <= 96:
        return 192, 128, True
    if d <= 128:
        return (64, 96, True) if one_wg else (128, 192 if softcap and local else 224, True)
    if d <= 192:
        return 128, 128 if softcap and local else 160, True
    return 128, 64 if local else 128, True


@quiet_fp
def fa3_prefill(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike,
    *,
    scale: float | None = None,
    causal: bool = False,
    num_splits: int = 0,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    q_descale: npt.ArrayLike | None = None,
    k_descale: npt.ArrayLike | None = None,
    v_descale: npt.ArrayLike | None = None,
    num_sms: int = 132,
    splits: list[int] | None = None,
    launch_heads: int | None = None,
    build: str = "vllm",
    softcap: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    machine: str | Machine = "sm90-cuda",
    trace: bool = False,
) -> AttentionResult:
    """FA3's varlen forward ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)`` on `machine`.

    q: (T, h, d), k: (T_k, h_k, d), v: (T_k, h_k, dv) (192 and 128 in the MLA prefill; any dims FA3 takes,
    :func:`kernel_dims`), all BF16, FP16 or FP8 E4M3, h a multiple of h_k; request i's queries are ``q[cu_seqlens_q[i]:
    cu_seqlens_q[i + 1]]``, its keys and values the same rows of k and v by `cu_seqlens_k`. scale: the call's
    ``softmax_scale`` (None: d^-0.5). causal: vLLM's new-token call (True) or its context chunks (False).
    num_splits: the caller's (0: FA3's heuristic, vLLM's default; 1: SGLang's, vLLM's batch-invariant mode).
    max_seqlen_q, max_seqlen_k: the call's (None: the longest request; at least that). q_descale, k_descale,
    v_descale: E4M3 only, (batch, h_k) FP32 factors (None: 1; 16-bit calls ignore them, as ``mha_fwd`` does).
    splits: per request, a split count for the prepare kernel's (a what-if). launch_heads: the launch's query heads
    when q holds only the first of them (None: q's). build: "vllm" (vLLM's fork, the default: vLLM 0.33's wheel)
    or "sglang" (sgl-flash-attn: FP8 accumulated in one level, some tiles, a window's bounds). softcap: over 0,
    FA3's softcapping (the scores through MUFU.TANH, :meth:`.mla._Units.with_softcap`); 0, below or NaN: none.
    window_size: (left, right), the keys a query sees before and after its own (-1: all), read with `causal` as
    :func:`window` says. Returns ``.out`` (T, h, dv) in the input format, BF16 for E4M3 (rows past
    ``cu_seqlens_q[-1]`` 0; an FP8 v wider than q at q <= 64 gets its first 64 columns, the rest NaN, counted as the
    hazard ``unwritten_columns``: the kernel leaves them as its buffer held them) and ``.lse`` (h, T), natural log;
    with `trace`, the launch's split bound, each request's split count and whether the heads were packed."""
    mc = get_machine(machine)
    qa, ka, va, cq, ck = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    T, H, d = qa.shape
    Hk, dv = ka.shape[1], va.shape[2]
    qlens, klens, mq, mk = _check_call(cq, ck, max_seqlen_q, max_seqlen_k, causal, num_sms, num_splits)
    cap = api_float(softcap, "softcap")
    causal, sides = _local(causal, window_size, mq, mk)
    fmt = get_format(qa.dtype).name
    fp8 = fmt == "e4m3"
    dk, dvk = kernel_dims(d, dv, 1 if fp8 else 2)
    _check_build(build)
    if fp8:
        mc.require(kernel="fa3-prefill (E4M3)", e4m3_products=True, suggest="sm90-cuda")
    descales = _descales(fp8, (q_descale, k_descale, v_descale), (len(qlens), Hk))
    u = _Units(mc, fmt, softmax_scale(scale, d ** -0.5), cap)
    out = np.zeros((T, H, dv), mc.dtype)
    no_k = ka.shape[0] == 0  # mha_fwd runs no kernel when k has no row: out 0, LSE +inf (flash_api.cpp:1281-1309)
    lse = np.full((H, T), np.inf if no_k else 0.0, mc.dtype)
    LH, size = _launch_heads(launch_heads, H, Hk), 1 if fp8 else 2
    bound, counts, pack = prefill_schedule(qlens, klens, heads=LH, heads_k=LH // (H // Hk), d=d, dv=dv,
                                           num_splits=num_splits, causal=causal, max_seqlen_q=mq,
                                           max_seqlen_k=mk, num_sms=num_sms, element_size=size, build=build,
                                           local=sides, softcap=bool(cap > 0))
    if splits is not None:
        counts = _check_splits(splits, len(qlens))
        pack = pack or max(counts) > 1
    if not no_k:
        one, local = use_one_mma_wg(d, mq, H // Hk, sides is not None, build), sides is not None
        tile = prefill_tile(dk, dvk, size, build, causal=causal, one_wg=one, local=local, softcap=bool(cap > 0))
        _requests(u, (qa, ka, va), cq, ck, out, lse, causal=causal, counts=counts, tile=tile, dims=(dk, dvk),
                  descales=descales if fp8 else None, two_level=build == "vllm",
                  local=None if sides is None else (*sides, _request_frame(dk, dvk, size, build)))
    hazards = _hazards(out, dvk)
    tr = {"bound": bound, "splits": list(counts), "pack_gqa": pack} if trace else {}
    return AttentionResult(mc.cast(out, "bf16" if fp8 else fmt), lse, tr, hazards)  # out_type (flash_api.cpp:936)


def _check_call(cq: np.ndarray, ck: np.ndarray, max_seqlen_q: int | None, max_seqlen_k: int | None, causal: object,
                num_sms: int, num_splits: int) -> tuple[list[int], list[int], int, int]:
    """The call's query and key lengths and its max_seqlen_q and max_seqlen_k (each checked against them), its
    causal flag and launch settings checked: an error naming the argument."""
    qlens, klens = np.diff(cq).tolist(), np.diff(ck).tolist()
    mq = _check_max(max_seqlen_q, "max_seqlen_q", max(qlens))
    mk = _check_max(max_seqlen_k, "max_seqlen_k", max(klens))
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    _check_launch(num_sms=num_sms, num_splits=num_splits, page_size=None, causal=causal, pack_gqa=None,
                  varlen_q=True, softcap=0.0, window_size=(-1, -1))
    return qlens, klens, mq, mk


def _hazards(out: np.ndarray, written: int) -> Counter:
    """The call's NaN outputs; where the kernel writes only the first `written` of the output's columns (the FP8
    64 / 64 kernel under a wider v), the rest set to NaN and counted as ``unwritten_columns`` (the kernel leaves
    them as its buffer held them)."""
    nan = int(np.isnan(out[..., :written]).sum())
    hazards = Counter(nan_outputs=nan) if nan else Counter()
    if written < out.shape[-1]:
        out[..., written:] = np.nan
        hazards["unwritten_columns"] = out[..., written:].size
    return hazards


def _local(causal: bool, window_size: object, mq: int, mk: int) -> tuple[bool, tuple[int, int] | None]:
    """The call's causal flag and its local window's (left, right) (None: not local) as :func:`window` reads
    them; an error naming ``window_size`` unless it is two ints (below 0: no limit on that side)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in window_size):
        raise TypeError(f"window_size: expected (left, right) ints, got {window_size!r}")
    causal, local, left, right = window(causal, (int(window_size[0]), int(window_size[1])), mq, mk)
    return causal, (left, right) if local else None


def _descales(fp8: bool, given: tuple, shape: tuple[int, int]) -> list:
    """q's, k's and v's descales, each checked (:func:`_check_descale`); None for 16-bit calls, which ignore them."""
    return [_check_descale(x, name, shape) if fp8 else None for x, name in zip(given, ("q_descale", "k_descale",
                                                                                          "v_descale"))]


def _launch_heads(launch_heads: int | None, H: int, Hk: int) -> int:
    """The launch's query heads: q's (None), or more, a whole number of KV heads' groups."""
    LH = H if launch_heads is None else check_int(launch_heads, "launch_heads", lo=H)
    if LH % (H // Hk):
        raise ValueError(f"launch_heads: a multiple of the query heads a KV head ({H // Hk}), got {LH}")
    return LH


def _padded(x: np.ndarray, n: int) -> np.ndarray:
    """`x` (rows, heads, d) with zero columns up to n: what the kernel's loads of a head dim under its own read (its
    first n columns where it has more: the FP8 64 / 64 kernel's loads of a wider v)."""
    if x.shape[-1] >= n:
        return x[..., :n]
    return np.concatenate([x, np.zeros(x.shape[:-1] + (n - x.shape[-1],), x.dtype)], axis=-1)


def _requests(u: _Units, qkv: tuple[np.ndarray, np.ndarray, np.ndarray], cq: np.ndarray, ck: np.ndarray,
              out: np.ndarray, lse: np.ndarray, *, causal: bool, counts: list[int], tile: tuple[int, int],
              dims: tuple[int, int], descales: list | None, two_level: bool,
              local: tuple[int, int, bool] | None = None) -> None:
    """Each request of the launch into `out` (T, h, dv) and `lse` (h, T), on the kernel of head dims `dims` (q, k and
    v zero-padded to them, the call's columns of its output kept); `descales` (a list, entries None or (batch, h_k))
    for FP8, None for 16-bit inputs; `local`: a local window's (left, right, whether its bare blocks are bounded by
    the request's keys, :func:`_request_frame`)."""
    mc, fmt = u.mc, u.fmt
    Q, K, V = (mc.cast(_padded(x, n), fmt) for x, n in zip(qkv, (dims[0], dims[0], dims[1])))
    dv = out.shape[-1]
    for i in range(len(cq) - 1):
        if cq[i + 1] == cq[i]:
            continue
        rows, keys = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        ru = u if descales is None else _Fp8Units(u, *(None if x is None else x[i] for x in descales),
                                                  two_level=two_level)
        wide, lse[:, rows] = _request(ru, Q[rows], K[keys], V[keys], causal=causal, splits=counts[i],
                                      block_m=tile[0], block_n=tile[1], local=local)
        w = min(dv, wide.shape[-1])
        out[rows, :, :w] = wide[..., :w]


class _Fp8Units(_Units):
    """The FP8 kernel's constants for one request, per KV head (arrays (h_k, 1)): ``softmax_scale_log2 *=
    q_descale * k_descale`` (flash_fwd_kernel_sm90.h:426-431) and the final scale ``v_descale``
    (mainloop_fwd_sm90_tma_gmma_ws.hpp:1329)."""

    def __init__(self, u: _Units, qd: np.ndarray | None, kd: np.ndarray | None, vd: np.ndarray | None, *,
                 two_level: bool = True):
        self.__dict__.update(u.__dict__)
        self.two_level = two_level  # vLLM's fork; off: FLASHATTENTION_DISABLE_FP8_TWO_LEVEL_ACCUMULATION, SGLang's
        mc = u.mc
        if qd is not None or kd is not None:
            qk = mc.mul(1 if qd is None else qd, 1 if kd is None else kd)  # FMUL.FTZ, each
            if u.softcap is None:
                self.c = mc.mul(u.c, qk)[:, None]
                self.c_ln2 = mc.mul(self.c, self.ln2)
            else:  # with a softcap the descales scale the scores before tanh (mainloop:1108-1113), not c
                self.softcap = mc.mul(u.softcap, qk)[:, None]
        self.final = None if vd is None else mc.ftz(mc.f(vd))[:, None]  # read by FMUL.FTZ (finalize)


def _request(u: _Units, Q: np.ndarray, K: np.ndarray, V: np.ndarray, *, causal: bool, splits: int, block_m: int,
             block_n: int, local: tuple[int, int, bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One request: Q (n_q, h, d), K (n_k, h_k, d), V (n_k, h_k, dv) -> out (n_q, h, dv), lse (h, n_q). The kernel's
    unit of work is a KV head's rows (position, query head of its group), packed as a varlen launch packs grouped
    heads; with one query head a KV head (the MHA form) these are the head's positions, as the unpacked kernel
    lays them out. With a local window (left, right) query s sees keys ``n_k - n_q + s - left`` to ``... + right``,
    and an m-block's key blocks start at the first key its first row sees (block.h:24-49's ``n_offset``), not at
    a multiple of kBlockN; the blocks the mainloop leaves unmasked are :func:`_unmasked`'s."""
    nq, H, d = Q.shape
    nk, Hk, dv = V.shape
    qpk = H // Hk
    Qu = Q.reshape(nq, Hk, qpk, d).transpose(1, 0, 2, 3).reshape(Hk, nq * qpk, d)
    pos = np.repeat(np.arange(nq), qpk)
    Ku, Vu = K.transpose(1, 0, 2), V.transpose(1, 0, 2)
    R = Qu.shape[1]
    left, right, request_frame = local if local is not None else (None, 0, True)
    limit = (nk - nq + pos + right) if causal or local else np.full(R, nk - 1)  # the last key each row sees
    first = None if local is None else nk - nq + pos - left  # the first, with a window
    O = np.zeros((Hk, R, dv), u.dt)
    L = np.full((Hk, R), -np.inf, u.dt)
    for m in range(-(-R // block_m)):
        r = slice(m * block_m, min(R, (m + 1) * block_m))
        off = 0 if local is None else _n_offset(m, block_m, qpk, nq, nk, left)
        end = -(-(nk - off) // block_n)
        if causal or local:  # block.h:35-49: the window of the m-block's last row, counted past the request's end
            m_idx_max = ((m + 1) * block_m - 1) // qpk + 1
            end = min(end, max(0, -(-(m_idx_max + nk - off - nq + right) // block_n)))
        lo_key = None if first is None else first[r] - off
        frame = nk if request_frame else nk - off
        bare = None if local is None else _unmasked(m, block_m, qpk, nq, frame, left, right, block_n)
        res = [_split(u, Qu[:, r], Ku[:, off:], Vu[:, off:], nk - off, lo, hi, limit[r] - off, block_n, lo_key, bare)
               for lo, hi in split_blocks(end, splits)]
        if len(res) == 1:
            O[:, r], L[:, r] = res[0]
        else:
            o, ll = _combine(u, [(o.reshape(-1, dv), ll.reshape(-1)) for o, ll in res])
            O[:, r], L[:, r] = o.reshape(Hk, -1, dv), ll.reshape(Hk, -1)
    return (O.reshape(Hk, nq, qpk, dv).transpose(1, 0, 2, 3).reshape(nq, H, dv),
            L.reshape(Hk, nq, qpk).transpose(0, 2, 1).reshape(H, nq))


def _request_frame(d: int, dv: int, element_size: int, build: str = "vllm") -> bool:
    """Whether the local mainloop's unmasked blocks are bounded by the request's keys rather than the m-block's
    (:func:`_unmasked`): in the fork's kernels with intra-warpgroup overlap (``tot_seqlen_k``,
    mainloop_fwd_sm90_tma_gmma_ws.hpp:1283-1314; tile_size.h: not at 64 / 256, 64 / 512 or a 16-bit 64); never in
    SGLang's (sgl-flash-attn cb303cf mainloop_fwd_sm90_tma_gmma_ws.hpp:1075, ``seqlen_k - n_offset``)."""
    return build == "vllm" and not (d == 64 and (dv > 64 or element_size == 2))


def _n_offset(m: int, block_m: int, qpk: int, nq: int, nk: int, left: int) -> int:
    """A local window's ``n_offset`` (block.h:24-33): m-block `m`'s first row's first key, where its key blocks
    start."""
    return max(0, (m * block_m) // qpk + nk - nq - left)


def _unmasked(m: int, block_m: int, qpk: int, nq: int, frame: int, left: int, right: int,
              block_n: int) -> tuple[int, int]:
    """The key blocks [from, to) of m-block `m` that a local window's mainloop runs without a mask
    (mainloop_fwd_sm90_tma_gmma_ws.hpp:1283-1314): past the blocks masked for the right edge,
    ``(m_idx_min + seqlen_k - seqlen_q + right) / kBlockN``, and before those masked for the left edge,
    ``ceil_div(m_idx_max + seqlen_k - seqlen_q - left, kBlockN)``, in C's integer division. The blocks count from
    the m-block's first key (``n_offset``), and the fork's kernels with intra-warpgroup overlap take ``seqlen_k``
    as the request's (`frame`), not less the offset: there such a block can hold keys outside some rows' windows, which
    the kernel then reads. The first block (the last walked from) is always masked."""
    m_idx_min = (m * block_m) // qpk
    m_idx_max = ((m + 1) * block_m - 1) // qpk + 1
    return _c_div(m_idx_max + frame - nq - left + block_n - 1, block_n), _c_div(m_idx_min + frame - nq + right,
                                                                                block_n)


def _c_div(a: int, b: int) -> int:
    """C's integer division (toward zero)."""
    return a // b if a >= 0 else -(-a // b)


def _scores(u: _Units, Q: np.ndarray, K: np.ndarray, V: np.ndarray, nk: int, lo: int, hi: int,
            block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """A split's ``S = Q K^T`` over its key blocks [lo, hi) (each block its own zero-initialised product; keys past
    the request read as 0) and its V rows: (S (U, R, n), V (U, n, dv))."""
    mc = u.mc
    U, R, _ = Q.shape
    keys = np.arange(lo * block_n, hi * block_n)
    inside = keys < nk
    Ks = np.where(inside[None, :, None], K[:, np.minimum(keys, nk - 1)], 0).astype(K.dtype)
    Vs = np.where(inside[None, :, None], V[:, np.minimum(keys, nk - 1)], 0).astype(V.dtype)
    Qm = mc.operand(Q)
    Ss = mc.f(mc.by_blocks(lambda kt: mc.matmul(Qm, mc.operand(kt)), np.ascontiguousarray(Ks.transpose(0, 2, 1)),
                           rows=U * R, block=block_n))
    return u.capped(Ss), Vs  # before the mask


def _masked(u: _Units, Ss: np.ndarray, nk: int, lo: int, blk: int, limit: np.ndarray, block_n: int,
            first: np.ndarray | None = None) -> np.ndarray:
    """Key block `blk`'s scores, -inf past the request, past each row's last key and before its `first`."""
    cols = slice((blk - lo) * block_n, (blk - lo + 1) * block_n)
    t = blk * block_n + np.arange(block_n)
    seen = (t[None, :] < nk) & (t[None, :] <= limit[:, None])
    if first is not None:
        seen &= t[None, :] >= first[:, None]
    return np.where(seen, Ss[..., cols], -np.inf).astype(u.dt)


def _split(u: _Units, Q: np.ndarray, K: np.ndarray, V: np.ndarray, nk: int, lo: int, hi: int, limit: np.ndarray,
           block_n: int, first: np.ndarray | None = None,
           bare: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One split of an m-block, Q (U, R, d), over key blocks [lo, hi), walked from hi - 1 down with intra-warpgroup
    overlap: (O normalised (U, R, dv), lse (U, R)). Each block's ``P V`` goes onto O before the next block's
    softmax, which then rescales O: ``O = fl(acc(O, P V) s')``, the last block's product added before the end.
    (``RescaleOBeforeGemm``, on for 16-bit inputs of head dims over 128, issues the rescale before the product
    instead, ``acc(fl(O s'), P' V')``, and so do the kernels without the overlap, 64 / 256 and 64 / 512: the same
    roundings in the same order.) For FP8 (:class:`_Fp8Units`) ``P`` is offset by 8 and rounded to E4M3
    (satfinite), and in vLLM's fork each product is a product of its own added to O in FP32 (the two-level
    accumulation, utils.h:238-325); otherwise O is the products' accumulator."""
    mc, dt = u.mc, u.dt
    U, R, _ = Q.shape
    dv = V.shape[-1]
    if hi <= lo:
        return np.zeros((U, R, dv), dt), np.full((U, R), -np.inf, dt)
    fp8 = isinstance(u, _Fp8Units)
    Ss, Vs = _scores(u, Q, K, V, nk, lo, hi, block_n)
    O = np.zeros((U, R, dv), dt)
    M = np.full((U, R), -np.inf, dt)
    part = Pq = Vprev = None
    for step, blk in enumerate(range(hi - 1, lo - 1, -1)):
        if bare is not None and step and max(lo, bare[0]) <= blk < max(lo, bare[1]):  # the mainloop's no_mask_fn
            S = Ss[..., (blk - lo) * block_n:(blk - lo + 1) * block_n].astype(dt)
        else:
            S = _masked(u, Ss, nk, lo, blk, limit, block_n, first)
        if step:
            O = _accumulate(u, O, Pq, Vprev)
        M, s, P = _softmax_step(u, S, M, first=step == 0, offset=FP8_MAX_OFFSET if fp8 else 0)
        part = lane_sums(mc, None if step == 0 else part, s, P)
        Pq = mc.operand(mc.cast(P, "e4m3", overflow="satfinite") if fp8 else mc.cast(P, u.fmt))
        Vprev = mc.operand(Vs[:, (blk - lo) * block_n:(blk - lo + 1) * block_n])
        if step:
            O = mc.mul(O, s[..., None])
    O = _accumulate(u, O, Pq, Vprev)
    if not fp8:
        return _finish(u, O, M, quad_total(mc, part))
    return _finish(u, O, M, quad_total(mc, part), sum_scale=2.0 ** -FP8_MAX_OFFSET, final=u.final)


def _accumulate(u: _Units, O: np.ndarray, P: np.ndarray, V: np.ndarray) -> np.ndarray:
    """``flash::gemm<zero_init=false>`` of ``P V`` onto O (utils.h:235-325): for FP8 with the two-level
    accumulation, a product from a cleared accumulator added to O in FP32; otherwise O itself the product's
    accumulator."""
    if isinstance(u, _Fp8Units) and u.two_level:
        return u.mc.f(O + u.mc.matmul(P, V))
    return u.mc.matmul(P, V, O)


def _softmax_step(u: _Units, S: np.ndarray, M: np.ndarray, *, first: bool,
                  offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``max_get_scale`` and ``online_softmax``'s exponentials (softmax.h:64-131): the new max, the rescale ``s``
    (1 on the first block) and ``P = exp2(fma(S, c, -max_scaled))``, ``max_scaled = fma(M, c, -offset)`` (0 where
    M is -inf)."""
    mc, dt = u.mc, u.dt
    c = u.c
    M_new = S.max(axis=-1) if first else np.maximum(M, S.max(axis=-1))
    if first:
        s = np.ones(M_new.shape, dt)
    else:
        cur = np.where(np.isneginf(M_new), 0, M_new).astype(dt)
        s = mc.exp2(mc.f(mc.f(M - cur) * c))
    max_scaled = np.where(np.isneginf(M_new), 0, mc.mul_add(M_new, c, dt.type(-offset))).astype(dt)
    P = mc.exp2(mc.mul_add(S, c if np.ndim(c) == 0 else c[..., None], -max_scaled[..., None]))
    return M_new, s, P


def _finish(u: _Units, O: np.ndarray, M: np.ndarray, Lsum: np.ndarray, *, sum_scale: float = 1.0,
            final: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``finalize`` (softmax.h:136-152) and ``rescale_o``: ``O fl(rcp(L) final)`` and the LSE from ``L
    sum_scale`` (2^-8 for FP8's offset)."""
    mc, dt = u.mc, u.dt
    empty = (Lsum == 0) | np.isnan(Lsum)
    inv = np.where(empty, 0, mc.div(mc.f(1), Lsum)).astype(dt)
    if final is not None:
        inv = mc.mul(inv, final)
    lse = np.where(empty, -np.inf, _split_lse(u, M, mc.f(Lsum * dt.type(sum_scale)))).astype(dt)
    return mc.mul(O, inv[..., None]), lse


def _check_build(build: str) -> None:
    """A build the model follows (:data:`PREFILL_BUILDS`)."""
    if build not in PREFILL_BUILDS:
        raise ValueError(f"build: expected one of {', '.join(PREFILL_BUILDS)}, got {build!r}")


def _check_splits(splits: npt.ArrayLike, batch: int) -> list[int]:
    """A what-if split count a request."""
    counts = [check_int(n, "splits", lo=1, hi=256) for n in np.asarray(splits).ravel().tolist()]
    if len(counts) != batch:
        raise ValueError(f"splits: one split count a request ({batch}), got {len(counts)}")
    return counts


def _check_descale(x: npt.ArrayLike | None, name: str, shape: tuple[int, int]) -> np.ndarray | None:
    """An FP8 descale: (batch, h_k) FP32 (``CHECK_SHAPE``, flash_api.cpp:1203-1232), or None."""
    if x is None:
        return None
    a = np.asarray(x)
    if a.shape != shape or a.dtype.kind != "f":
        raise ValueError(f"{name}: expected a float array of shape (batch, h_k) = {shape}, got {a.dtype} {a.shape}")
    return a.astype(np.float32)


def _check_inputs(q, k, v, cu_q, cu_k):
    """The call's tensors, or an error naming the argument."""
    arrs = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        a = np.asarray(x)
        fmt = get_format(a.dtype).name if a.dtype.kind in "fV" else None
        if fmt not in _FORMATS:  # mha_fwd: "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type"
            raise ValueError(f"{name}: FA3 takes BF16, FP16 or FP8 E4M3, got {a.dtype}")
        if a.ndim != 3 or min(a.shape[1:]) < 1 or (name == "q" and a.shape[0] < 1):
            raise ValueError(f"{name}: expected shape (tokens, heads, head dim), got {a.shape}")
        arrs.append(a)
    qa, ka, va = arrs
    if ka.dtype != qa.dtype or va.dtype != qa.dtype:
        raise ValueError(f"k, v: the same format as q ({qa.dtype}), got {ka.dtype} and {va.dtype}")
    if ka.shape[2] != qa.shape[2] or va.shape[:2] != ka.shape[:2]:
        raise ValueError(f"k, v: k (T_k, h_k, {qa.shape[2]}) and v (T_k, h_k, dv), got {ka.shape} and {va.shape}")
    if qa.shape[1] % ka.shape[1]:
        raise ValueError(f"k: its heads ({ka.shape[1]}) must divide q's ({qa.shape[1]})")
    kernel_dims(qa.shape[2], va.shape[2], 1 if get_format(qa.dtype).name == "e4m3" else 2)
    cus = []
    for name, cu, total in (("cu_seqlens_q", cu_q, qa.shape[0]), ("cu_seqlens_k", cu_k, ka.shape[0])):
        c = np.asarray(cu)
        if c.ndim != 1 or c.size < 2 or c.dtype.kind not in "iu":
            raise ValueError(f"{name}: expected a 1-D int array of batch + 1 offsets, got {c!r}"[:200])
        c = c.astype(np.int64)
        if c[0] < 0 or (np.diff(c) < 0).any() or c[-1] > total:
            raise ValueError(f"{name}: offsets must rise from 0 or more to at most {total}, got {c.tolist()}"[:200])
        cus.append(c)
    if cus[0].size != cus[1].size:
        raise ValueError(f"cu_seqlens_k: {cus[1].size} offsets for {cus[0].size - 1} requests")
    return qa, ka, va, cus[0], cus[1]


def _check_max(value: int | None, name: str, longest: int) -> int:
    """A call's max_seqlen: at least the longest request (the kernel's grid and bound are cut to it)."""
    return longest if value is None else check_int(value, name, lo=longest)
