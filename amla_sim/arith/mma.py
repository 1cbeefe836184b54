"""Tensor-core matrix multiply-accumulate, as the hardware computes it.

One instruction is a truncated fused dot-product-add (T-FDPA; MMA-Sim, arXiv:2511.10909; Khattak & Mikaitis,
arXiv:2512.07004). For each output element and each block of ``L`` products, with the incoming accumulator c:

    products a_i b_i are exact; a product's exponent is ea + eb, the operands' exponents *before* normalising
    the product (a subnormal operand counts with its format's minimum exponent), so its significand is in [0, 4)
    e_max = the largest exponent among the products and c (zeros take ``e_zero``)
    S = sum_i trunc(term_i * 2^(F - e_max))       # each term cut to F fraction bits, no sticky bit
    d = round(S * 2^(e_max - F))                    # one normalisation and one rounding

Instructions chain across K either through the accumulator (``chain="fused"``: the next block's c is this
block's d) or, for FP8 under Triton, by adding each block, computed from a zero accumulator, into an FP32
accumulator with an ordinary FP32 add (``chain="fp32-add"``).

Every named model is a row of :data:`MODEL_TABLE`; :func:`matmul` is the public entry point.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import numpy as np
import numpy.typing as npt

from .. import _blas_clock
from .._validate import quiet_fp
from ..engine import get_engine
from ..formats import (
    ACCUMULATORS,
    FORMATS,
    Accumulator,
    Format,
    exponent,
    fsum_to_fp32,
    get_format,
    is_float_dtype,
    round_accumulator,
    round_to,
    tf32_operand,
)
from .elementwise import fma

__all__ = ["TFDPA", "MMAModel", "MODEL_TABLE", "MODELS", "matmul", "t_fdpa", "get_model"]

Chain = Literal["fused", "fp32-add"]


@dataclass(frozen=True)
class TFDPA:
    """Parameters of one T-FDPA instruction for one input format (the paper symbols L, F, e_zero)."""

    L: int  # products fused per block
    F: int  # fraction bits kept after alignment to e_max
    output: Accumulator  # the accumulator's format and rounding (formats.ACCUMULATORS)
    chain: Chain  # how blocks are chained across K
    e_zero: int | None = None  # exponent of zero terms; None: zeros never set e_max
    source: str = ""


@dataclass(frozen=True)
class MMAModel:
    """A named matrix-multiply model: one :class:`TFDPA` row per input format, or a plain arithmetic."""

    name: str
    rows: Mapping[str, TFDPA] = field(default_factory=dict)
    kind: Literal["tfdpa", "exact", "fp32", "blas"] = "tfdpa"
    bit_exact: bool = True
    verified: bool = True
    doc: str = ""
    nan_bits: int | None = None  # the one NaN the unit writes (FP32 bits), None: IEEE propagation as NumPy does


_SM90 = "MMA-Sim nv.py (WGMMASim); MATLAB-tensor-core H100/H200 dumps (tests/data); our Triton captures"
_SM90_FP8 = (
    "MMA-Sim (F = 13, f32_e8m13 output); chaining measured on an H200 (tests/data/triton_dot.npz): the k32 blocks of"
    " one tl.dot chain through the 14-bit accumulator from zero, then one FP32 add into the accumulator"
)
_SM90_FP8_FUSED = (
    "MMA-Sim nv.py (WGMMASim, f32_e8m13 with C fused); a raw wgmma.m64n8k32 with a nonzero C on an H100: 100% of"
    " 196,608 e4m3 and e5m2 outputs, one and two chained instructions (tests/data/fp8_mma_sync.npz)"
)
_SM80 = "MMA-Sim nv.py (Ampere: F = 24, k16 split into two k8 halves); not verified here (no A100 captures)"

_SM90_16BIT = {  # Hopper's 16- and 19-bit rows, the same under Triton and CUDA
    "bf16": TFDPA(16, 25, "fp32-rz", "fused", -133, _SM90),
    "fp16": TFDPA(16, 25, "fp32-rz", "fused", -133, _SM90),
    "tf32": TFDPA(8, 25, "fp32-rz", "fused", -133, _SM90),
}
_SM90_FP8_ROWS = {f: TFDPA(32, 13, "e8m13-rz", "fp32-add", -133, _SM90_FP8) for f in ("e4m3", "e5m2")}
_SM90_FP8_FUSED_ROWS = {f: TFDPA(32, 13, "e8m13-rz", "fused", -133, _SM90_FP8_FUSED) for f in ("e4m3", "e5m2")}
# every NaN is written as 0x7FFFFFFF, whatever the inputs' payloads and signs or an Inf - Inf: measured on an H100,
# bf16 wgmma (M = 64) and mma.sync (M = 16) and e4m3 tl.dot (tests/data/nan_dot.npz)
_SM90_NAN = 0x7FFFFFFF

#: Every tensor-core model by name, with its parameters and their sources.
MODEL_TABLE: dict[str, MMAModel] = {
    "sm90": MMAModel(
        "sm90", {**_SM90_16BIT, **_SM90_FP8_ROWS}, doc="Hopper wgmma as Triton 3.x issues it, FP32 accumulator",
        nan_bits=_SM90_NAN,
    ),
    "sm90-fp8-fused": MMAModel(
        "sm90-fp8-fused", _SM90_FP8_FUSED_ROWS,
        doc="FP8 wgmma issued with the accumulator (CUDA/CUTLASS kernels): C fused into the 14-bit truncated sum, "
            "chained through it; Triton's tl.dot computes sm90's fp32-add row instead, mma.sync neither",
    ),
    "sm90-wgmma": MMAModel(
        "sm90-wgmma", {**_SM90_16BIT, **_SM90_FP8_FUSED_ROWS},
        doc="Hopper wgmma as CUDA C++ kernels issue it (CUTLASS's gemm: the accumulator in every instruction): "
            "sm90's 16-bit rows, and FP8 chained through the 14-bit truncated sum (sm90-fp8-fused)",
        nan_bits=_SM90_NAN,
    ),
    "sm90-fp16": MMAModel(
        "sm90-fp16",
        {"fp16": TFDPA(16, 25, "fp16-rne", "fused", -21, _SM90)},
        doc="Hopper wgmma with an FP16 accumulator (fp16 inputs)",
    ),
    "sm80": MMAModel(
        "sm80",
        {
            "bf16": TFDPA(8, 24, "fp32-rz", "fused", source=_SM80),
            "fp16": TFDPA(8, 24, "fp32-rz", "fused", source=_SM80),
            "tf32": TFDPA(4, 24, "fp32-rz", "fused", source=_SM80),
        },
        verified=False,
        doc="Ampere mma.sync from the public model; not checked against captures here",
    ),
    "ascend910": MMAModel(
        "ascend910",
        {
            "bf16": TFDPA(16, 26, "fp32-rne", "fused", source="assumption: no public bit-level model of the Cube"),
            "fp16": TFDPA(16, 26, "fp32-rne", "fused", source="assumption: no public bit-level model of the Cube"),
        },
        verified=False,
        doc="Ascend 910 Cube unit: parametric and UNVERIFIED (no public bit-level model exists)",
    ),
    "exact": MMAModel("exact", kind="exact", doc="exact sum of products plus acc, rounded once to FP32 (RNE)"),
    "fp32": MMAModel("fp32", kind="fp32", doc="sequential FP32 fused multiply-add in ascending K"),
    "blas": MMAModel("blas", kind="blas", bit_exact=False, doc="NumPy float32 matmul (BLAS): fast, NOT bit-exact"),
}
#: The names of MODEL_TABLE.
MODELS = tuple(MODEL_TABLE)


def get_model(model: str | MMAModel) -> MMAModel:
    """Look a model up by name (or pass an :class:`MMAModel` through)."""
    if isinstance(model, MMAModel):
        return model
    if isinstance(model, str) and model in MODEL_TABLE:
        return MODEL_TABLE[model]
    raise ValueError(f"model: unknown MMA model {model!r}; expected one of {MODELS}")


# --- operands -------------------------------------------------------------------------------------------


def _operand_format(x: np.ndarray, argname: str) -> Format:
    if not is_float_dtype(x.dtype):
        raise TypeError(f"{argname}: expected a float array (bf16, fp16, e4m3, e5m2, float32), got dtype {x.dtype}")
    return get_format(x.dtype, argname=argname)


_ZERO = -8000  # exponent of a zero operand: far below any product, and two of them still fit in int16
_POW2_BIAS = 512
_POW2 = np.ldexp(1.0, np.arange(-_POW2_BIAS, _POW2_BIAS, dtype=np.int64))  # exact powers of two


def _exponents(x64: np.ndarray, fmt: Format) -> np.ndarray:
    """Unnormalised exponent of each operand as int16: floor(log2|x|), at least the format's minimum
    (subnormals); zeros get a sentinel far below every product."""
    return np.where(x64 == 0, np.int16(_ZERO), exponent(x64, fmt.emin)).astype(np.int16)


def _exponent_of_c(c: np.ndarray, e_zero: int | None) -> np.ndarray:
    return np.where(c == 0, 2 * _ZERO if e_zero is None else e_zero, exponent(c, -126))


@quiet_fp
def t_fdpa(
    a: np.ndarray, b: np.ndarray, c: np.ndarray, row: TFDPA, ea: np.ndarray, eb: np.ndarray
) -> np.ndarray:
    """One T-FDPA over the last axis: a, b (..., L) exact float64 operands, c (...) float64; returns float64.

    ea, eb are the operands' unnormalised exponents (see :func:`_exponents`).
    """
    with np.errstate(invalid="ignore"):
        p = a * b  # exact: at most 11 x 11 significand bits; inf * 0 is NaN, handled below
    pe = ea + eb  # int16; a zero operand puts the product far below everything
    if row.e_zero is not None:
        pe = np.where(p == 0, np.int16(row.e_zero), pe)
    e_max = np.maximum(pe.max(axis=-1), _exponent_of_c(c, row.e_zero))
    e_max = np.where(e_max < -_POW2_BIAS // 2, 0, e_max)  # all zero: any exponent gives S = 0
    scale = _POW2[row.F - e_max + _POW2_BIAS]  # exact powers of two, well inside float64
    with np.errstate(invalid="ignore", over="ignore"):
        p *= scale[..., None]
        np.trunc(p, out=p)
        s = p.sum(axis=-1) + np.trunc(c * scale)  # exact integers < 2^40
        d = round_accumulator(s / scale, row.output)
        finite = np.isfinite(s)
        if not finite.all():  # Inf and NaN follow the FP64 sum; NaN comes out as the canonical 0x7FFFFFFF
            with np.errstate(invalid="ignore"):
                naive = (a * b).sum(axis=-1) + c
            d = np.where(finite, d, naive)
    return d


@lru_cache(maxsize=None)
def _floor_div(w: int) -> tuple[int, int, int]:
    """(mul, shift, lift) with floor((f - 127) / w) = ((f + w lift - 127) * mul >> shift) - lift for every FP32
    exponent field f: a division by w as an integer multiply and shift, checked here over the whole range."""
    lift, shift = -(-127 // w), 18
    mul = -(-(1 << shift) // w)
    f = np.arange(256)
    assert np.array_equal(((f + w * lift - 127) * mul >> shift) - lift, (f - 127) // w), w
    return mul, shift, lift


@quiet_fp
def _t_fdpa_blas(
    a: np.ndarray, b: np.ndarray, c: np.ndarray, row: TFDPA, ea: np.ndarray, eb: np.ndarray
) -> np.ndarray:
    """:func:`t_fdpa` for every element of a matrix product at once: a (..., M, L), b (..., L, n) finite
    float64 operands, c (..., M, n) float64; returns float64, bit for bit what :func:`t_fdpa` gives.

    e_max without a per-product pass: with row and column maxima A_i, B_j of the operand exponents and
    w = bit_length(L), the BLAS product T = sum_k 2^(w (ea_ik - A_i)) 2^(w (eb_kj - B_j)) lies in
    [2^(w d), L * 2^(w d)], below 2^(w (d + 1)), for d = max_k(ea_ik + eb_kj) - A_i - B_j (every term is a power
    of two, so rounding never takes T below its largest term nor above L times it), hence d = floor(log2 T) // w.
    The products then go one k at a time in a frame scaled by 2^-(A_i + B_j): an FP32 product (at most 22
    significant bits: exact), an FP32 scaling by 2^(F - e_max + A_i + B_j) onto the truncation grid (exact), the
    truncation by the cast to an integer, an integer sum. Elements outside the frame's safe ranges (all-zero or
    underflowing T, tiny or huge e_max, non-finite c) take :func:`t_fdpa`.
    """
    nz_a, nz_b = ea > _ZERO // 2, eb > _ZERO // 2
    low = np.int32(-30000)
    amax = np.max(np.where(nz_a, ea, low), axis=-1).astype(np.int32)  # (..., M)
    bmax = np.max(np.where(nz_b, eb, low), axis=-2).astype(np.int32)  # (..., n)
    alpha = np.where(nz_a, amax[..., None] - ea, 1000)  # exponent deficits within the row / column
    beta = np.where(nz_b, bmax[..., None, :] - eb, 1000)
    w = int(a.shape[-1]).bit_length()  # L < 2^w: L terms of one power of two stay below the next one
    cap = 150 // w + 1  # FP32 weights: 2^(-w cap) is zero; T < 2^-120 goes the slow way
    T = np.matmul(np.ldexp(np.float32(1), -w * np.minimum(alpha, cap)).astype(np.float32),
                  np.ldexp(np.float32(1), -w * np.minimum(beta, cap)).astype(np.float32))
    t_field = T.view(np.int32) >> 23  # biased exponent of T >= 0
    ab = amax[..., :, None] + bmax[..., None, :]  # (..., M, n)
    mul, shift, lift = _floor_div(w)
    e_max = ab + (((t_field + (w * lift - 127)) * mul) >> shift) - lift  # + floor((t_field - 127) / w)
    c32 = c.astype(np.float32)  # c is an FP32 (or FP16) value
    # FP32 zeros and subnormals count as 2^-126 here: either way they cannot set e_max of an element kept below
    e_c = np.maximum((c32.view(np.int32) >> 23) & 0xFF, 1) - 127
    np.maximum(e_max, e_c, out=e_max)
    d = e_max - ab
    floor = -100 if row.e_zero is None else max(-100, row.e_zero + 1)
    ok: np.ndarray | bool = True
    if not (t_field.min() >= 7 and floor <= e_max.min() and e_max.max() <= 100 and d.min() >= -70
            and d.max() <= 150 and np.isfinite(c32).all()):
        ok = (t_field >= 7) & (e_max >= floor) & (e_max <= 100) & (d >= -70) & (d <= 150) & np.isfinite(c32)
        e_max, d = np.where(ok, e_max, 0), np.where(ok, d, 0)
    # the scaled frame: a * 2^-A_i and b * 2^-B_j in FP32; operands below 2^-100 there contribute products
    # under the grid (d >= -70), so they are dropped rather than carried as FP32 subnormals
    a_hat = np.where(alpha <= 100, np.ldexp(a, -amax[..., None]), 0.0).astype(np.float32)
    b_hat = np.where(beta <= 100, np.ldexp(b, -bmax[..., None, :]), 0.0).astype(np.float32)
    scale = ((row.F + 127 - d) << 23).astype(np.int32).view(np.float32)  # 2^(F - d)
    wide = a.shape[-1] << (row.F + 2) > 2**31  # an int32 sum could overflow (not for the sm90 rows)
    acc = np.zeros(T.shape, np.int64 if wide else np.int32)
    t = np.empty(T.shape, np.float32)
    ti = np.empty(T.shape, acc.dtype)
    for k in range(a.shape[-1]):
        np.multiply(a_hat[..., :, k, None], b_hat[..., None, k, :], out=t)
        np.multiply(t, scale, out=t)
        np.copyto(ti, t, casting="unsafe")  # float -> int truncates toward zero
        np.add(acc, ti, out=acc)
    grid = ((1023 + row.F - e_max).astype(np.int64) << 52).view(np.float64)  # 2^(F - e_max), exact
    inverse = ((1023 - row.F + e_max).astype(np.int64) << 52).view(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (acc + np.trunc(c * grid)) * inverse  # an exact integer sum, scaled back exactly
    out = round_accumulator(v, row.output)
    if ok is not True:  # the general path, element by element
        bad = np.nonzero(~ok)
        *batch, i, j = bad
        ai, ei = (a[(*batch, i)], ea[(*batch, i)]) if batch else (a[i], ea[i])
        bt, ebt = np.swapaxes(b, -1, -2), np.swapaxes(eb, -1, -2)
        bj, ej = (bt[(*batch, j)], ebt[(*batch, j)]) if batch else (bt[j], ebt[j])
        out[bad] = t_fdpa(ai, bj, c[bad], row, ei, ej)
    return out


# --- the exact and scalar models --------------------------------------------------------------------------


def _grid(x: np.ndarray, fmt: Format) -> np.ndarray:
    """An exponent q with x a multiple of 2^q (inf for zeros): x's exponent in `fmt` minus its fraction bits."""
    return np.where(x == 0, np.inf, _exponents(x, fmt) - fmt.mantissa_bits)


