"""Logarithms in FP32 as sm_90 computes them: ``tl.log`` (libdevice's logf, in FP32 FMAs) and ``lg2.approx``
(the MUFU.LG2 unit, ``log2f`` under ``--use_fast_math``), bit for bit.

``tl.log(x)`` (Triton 3.6, CUDA) is not a hardware instruction: it inlines libdevice's ``__nv_logf`` (PTX in
``tests/data/log_units.npz``'s script, ``scripts/capture_thirdparty.py``). With x scaled by 2^23 where it is below
2^-126, its bits minus those of 2/3 split it into 2^e m, m in [2/3, 4/3); f = m - 1; a degree-8 polynomial
in ``fma.rn.ftz`` (the constants below) gives log(1 + f) = f + f^2 p(f), and e ln 2 is added with one more FMA.
:func:`log` with ``mode="sm90"`` replays those FP32 operations.

``lg2.approx.f32`` (MUFU.LG2), measured on an H100 (``scripts/capture_thirdparty.py``): for x = 2^e m, m in [1, 2),

- e >= 0: ``RZ(e + T(m))``, T(m) the unit's result on [1, 2) (a table of every significand, ``lg2_sm90.npz``);
- e <= -2: ``RZ(e + T(m) + eps)``, eps > 0 below every FP32 step there: the negative sum reads one unit high in a
  wider fixed point, as one's complement would, so an exact -2 comes out as -(2 - 2^-23);
- e = -1: a second table, measured on every significand of [0.5, 1) (the unit keeps more bits there);
- subnormal x (without .ftz): scaled by 2^24, then 24 subtracted in FP32 (round to nearest);
- +-0 (and subnormals with .ftz) give -inf, +inf gives +inf, negative x and NaN the NaN 0x7FFFFFFF.

CUDA's ``log2f`` without ``--use_fast_math`` is not the unit either: libdevice's ``__nv_log2f`` (:func:`log2f`,
from the PTX nvcc 13.0 emits; 100% of ``tests/data/math_builds.npz``) splits x at sqrt(1/2) instead of 2/3, so
that f = m - 1 lies in [sqrt(1/2) - 1, sqrt(2) - 1), evaluates a degree-9 polynomial p in FMAs and returns
``e + fma(f, fl32(log2 e), f (f p))``. Its ``logf`` is the same ``__nv_logf`` as Triton's ``tl.log`` (without
``.ftz``, which changes no result: every intermediate of a finite input is a normal number or zero).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from ..formats import FP32_MIN_NORMAL
from .elementwise import _NAN, LN2_F32, as_f32, fma

__all__ = ["log", "log2f", "lg2_approx", "LOGF_POLY", "LOG2F_POLY"]

LogMode = Literal["correctly-rounded", "sm90", "numpy-fast"]


def _f32(bits: int) -> np.float32:
    return np.uint32(bits).view(np.float32)


# libdevice __nv_logf's polynomial, highest degree first (the FP32 bits in the PTX)
#: libdevice ``__nv_logf``'s polynomial, highest degree first (the FP32 bits in the PTX).
LOGF_POLY = tuple(_f32(b) for b in (0xBE055027, 0x3E1039F6, 0xBDF8CDCC, 0x3E0F2955, 0xBE2AD8B9, 0x3E4CED0B,
                                     0xBE7FFF22, 0x3EAAAA78, 0xBF000000))
_TWO_THIRDS_BITS = 0x3F2AAAAB


def _logf_sm90(x: np.ndarray) -> np.ndarray:
    small = x < FP32_MIN_NORMAL
    xs = np.where(small, x * np.float32(2.0**23), x).astype(np.float32)
    bits = xs.view(np.int32)
    e_bits = (bits - np.int32(_TWO_THIRDS_BITS)) & np.int32(-(1 << 23))
    m = (bits - e_bits).view(np.float32)  # in [2/3, 4/3)
    e = fma(e_bits.astype(np.float32), np.float32(2.0**-23), np.where(small, np.float32(-23.0), np.float32(0)), ftz=True)
    f = (m - np.float32(1.0)).astype(np.float32)
    r = np.full_like(f, LOGF_POLY[0])
    for c in LOGF_POLY[1:]:
        r = fma(r, f, np.full_like(f, c), ftz=True)
    q = fma((f * r).astype(np.float32), f, f, ftz=True)
    y = fma(e, np.full_like(e, LN2_F32), q, ftz=True)
    special = xs.view(np.uint32) >= np.uint32(0x7F800000)  # +inf, NaN, negative: x * inf + inf
    y = np.where(special, fma(xs, np.full_like(xs, np.inf), np.full_like(xs, np.inf), ftz=True), y)
    y = np.where(x == 0, np.float32(-np.inf), y)
    return np.where(np.isnan(y), _NAN, y).astype(np.float32)


#: libdevice ``__nv_log2f``'s polynomial, highest degree first (the FP32 bits in the PTX).
LOG2F_POLY = tuple(_f32(b) for b in (0x3DC6B27F, 0xBE2C7F30, 0x3E2FCF2A, 0xBE374E43, 0x3E520BF4, 0xBE763C8B,
                                      0x3E93BF99, 0xBEB8AA49, 0x3EF6384A, 0xBF38AA3B))
_SQRT_HALF_BITS = 0x3F3504F3
_LOG2E_BITS = 0x3FB8AA3B


def log2f(x: npt.ArrayLike) -> np.ndarray:
    """CUDA's ``log2f`` without ``--use_fast_math`` (libdevice ``__nv_log2f``), bit for bit; see the module
    docstring."""
    xf = as_f32(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        small = xf < FP32_MIN_NORMAL
        xs = np.where(small, xf * np.float32(2.0**23), xf).astype(np.float32)
        bits = xs.view(np.int32)
        e_bits = (bits - np.int32(_SQRT_HALF_BITS)) & np.int32(-(1 << 23))
        m = (bits - e_bits).view(np.float32)  # in [sqrt(1/2), sqrt(2))
        e = fma(e_bits.astype(np.float32), np.float32(2.0**-23), np.where(small, np.float32(-23.0), np.float32(0)))
        f = (m - np.float32(1.0)).astype(np.float32)
        p = np.full_like(f, LOG2F_POLY[0])
        for c in LOG2F_POLY[1:]:
            p = fma(p, f, np.full_like(f, c))
        t = (f * (f * p).astype(np.float32)).astype(np.float32)
        y = (e + fma(f, np.full_like(f, _f32(_LOG2E_BITS)), t)).astype(np.float32)
        special = xs.view(np.uint32) >= np.uint32(0x7F800000)  # +inf, NaN, negative: x * inf + inf
        y = np.where(special, fma(xs, np.full_like(xs, np.inf), np.full_like(xs, np.inf)), y)
        y = np.where(xs == 0, np.float32(-np.inf), y)
    return np.where(np.isnan(y), _NAN, y).astype(np.float32)


def log(x: npt.ArrayLike, *, mode: LogMode = "correctly-rounded") -> np.ndarray:
    """ln x in FP32. mode: ``correctly-rounded`` (float64, rounded once), ``sm90`` (``tl.log`` under Triton 3.6:
    libdevice's logf, bit for bit), ``numpy-fast`` (NumPy's float32 log: CPU-dependent)."""
    xf = as_f32(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        if mode == "correctly-rounded":
            return np.log(xf.astype(np.float64)).astype(np.float32)
        if mode == "sm90":
            return _logf_sm90(xf)
        if mode == "numpy-fast":
            return np.log(xf)
    raise ValueError(f"mode: expected 'correctly-rounded', 'sm90' or 'numpy-fast', got {mode!r}")


@cache
def _lg2_tables() -> tuple[np.ndarray, np.ndarray]:
    """MUFU.LG2's FP32 results on every significand of [1, 2) and of [0.5, 1), as float64."""
    with np.load(Path(__file__).with_name("lg2_sm90.npz")) as z:
        out = []
        for key in ("one", "half"):
            first, step = z[f"{key}_first"].astype(np.int64), z[f"{key}_step"].astype(np.int64)
            bits = np.concatenate([first, first + np.cumsum(step)]).astype(np.uint32)
            out.append(bits.view(np.float32).astype(np.float64))
    return out[0], out[1]


