"""Compiled T-FDPA chains for the ``numba`` engine (the ``[fast]`` extra): what :func:`..mma.t_fdpa` computes,
element for element and bit for bit, for finite operands.

One output element and one block of L products, with the incoming accumulator c:

    e_max = max(ea_k + eb_k over the block, exponent of c)      # zeros: see below
    S     = trunc(c 2^(F - e_max)) + sum_k trunc(a_k b_k 2^(F - e_max))
    d     = round(S 2^(e_max - F))

Every step is exact: a_k b_k has at most 22 significant bits, the scalings are powers of two, each truncated
term is below 2^(F + 2) and S below 2^40. The terms go in FP32 with an int32 sum where that is provably exact,
else in float64 (see ``block`` in :func:`_make_block`). A tile of columns of B stays in cache while every row of A
meets it. L is a constant of the compiled code (one chain per L), so the loop over a block's products unrolls
and the loops over a tile's columns are vector code, 32-bit and 64-bit lanes in separate loops. Zero products and
a zero c count with the row's ``e_zero`` (never, for rows without one); an all-zero block gives +0, as the device
does. A non-finite c goes through unchanged (the products are finite here), as in the reference.
"""

from __future__ import annotations

import math
import types

import numba as nb
import numpy as np

OUTPUT_CODES = {"fp32-rz": 0, "e8m13-rz": 1, "fp32-rne": 2, "fp16-rne": 3}
_TILE = 512  # columns per task at most: the fastest of 64-1024 on benchmarks/bench_mma.py
_ROW_CHUNKS = 4  # a product of one tile and no batch is cut into this many row ranges (tasks for the threads)
_NO_E_ZERO = -(1 << 20)  # e_zero of rows whose zeros never set e_max
_ZERO_FLOOR = -4000  # e_max below this: every product and c are zero (zero operands carry -8000)
_EXP_MASK = np.uint64(0x7FF0_0000_0000_0000)  # a float64's exponent field: all ones for Inf and NaN
_u = np.uint64  # an unsigned index: no negative-index fix-up, so loads along a row stay vector loads


@nb.njit(cache=True, nogil=True)
def _round_fp16_rne(v: float) -> float:
    """v (exact float64) rounded to FP16, nearest even, Inf past the largest finite."""
    av = abs(v)
    if av == 0.0 or not np.isfinite(v):
        return v
    e = max(math.frexp(av)[1] - 1, -14)  # quantum 2^(e - 10); subnormals share 2^-24
    q = math.ldexp(np.rint(math.ldexp(av, 10 - e)), e - 10)
    if q > 65504.0:
        q = np.inf
    return q if v > 0 else -q


@nb.njit(cache=True, nogil=True)
def _round_output(v: float, out_code: int) -> float:
    """The row's final normalisation of an exact float64 value (the reference: ``formats.round_accumulator``)."""
    if out_code == 2:
        return np.float64(np.float32(v))
    if out_code == 3:
        return _round_fp16_rne(v)
    av = abs(v)
    if av >= 3.402823669209385e38:  # 2^128: overflow
        return np.inf if v > 0 else -np.inf
    bits = 23 if out_code == 0 else 13
    if av < 1.1754943508222875e-38:  # FP32's subnormal range: a fixed grid, 2^-149 (2^-139 for 14 bits)
        g = 126 + bits
        return np.trunc(math.ldexp(v, g)) * math.ldexp(1.0, -g)
    e = math.frexp(av)[1] - 1
    return np.trunc(math.ldexp(v, bits - e)) * math.ldexp(1.0, e - bits)


