"""FlashMLA's combine kernel, the part its decodes share: the first warp's sum over the splits' LSEs.

Upstream: deepseek-ai/FlashMLA 9241ae3 ``csrc/smxx/decode/combine/combine.cu`` (the dense and sparse FP8 decodes);
pengcuo/FlashMLA-ETAP 39e6160 ``csrc/flash_fwd_mla_kernel.h`` (``combine_attn_seqk_parallel``). What each decode
does with the sum (log2 or natural log, the sink, the weights) stays with its decode.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ....arith.reductions import _xor_tree
from ....machines import Machine

__all__ = ["combine_sum", "MAX_SPLITS", "combine_width"]

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
