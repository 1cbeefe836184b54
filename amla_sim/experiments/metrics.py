"""Error metrics against a reference, as the papers define them, and their statistics over samples."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from .._validate import quiet_fp


def _pair(x: npt.ArrayLike, ref: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore"):
        a, r = np.asarray(x).astype(np.float64), np.asarray(ref).astype(np.float64)
    if a.shape != r.shape:
        raise ValueError(f"x and ref: shapes differ ({a.shape} vs {r.shape})")
    return a, r

NONFINITE_FOOTNOTE = ("NaN or inf: samples whose metric is not finite, left out of the mean, median and s.e. "
                      "(nan where no sample is finite).")


@quiet_fp
def rel_frobenius(x: npt.ArrayLike, ref: npt.ArrayLike) -> float:
    """||x - ref||_F / ||ref||_F (the AMLA paper's Tables 3 and 4)."""
    a, r = _pair(x, ref)
    return float(np.linalg.norm(a - r) / np.linalg.norm(r))


@quiet_fp
def rmse(x: npt.ArrayLike, ref: npt.ArrayLike) -> float:
    """Root mean square error (ETAP's Table 1, SnapMLA's Table 2)."""
    a, r = _pair(x, ref)
    return float(np.sqrt(np.mean((a - r) ** 2)))


@quiet_fp
def cos_diff(x: npt.ArrayLike, ref: npt.ArrayLike) -> float:
    """FlashMLA's 1 - 2 sum(x y) / sum(x^2 + y^2)."""
    a, r = _pair(x, ref)
    return float(1.0 - 2.0 * np.sum(a * r) / np.sum(a * a + r * r))


@quiet_fp
def max_abs(x: npt.ArrayLike, ref: npt.ArrayLike) -> float:
    a, r = _pair(x, ref)
    return float(np.max(np.abs(a - r)))


@quiet_fp
def all_metrics(x: npt.ArrayLike, ref: npt.ArrayLike) -> dict[str, float]:
    return {"rel_frobenius": rel_frobenius(x, ref), "rmse": rmse(x, ref), "cos_diff": cos_diff(x, ref),
            "max_abs": max_abs(x, ref)}


def sample_stats(values: Iterable[float]) -> dict[str, Any]:
    """One metric over samples: the mean, median and standard error of the mean (None below two) of the finite
    samples (NaN where none is finite), and how many samples were NaN and how many infinite."""
    vals = [float(v) for v in values]
    finite = [v for v in vals if math.isfinite(v)]
    nan = sum(map(math.isnan, vals))
    return {"mean": _mean(finite), "median": _median(finite), "sem": _sem(finite), "nan": nan,
            "inf": len(vals) - len(finite) - nan}


def _mean(finite: list[float]) -> float:
    if not finite:
        return math.nan
    try:
        return statistics.fmean(finite)
    except OverflowError:  # a sum past the largest float: the mean of the scaled values
        return statistics.fmean(v / len(finite) for v in finite) * len(finite)


def _median(finite: list[float]) -> float:
    if not finite:
        return math.nan
    median = statistics.median(finite)
    if math.isinf(median):  # the two middle values' sum past the largest float: halve them first
        s = sorted(finite)
        median = s[len(s) // 2 - 1] / 2 + s[len(s) // 2] / 2
    return median


def _sem(finite: list[float]) -> float | None:
    if len(finite) < 2:
        return None
    try:
        return statistics.stdev(finite) / math.sqrt(len(finite))
    except OverflowError:  # a spread past the largest float
        return math.inf


def nonfinite_note(stats: dict[str, Any], samples: int) -> str:
    """What a table says beside a metric some of whose samples were not finite (left out of its statistics):
    such as ``" (NaN in 1 of 3 samples)"``; ``""`` where every sample was finite."""
    parts = [f"{label} in {stats[key]}" for key, label in (("nan", "NaN"), ("inf", "inf")) if stats[key]]
    return f" ({', '.join(parts)} of {samples} samples)" if parts else ""
