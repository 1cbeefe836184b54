"""vLLM's ``FLASHINFER_MLA_SPARSE_SM90`` backend: sparse MLA without RoPE (head size 512, GLM-5.3-Flash's NoPE
attention) through FlashInfer's sm90 MLA kernel, written against a machine.

Upstream: vLLM 0.33 ``vllm/v1/attention/backends/mla/flashinfer_mla_sparse_sm90.py`` (the plan ``:343-376``, the
top-k packing ``:90-109``, the run ``:593-646``) and ``sparse_utils.py:493-626`` (top-k positions to cache slots,
the valid ones packed to the front in their order); FlashInfer 0.7.2's kernel instantiated with
``head_dim_kpe = 0`` (``BatchMLAPageAttentionHopper<kNone, 512, 0>``, ``mla_hopper.cuh``).

Every query token is a request of one query (page size 1, not causal) whose keys are its valid top-k slots in
the order the indexer listed them; the plan's batch is padded with empty rows to vLLM's
``max_num_batched_tokens``, and its chunk length (``kv_len_limit``) comes from all the step's keys, so a token's
bits depend on its batchmates. The kernel is :func:`.mla.flashinfer_mla` with q and keys 512 wide: the scores
are the 32 latent k16 steps alone; an E4M3 cache is read as ``bf16(e4m3 * bf16(k_scale))``. vLLM asks for no LSE;
the kernel's own (base 2) is returned beside the output.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ...._validate import check_int
from ....formats import get_format
from ....machines import Machine
from ..._common import D_V, AttentionResult, _check_storage
from ..topk import sparse_rows
from .mla import _finite_positive, flashinfer_mla

__all__ = ["flashinfer_mla_sparse", "packed_topk"]


def packed_topk(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's conversion of a token's top-k list into the kernel's ``kv_indices`` (``sparse_utils.py:194-221``,
    ``flashinfer_mla_sparse_sm90.py:90-109``): its valid slots moved to the front in their order, -1 after them;
    and each token's count of them (its ``kv_len``)."""
    valid = indices >= 0
    order = np.argsort(~valid, axis=1, kind="stable")
    return np.take_along_axis(indices, order, axis=1), valid.sum(axis=1)


def flashinfer_mla_sparse(
    q: npt.ArrayLike,
    kv_cache: npt.ArrayLike,
    topk_indices: npt.ArrayLike,
    *,
    scale: float,
    k_scale: float | None = None,
    max_num_batched_tokens: int | None = None,
    plan_seqlens: npt.ArrayLike | None = None,
    num_sms: int = 132,
    machine: str | Machine = "sm90-cuda",
    trace: bool = False,
) -> AttentionResult:
    """vLLM's sparse SM90 call on `machine` (see the module docstring).

    q: (T, h, 512) BF16, one query a token (the absorbed latent query, no RoPE part); kv_cache: (rows, 512) BF16,
    or E4M3 (``--kv-cache-dtype fp8``) read with `k_scale` (the layer's, 1.0 unless the checkpoint sets one);
    topk_indices: (T, topk) cache rows, -1 for none, in the indexer's order. scale: the model's softmax scale, as
    vLLM passes it (GLM-5.3-Flash: 256^-0.5). max_num_batched_tokens: the rows vLLM plans (None: T), the empty
    ones after the step's tokens. plan_seqlens: (T,) the lengths vLLM plans the rows with, at least each token's
    valid count (its sync-free upper bounds, ``:303-341``; the work items' kv_end then clamped to the valid count
    on the device, ``_clamp_work_kv_end`` :112-143); None: the valid counts. Returns ``.out`` (T, h, 512) BF16
    and ``.lse`` (T, h), base 2; with `trace`, :func:`.mla.flashinfer_mla`'s plan.
    """
    qa = _check_storage(q, "q", ("bf16",))
    if qa.ndim != 3 or qa.shape[-1] != D_V or min(qa.shape) < 1:
        raise ValueError(f"q: expected shape (T, h, {D_V}) (one latent query a token, no RoPE part), got {qa.shape}")
    kva = _check_storage(kv_cache, "kv_cache", ("bf16", "e4m3"))
    if kva.ndim != 2 or kva.shape[1] != D_V or kva.shape[0] < 1:
        raise ValueError(f"kv_cache: expected shape (rows, {D_V}) (the latent cache as one-token pages), got "
                         f"{kva.shape}")
    T, N = qa.shape[0], kva.shape[0]
    idx = np.asarray(topk_indices)
    if idx.dtype.kind not in "iu" or idx.ndim != 2 or idx.shape[0] != T or idx.shape[1] < 1:
        raise ValueError(f"topk_indices: expected ints of shape ({T}, topk), got {idx.dtype} {idx.shape}")
    if idx.min() < -1 or idx.max() >= N:
        raise ValueError(f"topk_indices: expected cache rows in 0..{N - 1} or -1, got {idx.min()}..{idx.max()}")
    rows = T if max_num_batched_tokens is None else check_int(max_num_batched_tokens, "max_num_batched_tokens",
                                                             lo=T)
    e4m3 = get_format(kva.dtype).name == "e4m3"
    if k_scale is not None and not e4m3:
        raise ValueError("k_scale: only an E4M3 cache takes a scale (kv_cache is BF16)")
    if k_scale is not None:
        _finite_positive(k_scale, "k_scale")  # named here, not as ckv_scale
    packed, lens = packed_topk(idx.astype(np.int64))
    keys = sparse_rows(kva, packed, lens)
    scales = {"ckv_scale": 1.0 if k_scale is None else k_scale, "kpe_scale": 1.0} if e4m3 else {}
    res = flashinfer_mla(qa[:, None], keys, seqlens=lens, scale=scale, causal=False, page_size=1, num_sms=num_sms,
                         pad_rows=rows - T, plan_seqlens=plan_seqlens, machine=machine, trace=trace, **scales)
    return AttentionResult(res.out[:, 0], res.lse, res.trace, res.hazards)
