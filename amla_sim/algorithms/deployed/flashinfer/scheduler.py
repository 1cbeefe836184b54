"""FlashInfer's plan for its sm90 MLA kernel (``MLAPlan``): how a batch's query tiles and KV chunks are laid out
over the clusters, and which rows the merge combines.

Upstream: flashinfer-python 0.7.2, ``include/flashinfer/attention/scheduler.cuh:1613-1880`` (``MLAPlan``),
``:973`` (``cost_function``), ``:985-993`` (``packed_causal_kv_end``), ``include/flashinfer/heap.h`` (``MinHeap``,
over libstdc++'s ``push_heap``/``pop_heap``), ``include/flashinfer/allocator.h`` (the workspace offsets); the
wrapper's refusals ``flashinfer/mla/_batch_mla/_backends/_fa_common.py:256-357``.

A request's rows are its packed (query position, head) pairs, ``s * heads + h``; a cluster of one or two CTAs of
64 rows (two when the batch's mean packed length is over 64) takes a query tile of ``64 * cluster_size`` rows and
one KV chunk. Each tile's KV (the request's, or its causal end) is cut into chunks of ``kv_len_limit`` tokens
(32, 64, 128, 192 or a multiple of 256, from the batch's KV per cluster); a tile of more than one chunk writes
BF16 partials that the merge combines in chunk order. Which cluster runs a chunk (a float-cost min-heap) changes
no bit of the output; it is modelled for the plan readback (:attr:`FlashInferPlan.info` and the work lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ...._validate import check_int

__all__ = ["CTA_TILE_Q", "CTA_TILE_KV", "MAX_WORKS", "INT_WORKSPACE_BYTES", "TileWork", "FlashInferPlan",
           "cluster_size", "kv_len_limit", "causal_kv_end", "check_num_sms", "flashinfer_mla_plan"]

CTA_TILE_Q = 64  # mla_hopper.cuh:1297
CTA_TILE_KV = 64  # mla_hopper.cuh:1298
MAX_WORKS = 16384  # scheduler.cuh:1775 (max_total_num_works); _fa_common.py:253 refuses more
_ID_BYTES = 4  # IdType int32
INT_WORKSPACE_BYTES = 8 << 20  # the wrapper's int workspace (flashinfer/mla/_core.py: torch.empty(8 * 1024 * 1024))
_f32 = np.float32


@dataclass(frozen=True)
class TileWork:
    """One query tile of a request: its packed rows [row_start, row_stop), the KV its chunks cover
    (``remaining_len``), the chunks [kv_start, kv_end) in KV order, and whether they write partials."""

    request: int
    tile: int
    row_start: int
    row_stop: int
    remaining_len: int
    chunks: tuple[tuple[int, int], ...]
    split: bool


#: The arrays MLAPlan stages in the int workspace, in the order of their offsets in MLAPlanInfo (values 2 to 15):
#: three work lists, five merge arrays (one entry an SM), five work lists, the clusters' indptr.
STAGED_ARRAYS = ("q_indptr", "kv_indptr", "partial_indptr", "merge_packed_offset_start", "merge_packed_offset_end",
                 "merge_partial_packed_offset_start", "merge_partial_packed_offset_end", "merge_partial_stride",
                 "q_len", "kv_len", "q_start", "kv_start", "kv_end", "work_indptr")


@dataclass(frozen=True)
class FlashInferPlan:
    """What ``MLAPlan`` returns and stages: ``info`` the 18 MLAPlanInfo values, the per-cluster work lists
    (flattened cluster by cluster, ``work_indptr`` num_clusters + 1) and the merge CTAs' arrays (num_sms each), with
    the tiles in plan order (:class:`TileWork`) for the kernel model."""

    info: tuple[int, ...]
    cluster_size: int
    kv_len_limit: int
    work_indptr: np.ndarray
    q_indptr: np.ndarray
    kv_indptr: np.ndarray
    partial_indptr: np.ndarray
    q_len: np.ndarray
    kv_len: np.ndarray
    q_start: np.ndarray
    kv_start: np.ndarray
    kv_end: np.ndarray
    merge_packed_offset_start: np.ndarray
    merge_packed_offset_end: np.ndarray
    merge_partial_packed_offset_start: np.ndarray
    merge_partial_packed_offset_end: np.ndarray
    merge_partial_stride: np.ndarray
    tiles: tuple[TileWork, ...]

    @property
    def cluster_tile_q(self) -> int:
        return CTA_TILE_Q * self.cluster_size

    @property
    def num_works(self) -> int:
        return int(self.work_indptr[-1])

    def arrays(self) -> dict[str, np.ndarray]:
        """The staged int arrays by their MLAPlanInfo names (as a device readback lists them)."""
        return {n: getattr(self, n) for n in STAGED_ARRAYS}


def cluster_size(q_lens: Sequence[int], heads: int, empty: int = 0) -> int:
    """Two CTAs a cluster when the batch's mean packed query length (integer division) is over 64
    (scheduler.cuh:1644-1651); `empty` more requests of no query count in the mean."""
    return 2 if sum(q * heads for q in q_lens) // (len(q_lens) + empty) > CTA_TILE_Q else 1


def check_num_sms(num_sms: int, cs: int, *, name: str = "num_sms") -> int:
    """`num_sms` checked as the plan needs it, before anything is sized by it: one cluster of `cs` CTAs at least,
    and the staged int arrays (five of one entry an SM) within the wrapper's 8 MiB int workspace, which MLAPlan's
    allocator refuses to overflow (allocator.h:76-88, "Buffer overflow ... Increase the workspace buffer size").
    Returns the clusters. The SM count is the device's (cudaDevAttrMultiProcessorCount, 132 on an H100 SXM and an
    H200); another is a what-if."""
    n = check_int(num_sms, name, lo=1)
    if n // cs < 1:
        raise ValueError(f"{name}: {n} SM holds no cluster of {cs} CTAs")
    end = _offsets(n, n // cs, 0, 0)[13] + MAX_WORKS * _ID_BYTES
    if end > INT_WORKSPACE_BYTES:
        raise ValueError(f"{name}: {n} SMs stage {end} bytes of plan, more than the wrapper's int workspace "
                         f"({INT_WORKSPACE_BYTES}); MLAPlan refuses it (at most {_MAX_SMS} SMs)")
    return n // cs


def kv_len_limit(total_kv: int, num_clusters: int) -> int:
    """The chunk length from the batch's KV per cluster (scheduler.cuh:1670-1683)."""
    x = max(-(-total_kv // num_clusters), 1)
    for bound, limit in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if x <= bound:
            return limit
    return -(-x // 256) * 256


_chunk_length = kv_len_limit  # flashinfer_mla_plan's argument of that name shadows it


def causal_kv_end(q_len: int, kv_len: int, tile: int, cluster_tile_q: int, num_tiles: int, heads: int) -> int:
    """``packed_causal_kv_end``: the last tile sees every key, an earlier one up to its last row's query (ceil),
    clamped to [0, kv_len] (scheduler.cuh:985-993)."""
    if tile + 1 == num_tiles:
        return kv_len
    return max(min(kv_len - q_len + -(-((tile + 1) * cluster_tile_q) // heads), kv_len), 0)


class _MinHeap:
    """``MinHeap`` (heap.h) over libstdc++'s ``push_heap``/``pop_heap`` with ``a.cost > b.cost``: ties resolve as the
    library's sift does, which decides which cluster gets a chunk."""

    def __init__(self, n: int):
        self.h: list[tuple[int, np.float32]] = [(i, _f32(0)) for i in range(n)]

    def _up(self, hole: int, top: int, value: tuple[int, np.float32]) -> None:  # std::__push_heap
        h = self.h
        parent = (hole - 1) // 2
        while hole > top and h[parent][1] > value[1]:
            h[hole] = h[parent]
            hole = parent
            parent = (hole - 1) // 2
        h[hole] = value

    def insert(self, e: tuple[int, np.float32]) -> None:
        self.h.append(e)
        self._up(len(self.h) - 1, 0, e)

    def pop(self) -> tuple[int, np.float32]:
        h = self.h
        n = len(h)
        if n > 1:  # std::pop_heap: the last element sifted down from the root (std::__adjust_heap)
            n -= 1
            value, h[n] = h[n], h[0]
            hole = child = 0
            while child < (n - 1) // 2:
                child = 2 * (child + 1)
                if h[child][1] > h[child - 1][1]:
                    child -= 1
                h[hole] = h[child]
                hole = child
            if n % 2 == 0 and child == (n - 2) // 2:
                child = 2 * (child + 1)
                h[hole] = h[child - 1]
                hole = child - 1
            self._up(hole, 0, value)
        return h.pop()


def _offsets(num_sms: int, num_clusters: int, cluster_tile_q: int, head_dim_o: int) -> tuple[int, ...]:
    """The workspace byte offsets MLAPlanInfo records (scheduler.cuh:1791-1877; 16-aligned allocations from an
    aligned base, allocator.h)."""
    work, merge = MAX_WORKS * _ID_BYTES, num_sms * _ID_BYTES
    sizes = [work] * 3 + [merge] * 5 + [work] * 6  # q/kv/partial indptr, 5 merge arrays, 5 work arrays, work_indptr
    out, at = [], 0
    for s in sizes:
        at = -(-at // 16) * 16
        out.append(at)
        at += s
    partial_o = 2 * num_clusters * cluster_tile_q * 2 * head_dim_o
    return (*out, 0, -(-partial_o // 16) * 16)


_MAX_SMS = (INT_WORKSPACE_BYTES - 9 * MAX_WORKS * _ID_BYTES) // 5 // 16 * 16 // _ID_BYTES  # 389936


def check_causal_tile_bound(q_lens: Sequence[int], seqlens: Sequence[int], heads: int, cluster_tile_q: int) -> None:
    """The wrapper's refusal (_fa_common.py:325-357): the kernel bounds a causal tile's KV with floor((start +
    ctq) / heads) (mla_hopper.cuh:1074), the plan with ceil; where ctq is not a multiple of heads, a partial query at
    a tile's end loses its last key when that key starts a KV tile. FlashInfer refuses the plan (``backend="auto"``
    then runs fa2); so does the model, naming ``seqlens``."""
    if cluster_tile_q % heads == 0:
        return
    for i, (q, n) in enumerate(zip(q_lens, seqlens)):
        for end in range(cluster_tile_q, q * heads, cluster_tile_q):
            query, rem = divmod(end, heads)
            key = n - q + query
            if rem and query < q and 0 <= key < n and key % CTA_TILE_KV == 0:
                raise ValueError(f"seqlens: request {i} ({n} keys, {q} queries, {heads} heads) puts a causal tile "
                                 f"boundary where FlashInfer's fa3 MLA kernel would drop key {key}; the wrapper "
                                 "refuses this plan (backend='auto' runs fa2 instead)")


def flashinfer_mla_plan(
    seqlens: npt.ArrayLike,
    *,
    heads: int,
    q_lens: int | Sequence[int] = 1,
    causal: bool = False,
    num_sms: int = 132,
    page_size: int = 1,
    kv_indptr: Sequence[int] | None = None,
    head_dim_o: int = 512,
    kv_len_limit: int | None = None,
    empty_requests: int = 0,
) -> FlashInferPlan:
    """``MLAPlan`` for a batch: request i has ``q_lens[i]`` queries (an int: all alike) and ``seqlens[i]`` keys.
    kv_indptr: the page offsets the call passes (None: each request's pages after the previous one's, ``ceil(len /
    page_size)`` each); they are only recorded in the work lists. num_sms: the device's SM count (132 on an H100
    SXM and an H200; see :func:`check_num_sms`). empty_requests: requests of no query after the batch (a padded
    batch): they move the cluster size only. Refusals (ValueError naming the argument) are those of FlashInfer's
    fa3 preflight: more than 16384 work items, the causal tile boundary (:func:`check_causal_tile_bound`); each is
    checked from the lengths before any tile is walked.

    kv_len_limit: the chunk length to cut with, in place of the one the batch's KV gives (None). A request's tiles
    and chunks depend on the batch only through the chunk length and the cluster size (the batch's mean query
    length), so a request planned alone with its batch's ``kv_len_limit`` (and its query length) gets the tiles it
    has in that batch. Any length of at least 1 is taken (FlashInfer's own are 32, 64, 128, 192 and multiples of
    256); a plan that then needs more merge CTAs than SMs, or more than 16384 work items, is refused naming it."""
    lens = [int(n) for n in np.asarray(seqlens).ravel()]
    if not lens or min(lens) < 0 or np.asarray(seqlens).dtype.kind not in "iu":
        raise ValueError(f"seqlens: expected one or more ints >= 0, got {seqlens!r:.200}")
    b = len(lens)
    qs = [check_int(q_lens, "q_lens", lo=0)] * b if isinstance(q_lens, (int, np.integer)) else \
        [check_int(q, "q_lens", lo=0) for q in q_lens]
    if len(qs) != b:
        raise ValueError(f"q_lens: expected {b} query counts, got {len(qs)}")
    H = check_int(heads, "heads", lo=1)
    check_int(page_size, "page_size", lo=1)
    cs = cluster_size(qs, H, check_int(empty_requests, "empty_requests", lo=0))
    num_clusters = check_num_sms(num_sms, cs)
    ctq = cs * CTA_TILE_Q
    tiles = [-(-q * H // ctq) for q in qs]
    if sum(tiles) > MAX_WORKS:  # each query tile is a work item at least
        raise ValueError(f"seqlens, q_lens, heads: {b} requests in {sum(tiles)} query tiles of {ctq} rows, more work "
                         f"items than FlashInfer's fa3 MLA holds ({MAX_WORKS}); the wrapper refuses the plan")
    if causal:
        check_causal_tile_bound(qs, lens, H, ctq)
    ends = [[causal_kv_end(q, n, t, ctq, k, H) if causal else n for t in range(k - 1, -1, -1)]
            for q, n, k in zip(qs, lens, tiles)]
    limit = _chunk_length(sum(map(sum, ends)), num_clusters) if kv_len_limit is None else \
        check_int(kv_len_limit, "kv_len_limit", lo=1)
    works = sum(max(-(-e // limit), 1) for tile in ends for e in tile)
    if works > MAX_WORKS:
        raise ValueError(f"{'seqlens, num_sms' if kv_len_limit is None else 'kv_len_limit'}: the plan needs {works} "
                         f"work items in chunks of {limit} keys; FlashInfer's fa3 MLA holds {MAX_WORKS} (the wrapper "
                         "refuses the plan)")
    if kv_indptr is None:
        kv_ptr = np.concatenate([[0], np.cumsum([-(-n // page_size) for n in lens])]).astype(np.int64)
    else:
        kv_ptr = np.asarray(kv_indptr, np.int64).ravel()
        if kv_ptr.shape[0] < b + 1:
            raise ValueError(f"kv_indptr: expected {b + 1} page offsets, got {kv_ptr.shape[0]}")
    q_ptr = np.concatenate([[0], np.cumsum(qs)]).astype(np.int64)
    return _walk(qs, lens, ends, q_ptr, kv_ptr, H=H, cs=cs, num_sms=int(num_sms), limit=limit,
                 user_limit=kv_len_limit is not None, head_dim_o=head_dim_o)


def _walk(qs: list[int], lens: list[int], ends: list[list[int]], q_ptr: np.ndarray, kv_ptr: np.ndarray, *, H: int,
          cs: int, num_sms: int, limit: int, user_limit: bool, head_dim_o: int) -> FlashInferPlan:
    """MLAPlan's walk over the tiles, last tile of a request first (scheduler.cuh:1684-1760): the merge layout of
    a tile cut in chunks, each chunk to the cluster the cost heap pops. Bounded by the checks before it: at most
    16384 work items.

    Long: the passes in MLAPlan's order, so that each can be read beside ``scheduler.cuh``."""
    ctq, num_clusters = cs * CTA_TILE_Q, num_sms // cs
    heap = _MinHeap(num_clusters)
    fields = ("q_len", "kv_len", "q_indptr", "kv_indptr", "partial_indptr", "q_start", "kv_start", "kv_end")
    items: list[tuple[int, tuple[int, ...]]] = []  # (cluster, the work item's fields), in plan order
    merge = np.zeros((5, num_sms), np.int64)  # packed start, end, partial start, end, stride
    merges = partial_nnz = 0
    tiles: list[TileWork] = []
    for i, (q, n) in enumerate(zip(qs, lens)):
        packed = q * H
        for t, rem0 in zip(range(len(ends[i]) - 1, -1, -1), ends[i]):
            rem = rem0
            split = rem > limit
            row_tile = min(ctq, packed - t * ctq)
            if split:
                chunks_q = max(rem * cs // limit, 1)
                step = -(-row_tile // chunks_q)
                for off in range(0, row_tile, step):
                    if merges >= num_sms:
                        if user_limit:
                            raise ValueError(f"kv_len_limit: chunks of {limit} keys need more merge CTAs than the "
                                             f"{num_sms} SMs (MLAPlan's merge_cta_counter <= num_sm)")
                        raise AssertionError("MLAPlan: merge_cta_counter exceeds num_sm (scheduler.cuh:1771)")
                    base = int(q_ptr[i]) * H + t * ctq
                    merge[:, merges] = (base + off, base + min(off + step, row_tile), partial_nnz + off,
                                        partial_nnz + -(-rem // limit) * row_tile, row_tile)
                    merges += 1
            chunks, kv_start, empty = [], 0, rem == 0
            while rem > 0 or empty:
                c, cost = heap.pop()
                take = min(rem, limit)
                heap.insert((c, _f32(cost + _f32(_f32(2) * _f32(ctq) + _f32(take)))))
                items.append((c, (q, n, int(q_ptr[i]), int(kv_ptr[i]), partial_nnz if split else -1, t * ctq,
                                  kv_start, kv_start + take)))
                if split:
                    partial_nnz += row_tile
                chunks.append((kv_start, kv_start + take))
                rem -= take
                kv_start += take
                if empty:
                    break
            tiles.append(TileWork(i, t, t * ctq, t * ctq + row_tile, rem0, tuple(chunks), split))
    items.sort(key=lambda it: it[0])  # stable: cluster by cluster, each in plan order
    counts = np.bincount(np.array([c for c, _ in items], np.int64), minlength=num_clusters)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    flat = dict(zip(fields, np.array([v for _, v in items], np.int64).reshape(-1, len(fields)).T))
    info = (cs, num_clusters, *_offsets(num_sms, num_clusters, ctq, head_dim_o))
    return FlashInferPlan(info, cs, limit, indptr, flat["q_indptr"], flat["kv_indptr"], flat["partial_indptr"],
                          flat["q_len"], flat["kv_len"], flat["q_start"], flat["kv_start"], flat["kv_end"], *merge,
                          tuple(tiles))
