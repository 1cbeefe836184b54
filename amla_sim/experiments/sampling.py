"""Draw values of a narrow format directly from the distribution of ``round(X)``, X continuous.

Rounding a float64 draw of X to BF16 costs a float64 normal per value plus a rounding pass; a sweep of the AMLA
tables spends most of its non-BLAS time there. The rounded value has a discrete distribution on the format's
codes: a code gets the probability of the interval of reals that round to it (nearest-even; the ties have
probability zero), which the closed-form tail function of |X| gives. Walker's alias method then turns 32 random
bits into one code: the top B - 1 bits pick a bucket (one per magnitude code), the next 32 - B bits are compared
with the bucket's threshold, and the lowest bit is the sign. Probabilities are quantised to multiples of 2^-31;
everything else is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from ..formats import Format, get_format

__all__ = ["TABLE_DISTRIBUTIONS", "sample_rounded"]

TABLE_DISTRIBUTIONS = ("normal", "uniform", "flashmla")


def _tail(name: str, arg: float | None) -> Callable[[float], float]:
    """P(|X| >= t) for t >= 0: X symmetric about zero, so the sign is one fair bit."""
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


@lru_cache(maxsize=64)
def _alias_table(name: str, arg: float | None, fmt_name: str) -> tuple[np.ndarray, int]:
    """(table, threshold bits): Walker's alias method in integers, one uint32 per bucket.

    table[bucket] = (threshold << 1) | (alias << (bits + 1)): a draw keeps the bucket's own code when its
    threshold bits (with the sign bit below them) compare below ``threshold << 1``, else takes the alias. A full
    bucket is its own alias, so a threshold below 2^bits (bits + 1 bits with the shift) always suffices.
    """
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
    bits = 32 - fmt.bits  # threshold bits: (bits - 1) bucket bits + these + 1 sign bit = 32
    total = n << bits  # each of the n buckets holds 2^bits
    w = np.floor(prob / prob.sum() * total).astype(np.int64)
    short = total - int(w.sum())  # largest remainders first: integer weights that sum to total exactly
    w[np.argsort(-(prob / prob.sum() * total - w), kind="stable")[:short]] += 1
    cap = 1 << bits
    thr = np.zeros(n, np.int64)  # with alias = itself, a full bucket keeps its code whatever the threshold
    alias = np.arange(n, dtype=np.int64)
    small = [int(i) for i in np.flatnonzero(w < cap)]
    large = [int(i) for i in np.flatnonzero(w > cap)]
    w = w.tolist()
    while small and large:
        s, g = small.pop(), large[-1]
        thr[s], alias[s] = w[s], g
        w[g] -= cap - w[s]
        if w[g] < cap:
            small.append(large.pop())
        elif w[g] == cap:
            large.pop()
    return ((thr << 1) | (alias << (bits + 1))).astype(np.uint32), bits


def sample_rounded(name: str, arg: float | None, shape: tuple[int, ...], rng: np.random.Generator,
                   fmt: str = "bf16") -> np.ndarray:
    """``shape`` values of `fmt` distributed as X rounded to nearest-even, X the named distribution.

    name: ``normal`` (arg = sigma), ``uniform`` (arg = a), ``flashmla``; fmt: an 8- or 16-bit format.
    """
    f = get_format(fmt)
    if f.bits not in (8, 16) or f.name == "tf32":
        raise ValueError(f"fmt: the table sampler takes 8- and 16-bit formats, got {f.name}")
    table, bits = _alias_table(name, None if arg is None else float(arg), f.name)
    size = math.prod(shape)
    r = rng.bit_generator.random_raw((size + 1) // 2).view(np.uint32)[:size]
    bucket = r >> np.uint32(bits + 1)
    entry = np.take(table, bucket, mode="clip")  # in range by construction; clip skips the bounds check
    low = np.uint32((2 << bits) - 1)  # threshold bits and the sign bit
    code = np.where((r & low) < (entry & low), bucket, entry >> np.uint32(bits + 1))
    code |= (r & np.uint32(1)) << np.uint32(f.bits - 1)  # the sign bit
    return code.astype(f.uint_dtype).view(f.dtype).reshape(shape)
