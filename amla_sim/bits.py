"""Bit views of floats and the AMLA integer-add tricks (AMLA paper, Lemma 3.1 and Appendix A).

``AS_INT(F) = -2^31 S + 2^23 E + M`` for FP32 (Eq. 6): adding ``n * 2^23`` to the integer adds ``n`` to the
exponent field E, which multiplies F by ``2^n`` exactly while ``0 < E < 255`` and ``0 < E + n < 255``.
Outside that domain the integer add still happens, with two's-complement wrap-around; what it produces is the
subject of study, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from .formats import Format, FormatLike, as_native, get_format, is_float_dtype

__all__ = [
    "as_int",
    "as_float",
    "exponent_field",
    "int_add",
    "mul_pow2_via_int_add",
    "lemma_domain",
    "count_outside_lemma_domain",
    "mul_one_plus_eps_via_int_add",
    "CompensationError",
    "compensation_error",
    "optimal_compensation_coefficient",
]

_BIT_FORMATS = ("fp64", "fp32", "fp16", "bf16", "e4m3", "e5m2")


def _float_array(x: npt.ArrayLike, argname: str) -> tuple[np.ndarray, Format]:
    arr = as_native(x)
    if not is_float_dtype(arr.dtype):
        raise TypeError(f"{argname}: expected a float array (float64/32/16, bfloat16, float8), got dtype {arr.dtype}")
    return arr, get_format(arr.dtype, argname=argname)


def _int_array(n: npt.ArrayLike, argname: str) -> np.ndarray:
    arr = np.asarray(n)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{argname}: expected integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 2**63:
        raise ValueError(f"{argname}: values must fit in int64, got {int(arr.max())}")
    return arr


def as_int(x: npt.ArrayLike) -> np.ndarray:
    """AS_INT: reinterpret a float array's bits as signed integers of the same width (a copy, not a view)."""
    arr, fmt = _float_array(x, "x")
    return np.array(arr, order="C").view(fmt.int_dtype)


def as_float(i: npt.ArrayLike, fmt: FormatLike | None = None) -> np.ndarray:
    """AS_FLOAT: reinterpret integers as floats of `fmt` (default by width: int64 -> fp64, int32 -> fp32)."""
    arr = _int_array(i, "i")
    if fmt is None:
        by_width = {8: "fp64", 4: "fp32"}
        if arr.dtype.itemsize not in by_width:
            raise ValueError(f"fmt: {arr.dtype} integers are ambiguous (fp16 or bf16, e4m3 or e5m2); name the format")
        fmt = by_width[arr.dtype.itemsize]
    f = get_format(fmt)
    if f.name == "tf32":
        raise ValueError("fmt: tf32 has no bit view of its own; use fp32")
    if arr.dtype.itemsize != f.dtype.itemsize:
        raise ValueError(f"i: {arr.dtype} does not have the width of {f.name} ({8 * f.dtype.itemsize} bits)")
    return np.array(arr, order="C").view(f.dtype)


def exponent_field(x: npt.ArrayLike) -> np.ndarray:
    """The biased exponent field E of each element, as int64."""
    return _exponent_field(*_float_array(x, "x")).astype(np.int64)


def _exponent_field(arr: np.ndarray, fmt: Format) -> np.ndarray:
    u = np.asarray(arr, order="C").view(fmt.uint_dtype)  # (ascontiguousarray would make 0-d arrays 1-d)
    return (u >> fmt.uint_dtype.type(fmt.mantissa_bits)) & fmt.uint_dtype.type((1 << fmt.exponent_bits) - 1)


def int_add(x: npt.ArrayLike, k: npt.ArrayLike) -> np.ndarray:
    """AS_FLOAT(AS_INT(x) + k) with two's-complement wrap-around at x's width: what an integer AtomicAdd does."""
    arr, fmt = _float_array(x, "x")
    kk = _int_array(k, "k")
    try:
        shape = np.broadcast_shapes(arr.shape, kk.shape)
    except ValueError:
        raise ValueError(f"x and k: shapes {arr.shape} and {kk.shape} do not broadcast") from None
    width = 8 * fmt.dtype.itemsize
    u = np.array(arr, order="C").view(fmt.uint_dtype).astype(np.uint64)
    # int -> uint64 is reduction modulo 2^64, so the sum is exact modulo 2^width after masking
    total = u + kk.astype(np.int64).astype(np.uint64)
    if width < 64:
        total = total & np.uint64((1 << width) - 1)
    out = np.broadcast_to(total, shape).astype(fmt.uint_dtype)
    return out.view(fmt.dtype)


