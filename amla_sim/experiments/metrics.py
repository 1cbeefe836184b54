"""Error metrics against a reference, as the papers define them."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._validate import quiet_fp


def _pair(x: npt.ArrayLike, ref: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore"):
        a, r = np.asarray(x).astype(np.float64), np.asarray(ref).astype(np.float64)
    if a.shape != r.shape:
        raise ValueError(f"x and ref: shapes differ ({a.shape} vs {r.shape})")
    return a, r


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