def _matmul_exact(a64: np.ndarray, b64: np.ndarray, c64: np.ndarray, fmt: Format) -> np.ndarray:
    """Exact sum of products plus c, rounded once to FP32 (nearest even), at BLAS speed.

    A float64 matmul (any summation order) is within gamma_K sum|a b| of the exact sum (the products of formats
    up to FP32 are exact in float64). Where the whole error interval rounds to one FP32 value, that value is
    the answer. The rest are mostly sums that land exactly on a rounding midpoint (products of narrow formats
    have few bits): there, if every product and c lie on a common grid 2^q and sum|a b| + |c| < 2^(q + 53),
    every partial sum was exact and the float64 sum rounds correctly, ties to even. What is left (and non-finite
    values) is recomputed with :func:`math.fsum`. The answer never depends on the BLAS.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.matmul(a64, b64) + c64
        mag = np.matmul(np.abs(a64), np.abs(b64)) + np.abs(c64)
        k = a64.shape[-1] + 2
        u = 2.0**-53
        bound = (k * u / (1 - k * u)) * mag * (1 + 2.0**-40) + 2.0**-1074  # widened for the bound's own rounding
        lo, hi = (s - bound).astype(np.float32), (s + bound).astype(np.float32)
        out = s.astype(np.float32).astype(np.float64)
    unsure = np.nonzero((lo != hi) | ~np.isfinite(s) | ~np.isfinite(bound))
    if not unsure[0].size:
        return out
    *batch, i, j = unsure
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ga = _grid(a64, fmt)  # (..., M, K): computed once, gathered per unsure element
        gbt = np.swapaxes(_grid(b64, fmt), -1, -2)  # (..., N, K)
        row_g, col_g = (ga[(*batch, i)], gbt[(*batch, j)]) if batch else (ga[i], gbt[j])  # (n, K) each
        # every product and c is a multiple of 2^q
        q = np.minimum(np.min(row_g + col_g, axis=-1), _grid(c64[unsure], FORMATS["fp32"]))
        q = np.where(np.isfinite(q), q, 0)
        exact = np.isfinite(s[unsure]) & (mag[unsure] * (1 + 2 * k * u) < np.ldexp(1.0, (q + 53).astype(np.int64)))
    for n in np.flatnonzero(~exact):
        idx = tuple(int(x[n]) for x in unsure)
        *bi, ii, jj = idx
        row, col = a64[(*bi, ii, slice(None))], b64[(*bi, slice(None), jj)]
        out[idx] = fsum_to_fp32([*(row * col).tolist(), float(c64[idx])])
    return out


def _matmul_fp32(a64: np.ndarray, b64: np.ndarray, c64: np.ndarray) -> np.ndarray:
    acc = c64.astype(np.float32)
    for k in range(a64.shape[-1]):
        acc = fma(a64[..., :, k, None].astype(np.float32), b64[..., None, k, :].astype(np.float32), acc)
    return acc.astype(np.float64)


# --- the public entry point ---------------------------------------------------------------------------


def _check(a: np.ndarray, b: np.ndarray, acc: np.ndarray | None, dot_k: int | None) -> tuple[Format, tuple]:
    fa, fb = _operand_format(a, "a"), _operand_format(b, "b")
    if fa != fb:
        raise TypeError(f"a and b: mixed input formats {fa.name} and {fb.name}; convert one of them")
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"a and b: expected (..., M, K) and (..., K, N), got shapes {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"a and b: inner dimensions differ (K = {a.shape[-1]} vs {b.shape[-2]})")
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(f"a and b: batch shapes {a.shape[:-2]} and {b.shape[:-2]} do not broadcast") from None
    out_shape = (*batch, a.shape[-2], b.shape[-1])
    if acc is not None:
        if np.asarray(acc).dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise TypeError(f"acc: expected float32 (or float16 for sm90-fp16), got {np.asarray(acc).dtype}")
        try:
            np.broadcast_shapes(np.shape(acc), out_shape)
        except ValueError:
            raise ValueError(f"acc: shape {np.shape(acc)} does not broadcast to the output {out_shape}") from None
    if dot_k is not None:
        if not isinstance(dot_k, (int, np.integer)) or isinstance(dot_k, bool):
            raise TypeError(f"dot_k: expected an int or None, got {type(dot_k).__name__}")
        if dot_k <= 0:
            raise ValueError(f"dot_k: expected a positive K extent per tl.dot, got {dot_k}")
    return fa, out_shape


@quiet_fp  # NaN operands (any bit pattern) are arithmetic to model, not a fault to warn of
def matmul(
    a: npt.ArrayLike,
    b: npt.ArrayLike,
    acc: npt.ArrayLike | None = None,
    *,
    model: str | MMAModel,
    dot_k: int | None = None,
) -> np.ndarray:
    """``acc + a @ b`` as the named tensor-core `model` computes it.

    a: (..., M, K), b: (..., K, N) of one input format (bf16, fp16, e4m3, e5m2; float32 is read as TF32 by the
    tensor-core models, the hardware ignoring its 13 low fraction bits). acc: (..., M, N) float32 (float16 for
    ``sm90-fp16``) or None for zeros. dot_k: the K extent of each ``tl.dot`` when a kernel loops
    ``acc += tl.dot(a_blk, b_blk)`` (None: one call over all of K); models it does not affect ignore it.
    Returns float32 (float16 for ``sm90-fp16``).
    """
    m = get_model(model)
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    fmt, out_shape = _check(a_arr, b_arr, None if acc is None else np.asarray(acc), dot_k)
    K = a_arr.shape[-1]
    out_dtype = np.float32
    if m.kind == "blas":  # straight to float32: the fast path does no exact arithmetic at all
        with np.errstate(invalid="ignore", over="ignore"):
            out = _blas_clock.matmul(np.asarray(a_arr, dtype=np.float32), np.asarray(b_arr, dtype=np.float32))
            if acc is not None:
                out += np.asarray(acc, dtype=np.float32)
            return out.astype(out_dtype, copy=False)

    def accumulator(dtype: type) -> np.ndarray:  # C broadcast to the output, widened
        if acc is None:
            return np.zeros(out_shape, dtype)
        return np.broadcast_to(np.asarray(acc), out_shape).astype(dtype, copy=False)  # no copy when it already is

    def operands(dtype: type) -> tuple[np.ndarray, np.ndarray]:  # a and b broadcast to the batch, widened
        with np.errstate(invalid="ignore"):
            return (_widen(np.broadcast_to(a_arr, (*out_shape[:-2], out_shape[-2], K)), dtype),
                    _widen(np.broadcast_to(b_arr, (*out_shape[:-2], K, out_shape[-1])), dtype))

    if m.kind == "exact":
        if fmt.name == "fp64":
            raise ValueError("a: the exact model takes formats up to FP32 (their products are exact in float64)")
        return _matmul_exact(*operands(np.float64), accumulator(np.float64), fmt).astype(out_dtype)
    if m.kind == "fp32":
        return _matmul_fp32(*operands(np.float64), accumulator(np.float64)).astype(out_dtype)

    name = "tf32" if fmt.name == "fp32" else fmt.name
    if name not in m.rows:
        raise ValueError(f"a: model {m.name!r} has no tensor-core path for {fmt.name} inputs ({sorted(m.rows)})")
    row = m.rows[name]
    out_dtype = ACCUMULATORS[row.output].dtype
    if 0 in out_shape:  # nothing to compute: an empty result, as NumPy's matmul gives
        return np.zeros(out_shape, out_dtype)
    a32, b32 = operands(np.float32)  # exact for every tensor-core input format
    if name == "tf32":  # the tensor core reads the 19 high bits of each FP32 operand
        a32, b32, fmt = tf32_operand(a32), tf32_operand(b32), FORMATS["tf32"]
    nan = None if m.nan_bits is None or out_dtype != np.float32 else np.uint32(m.nan_bits).view(np.float32)
    fast = get_engine() == "numba"
    if out_dtype == np.float32:  # read as FP32 (widened for the NumPy path)
        c = accumulator(np.float32 if fast else np.float64)
    else:  # an FP16 accumulator reads C as FP16
        c = accumulator(np.float64)
        c = c if acc is None else round_to(c, out_dtype).astype(np.float64)
    if fast:
        out = _chain_numba(a32, b32, c, fmt, row, dot_k or K, nan)  # None: an operand is not finite
        if out is not None:
            return out.astype(out_dtype, copy=False)
    a64, b64 = a32.astype(np.float64), b32.astype(np.float64)
    out = _chain(a64, b64, c.astype(np.float64, copy=False), _exponents(a64, fmt), _exponents(b64, fmt), row,
                 dot_k or K).astype(out_dtype)
    if nan is not None:
        out = np.where(np.isnan(out), nan, out)
    return out


def _widen(x: np.ndarray, dtype: type) -> np.ndarray:
    """`x` as `dtype` (exact for every input format); an 8-bit format through a table of its 256 values, several
    times faster than ml_dtypes' cast and the same values."""
    if not (x.dtype.itemsize == 1 and x.dtype.name.startswith("float8")):
        return x.astype(dtype)
    table = np.arange(256, dtype=np.uint8).view(x.dtype).astype(dtype)
    return table[np.ascontiguousarray(x).view(np.uint8)]


