"""FlashMLA's combine kernel, the part its decodes share: the first warp's sum over the splits' LSEs.

Upstream: deepseek-ai/FlashMLA 9241ae3 ``csrc/smxx/decode/combine/combine.cu`` (the dense and sparse FP8 decodes);
pengcuo/FlashMLA-ETAP 39e6160 ``csrc/flash_fwd_mla_kernel.h`` (``combine_attn_seqk_parallel``) and vllm-project/
FlashMLA 46d64a8 ``csrc/extension/sm90/dense_fp8/flash_fwd_mla_kernel.h`` (``flash_fwd_splitkv_mla_combine_kernel``),
the older generation, whose whole combine :func:`splitkv_combine` is. What the newer decodes do with the sum
(log2 or natural log, the sink, the weights) stays with each decode.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ....arith.reductions import _xor_tree
from ....machines import Machine
from ..fast_math import logf

__all__ = ["combine_sum", "MAX_SPLITS", "combine_width", "splitkv_combine"]

#: The combine kernel's instantiations (``MLA_NUM_SPLITS_SWITCH``): it holds up to 160 splits of a request.
MAX_SPLITS = (32, 64, 96, 128, 160)


def combine_width(parts: int, num_sms: int) -> int:
    """The combine kernel instantiated for `parts` scheduler parts (the most splits a request can have): the
    least of :data:`MAX_SPLITS` that holds them. More than 160 parts is the kernel's ``FLASH_ASSERT(false)``, a
    ValueError naming `num_sms` here."""
    if parts < 1:
        raise ValueError(f"num_sms: {num_sms} SMs give no scheduler part")
    if parts > MAX_SPLITS[-1]:
        raise ValueError(f"num_sms: {num_sms} SMs give {parts} scheduler parts, more splits than FlashMLA's combine "
                         f"kernel holds ({MAX_SPLITS[-1]}: MLA_NUM_SPLITS_SWITCH asserts)")
    return next(n for n in MAX_SPLITS if parts <= n)


def combine_sum(mc: Machine, lse_s: np.ndarray, max_splits: int,
                exp: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The combine kernel's first warp (this FlashMLA commit's and FlashMLA-ETAP's): the splits' LSEs (R, n) padded
    with -inf to `max_splits`, their max M (0 where all are -inf), and ``sum exp(lse_s - M)`` as 32 lanes sum it,
    lane j over splits j, j + 32, ... in order from 0, then an xor butterfly over the lanes."""
    R, n = lse_s.shape
    pad = np.full((R, max_splits), -np.inf, mc.dtype)
    pad[:, :n] = lse_s
    M = np.max(pad, axis=1)
    M = np.where(np.isneginf(M), mc.f(0.0), M).astype(mc.dtype)
    lanes = []
    for lane in range(32):
        acc = np.zeros(R, mc.dtype)
        for k in range(lane, max_splits, 32):
            acc = mc.f(acc + exp(mc.f(pad[:, k] - M)))
        lanes.append(acc)
    return M, _xor_tree(lanes)


def splitkv_combine(mc: Machine, res: list[tuple[np.ndarray, np.ndarray]], max_splits: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The older generation's combine kernel over one request's splits, each (O (R, 512) FP32, lse (R,)): ``M = max
    lse_s`` and the lanes' sum (:func:`combine_sum`, ``expf``), ``g = logf(sum) + M`` (``__logf``, its multiply by
    ln 2 contracted into the add; +inf where the sum is 0 or NaN), and ``sum_s fma(expf(lse_s - g), O_s, .)`` from
    0 in split order. Returns (O, g), O in FP32."""
    dt = mc.dtype
    lse_s = np.stack([r[1] for r in res], axis=1)  # (R, n)
    M, total = combine_sum(mc, lse_s, max_splits, mc.exp)  # expf: exp2(fl(x log2 e))
    bad = (total == 0) | np.isnan(total)
    g = np.where(bad, np.inf, _combine_lse(mc, total, M)).astype(dt)
    acc = np.zeros((lse_s.shape[0], res[0][0].shape[1]), dt)
    for s in range(len(res)):
        w = mc.exp(mc.f(lse_s[:, s] - g))
        acc = mc.mul_add(w[:, None], res[s][0], acc)
    return acc, g


def _combine_lse(mc: Machine, total: np.ndarray, M: np.ndarray) -> np.ndarray:
    """``logf(sum_lse) + max_lse``: ``__logf``'s multiply by ln 2 contracted into the add."""
    return logf(mc, total, M)
