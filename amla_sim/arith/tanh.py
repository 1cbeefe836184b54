"""MUFU.TANH, PTX ``tanh.approx.f32`` on sm_90, bit for bit: what FlashAttention-3's softcap computes
(``cutlass::fast_tanh``).

Measured on an H200 on every FP32 of the binades 2^-8 to 2^4, both signs, and on 4 million random inputs below 2^-8
and the special values (``scripts/probe_tanh.py``; the summary in ``tests/data/mufu_tanh_h200.json``):

- the unit is odd; a NaN gives the canonical NaN 0x7FFFFFFF;
- every ``|x| < 2^-8``, zeros and subnormals included, gives x itself (the correctly rounded tanh for
  ``|x| < 2^-12``, up to 85 ULP above it just under 2^-8);
- every ``|x| >= 8``, infinities included, gives +-1;
- between, the unit reads only the fraction's top bits (17 in [2^-8, 2^-5), 18 in [2^-5, 2^-3), 19 in [2^-3, 1), 20
  in [1, 2) and [4, 8), 21 in [2, 4)): its output is constant over the inputs that share them, and a table measured
  on each of those 7.2 million inputs gives it (``tanh_sm90.npz``, built by ``scripts/make_mufu_tables.py --tanh``:
  per binade the run length and the outputs as the first and its steps). It is up to 134 ULP from the correctly
  rounded tanh, in [1, 2).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .elementwise import as_f32

__all__ = ["tanh_approx"]

_LO, _HI = -8, 2  # the binades the table covers: 2^-8 <= |x| < 2^3
_NAN_BITS = 0x7FFFFFFF
_ONE_BITS = 0x3F800000


@cache
def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per covered binade its run length's log2, the offset of its runs in one array, and that array: the output bits
    of every run (int32)."""
    with np.load(Path(__file__).with_name("tanh_sm90.npz")) as z:
        shifts, parts = [], []
        for e in range(_LO, _HI + 1):
            first, step = z[f"e{e}_first"].astype(np.int64), z[f"e{e}_step"].astype(np.int64)
            shifts.append(int(z[f"e{e}_shift"]))
            parts.append(np.concatenate([[first], first + np.cumsum(step)]).astype(np.int32))
    offsets = np.cumsum([0] + [p.size for p in parts[:-1]])
    return np.array(shifts, np.int32), offsets.astype(np.int64), np.concatenate(parts)


def tanh_approx(x: npt.ArrayLike) -> np.ndarray:
    """``tanh.approx.f32`` of FP32 `x` on sm_90 (the module docstring): float32, the shape of x. Values of another
    float type must be FP32 values (a ValueError naming ``x`` otherwise)."""
    xf = as_f32(x)
    bits = xf.view(np.uint32)
    mag = bits & np.uint32(0x7FFFFFFF)
    sign = bits & np.uint32(0x80000000)
    e = (mag >> np.uint32(23)).astype(np.int32) - 127
    inside = (e >= _LO) & (e <= _HI)
    shifts, offsets, table = _tables()
    j = np.clip(e - _LO, 0, _HI - _LO)
    frac = (mag & np.uint32((1 << 23) - 1)).astype(np.int64)
    y = np.take(table, np.where(inside, offsets[j] + (frac >> shifts[j]), 0)).astype(np.uint32)
    y = np.where(inside, y, np.where(e < _LO, mag, np.uint32(_ONE_BITS))) | sign
    y = np.where(mag > np.uint32(0x7F800000), np.uint32(_NAN_BITS), y)
    return y.view(np.float32)
