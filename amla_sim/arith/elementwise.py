"""Elementwise FP32 operations: exp, exp2, division, fused multiply-add, as IEEE defines them and as sm_90 runs them.

The IEEE paths are exact: a float64 operation whose result is rounded once to FP32. For ``+ - * / fma`` this is
correctly rounded (float64 has more than 2 * 24 + 2 bits, or round-to-odd where it has not); for exp and exp2 it
relies on the float64 libm result being within an ulp, which makes a wrong FP32 rounding astronomically rare.

The sm_90 paths model what Triton 3.6 emits (measured on an H200, ``tests/data/triton_exp_div.npz``,
``triton_exp2_unit.npz`` and ``ex2_edges.npz``):

- ``tl.exp(x)``: ``t = fl32(x * fl32(log2 e))`` (0x3FB8AA3B), then ``ex2.approx.f32(t)``.
- ``tl.exp2(x)``: ``ex2.approx.ftz.f32(x)``: subnormal inputs read as zero, subnormal results flushed to +0.
- ``a / b``: ``div.full.f32``; ``tl.math.div_rn``: IEEE (100% of captures).
- ``a * b + c``: contracted to one FMA (100% of captures).

``ex2.approx`` is modelled bit for bit (:func:`ex2_approx`): the MUFU.EX2 unit reads x as fixed point with 23
fraction bits, truncated toward zero; a negative x with a nonzero fraction is negated by complementing the
fraction's bits, which reads it 2^-23 lower; the result is 2^n times the unit's significand for the 23-bit fraction,
a table measured on every fraction (``ex2_sm90.npz``, built by ``scripts/make_mufu_tables.py``); results below
2^-126 are flushed. Without ``.ftz``, x < -126 is evaluated as ``fl32(EX2(x / 2)^2)``, which gives the subnormal
results. Agreement with the device: 100% of tl.exp2 on every FP32 in [1, 2) and in (-2, -1] (8.4 million each), on
32,768 random x in [-140, 130] and on 17,356 edge inputs (zeros, subnormals, tiny normals, integers, the
neighbourhoods of -150, -126 and 128, infinities, NaN); 100% of tl.exp on 32,768 random and the 17,356 edge inputs.
The table also shows the unit's structure: in each of the 64 intervals of the fraction, the significand is exactly
the floor of a quadratic form in the 17 remaining bits, as a table-driven interpolator with truncated multipliers
computes (``scripts/analyze_ex2_structure.py``: a linear program finds one for every interval, with margins of
0.00037-0.00057 ulp, ``tests/data/ex2_structure.txt``; a quadratic in the fraction itself misses by 0.04-0.10
ulp). The correctly rounded 2^x agrees with only 61.1% of [1, 2) and 51.0% of the random inputs.

``div.full.f32`` is modelled bit for bit too (:func:`div`): ``fl32(a * rcp.approx(b))`` after scaling both by
1/4 where ``|b| > 2^126`` and by 2^24 where ``|b| < 2^-126``, with ``rcp.approx.ftz`` (:func:`rcp_approx`) from a
table of MUFU.RCP measured on every significand (``rcp_sm90.npz``). Agreement: 100% of 32,768 random divisions,
of 21,697 edge pairs (zeros, subnormals, both ends of the range, infinities, NaN; the data allow other scale
factors between 2^23 and 2^32, and 2^-24 for 1/4) and of rcp.approx on 194,756 inputs. IEEE division agrees with
71.4% of the random divisions, ``fl32(a * fl32(1 / b))`` with 87.7%.

Both tables and every capture are byte-identical on an H100.

CUDA C++ compiled without ``--use_fast_math`` (vLLM's FlashMLA library, ``scripts/probe_math_builds.py``, nvcc 13.0
on an H200, ``tests/data/math_builds.npz``) turns ``exp2f`` into ``ex2.approx.f32`` (no ``.ftz``: equal on all 2^32
inputs), ``/`` into ``div.rn.f32`` (IEEE) and ``expf`` into libdevice's ``__nv_expf`` (:func:`expf_libdevice`); with
the flag, ``ex2.approx.ftz.f32``, ``div.approx.ftz.f32`` and ``ex2.approx.ftz`` of ``fl32(x log2 e)``.

On the ``numba`` engine the FMA and the MUFU.EX2 unit run compiled (``arith/_elementwise_numba.py``), with the same
bits.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from .._validate import quiet_fp
from ..engine import get_engine
from ..formats import FP32_MIN_NORMAL, flush_subnormals, is_float_dtype, round_to

__all__ = [
    "LN2",
    "LOG2E",
    "LOG2E_F32",
    "as_f32",
    "exp",
    "exp2",
    "exp_poly",
    "ex2_approx",
    "expf_libdevice",
    "div",
    "fma",
    "fma_bf16",
]

#: ln 2 in float64; machines round it to their own format.
LN2 = math.log(2.0)  # float64; machines round it to their own format
#: log2 e in float64.
LOG2E = 1.0 / LN2
#: fl32(log2 e), bits 0x3FB8AA3B: the multiplier of ``tl.exp``.
LOG2E_F32 = np.float32(float.fromhex("0x1.715476p+0"))  # fl32(log2 e), bits 0x3FB8AA3B: tl.exp's multiplier
LN2_F32 = np.float32(float.fromhex("0x1.62e43p-1"))  # fl32(ln 2), 0x3F317218
ExpMode = Literal["correctly-rounded", "sm90", "libdevice", "poly", "numpy-fast"]
DivMode = Literal["ieee", "sm90"]


def as_f32(x: npt.ArrayLike, argname: str = "x") -> np.ndarray:
    """`x` as a float32 array; other float types must convert exactly (Python floats are rounded)."""
    if isinstance(x, (float, int)) and not isinstance(x, bool):
        return np.asarray(x, dtype=np.float32)
    arr = np.asarray(x)
    if arr.dtype == np.float32:
        return arr
    if not is_float_dtype(arr.dtype):
        raise TypeError(f"{argname}: expected a float array, got dtype {arr.dtype}")
    with np.errstate(invalid="ignore", over="ignore"):
        wide = arr.astype(np.float64)
        out = wide.astype(np.float32)
    if not np.all((out.astype(np.float64) == wide) | np.isnan(wide)):
        raise ValueError(f"{argname}: values are not exactly representable in FP32; round them first")
    return out


_FRAC = (1 << 23) - 1
_NAN = np.uint32(0x7FFFFFFF).view(np.float32)  # the canonical NaN the units return


@cache
def _table(name: str) -> np.ndarray:
    """A measured MUFU table (int32, one entry per 23-bit fraction), stored as its first entry and its steps."""
    with np.load(Path(__file__).with_name(name)) as z:
        first, step = z["first"].astype(np.int64), z["step"].astype(np.int64)
    return np.concatenate([first, first + np.cumsum(step)]).astype(np.int32)


@cache
def _ex2_table() -> np.ndarray:
    """MUFU.EX2's significand of 2^(f / 2^23), less its leading bit, for every 23-bit fraction f (units of 2^-23:
    the FP32 fraction field of the result)."""
    return _table("ex2_sm90.npz") & _FRAC


def _mufu_ex2(x: np.ndarray, *, ftz: bool = False) -> np.ndarray:
    """The MUFU.EX2 unit on FP32 x (see the module docstring); results below 2^-126 flushed to +0. ftz: subnormal
    inputs read as zero."""
    if get_engine() == "numba":
        from . import _elementwise_numba

        return _elementwise_numba.mufu_ex2(x, _ex2_table(), ftz=ftz)
    if ftz:
        x = np.where(np.abs(x) < np.float32(2.0**-126), np.float32(0.0), x)
    with np.errstate(invalid="ignore"):  # |x| >= 256 saturates: the result is +inf or +0 either way
        fixed = np.trunc(np.minimum(np.abs(x), np.float32(255.99998)) * np.float32(2.0**23))  # exact, toward zero
    A = np.nan_to_num(fixed).astype(np.int32)
    X = np.where(x < 0, np.where((A & _FRAC) == 0, -A, ~A), A)  # ~A = -A - 1: the fraction complemented
    biased = (X >> 23) + 127  # 2^x = M 2^(n - 23): FP32 bits (n + 127) << 23 | M - 2^23
    bits = np.take(_ex2_table(), X & _FRAC)
    bits |= biased << 23
    if biased.min() < 1 or biased.max() > 254:
        bits = np.where(biased < 1, 0, np.where(biased > 254, 0x7F800000, bits))  # flushed to +0; overflow: +inf
    y = bits.view(np.float32)
    return np.where(np.isnan(x), _NAN, y) if np.isnan(x).any() else y


def ex2_approx(x: npt.ArrayLike, *, ftz: bool = False) -> np.ndarray:
    """PTX ``ex2.approx[.ftz].f32`` on sm_90, bit for bit (see the module docstring for the model and its
    measured agreement: 100% of every capture)."""
    xf = as_f32(x)
    if ftz:
        return _mufu_ex2(xf, ftz=True)
    small = xf < np.float32(-126.0)  # 2^x is subnormal or zero: square the unit's 2^(x / 2)
    with np.errstate(invalid="ignore"):  # a signalling NaN: NaN either way
        half = _mufu_ex2(np.where(small, xf * np.float32(0.5), xf))
    with np.errstate(under="ignore", over="ignore"):
        return np.where(small, half * half, half).astype(np.float32)


_EXP_MODES = "expected 'correctly-rounded', 'sm90', 'libdevice', 'poly' or 'numpy-fast'"


def exp(x: npt.ArrayLike, *, mode: ExpMode = "correctly-rounded") -> np.ndarray:
    """e^x in FP32. mode: ``correctly-rounded`` (float64, rounded once), ``sm90`` (``tl.exp``), ``libdevice``
    (CUDA's ``expf`` without ``--use_fast_math``, :func:`expf_libdevice`), ``numpy-fast`` (NumPy's float32 exp:
    fast, CPU-dependent, not for bit-exact work)."""
    xf = as_f32(x)
    with np.errstate(over="ignore", under="ignore"):
        if mode == "correctly-rounded":
            return np.exp(xf.astype(np.float64)).astype(np.float32)
        if mode == "sm90":
            return ex2_approx(xf * LOG2E_F32, ftz=False)
        if mode == "libdevice":
            return expf_libdevice(xf)
        if mode == "poly":
            return exp_poly(xf)
        if mode == "numpy-fast":
            return np.exp(xf)
    raise ValueError(f"mode: {_EXP_MODES}, got {mode!r}")


def exp2(x: npt.ArrayLike, *, mode: ExpMode = "correctly-rounded") -> np.ndarray:
    """2^x in FP32. mode: ``correctly-rounded``, ``sm90`` (``tl.exp2`` = ``ex2.approx.ftz.f32``, also CUDA's
    ``exp2f`` under ``--use_fast_math``), ``libdevice`` (CUDA's ``exp2f`` without it: ``ex2.approx.f32``),
    ``numpy-fast``."""
    xf = as_f32(x)
    with np.errstate(over="ignore", under="ignore"):
        if mode == "correctly-rounded":
            return np.exp2(xf.astype(np.float64)).astype(np.float32)
        if mode == "sm90":
            return ex2_approx(xf, ftz=True)
        if mode == "libdevice":
            return ex2_approx(xf, ftz=False)
        if mode == "poly":
            return exp_poly(xf * LN2_F32)
        if mode == "numpy-fast":
            return np.exp2(xf)
    raise ValueError(f"mode: {_EXP_MODES}, got {mode!r}")


def _f32_bits(bits: int) -> np.float32:
    return np.uint32(bits).view(np.float32)


_EXPF_K = _f32_bits(0x3BBB989D)  # log2 e / 256: the reduction's first step
_EXPF_J = (_f32_bits(0x437C0000), _f32_bits(0x4B400001), _f32_bits(0xCB40007F))  # 252, 1.5 2^23 + 1, -(1.5 2^23 + 127)
_EXPF_LO = _f32_bits(0x32A57060)  # log2 e - fl32(log2 e), the reduction's second FMA


def _fma_rm(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``fma.rm.f32`` where ``a b + c`` is exact in float64 (the reduction's operands: a in [0, 1] with 24 bits,
    b = 252, c near 2^23)."""
    v = a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)
    r = v.astype(np.float32)
    return np.where(r.astype(np.float64) > v, np.nextafter(r, np.float32(-np.inf)), r).astype(np.float32)


