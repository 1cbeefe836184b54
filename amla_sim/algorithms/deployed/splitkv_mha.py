"""Stage 1 of the split/merge Triton decode's MHA kernel: what vLLM's and SGLang's ``decode_attention_fwd`` run when
a KV head has one query head (``decode_attention_fwd_normal``: ``_fwd_kernel_stage1``, 64 keys a block, 4 warps,
q times K summed along 1,024 columns, q's 576 and zeros), as Triton 3.6 lowers it for sm_90 (read off its TTGIR and
PTX, ``scripts/capture_triton_mha.py``). Stage 2 is the grouped kernel's (:func:`.splitkv.stage2`).

Per block of 64 keys, one program per (row, split), on the tiles Triton lays out (:data:`TILES`): with a BF16 cache
a thread loads 8 columns of every key, the four warps side by side along the 1,024 columns, and the V tile sits on
2 x 2 warps (warp row w: keys w, w+2, ...); with an FP8 cache it loads 16 columns, two warps along the columns and
two along the keys, and the V tile sits on 4 x 1 warps (keys w, w+4, ...).

- ``qk``: a thread's products are summed in column order, then the warp's butterfly (lane xor 16, 8, 4, 2, 1), then
  the column warps' partials, by the same butterfly (``(w0 + w2) + (w1 + w3)`` of four). vLLM sums ``q * k`` in
  BF16 (``tl.sum`` of a BF16 tile): every add rounds to BF16, and the thread's chain is ``fma(q0, k0, bf16(q1
  k1))``, then each further column fused (``fma.rn.bf16``), but for a BF16 cache only the even ones: the odd ones
  are added as rounded products (``add.bf16``), the contraction LLVM makes of products it vectorised in pairs.
  SGLang sums ``(q * k).to(fp32)``: BF16 products, FP32 adds.
- ``s = fl(qk sm)``, -inf for a key past the split; ``m' = max(m, max(s))``, ``alpha = exp(m - m')``, ``p = exp(s -
  m')``; where every thread holds all 64 keys (the BF16 tile), the block's first key, which is never masked, has
  its product fused: ``exp(fma(qk, sm, -m'))``.
- ``acc``: per column and V warp row, ``fma(p_0, v_0, fl(p_1 v_1))`` over the row's first two keys, then an FMA for
  each further one; the rows' partials folded by the butterfly; ``acc = fma(acc, alpha, that)``. ``l = fma(l,
  alpha, sum(p))``, the sum as the key tile holds p: its keys in order a warp row, the rows' partials added.

A split writes ``acc / l`` (``div.full``) and ``m + log(l)`` (libdevice's logf).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...arith import elementwise as ew
from ...formats import round_to
from ...machines import Machine
from .._common import D_V

__all__ = ["MHA_BLOCK_N", "TILES", "stage1_mha"]

#: Keys a block (``_decode_att_m_fwd``'s BLOCK on CUDA), and the key tile's padded width.
MHA_BLOCK_N = 64
_COLS, _LANES, _WARPS = 1024, 32, 4


@dataclass(frozen=True)
class _Tile:
    """How Triton lays the block's tiles over the 4 warps: `vec` columns a thread (its 16-byte loads of K), `col_warps`
    warps along the key tile's columns (the rest along its keys), `v_rows` warps along the V tile's keys; `fused`:
    every product of a thread's BF16 chain fused (an FP8 cache, dequantized a value at a time) or only the even
    columns' (a BF16 cache, whose products LLVM vectorises in pairs)."""

    vec: int
    col_warps: int
    v_rows: int
    fused: bool

    @property
    def key_rows(self) -> int:
        """Warps along the key tile's keys: a thread holds keys w, w + key_rows, ... of the block."""
        return _WARPS // self.col_warps

    @property
    def first_key_fused(self) -> bool:
        """Every thread holds the block's first key, which is never masked: LLVM fuses its ``qk sm - m'``."""
        return self.key_rows == 1


#: The tiles of a BF16 and of an FP8 (E4M3) cache, read off the TTGIR.
TILES = {"bf16": _Tile(8, 4, 2, False), "e4m3": _Tile(16, 2, 4, True)}


def _add_bf16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``add.bf16`` (and ``fma.rn.bf16`` of a product float64 holds exactly): a + b rounded once to BF16, as
    float64."""
    return ew.fma_bf16(a, 1.0, b).astype(np.float64)


def _rounded(x: np.ndarray) -> np.ndarray:
    return round_to(x, "bf16").astype(np.float64)


def _thread_sums_bf16(prod: np.ndarray, fused: bool) -> np.ndarray:
    """vLLM's chain over a thread's columns, prod (..., vec) exact products: (...,) BF16 values as float64."""
    acc = _add_bf16(prod[..., 0], _rounded(prod[..., 1]))
    for c in range(2, prod.shape[-1]):
        acc = _add_bf16(acc, prod[..., c] if fused or c % 2 == 0 else _rounded(prod[..., c]))
    return acc


def _fold(x: np.ndarray, add) -> np.ndarray:
    """The butterfly over the last axis (xor n/2 first): lane 0's value, each half folded onto the other."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = add(x[..., :h], x[..., h:])
    return x[..., 0]


