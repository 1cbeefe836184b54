"""A clock around the BLAS matrix products of the fast and golden paths, so that sweeps can report how much of
their time is the bare matmuls (the yardstick of the reproduction's performance target)."""

from __future__ import annotations

import time

import numpy as np

_elapsed = 0.0


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.matmul, timed."""
    global _elapsed
    t0 = time.perf_counter()
    out = np.matmul(a, b)
    _elapsed += time.perf_counter() - t0
    return out


def elapsed() -> float:
    """Seconds spent in :func:`matmul` by this process so far."""
    return _elapsed