def expf_libdevice(x: npt.ArrayLike) -> np.ndarray:
    """CUDA's ``expf`` without ``--use_fast_math`` (libdevice ``__nv_expf`` as nvcc 13.0 emits it), bit for bit:
    ``t = sat(fma(x, log2 e / 256, 0.5))``; ``j = fma.rm(t, 252, 1.5 2^23 + 1)``, whose low bits are the integer
    part n + 127 of x log2 e; ``r = fma(x, lo, fma(x, fl32(log2 e), -(j - 1.5 2^23 - 127)))``; then
    ``ex2.approx.ftz(r)`` times 2^n from j's bits (one FP32 multiply, subnormals kept)."""
    xf = as_f32(x)
    ones = np.ones_like(xf)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        t = fma(xf, _EXPF_K * ones, np.float32(0.5) * ones)
        t = np.clip(np.where(np.isnan(t), np.float32(0.0), t), 0, 1).astype(np.float32)  # cvt.sat: NaN -> 0
        j = _fma_rm(t, _EXPF_J[0] * ones, _EXPF_J[1] * ones)
        k = (j + _EXPF_J[2]).astype(np.float32)
        r = fma(xf, _EXPF_LO * ones, fma(xf, LOG2E_F32 * ones, -k))
        scale = (j.view(np.uint32) << np.uint32(23)).view(np.float32)
        return (ex2_approx(r, ftz=True) * scale).astype(np.float32)


