"""SGLang's own FlashAttention-3 build (sgl-project/sgl-flash-attn, compiled into ``sglang-kernel``) as SGLang's
``fa3`` MLA backend calls it.

Upstream: sgl-flash-attn cb303cf ``hopper/`` (sglang-kernel 0.4.10, SGLang 0.5.23's, pins f89bc23, which is not
obtainable here; its MLA kernels, combine and prepare kernels disassemble to the same floating-point instructions
as cb303cf's). The MLA kernels do the arithmetic of vLLM's fork
(:mod:`amla_sim.algorithms.deployed.fa3.mla`; the cross-check's captures of both builds on the same inputs are
bit-identical); what differs is the host code's bound on the splits.
``mha_fwd`` takes ``seqlen_k`` from ``max_seqlen_k`` only for a call with ``cu_seqlens_k``, else the page table's
width times the page size (``flash_api.cpp:749``), and SGLang's ``flash_attn_with_kvcache`` passes neither
``max_seqlen_k`` nor ``cu_seqlens_k``: the bound ``get_num_splits`` computes (``flash_api.cpp:422-451``) comes from
the page table SGLang allocates, ``ceil(max_context_len / page_size)`` pages under CUDA graphs
(``flashattention_backend.py:2443-2447``), the batch's longest request rounded up to pages in eager mode. vLLM
passes the longest request. The DSA decode's table is the top-k list, so its bound is topk in both engines and
:func:`~amla_sim.algorithms.deployed.fa3.sparse.fa3_mla_sparse` models SGLang's call as it is.
"""

from __future__ import annotations

import numpy.typing as npt

from ...._validate import check_int
from ....machines import Machine
from ..._common import AttentionResult
from .mla import fa3_mla

__all__ = ["sgl_fa3_mla", "SGL_FA3_COMMIT"]

#: The sgl-project/sgl-flash-attn commit the captures were taken from.
SGL_FA3_COMMIT = "cb303cf"


def sgl_fa3_mla(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seqlens: npt.ArrayLike,
    table_pages: int,
    page_size: int = 1,
    scale: float | None = None,
    num_splits: int = 0,
    num_sms: int = 132,
    machine: str | Machine = "sm90-cuda",
    trace: bool = False,
) -> AttentionResult:
    """SGLang's MLA decode through its FA3 build: q (b, s_q, h, 576), kv (b, S_max, 576), request i's keys
    ``kv[i, :seqlens[i]]`` in pages of `page_size` (SGLang's ``--page-size``, 1 by default), a page table
    `table_pages` wide (at least the longest request's pages), causal with ``cu_seqlens_q``. num_splits: 0
    (FA3's heuristic) or 1 (``--enable-deterministic-inference``). Returns
    :func:`amla_sim.algorithms.deployed.fa3.mla.fa3_mla`'s result: ``.out`` (b,
    s_q, h, 512), ``.lse`` (h, b * s_q), natural log."""
    page = check_int(page_size, "page_size", lo=1)
    width = check_int(table_pages, "table_pages", lo=1)
    longest = max((int(n) for n in list(seqlens)), default=0) if seqlens is not None else 0
    if width * page < longest:
        raise ValueError(f"table_pages: {width} pages of {page} hold {width * page} keys, fewer than the longest "
                         f"request's {longest}")
    return fa3_mla(q, kv, seqlens=seqlens, scale=scale, causal=True, page_size=page, num_splits=num_splits,
                   varlen_q=True, num_sms=num_sms, max_seqlen_k=width * page, machine=machine, trace=trace)
