"""FP8 quantizers of SnapMLA and its ablation configs: one function, granularity as a parameter.

``quantize(x, granularity, ...)`` returns ``(x8, s)`` with ``x ~ x8 * s``: x8 in E4M3 (satfinite on machines that
saturate, as Triton's casts do) and s the FP32 scale broadcastable to x. The scale is ``max(amax, 1e-26) / 448``
over the group that shares it.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from .._validate import quiet_fp
from ..formats import FORMATS, is_float_dtype
from ..machines import Machine

Granularity = Literal["per-token", "per-tensor-static", "per-tensor-dynamic", "per-block"]
GRANULARITIES = ("per-token", "per-tensor-static", "per-tensor-dynamic", "per-block")
E4M3_MAX = FORMATS["e4m3"].max_finite  # 448
SCALE_FLOOR = 1e-26


@quiet_fp
def scales(x: np.ndarray, granularity: Granularity, machine: Machine, *, block: int = 64) -> np.ndarray:
    """Scales of shape broadcastable to x (..., tokens, dims): the group is a token, the tensor, or a block of
    `block` tokens (per batch element); static: 1.0."""
    mc = machine
    if not is_float_dtype(np.asarray(x).dtype):
        raise TypeError(f"x: expected a float array (float16/32/64, bfloat16), got dtype {np.asarray(x).dtype}")
    ax = np.abs(mc.f(x))
    if granularity == "per-token":
        amax = ax.max(axis=-1, keepdims=True)
    elif granularity == "per-tensor-static":
        return np.ones((1,) * x.ndim, mc.dtype)
    elif granularity == "per-tensor-dynamic":
        amax = ax.reshape(x.shape[0], -1).max(axis=-1).reshape((x.shape[0],) + (1,) * (x.ndim - 1))
    elif granularity == "per-block":
        if not isinstance(block, (int, np.integer)) or block < 1:
            raise ValueError(f"block: expected a positive int, got {block!r}")
        n = x.shape[-2]
        pad = -n % block
        a = np.concatenate([ax, np.zeros((*ax.shape[:-2], pad, ax.shape[-1]), ax.dtype)], axis=-2)
        amax = a.reshape(*ax.shape[:-2], -1, block, ax.shape[-1]).max(axis=(-1, -2))
        amax = np.repeat(amax, block, axis=-1)[..., :n, None]
    else:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    return (np.maximum(amax, mc.f(SCALE_FLOOR)) / mc.f(E4M3_MAX)).astype(mc.dtype)


@quiet_fp
def quantize(
    x: np.ndarray, granularity: Granularity, machine: Machine, *, block: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """(x8, s): x8 = e4m3(x / s) in the machine's FP8 cast, s from :func:`scales`."""
    s = scales(x, granularity, machine, block=block)
    return machine.cast(machine.f(x) / s, "e4m3"), s
