"""FlashAttention-3's split choice for the MLA decode (head dims 64 / 512), as vLLM's fork computes it.

Upstream: vllm-project/flash-attention 617264c (vLLM 0.33 pins b273a02, not obtainable here), ``hopper/``:
``heuristics.h`` (``num_splits_heuristic``, ``should_pack_gqa``), ``flash_api.cpp`` (``get_num_splits``,
``get_pack_gqa``, ``get_pagedkv_tma``, ``mha_fwd``), ``flash_prepare_scheduler.cu`` (each request's split count) and
``block.h`` (``BlockMN::get_n_block_min_max``: a split's blocks). The tile is 64 query rows by 64 keys
(``tile_size_fwd_sm90(64, 512)``); the rows of a request are its (query position, head) pairs, ``s * heads + h``,
when pack-GQA is on (always, for the calls vLLM and SGLang make).

The launch is varlen (vLLM passes ``cu_seqlens_q``, SGLang ``cache_seqlens``), so the split count is chosen twice:
``get_num_splits`` gives an upper bound for the whole launch (the caller's ``num_splits``, or the heuristic as if
the batch held one request), and the prepare kernel gives each request its own,
``max(min(cdiv(n_blocks, blocks_per_sm), bound), 1)`` with ``blocks_per_sm = ceilf(total_blocks * 1.1f / num_sm)``
over the whole batch (float32 arithmetic); more than 992 requests are never split. A split takes
``cdiv(n_block_max, splits)`` of its m-block's blocks; a causal m-block (s_q > 1) ends where its last query does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["KBLOCK_M", "KBLOCK_N", "MAX_SPLIT_BATCH", "num_splits_heuristic", "launch_splits", "dynamic_splits",
           "varlen_splits", "should_pack_gqa", "pagedkv_tma", "n_block_max", "n_offset", "split_blocks", "Fa3Schedule",
           "fa3_schedule", "window"]

KBLOCK_M = 64  # kBlockM: query rows a tile
KBLOCK_N = 64  # kBlockN: keys a block
MAX_SPLIT_BATCH = 992  # PREPARE_VARLEN_MAX_BATCHES_1CTA: more requests than this are never split
_L2 = 50 * 1024 * 1024  # num_splits_heuristic's L2 size
_f32 = np.float32


def window(causal: bool, window_size: tuple[int, int], max_seqlen_q: int,
           max_seqlen_k: int) -> tuple[bool, bool, int, int]:
    """``mha_fwd``'s reading of ``is_causal`` and ``window_size`` (flash_api.cpp:863-877, then
    ``set_params_fprop`` :195-204): (causal, local, left, right). A side as long as the call is none (-1); one
    query row is never causal; causal is the window (-1, 0); a local window's missing side is the whole call's."""
    left, right = (int(x) for x in window_size)
    left = -1 if left >= max_seqlen_k - 1 else left
    right = -1 if right >= max_seqlen_q - 1 else right
    if max_seqlen_q == 1 and left == right == -1:
        causal = False
    if causal:
        right = 0
    causal = left < 0 and right == 0
    local = (left >= 0 or right >= 0) and not causal
    if local:
        left = max_seqlen_k - 1 if left < 0 else left
        right = max_seqlen_q - 1 if right < 0 else right
    return causal, local, left, right


def num_splits_heuristic(total_mblocks: int, num_sms: int, num_n_blocks: int, num_m_blocks: int,
                         size_one_kv_head: int, is_causal: bool, max_splits: int = 128) -> int:
    """``num_splits_heuristic`` (heuristics.h): the fewest splits within 85% of the best wave efficiency, in the
    kernel's float32 arithmetic (the 0.85 compared in double)."""
    if _f32(total_mblocks) >= _f32(0.8) * _f32(num_sms):
        if size_one_kv_head > _L2 and num_m_blocks >= num_sms * 2 and not is_causal:
            return min(-(-size_one_kv_head // _L2), max_splits)
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    eff = []
    for n in range(1, max_splits + 1):
        waves = _f32(total_mblocks * n) / _f32(num_sms)
        eff.append(_f32(waves / _f32(math.ceil(waves))))
    best = max(eff)
    return next((n for n, e in enumerate(eff, 1) if float(e) >= 0.85 * float(best)), 1)


def should_pack_gqa(varlen_q: bool, s_q: int, heads: int, block_m: int = KBLOCK_M) -> bool:
    """``should_pack_gqa`` (heuristics.h): pack the heads into the query rows unless that wastes more of a tile."""
    if varlen_q:
        return True
    def up(a: int) -> int:
        return -(-a // block_m) * block_m

    return float(_f32(s_q) / _f32(up(s_q))) < 0.9 * float(_f32(s_q * heads) / _f32(up(s_q * heads)))


def pagedkv_tma(page_size: int | None, s_q: int, heads: int) -> bool:
    """``get_pagedkv_tma``: a paged cache goes through TMA when its pages hold whole blocks and a request has more
    query rows than a tile; otherwise a cp.async gather (``PagedKVNonTMA``). The two move the same data."""
    return page_size is not None and page_size % KBLOCK_N == 0 and s_q * heads > KBLOCK_M


def launch_splits(max_seqlen_k: int, *, s_q: int, heads: int, num_splits: int, causal: bool, batch: int,
                  num_sms: int = 132, local: tuple[int, int] | None = None) -> int:
    """The launch's split bound (``params.num_splits``): `num_splits` if positive, else ``get_num_splits`` as a
    varlen launch computes it (one request's m-blocks, the longest request's blocks; with a local window (left,
    right) the keys it loads, ``min(seqlen_k, left + right + 1 + kBlockM)``, flash_api.cpp:514-517); 1 above 992
    requests."""
    if batch > MAX_SPLIT_BATCH:
        return 1
    if num_splits > 0:
        return num_splits
    loaded = max_seqlen_k if local is None else max(0, min(max_seqlen_k, sum(local) + 1 + KBLOCK_M))
    n_blocks = -(-loaded // KBLOCK_N)
    m_blocks = -(-(s_q * heads) // KBLOCK_M)
    size_one_kv_head = max_seqlen_k * (64 + 512) * 2
    return num_splits_heuristic(m_blocks, num_sms, n_blocks, m_blocks, size_one_kv_head, causal or local is not None)


def dynamic_splits(seqlens: list[int], *, s_q: int, heads: int, bound: int, num_sms: int = 132) -> list[int]:
    """Each request's split count as ``prepare_varlen_num_blocks_kernel`` writes it (``num_splits_dynamic``)."""
    m_blocks = -(-(s_q * heads) // KBLOCK_M)
    return varlen_splits([m_blocks] * len(seqlens), [-(-n // KBLOCK_N) for n in seqlens], num_head=1, bound=bound,
                         num_sms=num_sms)  # num_head = h_k = 1 with pack-GQA


def varlen_splits(m_blocks: list[int], n_blocks: list[int], *, num_head: int, bound: int,
                  num_sms: int = 132) -> list[int]:
    """``prepare_varlen_num_blocks_kernel`` (flash_prepare_scheduler.cu:150-163) from each request's m-blocks and
    n-blocks: ``max(min(cdiv(n_blocks, blocks_per_sm), bound), 1)`` with ``blocks_per_sm = ceilf(float(total) *
    1.1f * float(num_head) / float(num_sm))``; one split each when `bound` is 1 or past 992 requests."""
    if bound == 1 or len(n_blocks) > MAX_SPLIT_BATCH:
        return [1] * len(n_blocks)
    total = sum(m * n for m, n in zip(m_blocks, n_blocks))
    per_sm = math.ceil(_f32(_f32(_f32(total) * _f32(1.1)) * _f32(num_head)) / _f32(num_sms))
    return [max(min(-(-n // per_sm), bound), 1) for n in n_blocks]


def n_offset(seqlen: int, m_block: int, *, s_q: int, heads: int, left: int, pack_gqa: bool = True) -> int:
    """A local window's ``n_offset`` (block.h:24-33): the first key of the m-block's first query row, where the
    m-block's key blocks start."""
    m_idx_min = (m_block * KBLOCK_M) // heads if pack_gqa else m_block * KBLOCK_M
    return max(0, m_idx_min + seqlen - s_q - left)


def n_block_max(seqlen: int, m_block: int, *, s_q: int, heads: int, causal: bool, pack_gqa: bool = True,
                local: tuple[int, int] | None = None) -> int:
    """``get_n_block_min_max``'s end for an m-block: the request's blocks, cut where the m-block's last query
    row's causal window ends (bottom-right aligned: query s sees keys up to seqlen - s_q + s), or its local window
    (left, right) does, counted from :func:`n_offset`."""
    off = 0 if local is None else n_offset(seqlen, m_block, s_q=s_q, heads=heads, left=local[0], pack_gqa=pack_gqa)
    end = -(-(seqlen - off) // KBLOCK_N)
    if causal or local is not None:
        rows_end = (m_block + 1) * KBLOCK_M
        last_q = (rows_end - 1) // heads + 1 if pack_gqa else rows_end
        end = min(end, -(-(last_q + seqlen - off - s_q + (0 if local is None else local[1])) // KBLOCK_N))
    return end


def split_blocks(end: int, splits: int) -> list[tuple[int, int]]:
    """The splits' block ranges [lo, hi) of an m-block whose blocks end at `end`; an empty range is a split with
    no work (the kernel writes O = 0 and LSE = -inf for it)."""
    per = -(-end // splits) if end > 0 else 0
    return [(min(s * per, end), min(s * per + per, end)) for s in range(splits)]


@dataclass(frozen=True)
class Fa3Schedule:
    """A launch's schedule: the split bound, each request's split count, pack-GQA and the paged path."""

    bound: int
    splits: tuple[int, ...]
    pack_gqa: bool
    causal: bool
    tma: bool
    local: tuple[int, int] | None = None  # a local window's (left, right)

    def blocks(self, i: int, seqlen: int, m_block: int, *, s_q: int, heads: int) -> list[tuple[int, int]]:
        """Request `i`'s splits, as block ranges counted from :meth:`offset`, for its m-block `m_block`."""
        end = n_block_max(seqlen, m_block, s_q=s_q, heads=heads, causal=self.causal, pack_gqa=self.pack_gqa,
                          local=self.local)
        return split_blocks(end, self.splits[i])

    def offset(self, seqlen: int, m_block: int, *, s_q: int, heads: int) -> int:
        """The first key of m-block `m_block`'s blocks: 0, or with a local window :func:`n_offset`."""
        if self.local is None:
            return 0
        return n_offset(seqlen, m_block, s_q=s_q, heads=heads, left=self.local[0], pack_gqa=self.pack_gqa)


def fa3_schedule(seqlens: list[int], *, s_q: int, heads: int, num_splits: int = 0, causal: bool = False,
                 pack_gqa: bool | None = None, page_size: int | None = 16, varlen_q: bool = True,
                 num_sms: int = 132, max_seqlen_k: int | None = None,
                 local: tuple[int, int] | None = None) -> Fa3Schedule:
    """What ``mha_fwd`` decides for a launch: the split bound and each request's count, pack-GQA (the kernel packs
    whenever it splits or gathers pages with cp.async), and whether pages go through TMA. max_seqlen_k: the
    call's ``max_seqlen_k`` (``params.seqlen_k``, which the bound is computed from; None: the longest request;
    the sparse call passes topk, ``flash_api.cpp:835``). local: a local window's (left, right) as :func:`window`
    reads it."""
    tma = pagedkv_tma(page_size, s_q, heads)
    bound = launch_splits(max(seqlens) if max_seqlen_k is None else max_seqlen_k, s_q=s_q, heads=heads,
                          num_splits=num_splits, causal=causal, batch=len(seqlens), num_sms=num_sms, local=local)
    pack = should_pack_gqa(varlen_q, s_q, heads) if pack_gqa is None else bool(pack_gqa)
    pack = pack or bound > 1 or (page_size is not None and not tma)
    return Fa3Schedule(bound, tuple(dynamic_splits(seqlens, s_q=s_q, heads=heads, bound=bound, num_sms=num_sms)),
                       pack, causal, tma, local)
