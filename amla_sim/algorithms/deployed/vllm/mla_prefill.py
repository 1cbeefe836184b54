"""vLLM 0.33's MLA prefill on Hopper as it chains its kernels (``model_executor/layers/attention/mla_attention.py``):
given the per-head q, k, v of the new tokens and the up-projected K and V of each request's cached context, the
prefill's output, bit for bit.

- The new tokens: one causal FA3 call over every prefill request (:func:`~amla_sim.algorithms.deployed.fa3.
  prefill.fa3_prefill`), returning the LSE when a request has context (``forward_mha``, L3262-3274).
- The context: packed into chunks of at most ``workspace`` rows (:func:`plan_context_chunks`, after
  ``plan_mla_context_chunks``, L1943-2011); a chunk covers a run of requests with context, each whole or, where
  the budget runs out, cut at a multiple of the page size and continued in the next chunk. One non-causal FA3 call a
  chunk over its requests' tokens (``_compute_prefill_context``, L3058-3080).
- The partials: a single chunk covering every request is the context's partial itself; otherwise the partial starts
  with the requests of no context at out 0 and LSE -inf, and each chunk's rows are copied in, except a continued
  request's, which are merged (``accumulate_mla_context_chunk``, L2847-2894: ``merge_attn_states`` with the running
  partial as prefix, in place, its LSE updated).
- The end: ``merge_attn_states(prefix = context, suffix = new tokens)`` (L3297-3303).

The merges are :func:`~amla_sim.algorithms.deployed.merge.vllm_merge_attn_states` (vLLM's ``_C``, no fast math).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ...._validate import check_int
from ..._common import AttentionResult
from ..fa3.prefill import cu_seqlens, fa3_prefill
from ..merge import vllm_merge_attn_states

__all__ = ["ContextChunk", "plan_context_chunks", "chunk_rows", "vllm_mla_prefill", "workspace_rows"]


def workspace_rows(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    """``determine_chunked_prefill_workspace_size`` (L2328-2349): ``min(max(8 max_model_len, 4 max_num_seqs
    block_size), 64K)``, rounded up to the page size (``align_mla_chunked_context_workspace_size``)."""
    for name, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs), ("block_size", block_size)):
        check_int(v, name, lo=1)
    rows = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)
    return -(-max(rows, block_size) // block_size) * block_size


@dataclass(frozen=True)
class ContextChunk:
    """One context chunk: requests [request_start, request_end), each from context offset ``starts[j]`` for
    ``seq_lens[j]`` rows; ``is_continuation``: its first request was begun by the previous chunk."""

    request_start: int
    request_end: int
    starts: tuple[int, ...]
    seq_lens: tuple[int, ...]
    is_continuation: bool


def plan_context_chunks(context_lens: list[int], workspace: int, *, block_size: int = 16,
                        align_chunk_to_block: bool = True) -> list[ContextChunk]:
    """vLLM's packing of the prefill requests' contexts into chunks of at most `workspace` rows (no decode context
    parallelism): requests in order, each whole while it fits; the one that does not is cut at the largest multiple
    of the alignment (the page size when `align_chunk_to_block`, else 1) below its remaining length that fits, and
    the next chunk continues it. A request of no context is in no chunk."""
    check_int(workspace, "workspace", lo=1)
    align = check_int(block_size, "block_size", lo=1) if align_chunk_to_block else 1
    cap = workspace // align * align
    if cap < 1:
        raise ValueError(f"workspace: {workspace} rows hold no chunk aligned to {align}")
    plans, r, start, n = [], 0, 0, len(context_lens)
    while r < n:
        if context_lens[r] == 0:
            r += 1
            continue
        first, starts, lens, rows = r, [], [], 0
        while r < n and context_lens[r] > 0:
            remaining = context_lens[r] - start
            if rows + remaining > workspace:
                cut = min(cap, (remaining - 1) // align * align, (workspace - rows) // align * align)
                if cut > 0:
                    starts.append(start)
                    lens.append(cut)
                    start += cut
                break
            rows += remaining
            starts.append(start)
            lens.append(remaining)
            r, start = r + 1, 0
        if not lens:  # the workspace cannot hold a first aligned piece of this request
            raise ValueError(f"workspace: {workspace} rows cannot hold a piece of request {r}'s context aligned to "
                             f"{align}")
        plans.append(ContextChunk(first, first + len(lens), tuple(starts), tuple(lens), starts[0] > 0))
    return plans


def chunk_rows(chunk: ContextChunk, qlens: list[int], context_lens: list[int]) -> tuple[slice, np.ndarray, int]:
    """A chunk's query rows (a slice of the prefill tokens), the context rows it gathers (indices into the
    requests' contexts laid end to end) and, for a continued chunk, how many of its query rows merge."""
    qoff, coff = cu_seqlens(qlens), cu_seqlens(context_lens)
    rows = np.concatenate([np.arange(coff[r] + s, coff[r] + s + n) for r, s, n in
                           zip(range(chunk.request_start, chunk.request_end), chunk.starts, chunk.seq_lens)])
    merged = qlens[chunk.request_start] if chunk.is_continuation else 0
    return slice(int(qoff[chunk.request_start]), int(qoff[chunk.request_end])), rows, merged