def rcp_approx(x: npt.ArrayLike) -> np.ndarray:
    """PTX ``rcp.approx.ftz.f32`` on sm_90 (MUFU.RCP), bit for bit: subnormal inputs read as zero, 1/m from a
    table measured on every significand m (``rcp_sm90.npz``), scaled by 2^-e, results below 2^-126 flushed."""
    bits = as_f32(x).view(np.int32)
    field = (bits >> 23) & 0xFF
    r = np.take(_table("rcp_sm90.npz"), bits & _FRAC)  # FP32 bits of 1/m, m in [1, 2)
    out = (r >> 23) - (field - 127)  # the exponent field of 2^-e / m (never above 253)
    r = (r & _FRAC) | (out << 23)
    r = np.where(out < 1, 0, r)  # flushed to zero
    r = np.where(field == 0, 0x7F800000, np.where(field == 255, 0, r))  # 1/(+-0 or subnormal) = inf, 1/inf = 0
    r |= bits & np.int32(-(2**31))  # the sign of x
    r = np.where((field == 255) & ((bits & _FRAC) != 0), _NAN.view(np.int32), r)
    return r.view(np.float32)


def div(a: npt.ArrayLike, b: npt.ArrayLike, *, mode: DivMode = "ieee") -> np.ndarray:
    """a / b in FP32. mode: ``ieee`` (correctly rounded; also ``tl.math.div_rn``) or ``sm90`` (Triton's ``/``,
    ``div.full.f32``, bit for bit: ``fl32(a' * rcp.approx(b'))`` with a, b scaled by 1/4 where ``|b| > 2^126`` and by
    2^24 where ``|b| < 2^-126``, so that the reciprocal neither flushes nor overflows)."""
    af, bf = as_f32(a, "a"), as_f32(b, "b")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        if mode == "ieee":
            return (af.astype(np.float64) / bf.astype(np.float64)).astype(np.float32)
        if mode == "sm90":
            mag = np.abs(bf)
            s = np.where(mag > np.float32(2.0**126), np.float32(0.25),
                         np.where(mag < np.float32(2.0**-126), np.float32(2.0**24), np.float32(1.0)))
            q = (af * s) * rcp_approx(bf * s)  # FP32 products, rounded to nearest even
            return np.where(np.isnan(q), _NAN, q)
    raise ValueError(f"mode: expected 'ieee' or 'sm90', got {mode!r}")