def _chain(
    a64: np.ndarray, b64: np.ndarray, c64: np.ndarray, ea: np.ndarray, eb: np.ndarray, row: TFDPA, dot_k: int
) -> np.ndarray:
    """Run the blocks of L products along K in ascending order, chained as the row says.

    ``fused``: every block takes the previous block's result as its c. ``fp32-add``: each ``tl.dot`` of
    `dot_k` runs its blocks fused from a zero accumulator, and its result is added to the FP32 accumulator
    with an FP32 add (round to nearest even).
    """
    K = a64.shape[-1]
    bt = np.swapaxes(b64, -1, -2)  # (..., N, K)
    ebt = np.swapaxes(eb, -1, -2)

    fast = bool(np.isfinite(a64).all() and np.isfinite(b64).all())  # else every element takes t_fdpa

    def blocks(acc: np.ndarray, k_lo: int, k_hi: int) -> np.ndarray:
        for k0 in range(k_lo, k_hi, row.L):
            k1 = min(k0 + row.L, k_hi)
            if fast:
                acc = _t_fdpa_blas(a64[..., :, k0:k1], b64[..., k0:k1, :], acc, row, ea[..., :, k0:k1],
                                   eb[..., k0:k1, :])
            else:
                acc = t_fdpa(a64[..., :, None, k0:k1], bt[..., None, :, k0:k1], acc, row, ea[..., :, None, k0:k1],
                             ebt[..., None, :, k0:k1])
        return acc

    n_cols, M = b64.shape[-1], a64.shape[-2]
    # keep a block's working set in cache: (rows, n) arrays for the BLAS path, (rows, n, L) products otherwise,
    # rows counting every batch
    budget = _CHUNK_ELEMENTS // 2 if fast else _CHUNK_ELEMENTS // row.L
    batch = a64.shape[:-2]
    n_batch = int(np.prod(batch, dtype=np.int64))
    if n_batch > 1 and n_batch * M * min(n_cols, _MIN_COLUMNS) > budget:  # batches are independent: a few at a time
        g = max(1, budget // (M * min(n_cols, _MIN_COLUMNS)))
        flat = [x.reshape(n_batch, *x.shape[-2:]) for x in (a64, b64, c64, ea, eb)]
        parts = [_chain(*(x[i:i + g] for x in flat), row, dot_k) for i in range(0, n_batch, g)]
        return np.concatenate(parts).reshape(*batch, M, n_cols)
    step = max(1, budget // max(1, n_batch * M))
    if n_cols > step:  # columns are independent: do them a slice at a time
        return np.concatenate(
            [
                _chain(a64, b64[..., j : j + step], c64[..., j : j + step], ea, eb[..., j : j + step], row, dot_k)
                for j in range(0, n_cols, step)
            ],
            axis=-1,
        )
    if row.chain == "fused":
        return blocks(c64, 0, K)
    acc = c64
    for k0 in range(0, K, dot_k):
        part = blocks(np.zeros_like(acc), k0, min(k0 + dot_k, K))
        with np.errstate(invalid="ignore", over="ignore"):
            # float64 has more than 2 * 24 + 2 bits, so rounding the float64 sum again to FP32 is innocuous
            acc = (acc + part).astype(np.float32).astype(np.float64)
    return acc


_CHUNK_ELEMENTS = 1 << 17
_MIN_COLUMNS = 64  # a slice of columns narrower than this does more bookkeeping than arithmetic


def _chain_numba(a32: np.ndarray, b32: np.ndarray, c: np.ndarray, fmt: Format, row: TFDPA, dot_k: int,
                 nan: np.float32 | None) -> np.ndarray | None:
    """:func:`_chain` compiled (the ``numba`` engine), the same bits: a32, b32 float32 (exact for every input
    format), C float32 or float64, the result in C's type, every NaN written as `nan` (None: as computed). None
    where an operand is not finite (the NumPy path takes those)."""
    from . import _mma_numba as nbk

    M, K = a32.shape[-2:]
    N = b32.shape[-1]
    a3, b3, c3 = a32.reshape(-1, M, K), b32.reshape(-1, K, N), c.reshape(-1, M, N)
    flip = N < M  # the kernel vectorises along N: C^T = B^T A^T, the same products in the same blocks
    if flip:
        a3, b3, c3 = np.swapaxes(b3, 1, 2), np.swapaxes(a3, 1, 2), np.swapaxes(c3, 1, 2)
    a3, b3, c3 = (np.ascontiguousarray(x) for x in (a3, b3, c3))
    ea, eb = nbk.exponents(a3, fmt.emin), nbk.exponents(b3, fmt.emin)
    if ea is None or eb is None:
        return None
    e_zero = nbk._NO_E_ZERO if row.e_zero is None else row.e_zero
    out = nbk.chain(a3, ea, b3, eb, c3, row.L, row.F, nbk.OUTPUT_CODES[row.output], e_zero, dot_k,
                    row.chain == "fp32-add", nan)
    return (np.swapaxes(out, 1, 2) if flip else out).reshape(c.shape)
