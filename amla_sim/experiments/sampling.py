"""Draw values of a narrow format directly from the distribution of ``round(X)``, X continuous.

Rounding a float64 draw of X to BF16 costs a float64 normal per value plus a rounding pass; a sweep of the AMLA
tables spent most of its non-BLAS time there. The rounded value has a discrete distribution on the format's
codes: a code gets the probability of the interval of reals that round to it (nearest-even; the ties have
probability zero), which the closed-form tail function of ``|X|`` gives. Those probabilities, as integer weights
summing to 2^31 (each off by less than 2^-31), are sampled by inversion from 32 random bits: the top bit is the
sign, the other 31 a uniform integer u, and the magnitude code is the first whose cumulative weight exceeds u.
A guide table indexed by the sign and the top 16 bits of u answers directly wherever its bucket lies inside one
code's range; the few buckets that straddle a boundary are settled by a binary search.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from ..formats import Format, get_format

__all__ = ["TABLE_DISTRIBUTIONS", "sample_rounded"]

#: The distributions the exact sampler of rounded values draws.
TABLE_DISTRIBUTIONS = ("normal", "uniform", "flashmla")


def _tail(name: str, arg: float | None) -> Callable[[float], float]:
    """``P(|X| >= t)`` for t >= 0: X symmetric about zero, so the sign is one fair bit."""
    if name == "normal":  # N(0, sigma^2)
        s = float(arg) * math.sqrt(2.0)
        return lambda t: math.erfc(t / s)
    if name == "uniform":  # U(-a, a)
        return lambda t: max(0.0, 1.0 - t / float(arg))
    if name == "flashmla":  # clip(N(0, 1) / 10, -1, 1): the clip piles the tail onto +-1
        return lambda t: math.erfc(10.0 * t / math.sqrt(2.0)) if t <= 1.0 else 0.0
    raise ValueError(f"dist: the table sampler takes {TABLE_DISTRIBUTIONS}, got {name!r}")


def _magnitudes(fmt: Format) -> np.ndarray:
    """Value of every code with the sign bit clear, as float64 (NaN codes give NaN)."""
    codes = np.arange(1 << (fmt.bits - 1), dtype=fmt.uint_dtype)
    with np.errstate(invalid="ignore"):
        return codes.view(fmt.dtype).astype(np.float64)


_STRADDLE = np.uint16(0xFFFF)  # a guide entry that straddles a boundary (no code of 8 or 16 bits is 0xFFFF)
_GUIDE_BITS = 16  # buckets per sign: 2^16 of 2^15 values of u each


@lru_cache(maxsize=64)
def _weights(name: str, arg: float | None, fmt_name: str) -> np.ndarray:
    """Integer weight of every magnitude code (sign bit clear), in units of 2^-31, summing to 2^31 exactly."""
    fmt = get_format(fmt_name)
    mags = _magnitudes(fmt)
    n = mags.size
    finite = np.isfinite(mags)
    order = np.argsort(np.where(finite, mags, np.inf), kind="stable")
    ranked = order[: int(finite.sum())]  # finite codes by increasing magnitude
    vals = mags[ranked]
    # every real in [lo, hi) rounds to the code: the boundaries are the midpoints to the neighbours
    hi = np.append((vals[:-1] + vals[1:]) / 2, vals[-1] + (vals[-1] - vals[-2]) / 2)
    lo = np.concatenate([[0.0], hi[:-1]])
    tail = _tail(name, arg)
    t_lo = np.array([tail(float(v)) for v in lo])
    t_hi = np.array([tail(float(v)) for v in hi])
    prob = np.zeros(n)
    prob[ranked] = t_lo - t_hi
    if fmt.has_inf:  # beyond the last boundary a value overflows to Inf
        prob[np.flatnonzero(np.isinf(mags))[0]] = t_hi[-1]
    else:  # e4m3fn has no Inf: the tail would round to NaN; no table distribution reaches it
        prob[ranked[-1]] += t_hi[-1]
    total = 1 << 31
    scaled = prob / prob.sum() * total
    w = np.floor(scaled).astype(np.int64)
    short = total - int(w.sum())  # largest remainders first: integer weights that sum to 2^31 exactly
    w[np.argsort(-(scaled - w), kind="stable")[:short]] += 1
    return w


@lru_cache(maxsize=64)
def _tables(name: str, arg: float | None, fmt_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative weights, guide): code(u) = first index with cum > u; guide[sign << 16 | u >> 15] is the signed
    code when the whole bucket maps to one code, else :data:`_STRADDLE`."""
    fmt = get_format(fmt_name)
    cum = np.cumsum(_weights(name, arg, fmt_name))
    starts = np.arange(1 << _GUIDE_BITS, dtype=np.int64) << (31 - _GUIDE_BITS)
    first = np.searchsorted(cum, starts, side="right")
    last = np.searchsorted(cum, starts + (1 << (31 - _GUIDE_BITS)) - 1, side="right")
    half = np.where(first == last, first, int(_STRADDLE)).astype(np.uint16)
    sign = np.uint16(1 << (fmt.bits - 1))
    guide = np.concatenate([half, np.where(half == _STRADDLE, _STRADDLE, half | sign)])
    return cum, guide


def sample_rounded(name: str, arg: float | None, shape: tuple[int, ...], rng: np.random.Generator,
                   fmt: str = "bf16") -> np.ndarray:
    """``shape`` values of `fmt` distributed as X rounded to nearest-even, X the named distribution.

    name: ``normal`` (arg = sigma), ``uniform`` (arg = a), ``flashmla``; fmt: an 8- or 16-bit format.
    """
    f = get_format(fmt)
    if f.bits not in (8, 16) or f.name == "tf32":
        raise ValueError(f"fmt: the table sampler takes 8- and 16-bit formats, got {f.name}")
    cum, guide = _tables(name, None if arg is None else float(arg), f.name)
    size = math.prod(shape)
    r = rng.bit_generator.random_raw((size + 1) // 2).view(np.uint32)[:size]
    code = np.take(guide, r >> np.uint32(31 - _GUIDE_BITS), mode="clip")  # in range by construction
    fix = np.flatnonzero(code == _STRADDLE)
    if fix.size:
        rf = r[fix]
        mag = np.searchsorted(cum, rf & np.uint32(0x7FFFFFFF), side="right").astype(np.uint16)
        code[fix] = mag | ((rf >> np.uint32(31)).astype(np.uint16) << np.uint16(f.bits - 1))
    return code.astype(f.uint_dtype).view(f.dtype).reshape(shape)
