"""Input distributions of the papers' accuracy experiments, drawn reproducibly from a seed."""

from __future__ import annotations

from typing import Literal

import numpy as np

from .._validate import check_int, check_positive_int, quiet_fp
from ..formats import round_to
from .sampling import TABLE_DISTRIBUTIONS, sample_rounded

DISTRIBUTIONS = ("normal:SIGMA", "uniform:A", "flashmla", "fa3-outliers", "rope-outliers")


def parse_dist(spec: str) -> tuple[str, float | None]:
    """``"normal:2"`` -> ("normal", 2.0); ``"flashmla"`` -> ("flashmla", None). Errors name the argument."""
    name, _, arg = spec.partition(":")
    if name in ("normal", "uniform"):
        try:
            value = float(arg)
        except ValueError:
            raise ValueError(f"dist: {name} needs a number, as in {name}:2, got {spec!r}") from None
        if not np.isfinite(2 * value) or value <= 0:  # uniform draws from a range of width 2a
            raise ValueError(f"dist: {name}'s parameter must be positive and below 8e307, got {spec!r}")
        return name, value
    if name in ("flashmla", "fa3-outliers", "rope-outliers") and not arg:
        return name, None
    raise ValueError(f"dist: expected one of {DISTRIBUTIONS}, got {spec!r}")


def _draw(name: str, arg: float | None, shape: tuple[int, ...], rng: np.random.Generator, d_v: int) -> np.ndarray:
    # in place where a step is one operation on the draws (the same bits, one array of tens of millions fewer)
    if name == "normal":  # N(0, sigma^2)
        x = rng.standard_normal(shape)
        x *= arg
        return x
    if name == "uniform":  # U(-a, a)
        return rng.uniform(-arg, arg, shape)
    if name == "flashmla":  # FlashMLA's test: randn / 10 clamped to [-1, 1]
        x = rng.standard_normal(shape)
        x /= 10
        return np.clip(x, -1, 1, out=x)
    if name == "fa3-outliers":  # FA3's: N(0, 1) + N(0, 100) * Bernoulli(0.001)
        return rng.standard_normal(shape) + rng.standard_normal(shape) * 10 * (rng.random(shape) < 0.001)
    # rope-outliers: content N(0, 9) clipped to +-10; RoPE N(0, 1) with 0.1% outliers of 500-1000
    x = np.clip(rng.standard_normal(shape) * 3, -10, 10)
    rope = rng.standard_normal(shape[:-1] + (shape[-1] - d_v,))
    spikes = rng.random(rope.shape) < 0.001
    rope = np.where(spikes, rng.uniform(500, 1000, rope.shape) * np.sign(rope), rope)
    x[..., d_v:] = rope
    return x


@quiet_fp
def make_inputs(
    dist: str, *, batch: int = 1, heads: int = 128, sq: int = 1, context: int = 8192, d_k: int = 576,
    d_v: int = 512, seed: int = 0, fmt: str = "bf16", sampler: Literal["round", "table"] = "round",
) -> tuple[np.ndarray, np.ndarray]:
    """q: (batch, sq, heads, d_k) and kv: (batch, context, d_k), drawn from `dist` and rounded to `fmt`.

    sampler: ``round`` draws float64 values and rounds them (the captures and examples use it); ``table``
    draws the rounded values directly from their exact distribution (:mod:`.sampling`; several times faster,
    for sweeps; normal, uniform and flashmla into 8- and 16-bit formats). The two give different draws of the
    same distribution.
    """
    for arg, v in (("batch", batch), ("heads", heads), ("sq", sq), ("context", context), ("d_k", d_k)):
        check_positive_int(v, arg)
    check_int(d_v, "d_v", lo=1, hi=d_k)
    check_int(seed, "seed", lo=0)
    if sampler not in ("round", "table"):
        raise ValueError(f"sampler: expected 'round' or 'table', got {sampler!r}")
    name, a = parse_dist(dist)
    rng = np.random.default_rng(seed)
    if sampler == "table":
        if name not in TABLE_DISTRIBUTIONS:
            raise ValueError(f"sampler: 'table' takes the distributions {TABLE_DISTRIBUTIONS}, not {dist!r}")
        return (sample_rounded(name, a, (batch, sq, heads, d_k), rng, fmt),
                sample_rounded(name, a, (batch, context, d_k), rng, fmt))
    q = _draw(name, a, (batch, sq, heads, d_k), rng, d_v)
    kv = _draw(name, a, (batch, context, d_k), rng, d_v)
    return round_to(q, fmt), round_to(kv, fmt)
