"""SGLang's choice of KV splits for its Triton MLA decode, on the host: how many splits each request of a decode
batch gets, which is what makes a request's bits depend on its batchmates.

Upstream: sgl-project/sglang 0.5.23 (the wheel), ``sglang/srt/layers/attention/triton_backend.py``
(``TritonAttnBackend.__init__``: ``max_kv_splits``; ``get_num_kv_splits``) and
``sglang/kernels/ops/attention/metadata.py`` (``get_num_kv_splits_triton``, one program over the batch).

Over the batch's lengths (max ``M``, min ``m``, the min taken as ``M`` when ``8 M < 10 m``):

- ``s1 = min(cdiv(M, m), max_kv_splits)`` and ``chunk1 = cdiv(M, s1)``: the spread of the lengths;
- ``cores = int(sms * max(log2(fl32(M) / 64), 1))`` (float32, truncated), ``grid = num_seq * num_group *
  cdiv(heads, min(16, heads))`` (MLA: one KV head), ``s2 = min(cdiv(cores, grid), max_kv_splits)``, ``chunk2 =
  cdiv(M, s2)``: the SMs shared among the batch's head tiles;
- request i gets ``max(cdiv(L_i, chunk1), cdiv(L_i, chunk2))`` splits.

So a request's split count falls as the batch grows, and follows the longest and shortest batchmates. With
``--enable-deterministic-inference`` the count is ``cdiv(L_i, 256)`` (``split_tile_size``), whatever the batch;
with ``SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS`` it is ``max_kv_splits`` for every request.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ...._validate import check_int

__all__ = ["num_kv_splits", "mla_max_kv_splits", "deterministic_kv_splits", "BASE_KV_SPLITS", "SPLIT_TILE_SIZE",
           "MIN_BLOCK_KV"]

#: ``triton_attention_num_kv_splits``'s default, which the MLA cap raises (``_mla_decode_kv_splits_cap``).
BASE_KV_SPLITS = 8
#: ``SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE``'s default: the split size of deterministic inference.
SPLIT_TILE_SIZE = 256
#: ``_MLA_DECODE_MIN_BLOCK_KV``: the kernel's smallest split.
MIN_BLOCK_KV = 32


def _next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def mla_max_kv_splits(max_context_len: int, *, sms: int = 132, base: int = BASE_KV_SPLITS) -> int:
    """The backend's ``max_kv_splits`` for an MLA model: ``max(base, min(next_pow2(sms), next_pow2(cdiv(
    max_context_len, 32))))`` (256 for DeepSeek-V3's 163,840 tokens on 132 SMs)."""
    check_int(max_context_len, "max_context_len", lo=1)
    check_int(sms, "sms", lo=1)
    check_int(base, "base", lo=1)
    return max(base, min(_next_power_of_2(sms), _next_power_of_2(-(-max_context_len // MIN_BLOCK_KV))))


def num_kv_splits(seqlens: npt.ArrayLike, *, heads: int, max_kv_splits: int, sms: int = 132, heads_kv: int = 1,
                  num_group: int = 1) -> np.ndarray:
    """``get_num_kv_splits_triton``: every request's split count (int64, one per request, each repeated
    `num_group` times as the kernel stores them) for a batch of `seqlens` (each at least 1)."""
    lens = np.asarray(seqlens)
    if lens.ndim != 1 or lens.size < 1 or lens.dtype.kind not in "iu" or lens.min() < 1:
        raise ValueError(f"seqlens: expected one length of at least 1 per request, got {seqlens!r:.80}")
    check_int(heads, "heads", lo=1)
    check_int(heads_kv, "heads_kv", lo=1, hi=heads)
    check_int(max_kv_splits, "max_kv_splits", lo=1)
    check_int(sms, "sms", lo=1)
    check_int(num_group, "num_group", lo=1)
    lens = lens.astype(np.int64)
    longest, shortest = int(lens.max()), _spread_floor(int(lens.max()), int(lens.min()))
    s1 = min(-(-longest // shortest), max_kv_splits)
    chunk1 = -(-longest // s1)
    s2 = min(-(-_core_budget(longest, sms) // (lens.size * num_group * _head_tiles(heads, heads_kv))), max_kv_splits)
    chunk2 = -(-longest // s2)
    splits = np.maximum(-(-lens // chunk1), -(-lens // chunk2))
    return np.repeat(splits, num_group)


def _spread_floor(longest: int, shortest: int) -> int:
    """Lengths within 25% of each other count as one: the shortest is taken as the longest when 8 M < 10 m."""
    return longest if longest * 8 < shortest * 10 else shortest


def _core_budget(longest: int, sms: int) -> int:
    """``int(sms * max(log2(fl32(M) / 64), 1))``: more splits as the longest request grows (float32, truncated)."""
    ext = np.float32(longest) / np.float32(64.0)
    return int(np.float32(sms) * max(np.log2(ext, dtype=np.float32), np.float32(1.0)))


def _head_tiles(heads: int, heads_kv: int) -> int:
    """The programs a request's heads take: one a head for MHA, else tiles of min(16, group) heads."""
    group = heads // heads_kv
    return heads if group == 1 else -(-heads // min(16, group))


def deterministic_kv_splits(seqlens: npt.ArrayLike, tile: int = SPLIT_TILE_SIZE) -> np.ndarray:
    """Deterministic inference's split counts: ``cdiv(L_i, tile)``, each request on its own."""
    check_int(tile, "tile", lo=1)
    lens = np.asarray(seqlens, np.int64)
    return -(-lens // tile)
