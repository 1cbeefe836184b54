"""Row reductions in FP32, in a stated order: sequential, pairwise, or the order of Triton's ``tl.sum``.

Every order adds FP32 values with FP32 additions (round to nearest even), so the result is the same on every CPU.
Triton's order (measured on an H200 with Triton 3.6, ``tests/data/triton_reduce.npz``, 100% of rows): the row is
spread over a blocked layout of ``vec`` consecutive elements per thread, ``lanes`` threads of a warp and
``warps`` warps; each thread adds its own elements in register order, then the lanes combine in an xor
butterfly (offsets lanes/2 ... 1), then the warps in an xor tree.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

from .elementwise import as_f32

__all__ = ["row_sum", "row_max", "triton_layout"]

Order = Literal["sequential", "pairwise", "triton"]


def triton_layout(n: int, *, num_warps: int = 4, vec: int = 4) -> tuple[int, int, int]:
    """(vec, lanes, warps) of Triton's default blocked layout along a row of `n` FP32 values (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n: Triton blocks are powers of two, got {n}")
    vec = min(vec, n)
    lanes = min(32, n // vec)
    warps = min(num_warps, max(1, n // (vec * lanes)))
    return vec, lanes, warps


def _sequential(x: np.ndarray) -> np.ndarray:
    acc = x[..., 0]
    for i in range(1, x.shape[-1]):
        acc = acc + x[..., i]
    return acc


def _pairwise(x: np.ndarray) -> np.ndarray:
    n = x.shape[-1]
    if n == 1:
        return x[..., 0]
    h = n // 2
    return _pairwise(x[..., :h]) + _pairwise(x[..., h:])


def _xor_tree(parts: list[np.ndarray]) -> np.ndarray:
    off = len(parts) // 2
    while off >= 1:
        parts = [parts[t] + parts[t ^ off] for t in range(len(parts))]
        off //= 2
    return parts[0]


def _triton(x: np.ndarray, layout: tuple[int, int, int]) -> np.ndarray:
    vec, lanes, warps = layout
    n = x.shape[-1]
    span = vec * lanes * warps
    if n % span:
        raise ValueError(f"layout: {layout} does not tile a row of {n}")
    chunks = n // span
    # (..., chunks, warps, lanes, vec) -> per thread: its registers in order (chunk, vec)
    t = x.reshape(*x.shape[:-1], chunks, warps, lanes, vec)
    t = np.moveaxis(t, -4, -2)  # (..., warps, lanes, chunks, vec)
    per_thread = _sequential(t.reshape(*t.shape[:-2], chunks * vec))  # (..., warps, lanes)
    per_warp = [_xor_tree([per_thread[..., w, i] for i in range(lanes)]) for w in range(warps)]
    return _xor_tree(per_warp)


def row_sum(
    x: npt.ArrayLike, *, order: Order = "sequential", layout: tuple[int, int, int] | None = None
) -> np.ndarray:
    """Sum along the last axis in FP32. `layout` (vec, lanes, warps) for ``triton`` defaults to
    :func:`triton_layout` of the row length."""
    xf = as_f32(x)
    if xf.ndim == 0 or xf.shape[-1] == 0:
        raise ValueError(f"x: expected a non-empty last axis, got shape {xf.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        if order == "sequential":
            return _sequential(xf)
        if order == "pairwise":
            return _pairwise(xf)
        if order == "triton":
            return _triton(xf, layout or triton_layout(xf.shape[-1]))
    raise ValueError(f"order: expected 'sequential', 'pairwise' or 'triton', got {order!r}")


def row_max(x: npt.ArrayLike) -> np.ndarray:
    """Maximum along the last axis (NaN propagates); the same in every order."""
    xf = as_f32(x)
    if xf.ndim == 0 or xf.shape[-1] == 0:
        raise ValueError(f"x: expected a non-empty last axis, got shape {xf.shape}")
    return np.max(xf, axis=-1)
