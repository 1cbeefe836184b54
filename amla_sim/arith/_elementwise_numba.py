"""Compiled elementwise units for the ``numba`` engine (the ``[fast]`` extra): the same bits as
:mod:`.elementwise`, in one pass over the data instead of a dozen NumPy passes.

- :func:`fma`: ``fl32(a b + c)`` through float64 with round-to-odd (:func:`.elementwise.fma`).
- :func:`mufu_ex2`: the MUFU.EX2 unit from its measured table (:func:`.elementwise._mufu_ex2`).

Where an operand is NaN, :func:`fma` answers None and the caller takes the NumPy path: with two NaN operands the
payload that survives depends on the order in which the CPU instruction receives them, which the compiler is
free to swap.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba.core import types
from numba.extending import intrinsic

_FRAC = (1 << 23) - 1
_NAN_BITS = np.int32(0x7FFFFFFF)
_EXP64 = np.uint64(0x7FF0_0000_0000_0000)


@intrinsic
def _bits64(typingctx, x):
    """A float64's bits as a uint64 (a register move)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint64))
    return types.uint64(types.float64), codegen


@intrinsic
def _float64(typingctx, u):
    """The float64 whose bits are the uint64 u."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))
    return types.float64(types.uint64), codegen


@nb.njit(cache=True, nogil=True)
def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray, out: np.ndarray) -> bool:
    """out = fl32(a b + c), flat float32 arrays of one size; False (out incomplete) where an operand is NaN."""
    nan = False
    for i in range(out.size):
        x, y, z = a[i], b[i], c[i]
        nan |= (x != x) | (y != y) | (z != z)
        p = np.float64(x) * np.float64(y)  # exact: 24 x 24 significand bits
        c64 = np.float64(z)
        s = p + c64
        bb = s - p  # TwoSum: err is the exact rounding error of s
        err = (p - (s - bb)) + (c64 - bb)
        u = _bits64(s)
        if (err != 0.0) & ((u & np.uint64(1)) == np.uint64(0)) & ((u & _EXP64) != _EXP64):
            # round to odd: one ulp toward the exact sum (s is never 0 here: a zero sum is exact)
            u = u + np.uint64(1) if (err > 0.0) == (s > 0.0) else u - np.uint64(1)
        out[i] = np.float32(_float64(u))
    return not nan


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray | None:
    """fl32(a b + c) for float32 arrays (broadcast together), or None where an operand is NaN."""
    shape = np.broadcast_shapes(a.shape, b.shape, c.shape)
    size = int(np.prod(shape))
    # an operand of the full size is itself in order; a broadcast one is copied out (never a broadcast view, which
    # numba would take as writeable)
    flat = [np.ascontiguousarray(v).reshape(-1) if v.size == size else np.broadcast_to(v, shape).reshape(-1)
            for v in (a, b, c)]
    out = np.empty(shape, np.float32)
    return out if _fma(*flat, out.reshape(-1)) else None


@nb.njit(cache=True, nogil=True)
def _ex2(x: np.ndarray, table: np.ndarray, ftz: bool, out: np.ndarray) -> None:
    """out (int32 bits) = MUFU.EX2 of the flat float32 array x; ftz: subnormal inputs read as zero."""
    for i in range(x.size):
        v = x[i]
        if v != v:
            out[i] = _NAN_BITS
            continue
        if ftz and abs(v) < np.float32(2.0**-126):
            v = np.float32(0.0)
        fixed = np.trunc(min(abs(v), np.float32(255.99998)) * np.float32(2.0**23))  # exact, toward zero
        A = np.int32(fixed)
        X = A if v >= 0 else (-A if (A & _FRAC) == 0 else ~A)  # ~A = -A - 1: the fraction complemented
        biased = (X >> 23) + 127  # 2^x = M 2^(n - 23): FP32 bits (n + 127) << 23 | M - 2^23
        if biased < 1:
            out[i] = 0  # flushed to +0
        elif biased > 254:
            out[i] = 0x7F800000
        else:
            out[i] = table[X & _FRAC] | (biased << 23)


def mufu_ex2(x: np.ndarray, table: np.ndarray, *, ftz: bool = False) -> np.ndarray:
    """MUFU.EX2 of float32 x (any shape) from the unit's table of significand bits, one per 23-bit fraction."""
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(flat.size, np.int32)
    _ex2(flat, table, ftz, out)
    return out.view(np.float32).reshape(np.shape(x))