@quiet_fp  # NaN operands (any bit pattern) are arithmetic to model, not a fault to warn of
def fma(a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike, *, ftz: bool = False) -> np.ndarray:
    """FP32 fused multiply-add ``a * b + c``, rounded once to nearest even (binary64 with round-to-odd).

    ftz: ``fma.rn.ftz.f32``: subnormal inputs and results flushed to a zero of the same sign."""
    af, bf, cf = (as_f32(v, n) for v, n in ((a, "a"), (b, "b"), (c, "c")))
    if not ftz and get_engine() == "numba":
        from . import _elementwise_numba

        out = _elementwise_numba.fma(af, bf, cf)  # None where an operand is NaN: the NumPy path below
        if out is not None:
            return out
    a64, b64, c64 = (v.astype(np.float64) for v in (af, bf, cf))
    if ftz:
        a64, b64, c64 = (_flush(v) for v in (a64, b64, c64))
    with np.errstate(invalid="ignore", over="ignore"):
        out = _sum_to_odd(a64 * b64, c64).astype(np.float32)  # the product exact: 24 x 24 significand bits
    return _flush(out).astype(np.float32) if ftz else out


@quiet_fp
def fma_bf16(a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike) -> np.ndarray:
    """PTX ``fma.rn.bf16`` (``add.bf16`` is ``a + c`` with b = 1): ``a * b + c`` rounded once to BF16, nearest even;
    a, b, c hold BF16 (or FP32) values, whose product float64 holds exactly. Returns BF16."""
    a64, b64, c64 = (np.asarray(v, np.float64) for v in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):
        return round_to(_sum_to_odd(a64 * b64, c64), "bf16")


