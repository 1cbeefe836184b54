"""The table sampler: its weights hold the exact probabilities of the rounded values, and it draws them."""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np
import pytest

from amla_sim.experiments.inputs import make_inputs
from amla_sim.experiments.sampling import _tables, _weights, sample_rounded
from amla_sim.formats import get_format, round_to


def _table_probabilities(name, arg, fmt_name):
    """The integer weight the sampler gives each magnitude code, and their total (2^31)."""
    w = _weights(name, arg, fmt_name)
    assert (w >= 0).all()
    return w, 1 << 31


def _interval_probability(v_prev: float, v: float, v_next: float, tail) -> float:
    """P(round(|X|) = v) from the code's neighbours: reals between the midpoints round to v."""
    return tail((v_prev + v) / 2 if v > 0 else 0.0) - tail((v + v_next) / 2)


@pytest.mark.parametrize(
    "name, arg, fmt",
    [("normal", 1.0, "bf16"), ("normal", 10.0, "bf16"), ("uniform", 60.0, "bf16"), ("uniform", 1.0, "fp16"),
     ("flashmla", None, "bf16"), ("normal", 1.0, "e4m3"), ("normal", 2.0, "e5m2")],
)
def test_weights_hold_the_rounded_distribution(name, arg, fmt):
    f = get_format(fmt)
    tail = {"normal": lambda t: math.erfc(t / (arg * math.sqrt(2))), "uniform": lambda t: max(0.0, 1 - t / arg),
            "flashmla": lambda t: math.erfc(10 * t / math.sqrt(2)) if t <= 1 else 0.0}[name]
    got, total = _table_probabilities(name, arg, fmt)
    assert int(got.sum()) == total
    codes = np.arange(got.size, dtype=f.uint_dtype)
    with np.errstate(invalid="ignore"):  # the NaN codes widen to NaN, which is the point
        vals = codes.view(f.dtype).astype(np.float64)
    finite = np.flatnonzero(np.isfinite(vals))
    worst = 0.0
    for i in finite:  # positive codes are ordered by value: the neighbours are the codes beside it
        v = vals[i]
        prev = vals[i - 1] if i > 0 else 0.0
        nxt = vals[i + 1] if i + 1 < vals.size and np.isfinite(vals[i + 1]) else v + (v - prev)
        want = _interval_probability(prev, v, nxt, tail)
        worst = max(worst, abs(got[i] / total - want))
    assert worst < 2.0**-31 + 1e-15
    if name == "uniform":  # a rational distribution: the masses are exact fractions, check one exactly
        i = int(np.searchsorted(vals[finite], arg / 3))
        v, prev, nxt = (Fraction(float(vals[finite][j])) for j in (i, i - 1, i + 1))
        exact = ((v + nxt) / 2 - (prev + v) / 2) / Fraction(arg)
        assert abs(Fraction(int(got[finite][i]), total) - exact) < Fraction(1, 2**31)


@pytest.mark.parametrize("fmt", ["bf16", "e4m3"])
def test_draws_decode_the_bits_as_documented(fmt):
    """Re-derive draws from the raw random words by the documented rule alone (top bit: sign; the low 31 bits
    u: the first code whose cumulative weight exceeds u), with no guide table: both of the sampler's paths."""
    cum = np.cumsum(_weights("normal", 1.0, fmt)).tolist()
    bits = get_format(fmt).bits
    n, seed = 20_000, 7
    x = sample_rounded("normal", 1.0, (n,), np.random.default_rng(seed), fmt)
    words = np.random.default_rng(seed).bit_generator.random_raw((n + 1) // 2).view(np.uint32)[:n]
    got = x.view(np.uint16 if bits == 16 else np.uint8).tolist()
    want = [bisect.bisect_right(cum, w & 0x7FFFFFFF) | (w >> 31) << (bits - 1) for w in words.tolist()]
    assert got == want
    _, guide = _tables("normal", 1.0, fmt)
    straddled = (guide[words >> 15] == 0xFFFF).mean()
    assert 0 < straddled < 0.1  # both paths ran


@pytest.mark.parametrize("name, arg", [("normal", 1.0), ("normal", 10.0), ("uniform", 3.0), ("flashmla", None)])
def test_draws_match_rounded_float64_draws(name, arg):
    """Frequencies of the table sampler against rounding float64 draws (fixed seeds: no flakiness): the chi^2
    statistic over the 40 most likely codes stays below its 0.999 quantile (about 73 for 39 degrees of freedom)."""
    n = 400_000
    x = sample_rounded(name, arg, (n,), np.random.default_rng(1), "bf16").astype(np.float64)
    rng = np.random.default_rng(2)
    src = {"normal": lambda: rng.standard_normal(n) * arg, "uniform": lambda: rng.uniform(-arg, arg, n),
           "flashmla": lambda: np.clip(rng.standard_normal(n) / 10, -1, 1)}[name]()
    y = round_to(src, "bf16").astype(np.float64)
    vals, counts = np.unique(np.concatenate([x, y]), return_counts=True)
    top = vals[np.argsort(-counts)[:40]]
    cx = np.array([(x == v).sum() for v in top])
    cy = np.array([(y == v).sum() for v in top])
    chi2 = float((((cx - cy) ** 2) / (cx + cy)).sum())
    assert chi2 < 73, chi2
    assert abs(x.mean() - y.mean()) < 6 * x.std() / math.sqrt(n)


def test_make_inputs_table_sampler_shapes_and_errors():
    q, kv = make_inputs("normal:2", heads=4, context=16, sampler="table", seed=3)
    assert q.shape == (1, 1, 4, 576) and kv.shape == (1, 16, 576) and q.dtype == kv.dtype == get_format("bf16").dtype
    q2, kv2 = make_inputs("normal:2", heads=4, context=16, sampler="table", seed=3)
    assert np.array_equal(q.view(np.uint16), q2.view(np.uint16)) and np.array_equal(kv.view(np.uint16), kv2.view(np.uint16))
    with pytest.raises(ValueError, match="sampler"):
        make_inputs("fa3-outliers", heads=4, context=16, sampler="table")
    with pytest.raises(ValueError, match="sampler"):
        make_inputs("normal:1", heads=4, context=16, sampler="fast")
    with pytest.raises(ValueError, match="fmt"):
        make_inputs("normal:1", heads=4, context=16, sampler="table", fmt="fp32")
