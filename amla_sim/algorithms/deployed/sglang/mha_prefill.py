"""SGLang 0.5.23's MHA-form MLA prefill on Hopper (the ``fa3`` backend's extend of DeepSeek-V3/R1, Kimi-K2) as it
chains its kernels (``srt/models/deepseek_common/attention_forward_methods/forward_mha.py``): given the per-head q,
k, v of the new tokens and the up-projected K and V of each request's cached prefix, the prefill's output, bit for
bit.

SGLang routes an extend batch here when its summed prefix lengths are 0 or at least 8192 (see
:mod:`amla_sim.invariance.routing`), and then:

- **no prefix** (``forward_normal``): one causal FA3 call over each request's new tokens;
- **one shot** (``MHA_ONE_SHOT``, the batch's total length at most ``get_max_chunk_capacity()``, 128K): one causal
  call of the new tokens over each request's prefix and new tokens together (bottom-right causal);
- **chunked** (``MHA_CHUNKED_KV``): the new tokens' causal call with its LSE; then the prefixes cut into chunks of
  ``capacity // batch`` tokens a request (chunk j: tokens ``[j L, (j + 1) L)`` of every prefix,
  ``prepare_chunked_prefix_cache_info``), one non-causal call a chunk, each merged into the accumulator with
  ``merge_state_v2(chunk, accumulator)``: the chunk the prefix operand, the reverse of vLLM's order
  (:func:`~amla_sim.algorithms.deployed.merge.sglang_new_then_chunks`).

Every FA3 call is SGLang's build (``build="sglang"``) with ``num_splits`` 1 (``sgl_kernel``'s default, never
passed); with ``--kv-cache-dtype fp8_e4m3`` q, k and v arrive in E4M3 and the calls run FA3's FP8 path.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ...._validate import check_int
from ..._common import AttentionResult
from ..fa3.prefill import cu_seqlens, fa3_prefill
from ..merge import sglang_merge_state_v2

__all__ = ["sglang_mla_prefill", "prefix_chunks", "MAX_CHUNK_CAPACITY", "MHA_MODES"]

#: ``ForwardBatch.get_max_chunk_capacity()``: the batch's total tokens up to which the MHA prefill is one call, and
#: the tokens a prefix chunk holds across the batch
MAX_CHUNK_CAPACITY = 128 * 1024
MHA_MODES = ("auto", "one-shot", "chunked")


def prefix_chunks(prefix_lens: list[int], capacity: int = MAX_CHUNK_CAPACITY) -> list[tuple[list[int], list[int]]]:
    """``prepare_chunked_prefix_cache_info``: per chunk, each request's (start, length) in its prefix, chunk j
    holding tokens ``[j L, (j + 1) L)`` of every prefix, ``L = capacity // batch``; a request past its prefix has
    length 0 in that chunk."""
    lens = [check_int(n, "prefix_lens", lo=0) for n in prefix_lens]
    L = check_int(capacity, "capacity", lo=1) // max(len(lens), 1)
    if L < 1:
        raise ValueError(f"capacity: {capacity} tokens give {len(lens)} requests no prefix chunk")
    n = -(-max(lens, default=0) // L)
    return [([j * L] * len(lens), [max(0, min(p, (j + 1) * L) - j * L) for p in lens]) for j in range(n)]


def sglang_mla_prefill(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, k_prefix: npt.ArrayLike,
                       v_prefix: npt.ArrayLike, qlens: list[int], prefix_lens: list[int], *, mode: str = "auto",
                       capacity: int = MAX_CHUNK_CAPACITY, scale: float | None = None, num_sms: int = 132,
                       launch_heads: int | None = None, trace: bool = False) -> AttentionResult:
    """SGLang 0.5.23's MHA-form prefill of an extend batch (see the module docstring): q, k (T, h, 192) and v (T, h,
    128) of the new tokens, request by request (`qlens`); k_prefix (P, h, 192), v_prefix (P, h, 128) the requests'
    cached prefixes end to end (`prefix_lens`). mode: "auto" (SGLang's choice: one shot while the batch's prefix
    and new tokens are at most `capacity`, else chunked), "one-shot" or "chunked". capacity:
    ``get_max_chunk_capacity()`` (128K). Returns ``.out`` (T, h, 128) BF16 (FP16 for FP16 inputs) and, chunked,
    the merged ``.lse`` (T, h) (else the call's (h, T)); with `trace`, the mode and the chunks."""
    qlens = [check_int(n, "qlens", lo=1) for n in qlens]
    prefix_lens = [check_int(n, "prefix_lens", lo=0) for n in prefix_lens]
    if len(qlens) != len(prefix_lens):
        raise ValueError(f"prefix_lens: one a request ({len(qlens)}), got {len(prefix_lens)}")
    if mode not in MHA_MODES:
        raise ValueError(f"mode: expected one of {', '.join(MHA_MODES)}, got {mode!r}")
    check_int(capacity, "capacity", lo=1)
    qa, ka, va, kp, vp = (np.asarray(x) for x in (q, k, v, k_prefix, v_prefix))
    for name, pre, new in (("k_prefix", kp, ka), ("v_prefix", vp, va)):
        if pre.ndim != 3 or pre.shape[1:] != new.shape[1:] or pre.dtype != new.dtype:
            raise ValueError(f"{name}: expected (P, {', '.join(map(str, new.shape[1:]))}) {new.dtype} as the new "
                             f"tokens' {name[0]}, got {pre.dtype} {pre.shape}")
    if kp.shape[0] < sum(prefix_lens) or vp.shape[0] < sum(prefix_lens):
        raise ValueError(f"k_prefix, v_prefix: {sum(prefix_lens)} rows of prefix, got {kp.shape[0]} and "
                         f"{vp.shape[0]}")
    kw = {"scale": scale, "num_splits": 1, "num_sms": num_sms, "launch_heads": launch_heads, "build": "sglang"}
    cu = cu_seqlens(qlens)
    if mode == "auto":
        mode = "one-shot" if sum(qlens) + sum(prefix_lens) <= capacity else "chunked"
    if mode == "one-shot" or not any(prefix_lens):
        po = cu_seqlens(prefix_lens)
        kk, vv = (np.concatenate([x for i in range(len(qlens)) for x in (pre[po[i]:po[i + 1]], new[cu[i]:cu[i + 1]])])
                  for pre, new in ((kp, ka), (vp, va)))
        res = fa3_prefill(qa, kk, vv, cu, cu_seqlens([p + n for p, n in zip(prefix_lens, qlens)]), causal=True,
                          **kw)
        return AttentionResult(res.out, res.lse, {"mode": "one-shot"} if trace else {}, res.hazards)
    new = fa3_prefill(qa, ka, va, cu, cu, causal=True, **kw)
    acc, acc_lse = new.out, np.ascontiguousarray(new.lse.T)  # lse.T.contiguous(), as SGLang holds it
    po = cu_seqlens(prefix_lens)
    chunks = prefix_chunks(prefix_lens, capacity)
    for starts, lens in chunks:
        rows = np.concatenate([np.arange(po[i] + s, po[i] + s + n) for i, (s, n) in enumerate(zip(starts, lens))])
        res = fa3_prefill(qa, kp[rows], vp[rows], cu, cu_seqlens(lens), causal=False, **kw)
        acc, acc_lse = sglang_merge_state_v2(res.out, np.ascontiguousarray(res.lse.T), acc, acc_lse)
    tr = {"mode": "chunked", "chunks": chunks} if trace else {}
    return AttentionResult(acc, acc_lse, tr, new.hazards)