def vllm_mla_prefill(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, k_context: npt.ArrayLike,
                     v_context: npt.ArrayLike, qlens: list[int], context_lens: list[int], *, workspace: int,
                     block_size: int = 16, align_chunk_to_block: bool = True, scale: float | None = None,
                     num_splits: int = 0, num_sms: int = 132, launch_heads: int | None = None,
                     trace: bool = False) -> AttentionResult:
    """vLLM 0.33's MLA prefill of a batch on Hopper (see the module docstring): q, k (T, h, 192) and v (T, h, 128)
    of the new tokens, request by request (``qlens``); k_context (C, h, 192), v_context (C, h, 128) the requests'
    contexts end to end (``context_lens``, each request's context before its new tokens). workspace: the chunked
    prefill workspace's rows (:func:`workspace_rows`). num_splits: 0 as vLLM passes it, 1 in its batch-invariant
    mode. launch_heads: the layer's heads when q holds only the first of them (:func:`fa3_prefill`'s). Returns
    ``.out`` (T, h, 128) in the input format and ``.lse``: the new tokens' LSE (h, T) where no request
    has context, else the context's (vLLM's output carries no merged LSE); with `trace`, the chunks."""
    qlens = [check_int(n, "qlens", lo=1) for n in qlens]
    context_lens = [check_int(n, "context_lens", lo=0) for n in context_lens]
    if len(qlens) != len(context_lens):
        raise ValueError(f"context_lens: one a request ({len(qlens)}), got {len(context_lens)}")
    kc, vc = np.asarray(k_context), np.asarray(v_context)
    if kc.shape[0] < sum(context_lens) or vc.shape[0] < sum(context_lens):
        raise ValueError(f"k_context, v_context: {sum(context_lens)} rows of context, got {kc.shape[0]} and "
                         f"{vc.shape[0]}")
    cu = cu_seqlens(qlens)
    kw = {"scale": scale, "num_splits": num_splits, "num_sms": num_sms, "launch_heads": launch_heads}
    new = fa3_prefill(q, k, v, cu, cu, causal=True, **kw)
    plans = plan_context_chunks(context_lens, workspace, block_size=block_size,
                                align_chunk_to_block=align_chunk_to_block)
    tr = {"chunks": plans} if trace else {}
    if not plans:
        return AttentionResult(new.out, new.lse, tr, new.hazards)
    qa = np.asarray(q)
    T = qa.shape[0]
    out, lse = None, None
    for chunk in plans:
        rows, ctx, merged = chunk_rows(chunk, qlens, context_lens)
        ql = qlens[chunk.request_start:chunk.request_end]
        res = fa3_prefill(qa[rows], kc[ctx], vc[ctx], cu_seqlens(ql), cu_seqlens(chunk.seq_lens), causal=False, **kw)
        if out is None:
            if len(plans) == 1 and all(n > 0 for n in context_lens):
                out, lse = res.out, res.lse
                break
            out = np.zeros((T,) + res.out.shape[1:], res.out.dtype)  # init_mla_context_partial (empty rows: 0,
            lse = np.full((res.lse.shape[0], T), -np.inf, np.float32)  # -inf; the rest written by a chunk)
        lo = rows.start
        if merged:
            m = slice(lo, lo + merged)
            out[m], lse[:, m] = vllm_merge_attn_states(out[m], lse[:, m], res.out[:merged], res.lse[:, :merged])
        out[lo + merged:rows.stop], lse[:, lo + merged:rows.stop] = res.out[merged:], res.lse[:, merged:]
    final, _ = vllm_merge_attn_states(out, lse, new.out, new.lse)
    return AttentionResult(final, lse, tr, new.hazards)