def mul_pow2_via_int_add(x: npt.ArrayLike, n: npt.ArrayLike) -> np.ndarray:
    """Lemma 3.1 / Eq. 8: AS_FLOAT(AS_INT(x) + n * 2^mantissa_bits), with wrap-around and no checks.

    Equals ``x * 2**n`` bit for bit where :func:`lemma_domain` holds; elsewhere it is whatever the integer add
    gives: +0.0 with n = -3 wraps to 0xFE800000 = -2^126, which is why AMLA as shipped zeroes ``|O| > 1e10``.
    """
    arr, fmt = _float_array(x, "x")
    nn = _int_array(n, "n")
    if fmt.name not in _BIT_FORMATS:
        raise ValueError(f"x: no bit trick for {fmt.name}")
    step = nn.astype(np.int64).astype(np.uint64) * np.uint64(1 << fmt.mantissa_bits)  # wraps modulo 2^64
    return int_add(arr, step.view(np.int64))


def lemma_domain(x: npt.ArrayLike, n: npt.ArrayLike) -> np.ndarray:
    """Where Lemma 3.1's hypotheses hold: 0 < E < E_max and 0 < E + n < E_max (E_max = 255 for FP32)."""
    arr, fmt = _float_array(x, "x")
    nn = _int_array(n, "n").astype(np.int64)
    try:
        np.broadcast_shapes(arr.shape, nn.shape)
    except ValueError:
        raise ValueError(f"x and n: shapes {arr.shape} and {nn.shape} do not broadcast") from None
    e_max = (1 << fmt.exponent_bits) - 1
    # then e + n fits in int32
    narrow = fmt.dtype.itemsize <= 4 and -(2**30) < nn.min(initial=0) and nn.max(initial=0) < 2**30
    signed, unsigned = (np.int32, np.uint32) if narrow else (np.int64, np.uint64)
    e = _exponent_field(arr, fmt).astype(signed)
    # 0 < v < e_max  <=>  (v - 1) as unsigned < e_max - 1: one comparison per condition
    inside = (e - 1).astype(unsigned) < e_max - 1
    return inside & ((e + nn.astype(signed) - 1).astype(unsigned) < e_max - 1)


def count_outside_lemma_domain(x: npt.ArrayLike, n: npt.ArrayLike, *, axis: int = -1) -> int:
    """How many elements of x violate :func:`lemma_domain` for n, with n constant along `axis` (one shift per
    row, as AMLA's rows have): the per-row exponent range settles most rows without an elementwise test."""
    arr, fmt = _float_array(x, "x")
    nn = np.asarray(_int_array(n, "n"), dtype=np.int64)
    if arr.size == 0:
        return 0
    e = _exponent_field(arr, fmt)
    lo, hi = e.min(axis=axis, keepdims=True).astype(np.int64), e.max(axis=axis, keepdims=True).astype(np.int64)
    e_max = (1 << fmt.exponent_bits) - 1
    try:
        clear = (lo > 0) & (hi < e_max) & (lo + nn > 0) & (hi + nn < e_max)
    except ValueError:
        raise ValueError(f"x and n: n of shape {nn.shape} is not one value per row of x {arr.shape}") from None
    if clear.all():
        return 0
    return int((~lemma_domain(arr, np.broadcast_to(nn, clear.shape))).sum())


def mul_one_plus_eps_via_int_add(
    x: npt.ArrayLike, eps: npt.ArrayLike, *, coefficient: float = 1.5
) -> np.ndarray:
    """Appendix A: x * (1 + eps) approximated as AS_FLOAT(AS_INT(x) + round(coefficient * 2^m * eps)).

    ``m`` is x's mantissa width (23 for FP32); round is to nearest, ties to even.
    """
    arr, fmt = _float_array(x, "x")
    e = np.asarray(eps)
    if not is_float_dtype(e.dtype) and e.dtype.kind not in "iu":
        raise TypeError(f"eps: expected real numbers, got dtype {e.dtype}")
    delta = np.rint(float(coefficient) * np.ldexp(e.astype(np.float64), fmt.mantissa_bits)).astype(np.int64)
    return int_add(arr, delta)