@nb.njit(cache=True, nogil=True)
def _block_general(arow: np.ndarray, earow: np.ndarray, b: np.ndarray, eb: np.ndarray, j0: int, kb: int,
                   ke: int, F: int, out_code: int, e_zero: int, cur: np.ndarray) -> None:
    """One T-FDPA of ke - kb products for a tile of columns, element by element, for every case: the blocks
    the vector kernel does not take (a non-finite c, a last block shorter than L)."""
    for j in range(cur.size):
        c = cur[j]
        if not np.isfinite(c):
            continue  # the products are finite: d = c, as in the reference
        em = max(math.frexp(c)[1] - 1, -126) if c != 0.0 else e_zero
        for k in range(kb, ke):
            x, y = arow[k], b[k, j0 + j]
            em = max(em, e_zero if (x == 0.0 or y == 0.0) and e_zero != _NO_E_ZERO else earow[k] + eb[k, j0 + j])
        if em < _ZERO_FLOOR:
            cur[j] = 0.0  # every product and c are zero
            continue
        sc = math.ldexp(1.0, F - em)
        s = np.int64(c * sc)
        for k in range(kb, ke):
            s += np.int64(np.float64(arow[k]) * np.float64(b[k, j0 + j]) * sc)
        cur[j] = _round_output(math.ldexp(np.float64(s), em - F), out_code)


def _make_block(L: int):
    """The T-FDPA of one block of L products for a tile of columns. L is a constant of the compiled code, so the
    loop over a block's products unrolls and each loop over a tile's columns runs in vector registers: a
    column's e_max and sum are built in registers and stored once a block (per product, the loads of b and its
    exponents only)."""

    @nb.njit(cache=True, nogil=True)
    def block(arow: np.ndarray, earow: np.ndarray, b: np.ndarray, eb: np.ndarray, j0: int, kb: int, F: int,
              out_code: int, e_zero: int, narrow_sum: bool, cur: np.ndarray, em: np.ndarray, t32: np.ndarray,
              s: np.ndarray, scb: np.ndarray, sc32b: np.ndarray, p2b: np.ndarray) -> None:
        """One T-FDPA of L products for a tile of columns, with cur as c; cur takes d.

        Where only tiny products are seen, a zero product (or c) sets e_max to the row's e_zero; where everything
        is zero, S = 0. The products go in FP32 and an int32 sum when every e_max of the tile is in
        [F - 124, 126] and L 2^(F + 2) fits an int32: then a b is an exact FP32 product, the scaling by
        2^(F - e_max) is exact or leaves a term below 1 that truncates to 0 either way, and no sum overflows.
        Otherwise in float64, truncated with ``trunc``: every term is an integer below 2^(F + 2), every partial
        sum below 2^53, so exact. A non-finite c goes to :func:`_block_general`; a result outside FP32's normal
        range takes the general rounding."""
        w = cur.size
        cbits = cur.view(np.uint64)
        odd, low, wide = False, False, False
        # 64-bit lanes and 32-bit lanes in separate loops: a loop is vectorised at the width of its widest type
        for j in range(w):  # the exponent of c (-126 at least; a zero c takes e_zero)
            odd |= (cbits[j] & _EXP_MASK) == _EXP_MASK
            ec = np.int32((cbits[j] >> np.uint64(52) & np.uint64(0x7FF)) - np.uint64(1023))
            em[j] = max(ec, np.int32(-126)) if cur[j] != 0.0 else np.int32(e_zero)
        if odd:
            _block_general(arow, earow, b, eb, j0, kb, kb + L, F, out_code, e_zero, cur)
            return
        for j in range(w):  # e_max (int32 throughout)
            m = em[j]
            for k in range(L):
                m = max(m, np.int32(earow[_u(kb + k)] + eb[_u(kb + k), _u(j0 + j)]))
            em[j] = m
            low |= m < e_zero
        if low and e_zero != _NO_E_ZERO:  # only tiny products somewhere: a zero product sets e_max to e_zero
            for k in range(kb, kb + L):
                for j in range(w):
                    if earow[k] < _ZERO_FLOOR or eb[k, j0 + j] < _ZERO_FLOOR:
                        em[j] = max(em[j], np.int32(e_zero))
        for j in range(w):
            e = em[j] if em[j] >= _ZERO_FLOOR else np.int32(0)  # every product and c zero: S = 0, any exponent
            wide |= (e < F - 124) | (e > 126)
            scb[j] = np.int64(1023 + F - e) << 52  # 2^(F - e_max)
            sc32b[j] = np.int32(127 + F - e) << 23
            p2b[j] = np.int64(1023 - F + e) << 52  # 2^(e_max - F)
        sc, p2 = scb.view(np.float64), p2b.view(np.float64)
        if narrow_sum and not wide:
            sc32 = sc32b.view(np.float32)
            for j in range(w):
                f, t = sc32[j], np.int32(0)
                for k in range(L):  # float -> int truncates toward zero
                    t = np.int32(t + np.int32(arow[_u(kb + k)] * b[_u(kb + k), _u(j0 + j)] * f))
                t32[j] = t
            for j in range(w):
                s[j] = np.float64(t32[j]) + np.trunc(cur[j] * sc[j])
        else:
            for j in range(w):
                f, t = sc[j], 0.0 + np.trunc(cur[j] * sc[j])  # an integer sum: a zero S is +0
                for k in range(L):
                    t += np.trunc(np.float64(arow[_u(kb + k)]) * np.float64(b[_u(kb + k), _u(j0 + j)]) * f)
                s[j] = t
        if out_code < 2:  # toward zero: clear the low bits of the float64 significand
            mask = np.uint64(~((1 << (29 if out_code == 0 else 39)) - 1) & 0xFFFF_FFFF_FFFF_FFFF)
            for j in range(w):
                d = s[j] * p2[j]
                odd |= ((abs(d) < 1.1754943508222875e-38) & (d != 0.0)) | (abs(d) >= 3.402823669209385e38)
                cur[j] = d
                cbits[j] &= mask
        if odd or out_code >= 2:  # the general rounding: outside FP32's normal range, or to nearest
            for j in range(w):
                cur[j] = _round_output(s[j] * p2[j], out_code)

    return block


