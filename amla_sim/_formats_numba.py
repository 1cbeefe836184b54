"""Compiled rounding for the ``numba`` engine (the ``[fast]`` extra): the same bits as :mod:`.formats`."""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(cache=True, nogil=True)
def stochastic_bits(u: np.ndarray, r: np.ndarray, drop: int, lo: np.uint32, hi: np.uint32):
    """FP32 bits u rounded stochastically to `drop` fewer fraction bits with raw draws r (see
    ``formats._stochastic_fp32``); also the indices whose magnitude is outside [lo, hi), for the general path."""
    y = np.empty_like(u)
    keep = np.uint32(~((1 << drop) - 1) & 0xFFFFFFFF)
    shift = np.uint64(64 - drop)
    n_slow = 0
    for i in range(u.size):
        v = u[i]
        up = np.uint32(np.uint32(r[i] >> shift) < (v & ~keep))
        y[i] = (v & keep) + (up << np.uint32(drop))
        a = v & np.uint32(0x7FFFFFFF)
        n_slow += np.int64(a - lo >= hi - lo)  # outside [lo, hi), as one unsigned comparison
    slow = np.empty(n_slow, np.int64)
    if n_slow:
        k = 0
        for i in range(u.size):
            if (u[i] & np.uint32(0x7FFFFFFF)) - lo >= hi - lo:
                slow[k] = i
                k += 1
    return y, slow