@dataclass(frozen=True)
class CompensationError:
    """Relative error of :func:`mul_one_plus_eps_via_int_add` against x*(1+eps), in units of ``|eps|``."""

    coefficient: float
    worst: float  # max over mantissas and eps of |error| / |eps|
    mean: float  # mean of |error| / |eps|
    mean_signed: float  # mean of error / |eps| * sign(eps): the bias


def _compensation_samples(eps: npt.ArrayLike | None, mantissas: int) -> tuple[np.ndarray, np.ndarray]:
    if eps is None:
        # what AMLA's c_i/c_{i-1} - 1 spans: BF16 rounding ratios, |eps| < 2^-8
        eps = np.linspace(-(2.0**-8), 2.0**-8, 66)[1:-1]
    e = np.asarray(eps, dtype=np.float64).ravel()
    if e.size == 0 or np.any(e == 0) or not np.all(np.isfinite(e)):
        raise ValueError("eps: expected non-zero finite values")
    if not isinstance(mantissas, (int, np.integer)) or not 2 <= mantissas <= 1 << 23:
        raise ValueError(f"mantissas: expected an int in [2, 2^23], got {mantissas!r}")
    m = np.unique(np.linspace(0, (1 << 23) - 1, int(mantissas)).round().astype(np.int64))
    x = as_float((np.int64(127) << 23 | m).astype(np.int32))  # 1 + M / 2^23, every mantissa in [1, 2)
    return x, e


def compensation_error(
    coefficient: float = 1.5, *, eps: npt.ArrayLike | None = None, mantissas: int = 1 << 14
) -> CompensationError:
    """Measure Appendix A's approximation over `mantissas` evenly spread FP32 mantissas and every `eps`.

    To first order the approximation multiplies by ``1 + coefficient * eps / (1 + f)`` (f = M / 2^23), so the
    error is ``eps * (coefficient / (1 + f) - 1)``: 1.5 is exact only at the mid-mantissa f = 1/2.
    """
    x, e = _compensation_samples(eps, mantissas)
    got = mul_one_plus_eps_via_int_add(x[None, :], e[:, None], coefficient=coefficient).astype(np.float64)
    xd = x.astype(np.float64)[None, :]
    # got - x is exact in float64; the reference product x * eps has a 2^-53 relative rounding only
    err = ((got - xd) - xd * e[:, None]) / (xd * (1.0 + e[:, None])) / np.abs(e[:, None])
    return CompensationError(
        coefficient=float(coefficient),
        worst=float(np.max(np.abs(err))),
        mean=float(np.mean(np.abs(err))),
        mean_signed=float(np.mean(err * np.sign(e[:, None]))),
    )


def optimal_compensation_coefficient(
    metric: Literal["worst", "mean", "bias"] = "worst",
    *,
    eps: npt.ArrayLike | None = None,
    mantissas: int = 1 << 12,
    tol: float = 1e-6,
) -> float:
    """The coefficient in [1, 2] that minimises the worst-case, mean or ``|mean signed|`` error (golden section)."""
    keys = {"worst": lambda r: r.worst, "mean": lambda r: r.mean, "bias": lambda r: abs(r.mean_signed)}
    if metric not in keys:
        raise ValueError(f"metric: expected one of {sorted(keys)}, got {metric!r}")
    key = keys[metric]

    def f(c: float) -> float:
        return key(compensation_error(c, eps=eps, mantissas=mantissas))

    if not isinstance(tol, (int, float, np.floating)) or isinstance(tol, bool) or not 1e-12 <= tol <= 1:
        raise ValueError(f"tol: expected a number in [1e-12, 1], got {tol!r}")  # below, [1, 2] no longer shrinks
    invphi = (np.sqrt(5.0) - 1.0) / 2.0
    a, b = 1.0, 2.0
    c, d = b - invphi * (b - a), a + invphi * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - invphi * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + invphi * (b - a)
            fd = f(d)
    return float((a + b) / 2.0)