def _make_chain(L: int):
    """The chain for blocks of L products (:func:`_make_block`): tasks of (batch, tile of columns, rows) over the
    threads, each tile's accumulators kept while every row of A meets the block's rows of B in turn."""

    def chain(a: np.ndarray, ea: np.ndarray, b: np.ndarray, eb: np.ndarray, c: np.ndarray, F: int,
              out_code: int, e_zero: int, dot_k: int, fp32_add: bool, canon: bool, nan: float,
              tile: int) -> np.ndarray:
        nb_, M, K = a.shape
        N = b.shape[2]
        out = np.empty((nb_, M, N), c.dtype)
        tiles = (N + tile - 1) // tile
        # few (batch, tile) tasks: cut the rows too, so that every core has work (rows are independent)
        chunks = _ROW_CHUNKS if nb_ * tiles < _ROW_CHUNKS and M >= 2 * _ROW_CHUNKS else 1
        rows = (M + chunks - 1) // chunks
        step = dot_k if fp32_add else K
        narrow_sum = L << (F + 2) <= 1 << 31  # |sum of L terms| < L 2^(F + 2) (significands below 2 each)
        for t in nb.prange(nb_ * tiles * chunks):
            bi, rest = t // (tiles * chunks), t % (tiles * chunks)
            j0, i0 = (rest // chunks) * tile, (rest % chunks) * rows
            w, h = min(tile, N - j0), min(rows, M - i0)
            cur = np.empty((h, w))  # the tile's accumulators: every row of A meets the block's rows of B in turn
            part = np.zeros((h, w)) if fp32_add else cur
            for i in range(h):
                for j in range(w):
                    cur[i, j] = c[bi, i0 + i, j0 + j]
            em, t32, s = np.empty(w, np.int32), np.empty(w, np.int32), np.empty(w)
            scb, sc32b, p2b = np.empty(w, np.int64), np.empty(w, np.int32), np.empty(w, np.int64)
            for k0 in range(0, K, step):
                k1 = min(k0 + step, K)
                if fp32_add:
                    part[:] = 0.0
                for kb in range(k0, k1, L):
                    for i in range(h):
                        if kb + L <= k1:
                            _block(a[bi, i0 + i], ea[bi, i0 + i], b[bi], eb[bi], j0, kb, F, out_code, e_zero,
                                   narrow_sum, part[i], em, t32, s, scb, sc32b, p2b)
                        else:  # a last block of fewer than L products
                            _block_general(a[bi, i0 + i], ea[bi, i0 + i], b[bi], eb[bi], j0, kb, k1, F, out_code,
                                           e_zero, part[i])
                if fp32_add:
                    for i in range(h):
                        for j in range(w):
                            cur[i, j] = np.float64(np.float32(cur[i, j] + part[i, j]))
            for i in range(h):
                for j in range(w):
                    v = cur[i, j]
                    out[bi, i0 + i, j0 + j] = nan if canon and v != v else v
        return out

    # The block of L products is a global of this chain's own, not a variable of its closure: numba's cache keys a
    # closure by the pickle of its variables, and a compiled function's pickle holds an id drawn in each process,
    # so that no process found the chain another one had compiled (each compiled it again, ~20 s, and added an
    # entry to the cache). The closure holds L alone, the key of one chain per L in every process.
    fn = types.FunctionType(chain.__code__, {**globals(), "_block": _make_block(L)}, chain.__name__,
                            chain.__defaults__, chain.__closure__)
    fn.__qualname__ = chain.__qualname__
    return nb.njit(cache=True, parallel=True)(fn)


_CHAINS: dict[int, object] = {}


def chain(a: np.ndarray, ea: np.ndarray, b: np.ndarray, eb: np.ndarray, c: np.ndarray, L: int, F: int,
          out_code: int, e_zero: int, dot_k: int, fp32_add: bool, nan: np.floating | None = None) -> np.ndarray:
    """acc + a @ b as a chain of T-FDPA blocks: a (B, M, K), b (B, K, N) float32 (finite) with exponents ea, eb
    (int32, zeros -8000), c (B, M, N) float32 or float64 (the result's type). ``fp32_add``: each `dot_k` of K runs
    from a zero accumulator and is added to the FP32 accumulator (nearest even); else every block takes the
    previous block's result. nan: the one NaN the unit writes (None: NaNs as computed)."""
    if L not in _CHAINS:
        _CHAINS[L] = _make_chain(L)
    if not c.flags.writeable:  # numba types the flag: a read-only C would compile a chain of its own (seconds)
        c = c.copy()
    canon = nan is not None
    # a float32 NaN widened to float64 keeps its payload's high bits, so storing it back gives the same bits
    return _CHAINS[L](a, ea, b, eb, c, F, out_code, e_zero, dot_k, fp32_add, canon,
                      np.float64(nan) if canon else 0.0, _tile_width(b.shape[2], b.shape[0]))


def _tile_width(N: int, batches: int) -> int:
    """Columns per task: at most _TILE; where there are few tasks, as many tiles as make the tasks a multiple of
    the threads (5 tiles on 2 threads keep one idle a fifth of the time)."""
    threads = nb.get_num_threads()
    tiles = -(-N // _TILE)
    if batches * tiles < 4 * threads:
        while batches * tiles % threads:
            tiles += 1
    width = -(-N // tiles)
    return min(_TILE, -(-width // 16) * 16)  # whole vectors


@nb.njit(cache=True, nogil=True)
def _exponents(x: np.ndarray, emin: int, out: np.ndarray) -> bool:
    """out = the unnormalised exponents of the flat float32 x; whether every element is finite."""
    bits = x.view(np.uint32)
    odd = False
    for n in range(x.size):
        field = np.int32((bits[n] >> np.uint32(23)) & np.uint32(0xFF))
        odd |= field == 255
        out[n] = max(field - np.int32(127), np.int32(emin)) if x[n] != 0.0 else np.int32(-8000)
    return not odd


def exponents(x: np.ndarray, emin: int) -> np.ndarray | None:
    """The operands' unnormalised exponents (int32): max(floor(log2|x|), emin), -8000 for zeros (x float32,
    contiguous); None where an element is Inf or NaN."""
    out = np.empty(x.shape, np.int32)
    return out if _exponents(x.reshape(-1), emin, out.reshape(-1)) else None