def _round_toward_zero(s: np.ndarray) -> np.ndarray:
    """float64 -> FP32, toward zero (exact for the sums here: |s| < 2^8, at most 2^-40 below the FP32 grid)."""
    f = s.astype(np.float32)
    return np.where(np.abs(f.astype(np.float64)) > np.abs(s), np.nextafter(f, np.float32(0)), f)


def lg2_approx(x: npt.ArrayLike, *, ftz: bool = False) -> np.ndarray:
    """PTX ``lg2.approx[.ftz].f32`` on sm_90 (MUFU.LG2), bit for bit; see the module docstring."""
    bits = as_f32(x).view(np.uint32)
    one, half = _lg2_tables()
    field = ((bits >> 23) & 0xFF).astype(np.int64)
    frac = (bits & 0x7FFFFF).astype(np.int64)
    sub = (field == 0) & (frac != 0)
    zero = (field == 0) & ((frac == 0) | (sub & ftz))
    shift = np.where(sub, 23 - np.floor(np.log2(np.maximum(frac, 1))).astype(np.int64), 0)  # to a leading 1
    frac = np.where(sub, (frac << shift) & 0x7FFFFF, frac)
    e = np.where(sub, 24 - 126 - shift, field - 127)  # subnormals: scaled by 2^24 first
    s = e + np.take(one, frac) + np.where(e < 0, 2.0**-40, 0.0)
    y = np.where(e == -1, np.take(half, frac).astype(np.float32), _round_toward_zero(s))
    with np.errstate(over="ignore"):
        y = np.where(sub, (y - np.float32(24.0)).astype(np.float32), y)
    y = np.where(zero, np.float32(-np.inf), y)
    y = np.where(bits == 0x7F800000, np.float32(np.inf), y)
    nan = ((field == 255) & ((bits & 0x7FFFFF) != 0)) | ((bits >> 31 == 1) & ~zero)
    return np.where(nan, _NAN, y).astype(np.float32)
