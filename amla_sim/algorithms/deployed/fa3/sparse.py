"""FlashAttention-3's sparse MLA call: DeepSeek V3.2's attention as vLLM (``FLASH_ATTN_MLA_SPARSE``) and SGLang's
DSA ``fa3`` decode run it on Hopper with a BF16 cache.

Upstream: vLLM 0.33 ``vllm/v1/attention/backends/mla/flashattn_mla_sparse.py:215-259`` (``flash_attn_varlen_func``
with ``max_seqlen_q=1``, ``cu_seqlens_q = arange(T + 1)``, ``max_seqlen_k = topk``, ``seqused_k = valid_counts``,
``block_table = topk_indices``, causal) and SGLang 0.5.23 ``srt/layers/attention/dsa_backend.py:2737-2803``
(``flash_attn_with_kvcache`` with ``page_table = page_table_1``, ``cache_seqlens = min(seq_len, topk)``). The cache
is seen as pages of one token: every query token is a sequence of its own, whose page table is its top-k list of
cache rows, the valid ones first. FA3's kernel is then :func:`.mla.fa3_mla` unchanged, over T one-query requests
whose keys are their gathered rows: the split bound comes from ``max_seqlen_k`` (topk in both calls,
``flash_api.cpp:835``) as if the launch held one request, each token's split count from the prepare kernel over all
T tokens (none split beyond 992 tokens), and a token of no valid row writes out 0 and LSE -inf. So a token's bits
depend on the launch's other tokens through the split counts: a decode batch of a few tokens splits, a prefill of
thousands does not.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ...._validate import check_int
from ....formats import get_format
from ....machines import Machine
from ....schedules import Schedule
from ..._common import D_K, AttentionResult, _check_storage, causal_lists, check_kernel_layout
from ..topk import sparse_rows
from .mla import fa3_mla
from .scheduler import KBLOCK_N

__all__ = ["fa3_mla_sparse", "fa3_mla_sparse_decode"]


def _check(q: npt.ArrayLike, kv_cache: npt.ArrayLike, topk_indices: npt.ArrayLike,
           valid_counts: npt.ArrayLike | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The call's arrays, or an error naming the argument the kernel would misread."""
    qa = _check_storage(q, "q", ("bf16", "fp16"))
    kva = _check_storage(kv_cache, "kv_cache", (get_format(qa.dtype).name,))
    if qa.ndim != 3 or qa.shape[-1] != D_K or min(qa.shape) < 1:
        raise ValueError(f"q: expected shape (T, h, {D_K}) (one query a token), got {qa.shape}")
    if kva.ndim != 2 or kva.shape[1] != D_K or kva.shape[0] < 1:
        raise ValueError(f"kv_cache: expected shape (rows, {D_K}) (the cache as one-token pages), got {kva.shape}")
    idx = np.asarray(topk_indices)
    T, N = qa.shape[0], kva.shape[0]
    if idx.dtype.kind not in "iu" or idx.ndim != 2 or idx.shape[0] != T or idx.shape[1] < 1:
        raise ValueError(f"topk_indices: expected ints of shape ({T}, topk), got {idx.dtype} {idx.shape}")
    if idx.size and (idx.min() < -1 or idx.max() >= N):
        raise ValueError(f"topk_indices: expected cache rows in 0..{N - 1} or -1, got {idx.min()}..{idx.max()}")
    idx = idx.astype(np.int64)
    valid = (idx >= 0).sum(axis=1) if valid_counts is None else np.asarray(valid_counts)
    if valid.shape != (T,) or valid.dtype.kind not in "iu" or valid.min() < 0 or valid.max() > idx.shape[1]:
        raise ValueError(f"valid_counts: expected {T} ints in 0..{idx.shape[1]}, got {valid_counts!r}")
    valid = valid.astype(np.int64)
    hole = (np.arange(idx.shape[1])[None, :] < valid[:, None]) & (idx < 0)
    if hole.any():
        t = int(np.flatnonzero(hole.any(axis=1))[0])
        raise ValueError(f"topk_indices: token {t} has -1 among its first valid_counts[{t}] = {valid[t]} entries "
                         "(the kernel reads them all: the valid rows come first, as the indexer writes them)")
    return qa, kva, idx, valid