def _sum_to_odd(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float64 ``p + c`` rounded to odd (TwoSum's exact error decides the last bit), which any format of at most 51
    significand bits then rounds as it would the exact sum: one rounding, not two."""
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    odd = (s.view(np.uint64) & np.uint64(1)) == 1
    fix = (err != 0) & ~odd & np.isfinite(s)
    return np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)


def _flush(x: np.ndarray) -> np.ndarray:
    """Subnormals (of FP32) replaced by a zero of their sign, as ``.ftz`` does."""
    return flush_subnormals(x, keep_sign=True)


# exp_poly: a software exp both the kernels (amla_sim.gpu, exact mode) and NumPy compute bit for bit alike
LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))  # 0x3F317200: the high bits of ln 2, exact products with n
LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))  # 0x35BFBE8E: ln 2 - LN2_HI
EXP_POLY = tuple(np.float32(c) for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0))  # Taylor, Horner


def _pow2(k: np.ndarray) -> np.ndarray:
    """2^k for integer-valued float32 k in [-126, 127], from its bits."""
    return ((k.astype(np.int32) + 127) << 23).astype(np.int32).view(np.float32)


def exp_poly(x: npt.ArrayLike) -> np.ndarray:
    """e^x from FP32 operations only: n = rint(x log2 e), r = x - n ln 2 (two FMAs), a degree-6 Horner
    polynomial in FMAs, then two exact power-of-two multiplies. Results below 2^-126 flush to +0. Within 2 ulp
    of e^x; identical on every IEEE machine, which is why the kernels' exact mode uses it."""
    xf = as_f32(x)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        xc = np.minimum(np.maximum(xf, np.float32(-88.0)), np.float32(88.0))
        n = np.rint(xc * LOG2E_F32)
        r = fma(n, -LN2_HI, xc)
        r = fma(n, -LN2_LO, r)
        p = np.full_like(r, EXP_POLY[0])
        for c in EXP_POLY[1:]:
            p = fma(p, r, np.full_like(r, c))
        nh = np.floor(n * np.float32(0.5))
        y = (p * _pow2(nh)) * _pow2(n - nh)
        y = np.where(y < FP32_MIN_NORMAL, np.float32(0.0), y)
        y = np.where(xf > np.float32(88.72283), np.float32(np.inf), y)
        return np.where(np.isnan(xf), xf, y).astype(np.float32)
