"""The inputs of the tensor-core captures (``acc += tl.dot(a, b)`` on an H100/H200), rebuilt from their seed.

A capture stores the device's outputs and the inputs' CRC (:func:`.files.input_crc`); the inputs are regenerated
here (NumPy's PCG64 and :func:`amla_sim.formats.round_to` are deterministic on every platform), which keeps the
committed files small.
"""

from __future__ import annotations

import numpy as np

from ..formats import get_format, round_to

__all__ = ["DOT_DISTRIBUTIONS", "dot_operand"]

#: The input distributions of the tensor-core captures.
DOT_DISTRIBUTIONS = ("normal", "wide", "special")


def dot_operand(fmt: str, dist: str, shape: tuple[int, int], seed: int) -> np.ndarray:
    """An operand of `fmt` for a ``tl.dot`` capture.

    normal: N(0, 1). wide: N(0, 1) * 2^U{-8..8} (U{-5..5} for FP8), exponents spread over many binades.
    special: 10% zeros, 10% subnormals of the format, 2% large values (near the largest finite, at most 2^60),
    the rest N(0, 1)
    (no Inf/NaN: they would poison whole rows).
    """
    f = get_format(fmt)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if dist == "wide":
        span = 5 if f.bits == 8 else 8
        x = x * np.exp2(rng.integers(-span, span + 1, shape))
    elif dist == "special":
        u = rng.random(shape)
        sub = rng.integers(1, 1 << f.mantissa_bits, shape) * f.min_subnormal * rng.choice([-1.0, 1.0], shape)
        # large values, but products of two stay far from FP32 overflow
        big = min(f.max_finite, 2.0**60) * rng.uniform(0.25, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
        x = np.where(u < 0.10, 0.0, np.where(u < 0.20, sub, np.where(u < 0.22, big, x)))
    elif dist != "normal":
        raise ValueError(f"dist: expected one of {DOT_DISTRIBUTIONS}, got {dist!r}")
    return round_to(x, f, overflow="satfinite")
