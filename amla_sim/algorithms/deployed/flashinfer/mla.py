"""FlashInfer's sm90 MLA decode (``BatchMLAPagedAttentionWrapper``, backend ``fa3``: what ``backend="auto"``
runs on Hopper, SGLang's ``flashinfer`` MLA backend), written against a machine.

Upstream: flashinfer-python 0.7.2, ``include/flashinfer/attention/mla_hopper.cuh`` (the kernel), ``mla.cuh``
(``StandardAttention``, ``finalize_m_``, ``DevicePersistentMergeStates``), ``state.cuh`` (``state_t``),
``math.cuh`` (``ptx_exp2``, ``ptx_log2``, ``ptx_rcp``), ``vec_dtypes.cuh`` (the FP8 dequant); the plan is
:mod:`amla_sim.algorithms.deployed.flashinfer.scheduler`. Built with ``-use_fast_math -O3`` for sm_90a; the
contractions below were read off the PTX nvcc 13.0 makes of the kernel.

A work item is one query tile of a request (64 packed rows a CTA, one or two CTAs) and one KV chunk [lo, hi);
its 64-key tiles, which start at lo, are walked from the last. With ``c = fl(fl32(scale) * fl32(log2 e))``
(``sm_scale_log2``, an FP32 product) and the running max ``m`` of the raw scores:

- ``S = Q_pe K_pe^T`` then ``+= Q_nope CKV^T``, one FP32 accumulator (wgmma m64n64k16, 4 + 32 steps); keys past
  hi, or after the row's query when causal, get -inf;
- ``m' = max(m, rowmax S)``, ``ms = max(fl(m' c), -FLT_MAX)``; ``o_scale = ex2(fma(m, c, -ms))`` (0 on the first
  tile; *not* 1 when the max stays, but 2 to the rounding error of ``fl(m c)``); ``P = ex2(fma(S, c, -ms))``;
- each of a row's four lanes sums its pairs of columns ``(8k + 2t, 8k + 2t + 1)`` in k order, and
  ``d = fma(d, o_scale, that)`` (d starts at 1, so the first tile gives the sum);
- P rounded to the input format, ``O = fl(O o_scale) + P V`` on the tensor cores (4 k16 steps, O from 0).

At the end the lanes meet, ``(d0 + d2) + (d1 + d3)``; ``O = fl(O rcp(d))`` (0 where m is -inf) and ``lse =
lg2(d) + fl(m c)``, base 2 (-inf where m is -inf). A tile of one chunk writes O in the input format and its LSE
(``return_lse_base_on_e``: ``fl(lse ln 2)``). A split tile writes every chunk's O *in the input format* (BF16
partials) with its FP32 LSE, and the merge, per row over the chunks in order from ``m = -inf, d = 1, o = 0``:
``m' = max(m, lse_k)``, ``f1 = ex2(max(m - m', -inf))``, ``f2 = ex2(max(lse_k - m', -inf))``, ``d = fma(d, f1,
f2)``, ``o = fma(f1, o, fl(f2 o_k))``; then ``o = fl(o rcp(d))`` (0 where d is 0) and ``lse = m + lg2(d)``.
``ex2``, ``lg2`` and ``rcp`` are MUFU's ``.approx.ftz``, and every FP32 multiply, FMA and division flushes subnormal
operands and results to zeros of their sign (``-ftz=true``, :meth:`~amla_sim.machines.Machine.mul`): a latent cache
scale of 2^-120 or a cache near 1e-38 makes subnormal partial outputs, which ``O * o_scale`` and ``O * rcp(d)`` write
as 0.

An E4M3 cache (BF16 q) is dequantised to BF16 before every product: ``bf16(e4m3 * bf16(scale))`` with
``ckv_scale`` for the 512 latent columns (also V) and ``kpe_scale`` for the 64 rope columns; with
``ckv_scale_arr`` (FP32 per token and 128 columns) ``bf16(fl(e4m3 * s))``.

``head_dim_kpe = 0`` (NoPE MLA, q and kv 512 wide: vLLM's ``FLASHINFER_MLA_SPARSE_SM90`` for GLM-5.3-Flash) is
the instantiation ``<512, 0>``: no rope steps, ``S`` is the 32 latent k16 steps alone, the first from 0
(``compute_mla_qk`` :489-505), and only the latent columns are dequantised (:414). vLLM's sparse call makes every
query token a request of one query whose keys are its top-k slots (page size 1, not causal), pads the plan's batch
to ``max_num_batched_tokens`` rows with empty ones (``pad_rows``: they move the cluster size, the batch's mean
packed length) and, planning from upper bounds, clamps each work item's ``kv_end`` to the row's valid count on the
device (``plan_seqlens``).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....formats import get_format
from ....machines import Machine, get_machine
from ....schedules import Schedule
from ..._common import D_K, D_V, AttentionResult, check_kernel_inputs, check_kernel_layout
from ..fast_math import ln2
from ..row_sums import quad_total as _row_total
from ..scalars import api_float, scale_log2_f32, softmax_scale
from ..sglang.fp4_cache import through_fp4_pool
from .scheduler import CTA_TILE_KV, FlashInferPlan, TileWork, flashinfer_mla_plan

__all__ = ["flashinfer_mla", "flashinfer_mla_decode", "FLASHINFER_VERSION"]

#: The flashinfer-python release the model follows.
FLASHINFER_VERSION = "0.7.2"
_FLT_MAX = float(np.finfo(np.float32).max)
_KERNEL = "FlashInfer's MLA decode"
#: The caches :func:`flashinfer_mla_decode` keeps (SGLang's ``--kv-cache-dtype`` on its ``flashinfer`` backend).
KV_CACHES = ("bf16", "fp4_mx_block16")


class _Units:
    """The machine's operations and the kernel's constants."""

    def __init__(self, mc: Machine, fmt: str, scale: np.float32):
        self.mc = mc
        self.dt = mc.dtype
        self.fmt = fmt
        self.c = _scale_log2(mc, scale)
        self.loge2 = ln2(mc)  # math::loge2 = 0.693147180559945309417f (math.cuh:32)
        self.neg_max = mc.f(-_FLT_MAX)


def _scale_log2(mc: Machine, scale: np.float32) -> np.ndarray:
    """``sm_scale_log2 = params.sm_scale * math::log2e`` (mla.cuh:44): an FP32 product of the float scale on the
    device, where the FTZ multiply reads a subnormal scale as 0 (and flushes a subnormal product)."""
    return mc.ftz(scale_log2_f32(mc, mc.ftz(scale)))


@quiet_fp
def flashinfer_mla(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seqlens: npt.ArrayLike | None = None,
    scale: float | None = None,
    causal: bool = False,
    page_size: int = 1,
    ckv_scale: float | None = None,
    kpe_scale: float | None = None,
    ckv_scale_arr: npt.ArrayLike | None = None,
    return_lse_base_on_e: bool = False,
    num_sms: int = 132,
    machine: str | Machine = "sm90-cuda",
    trace: bool = False,
    kv_len_limit: int | None = None,
    pad_rows: int = 0,
    plan_seqlens: npt.ArrayLike | None = None,
) -> AttentionResult:
    """FlashInfer 0.7.2's sm90 MLA kernel on `machine` (see the module docstring).

    q: (b, s_q, h, 576) BF16 or FP16 (q_nope the first 512 columns, q_pe the last 64); kv: (b, S_max, 576), the
    format of q, or E4M3 with a BF16 q (``kv_data_type=float8_e4m3fn``, ``scale_mode="kv-per-tensor"``: then
    ``kpe_scale`` and one of ``ckv_scale`` / ``ckv_scale_arr`` (b, S_max, 4) FP32); request i's keys are
    ``kv[i, :seqlens[i]]`` (0 keys: out 0, LSE -inf). causal: the plan's mask (bottom-right; SGLang passes it
    for its multi-token steps). page_size: the cache's page (it moves the data, not the bits). num_sms: the
    device's SM count (132 on an H100 SXM and an H200), which the plan splits the KV over.

    kv_len_limit: the plan's chunk length, in place of the one the batch's KV gives (None, the kernel's):
    :func:`~.scheduler.flashinfer_mla_plan`'s argument. A request's bits depend on its batchmates only through
    it (rows of different requests never meet), so a request run alone with its batch's chunk length gives its
    bits in that batch; the invariance study runs it so.

    q and kv may both be 512 wide (``head_dim_kpe = 0``, no q_pe / kpe: the ``<512, 0>`` kernel; ``kpe_scale`` is
    still required with an E4M3 cache, as the wrapper requires it, and unused). pad_rows: empty requests (0
    queries, 0 keys) appended to the plan's batch, as vLLM's sparse backend plans ``max_num_batched_tokens`` rows
    (``flashinfer_mla_sparse_sm90.py:355-359``): they change the cluster size only. plan_seqlens: (b,) the lengths
    the plan is made from (>= seqlens; vLLM's sync-free upper bounds, :337-339), each work item's kv_end then
    clamped to ``max(min(kv_end, seqlens[i]), kv_start)`` (``_clamp_work_kv_end`` :112-143); not with causal.

    Returns ``.out`` (b, s_q, h, 512) in q's format (float64 on golden) and ``.lse`` (b * s_q, h) as the wrapper
    returns it: base 2, natural with `return_lse_base_on_e`; with `trace`, the plan's 18 MLAPlanInfo values
    (``plan``, int64, as the wrapper's plan returns them) and the whole plan (``mla_plan``: work lists, tiles).
    """
    mc = get_machine(machine)
    mc.require(kernel=_KERNEL, suggest="sm90-cuda", log2=True)
    qa, kva, lens = _check_inputs(q, kv, seqlens)
    fmt, kv_fmt = get_format(qa.dtype).name, get_format(kva.dtype).name
    if kv_fmt != fmt and not (kv_fmt == "e4m3" and fmt == "bf16"):
        raise TypeError(f"kv: the kernel takes a cache of q's format ({fmt.upper()}) or E4M3 with a BF16 q, got "
                        f"{kv_fmt.upper()}")
    scales = _kv_scales(kv_fmt, kva.shape, ckv_scale, kpe_scale, ckv_scale_arr)
    sm = softmax_scale(scale)
    for name, v in (("causal", causal), ("return_lse_base_on_e", return_lse_base_on_e), ("trace", trace)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name}: expected True or False, got {v!r}")
    b, s_q, H, d_k = qa.shape
    lens = [int(n) for n in lens]
    plan = _plan(lens, s_q, H, bool(causal), num_sms=num_sms, page_size=page_size, kv_len_limit=kv_len_limit,
                 pad_rows=pad_rows, plan_seqlens=plan_seqlens)
    u = _Units(mc, fmt, sm)
    Q = mc.cast(qa, fmt).reshape(b, s_q * H, d_k)
    out = np.zeros((b, s_q * H, D_V), mc.dtype)
    lse = np.full((b, s_q * H), -np.inf, mc.dtype)
    K, at = None, -1
    for tile in plan.tiles:  # a request's tiles are consecutive
        i = tile.request
        if i != at:
            K, at = _keys(u, kva[i, :lens[i]], scales, i), i
        rows = slice(tile.row_start, tile.row_stop)
        out[i, rows], lse[i, rows] = _tile(u, plan, tile, Q[i, rows], K, lens[i], s_q, H, bool(causal))
    if return_lse_base_on_e:
        lse = mc.f(lse * u.loge2)  # final_lse *= math::loge2 (mla_hopper.cuh:755-757, mla.cuh:807-809)
    hazards: Counter = Counter()
    if np.isnan(out).any():
        hazards["nan_outputs"] += int(np.isnan(out).sum())
    res = mc.cast(out, fmt).reshape(b, s_q, H, D_V)
    tr = {"plan": np.asarray(plan.info, np.int64), "mla_plan": [plan]} if trace else {}
    return AttentionResult(res, np.ascontiguousarray(lse.reshape(b * s_q, H)), tr, hazards)


def _check_inputs(q: npt.ArrayLike, kv: npt.ArrayLike, seqlens: npt.ArrayLike | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`check_kernel_inputs` for 576-wide q and kv (head_dim_kpe 64) or 512-wide ones (head_dim_kpe 0)."""
    return check_kernel_inputs(q, kv, seqlens, formats=("bf16", "fp16"), kv_formats=("bf16", "fp16", "e4m3"),
                               empty=True, widths=(D_K, D_V))


def _plan(lens: list[int], s_q: int, H: int, causal: bool, *, num_sms: int, page_size: int,
          kv_len_limit: int | None, pad_rows: int, plan_seqlens: npt.ArrayLike | None) -> FlashInferPlan:
    """The wrapper's plan of the call: the requests' lengths (or vLLM's upper bounds), then `pad_rows` empty
    requests."""
    pads = check_int(pad_rows, "pad_rows", lo=0)
    planned = _plan_lengths(plan_seqlens, lens, causal)
    return flashinfer_mla_plan(planned, heads=H, q_lens=s_q, causal=causal, num_sms=num_sms, page_size=page_size,
                               kv_len_limit=kv_len_limit, empty_requests=pads)


def _plan_lengths(plan_seqlens: npt.ArrayLike | None, lens: list[int], causal: bool) -> list[int]:
    """The lengths the plan is made from: the keys (None), or vLLM's upper bounds (at least the keys)."""
    if plan_seqlens is None:
        return lens
    p = np.asarray(plan_seqlens)
    if causal or p.dtype.kind not in "iu" or p.shape != (len(lens),) or (p < np.asarray(lens)).any() \
            or min(lens) < 1:
        raise ValueError(f"plan_seqlens: expected {len(lens)} ints >= seqlens >= 1 (not causal), got "
                         f"{plan_seqlens!r}")
    return [int(n) for n in p]


def _kv_scales(kv_fmt: str, shape: tuple[int, ...], ckv_scale: object, kpe_scale: object,
               ckv_scale_arr: npt.ArrayLike | None) -> tuple[np.float32, np.float32, np.ndarray | None] | None:
    """The FP8 cache's scales as the kernel reads them (float; the array FP32), or an error naming the argument:
    exactly one of ckv_scale / ckv_scale_arr and kpe_scale with an E4M3 cache, none otherwise
    (_fa_common.py:691-724)."""
    given = [n for n, v in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale), ("ckv_scale_arr", ckv_scale_arr))
             if v is not None]
    if kv_fmt != "e4m3":
        if given:
            raise ValueError(f"{given[0]}: only an E4M3 cache takes scales (kv is {kv_fmt.upper()})")
        return None
    if (ckv_scale is None) == (ckv_scale_arr is None):
        raise ValueError("ckv_scale: an E4M3 cache takes exactly one of ckv_scale and ckv_scale_arr")
    if kpe_scale is None:
        raise ValueError("kpe_scale: an E4M3 cache needs kpe_scale")
    arr = None
    if ckv_scale_arr is not None:
        arr = np.asarray(ckv_scale_arr)
        want = (shape[0], shape[1], D_V // 128)
        if arr.dtype != np.float32 or arr.shape != want:
            raise ValueError(f"ckv_scale_arr: expected float32 of shape {want}, got {arr.dtype} {arr.shape}")
    ckv = np.float32(1) if ckv_scale is None else _finite_positive(ckv_scale, "ckv_scale")
    return ckv, _finite_positive(kpe_scale, "kpe_scale"), arr


def _finite_positive(x: object, name: str) -> np.float32:
    """A cache scale as the wrapper takes it: refused unless ``float(x)`` is finite and positive (``_fa_common.py``
    ``run_from_wrapper``: "must be a finite positive value"; checked on the double, so 1e39 passes and is an
    infinity as the kernel's float), then rounded to FP32 (:func:`.scalars.api_float`)."""
    f = api_float(x, name)  # a real number, or a ValueError naming `name`
    try:
        v = float(x)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: must be a finite positive value (FlashInfer's wrapper refuses it), got {x!r}")
    return f


def _keys(u: _Units, kv: np.ndarray, scales: tuple | None, i: int) -> np.ndarray:
    """A request's keys as the tensor cores read them: the cache itself, or an E4M3 cache dequantised to BF16."""
    if scales is None:
        return u.mc.cast(kv, u.fmt)
    ckv, kpe, arr = scales
    return _dequant(u.mc, kv, ckv, kpe, None if arr is None else arr[i, :kv.shape[0]])


def _dequant(mc: Machine, kv: np.ndarray, ckv_scale: np.float32, kpe_scale: np.float32,
             arr: np.ndarray | None) -> np.ndarray:
    """``repack_fp8_kv_to_bf16`` (mla_hopper.cuh:352-439): E4M3 to BF16 exactly (``fast_dequant_f8f16x4``), then
    ``__hmul2`` by the scale rounded to BF16, one rounding (BF16 arithmetic keeps subnormals); with the per-token
    array, an FP32 product (fast math's ``FMUL.FTZ``: a subnormal operand or product is a zero) rounded to BF16."""
    x = mc.f(kv)

    def hmul(part: np.ndarray, scale: np.float32) -> np.ndarray:
        return mc.cast(part * mc.cast(mc.f(scale), "bf16"), "bf16")

    def fmul(part: np.ndarray) -> np.ndarray:
        return mc.cast(mc.mul(part, np.repeat(arr, 128, axis=1)), "bf16")

    nope = hmul(x[:, :D_V], ckv_scale) if arr is None else fmul(x[:, :D_V])
    if x.shape[1] == D_V:  # head_dim_kpe 0: the latent only (repack_fp8_kv_to_bf16's KPE part compiled out, :414)
        return nope
    return np.concatenate([nope, hmul(x[:, D_V:], kpe_scale)], axis=1)


def _tile(u: _Units, plan: FlashInferPlan, tile: TileWork, Q: np.ndarray, K: np.ndarray, seqlen: int, s_q: int,
          H: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """A query tile's rows over its chunks: (O normalised, base-2 lse), merged when the tile is split."""
    q_idx = np.arange(tile.row_start, tile.row_stop) // H
    last = seqlen - s_q + q_idx if causal else np.full(q_idx.shape, seqlen - 1)  # a row's last key
    res = []
    for lo, hi in tile.chunks:
        hi = max(min(hi, seqlen), lo)  # vLLM's kv_end clamp (a no-op when the plan had the keys' lengths)
        # the kernel's own bound: floor((q_start + cluster_tile_q) / heads) (mla_hopper.cuh:1072-1077)
        end = min(hi, seqlen - s_q + (tile.row_start + plan.cluster_tile_q) // H) if causal else hi
        O, m, d = _chunk(u, Q, K, seqlen, lo, hi, end, last)
        res.append((O, _split_lse(u, m, d)))
    if not tile.split:
        return res[0]
    return _merge(u, [(_partial(u, O), L) for O, L in res])


def _partial(u: _Units, O: np.ndarray) -> np.ndarray:
    """A split's O as the merge reads it back: ``partial_o`` is ``DTypeO*`` (batch_mla_sm90_run.cu:96-97), so the
    partials are rounded to the output format (``write_o`` :677-684), and read back exactly (``cast_load``)."""
    return u.mc.f(u.mc.cast(O, u.fmt))


def _chunk(u: _Units, Q: np.ndarray, K: np.ndarray, seqlen: int, lo: int, hi: int, end: int,
           last: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One work item: keys [lo, hi), tiles of 64 from lo, ``ceil(end / 64) - lo / 64`` of them walked from the
    last (mla_hopper.cuh:1062-1242). Returns O normalised (FP32), the raw max m and the row sum d."""
    mc, dt = u.mc, u.dt
    R = Q.shape[0]
    tiles = max(-(-end // CTA_TILE_KV) - lo // CTA_TILE_KV, 0)
    m = np.full(R, -np.inf, dt)
    lanes = np.ones((R, 4), dt)  # init_states_: d = 1.f in every lane
    O = np.zeros((R, D_V), dt)
    if tiles:
        t = lo + np.arange(tiles * CTA_TILE_KV)
        Ks = np.where((t < seqlen)[:, None], K[np.minimum(t, seqlen - 1)], 0).astype(K.dtype)
        valid = (t[None, :] < hi) & (t[None, :] <= last[:, None])  # logits_mask_ (:551-573)
        S_all = _scores(u, Q, Ks)
        Vs = mc.operand(Ks[:, :D_V])
    for j in range(tiles - 1, -1, -1):
        cols = slice(j * CTA_TILE_KV, (j + 1) * CTA_TILE_KV)
        S = np.where(valid[:, cols], S_all[:, cols], -np.inf).astype(dt)
        m_prev, m = m, np.fmax(m, S.max(axis=1))
        ms = np.fmax(mc.f(m * u.c), u.neg_max)  # update_md_ (:609)
        o_scale = _o_scale(u, m_prev, m, ms)
        P = mc.exp2(mc.mul_add(S, u.c, -ms[:, None]))
        lanes = _lane_sums(mc, lanes, o_scale, P)
        O = mc.matmul(mc.operand(mc.cast(P, u.fmt)), Vs[cols], _rescale(mc, O, o_scale))
    d = _row_total(mc, lanes)
    inv = np.where(np.isneginf(m), 0, mc.div(mc.f(1), d)).astype(dt)  # normalize_d_ (:641-655)
    return mc.mul(O, inv[:, None]), m, d


def _rescale(mc: Machine, O: np.ndarray, o_scale: np.ndarray) -> np.ndarray:
    """``rescale_o_`` (mla_hopper.cuh:576-583): ``o_frag *= o_scale``, ``mul.ftz``: a subnormal running output is read
    as 0, a subnormal product written as 0."""
    return mc.mul(O, o_scale[:, None])


def _o_scale(u: _Units, m_prev: np.ndarray, m: np.ndarray, ms: np.ndarray) -> np.ndarray:
    """``ptx_exp2(m_prev * sm_scale - m_scaled)`` (:610), the multiply contracted: 0 on the first tile, and 2 to
    the rounding error of ``fl(m c)`` where the max stays."""
    return u.mc.exp2(u.mc.mul_add(m_prev, u.c, -ms))


def _scores(u: _Units, Q: np.ndarray, Ks: np.ndarray) -> np.ndarray:
    """``compute_mla_qk`` (:441-509): Q_pe K_pe^T (4 k16 steps, from 0) then Q_nope CKV^T (32 steps) in one
    accumulator, every 64-key tile at once (:meth:`Machine.by_blocks`)."""
    mc = u.mc
    KT = np.ascontiguousarray(Ks.T)
    Qm = mc.operand(Q)

    def product(kt: np.ndarray) -> np.ndarray:
        kt = mc.operand(kt)
        if kt.shape[0] == D_V:  # head_dim_kpe 0: the 32 latent steps, the first with init (:489-505)
            return mc.matmul(Qm, kt)
        return mc.matmul(Qm[:, :D_V], kt[:D_V], mc.matmul(Qm[:, D_V:], kt[D_V:]))

    return mc.f(mc.by_blocks(product, KT, rows=Q.shape[0], block=CTA_TILE_KV))


def _lane_sums(mc: Machine, lanes: np.ndarray, s: np.ndarray, P: np.ndarray) -> np.ndarray:
    """``update_md_`` (:611-619): lane t adds its pairs ``P[8k + 2t] + P[8k + 2t + 1]`` for k in order (from 0),
    then ``d = fma(d, o_scale, that)``. lanes (R, 4) -> (R, 4)."""
    Pl = P.reshape(P.shape[0], 8, 4, 2)  # column 8k + 2t + e -> (k, t, e)
    local = mc.f(Pl[:, 0, :, 0] + Pl[:, 0, :, 1])
    for k in range(1, 8):
        local = mc.f(local + mc.f(Pl[:, k, :, 0] + Pl[:, k, :, 1]))
    return mc.mul_add(lanes, s[:, None], local)


def _split_lse(u: _Units, m: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``finalize_m_`` then ``write_o`` (mla.cuh:750-761, mla_hopper.cuh:715-716): ``lg2(d) + fl(m c)``, base 2;
    -inf where m is -inf (the multiply sits behind a select: no contraction)."""
    mc = u.mc
    return np.where(np.isneginf(m), -np.inf, mc.f(mc.log2(d) + mc.f(m * u.c))).astype(u.dt)


def _merge(u: _Units, parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """``DevicePersistentMergeStates`` over a row's chunks in order (mla.cuh:763-814, state.cuh:37-83)."""
    mc, dt = u.mc, u.dt
    R = parts[0][1].shape[0]
    m = np.full(R, -np.inf, dt)
    d = np.ones(R, dt)
    o = np.zeros((R, D_V), dt)
    for O_k, lse_k in parts:
        m_prev, m = m, np.fmax(m, lse_k)
        f1 = mc.exp2(np.fmax(mc.f(m_prev - m), -np.inf))  # max() drops the NaN of -inf - -inf
        f2 = mc.exp2(np.fmax(mc.f(lse_k - m), -np.inf))
        d = mc.mul_add(d, f1, f2)  # d_prev * f1 + 1 * f2
        o = _merge_o(mc, o, f1, O_k, f2)
    inv = np.where(d > 0, mc.div(mc.f(1), d), 0).astype(dt)  # __fdividef(1.f, d)
    return mc.mul(o, inv[:, None]), _merge_lse(mc, m, d)


def _merge_o(mc: Machine, o: np.ndarray, f1: np.ndarray, O_k: np.ndarray, f2: np.ndarray) -> np.ndarray:
    """``o * f1 + other_o * f2``: the PTX fuses ``o * f1`` (``fma.rn.ftz(f1, o, fl(f2 o_k))``)."""
    return mc.mul_add(o, f1[:, None], mc.mul(O_k, f2[:, None]))


def _merge_lse(mc: Machine, m: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``state_t::get_lse``: ``m + lg2(d)``, base 2."""
    return mc.f(m + mc.log2(d))


def flashinfer_mla_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "sm90-cuda",
    schedule: str | Schedule = "reference",
    block: int = CTA_TILE_KV,
    scale: float | None = None,
    num_sms: int = 132,
    kv_cache: str = "bf16",
    trace: bool = False,
) -> AttentionResult:
    """:func:`flashinfer_mla` as the papers' algorithms are called (``run``, ``reproduce``, ``sweep``): every
    request the whole of kv, causal when s_q > 1 (as SGLang plans its multi-token steps), the LSE natural
    (``return_lse_base_on_e``) as (b, s_q, h). The kernel lays its work out itself: `block` must be its 64 and
    `schedule` is checked, not used.

    kv_cache: the KV cache SGLang's ``flashinfer`` backend keeps: ``bf16`` (kv as given) or ``fp4_mx_block16``
    (``--kv-cache-dtype fp4_mx_block16``: kv written to the FP4 pool and read back to BF16 before the kernel,
    :func:`~amla_sim.algorithms.deployed.sglang.fp4_cache.through_fp4_pool`)."""
    check_kernel_layout(schedule, block, CTA_TILE_KV)
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache: expected one of {list(KV_CACHES)}, got {kv_cache!r}")
    if kv_cache == "fp4_mx_block16":
        kv = through_fp4_pool(kv)
    s_q = np.shape(q)[1] if np.ndim(q) == 4 else 1
    res = flashinfer_mla(q, kv, scale=scale, causal=s_q > 1, return_lse_base_on_e=True, num_sms=num_sms,
                         machine=machine, trace=trace)
    b, s_q, H = res.out.shape[:3]
    return AttentionResult(res.out, res.lse.reshape(b, s_q, H), res.trace, res.hazards)