def fa3_mla_sparse(
    q: npt.ArrayLike,
    kv_cache: npt.ArrayLike,
    topk_indices: npt.ArrayLike,
    *,
    valid_counts: npt.ArrayLike | None = None,
    scale: float | None = None,
    num_splits: int = 0,
    max_seqlen_k: int | None = None,
    num_sms: int = 132,
    machine: str | Machine = "sm90-cuda",
    trace: bool = False,
) -> AttentionResult:
    """FA3's sparse MLA call on `machine` (see the module docstring).

    q: (T, h, 576) BF16 or FP16, one query a token (q_nope then q_rope); kv_cache: (rows, 576) of the same format,
    the paged cache as flat rows (kv_c then k_rope); topk_indices: (T, topk) ints, cache rows with -1 for an
    invalid entry, the valid ones first; valid_counts: (T,) the kernel's ``seqused_k`` (None: each token's
    non-negative entries, vLLM's ``valid_counts``; SGLang's ``min(seq_len, topk)`` is the same count).
    max_seqlen_k: the call's (None: topk, as both engines pass it or the kernel infers it). num_splits: 0 (FA3's
    heuristic; SGLang passes 1 in deterministic mode). Returns ``.out`` (T, h, 512) and ``.lse`` (h, T), natural
    log, as the kernel returns them; with `trace`, :func:`.mla.fa3_mla`'s schedule.
    """
    qa, kva, idx, valid = _check(q, kv_cache, topk_indices, valid_counts)
    topk = idx.shape[1]
    bound = topk if max_seqlen_k is None else check_int(max_seqlen_k, "max_seqlen_k", lo=1)
    keys = sparse_rows(kva, idx, valid)  # the kernel reads a token's first valid[t] slots alone (mla.py's _split)
    res = fa3_mla(qa[:, None], keys, seqlens=valid, scale=scale, causal=True, page_size=1, num_splits=num_splits,
                  varlen_q=True, num_sms=num_sms, max_seqlen_k=bound, machine=machine,
                  trace=trace)
    return AttentionResult(res.out[:, 0], res.lse, res.trace, res.hazards)


def fa3_mla_sparse_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "sm90-cuda",
    schedule: str | Schedule = "reference",
    block: int = KBLOCK_N,
    scale: float | None = None,
    num_sms: int = 132,
    trace: bool = False,
) -> AttentionResult:
    """:func:`fa3_mla_sparse` as the papers' algorithms are called (``run``, ``reproduce``, ``sweep``): query s of
    request i a token of the launch whose list is request i's rows up to its causal end ``S - s_q + s`` (topk =
    S), the LSE as (b, s_q, h). The kernel lays its work out itself: `block` must be its 64 and `schedule` is
    checked, not used."""
    check_kernel_layout(schedule, block, KBLOCK_N)
    qa = np.asarray(q)
    kva = np.asarray(kv)
    if qa.ndim != 4 or kva.ndim != 3 or kva.shape[0] != qa.shape[0]:
        raise ValueError(f"q, kv: expected (b, s_q, h, 576) and (b, S, 576), got {qa.shape} and {kva.shape}")
    b, s_q, H, _ = qa.shape
    S = kva.shape[1]
    idx = causal_lists(b, s_q, S, S)
    res = fa3_mla_sparse(qa.reshape(b * s_q, H, -1), kva.reshape(b * S, -1), idx.astype(np.int32), scale=scale,
                         num_sms=num_sms, machine=machine, trace=trace)
    return AttentionResult(res.out.reshape(b, s_q, H, -1), res.lse.T.reshape(b, s_q, H), res.trace, res.hazards)