def _scores(mc: Machine, q: np.ndarray, Kb: np.ndarray, tile: _Tile, bf16_sum: bool) -> np.ndarray:
    """q (b, 576), Kb (b, S, n, 576) BF16 -> qk (b, S, n) in FP32 as the reduction leaves it: the thread's chain,
    the warp's butterfly, then the warps' partials, by the same butterfly."""
    prod = q[:, None, None, :].astype(np.float64) * Kb.astype(np.float64)  # exact: 8 x 8 significand bits
    pad = np.zeros(prod.shape[:-1] + (_COLS - prod.shape[-1],))
    threads = np.concatenate([prod, pad], axis=-1).reshape(prod.shape[:-1] + (tile.col_warps, _LANES, tile.vec))
    if bf16_sum:
        return mc.f(_fold(_fold(_thread_sums_bf16(threads, tile.fused), _add_bf16), _add_bf16))

    def add(a, b):
        return mc.f(a + b)

    p32 = mc.f(round_to(threads, "bf16"))  # BF16 products, FP32 adds in column order
    acc = p32[..., 0]
    for c in range(1, tile.vec):
        acc = add(acc, p32[..., c])
    return _fold(_fold(acc, add), add)


def _pv(mc: Machine, p: np.ndarray, V: np.ndarray, rows: int) -> np.ndarray:
    """sum_k p_k V_k, p (..., 64), V (..., 64, 512) FP32: per warp row w (keys w, w + rows, ...) an FMA chain begun
    with ``fma(p_0 v_0, fl(p_1 v_1))``, the rows' partials then folded as a butterfly."""
    parts = []
    for w in range(rows):
        pk, vk = p[..., w::rows], V[..., w::rows, :]
        acc = mc.mul_add(pk[..., 0, None], vk[..., 0, :], mc.f(pk[..., 1, None] * vk[..., 1, :]))
        for i in range(2, pk.shape[-1]):
            acc = mc.mul_add(pk[..., i, None], vk[..., i, :], acc)
        parts.append(acc)
    return _fold(np.stack(parts, axis=-1), lambda a, b: mc.f(a + b))


def _p_sum(mc: Machine, p: np.ndarray, rows: int) -> np.ndarray:
    """``tl.sum(p)`` over the 64 keys as the key tile holds them: warp row w's keys w, w + rows, ... in order, the
    rows' partials then folded."""
    parts = []
    for w in range(rows):
        pk = p[..., w::rows]
        acc = pk[..., 0]
        for k in range(1, pk.shape[-1]):
            acc = mc.f(acc + pk[..., k])
        parts.append(acc)
    return _fold(np.stack(parts, axis=-1), lambda a, b: mc.f(a + b))


def stage1_mha(mc: Machine, Q: np.ndarray, K: np.ndarray, ranges: np.ndarray, sm: np.ndarray, *,
               bf16_sum: bool, cache: str = "bf16") -> tuple[np.ndarray, np.ndarray]:
    """Stage 1 for Q (b, 1, 576), K (b, S_max, 576) BF16 (V its first 512 columns; an FP8 cache already read as
    BF16) and the (b, S, 2) token ranges of the splits: (mid (b, 1, S, 512), lse (b, 1, S)), NaN for an empty
    split. bf16_sum: vLLM's BF16 ``tl.sum`` of q times k (SGLang's sums in FP32). cache: the cache as stored,
    ``bf16`` or ``e4m3``, which sets the tiles (:data:`TILES`)."""
    tile = TILES[cache]
    b, S = ranges.shape[:2]
    start, end = ranges[..., 0], ranges[..., 1]
    n_blocks = int(max(0, (-(-(end - start) // MHA_BLOCK_N)).max()))
    dt = mc.dtype
    m = np.full((b, S), -np.inf, dt)
    l = np.zeros((b, S), dt)
    acc = np.zeros((b, S, D_V), dt)
    q = Q[:, 0]
    for j in range(n_blocks):
        t = start[..., None] + j * MHA_BLOCK_N + np.arange(MHA_BLOCK_N)  # (b, S, 64)
        valid = t < end[..., None]
        live = valid[..., 0]  # the split runs this block
        Kb = K[np.arange(b)[:, None, None], np.minimum(t, K.shape[1] - 1)]
        Kb = np.where(valid[..., None], Kb, 0).astype(K.dtype)  # keys past the split load as 0
        qk = _scores(mc, q, Kb, tile, bf16_sum)  # (b, S, 64)
        s = np.where(valid, mc.f(qk * sm), -np.inf).astype(dt)
        m_new = np.maximum(m, mc.rowmax(s))
        alpha = mc.exp(m - m_new)
        p = mc.exp(s - m_new[..., None])
        if tile.first_key_fused:
            p[..., 0] = mc.exp(mc.mul_add(qk[..., 0], sm, -m_new))
        p = np.where(live[..., None], p, 0).astype(dt)
        acc_new = mc.mul_add(acc, alpha[..., None], _pv(mc, p, mc.f(Kb[..., :D_V]), tile.v_rows))
        l_new = mc.mul_add(l, alpha, _p_sum(mc, p, tile.key_rows))
        m, l = np.where(live, m_new, m), np.where(live, l_new, l)
        acc = np.where(live[..., None], acc_new, acc)
    ran = end > start
    with np.errstate(divide="ignore", invalid="ignore"):
        mid = np.where(ran[..., None], mc.div(acc, l[..., None]), np.nan).astype(dt)
        lse = np.where(ran, mc.f(m + mc.log(l)), np.nan).astype(dt)
    return mid[:, None], lse[:, None]
