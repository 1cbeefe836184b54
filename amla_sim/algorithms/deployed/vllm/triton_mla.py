"""vLLM's Triton MLA decode (the TRITON_MLA backend), written against a machine: the split/merge decode of
:mod:`amla_sim.algorithms.deployed.splitkv` with vLLM's parameters. On ``sm90-triton`` it predicts the kernel's
output and LSE bit for bit, with a BF16 or an FP8 cache.

Upstream: vllm-project/vllm 0.33.0, ``vllm/v1/attention/ops/triton_decode_attention.py`` (``decode_attention_fwd``,
the grouped stage 1 and stage 2; adapted by vLLM from an older SGLang) and ``vllm/v1/attention/backends/mla/
triton_mla.py`` (``forward_mqa``, ``_compute_num_kv_splits``). What vLLM's differs in from SGLang's:

- one split count for the whole batch, ``min(next_pow2(max(1, max_seq_len // 512)), 2 sms)`` (the longest request
  sets every request's; 1 under ``VLLM_BATCH_INVARIANT``), and splits of ``cdiv(L, num_kv_splits)`` tokens (no
  rounding to a minimum block);
- an MTP step of s_q query tokens is b s_q rows, row t of a request with its own extent ``L - s_q + 1 + t``
  (causal; ``L`` when not) and so its own split boundaries;
- an FP8 (E4M3) cache is dequantized in stage 1, ``bf16(fl32(x) * k_scale)`` for K and K_rope alike, and V is that
  dequantized K (vLLM passes ``k_scale`` as ``v_scale`` too; stage 2 does not scale); the upcast operands take the
  tensor cores in another k order (:data:`FP8_CACHE_K_ORDER`), so both dots group their products differently;
- stage 2 writes the output and the LSE ``m + tl.log(l)`` in q's format (BF16);
- with one query head (a KV head's group of one) the op takes its MHA kernel, ``decode_attention_fwd_normal``
  (:mod:`amla_sim.algorithms.deployed.splitkv_mha`: q times K summed in BF16), and the same stage 2.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....formats import get_format
from ....machines import Machine, get_machine
from ....resources import check_fits
from ....schedules import Schedule
from ..._common import D_K, AttentionResult, check_kernel_inputs, check_kernel_layout
from ..scalars import api_float, softmax_scale
from ..splitkv import split_ranges, stage1, stage2
from ..splitkv_mha import stage1_mha
from .fp8 import quantize_cache_fp8

__all__ = ["vllm_triton_mla", "vllm_triton_mla_decode", "vllm_num_kv_splits", "VLLM_VERSION", "FP8_CACHE_K_ORDER"]

#: The vLLM release whose kernel file and backend the model follows.
VLLM_VERSION = "0.33.0"
BLOCK_N, BLOCK_H, NUM_WARPS = 32, 16, 4  # _decode_grouped_att_m_fwd on NVIDIA
_MIN_WORK_PER_SPLIT, _SPLIT_OCCUPANCY_MULTIPLIER = 512, 2
#: The order of k in each 32 as the tensor cores take it when the dots' operands are upcast from an FP8 cache in
#: registers: Triton lays those out with kWidth = 4 (four consecutive k a thread, for the 8-bit source), so the first
#: mma.sync.m16n8k16 of a 32 sums k 4t, 4t + 1 (t < 8) and the second 4t + 2, 4t + 3; a BF16 cache keeps kWidth = 2,
#: k in order. Read off the kernel's TTGIR and PTX (Triton 3.6; scripts/vllm_triton_kwidth.py) and measured: 100%
#: of the FP8 captures' bits with it.
FP8_CACHE_K_ORDER = tuple(4 * t + e for e2 in (0, 2) for t in range(8) for e in (e2, e2 + 1))
_BYTES_PER_SPLIT = 3 * 8 * (512 + 1)  # per row and split: mid and lse in float64, and the copies made of them


def vllm_num_kv_splits(max_seq_len: int, sms: int = 132, *, batch_invariant: bool = False) -> int:
    """``_compute_num_kv_splits``: the next power of two of ``max(1, max_seq_len // 512)``, at most 2 x `sms`; 1
    in batch-invariant mode."""
    check_int(max_seq_len, "max_seq_len", lo=0)
    check_int(sms, "sms", lo=1)
    if batch_invariant:
        return 1
    ideal = 1 << (max(1, max_seq_len // _MIN_WORK_PER_SPLIT) - 1).bit_length()
    return min(ideal, sms * _SPLIT_OCCUPANCY_MULTIPLIER)


def row_extents(seqlens: np.ndarray, s_q: int, causal: bool) -> np.ndarray:
    """``forward_mqa``'s per-row lengths of an MTP step: row t of a request of L tokens sees ``max(L - s_q + 1 + t,
    0)`` when causal, L otherwise; (b s_q,)."""
    L = np.asarray(seqlens, np.int64)[:, None]
    off = np.arange(1 - s_q, 1)[None, :] if causal else np.zeros((1, s_q), np.int64)
    return np.maximum(L + off, 0).reshape(-1)


@quiet_fp
def vllm_triton_mla(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seqlens: npt.ArrayLike | None = None,
    scale: float | None = None,
    k_scale: float = 1.0,
    num_kv_splits: int | None = None,
    sms: int = 132,
    batch_invariant: bool = False,
    causal: bool = True,
    page_size: int = 16,
    machine: str | Machine = "sm90-triton",
    trace: bool = False,
) -> AttentionResult:
    """vLLM's Triton MLA decode on `machine` (see the module docstring).

    q: (b, s_q, h, 576) BF16. kv: (b, S_max, 576), the cache as stored: BF16, or E4M3 with its scale `k_scale`
    (:func:`amla_sim.algorithms.deployed.vllm.fp8.quantize_cache_fp8` writes it); rows past ``seqlens[i]``
    ignored, V its first 512 columns.
    num_kv_splits: None for vLLM's choice over the batch (:func:`vllm_num_kv_splits` of the longest request on
    `sms` SMs, 1 with `batch_invariant`). causal: the MTP rows' extents (vLLM's decode is causal). page_size is
    checked only (paging changes no bits). Returns ``.out`` (b, s_q, h, 512) and ``.lse`` (b, s_q, h), both BF16
    as the kernel stores them (the LSE buffer is (b s_q, h)); with `trace`, ``splits`` (b s_q, n, 2) every
    split's token range, ``mid`` and ``split_lse`` stage 1's partial outputs and LSEs.
    """
    mc = get_machine(machine)
    mc.require(kernel="vllm-triton-mla", natural_log=True, suggest="sm90-triton")
    qa, kva, lens = check_kernel_inputs(q, kv, seqlens, kv_formats=("bf16", "e4m3"), empty=True)
    sm, ks = softmax_scale(scale), api_float(k_scale, "k_scale")
    check_int(sms, "sms", lo=1)
    check_int(page_size, "page_size", lo=1)
    for name, v in (("batch_invariant", batch_invariant), ("causal", causal)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name}: expected True or False, got {v!r}")
    n = vllm_num_kv_splits(int(lens.max()), sms, batch_invariant=batch_invariant) if num_kv_splits is None \
        else check_int(num_kv_splits, "num_kv_splits", lo=1, hi=65535)  # stage 1's grid holds it in CUDA's z
    b, s_q, H, _ = qa.shape
    check_fits(_BYTES_PER_SPLIT * b * s_q * H * n, what=f"vllm_triton_mla with {n} splits", lower="num_kv_splits")
    rows = row_extents(lens, s_q, bool(causal))  # a row that sees no key: out NaN, LSE -inf (0 / 0, log 0)
    ranges = split_ranges(rows, n, n, min_block_kv=1)
    Q = mc.cast(qa, "bf16").reshape(b * s_q, H, D_K)
    K = _dequantized(mc, kva, ks)
    K = np.repeat(K, s_q, axis=0) if s_q > 1 else K
    tr: dict[str, list[np.ndarray]] = {}
    k_order = np.array(FP8_CACHE_K_ORDER) if get_format(kva.dtype).name == "e4m3" else None
    if H == 1:  # kv_group_num 1: decode_attention_fwd_normal, the MHA kernel (triton_decode_attention.py:781)
        mid, lse_s = stage1_mha(mc, Q, K, ranges, mc.f(sm), bf16_sum=True, cache=get_format(kva.dtype).name)
    else:
        mid, lse_s = stage1(mc, Q, K, ranges, mc.f(sm), BLOCK_N, NUM_WARPS, None, k_order=k_order)
    out, lse = stage2(mc, mid, lse_s, ranges, mc.f(1.0))
    if trace:
        tr = {"splits": [ranges], "mid": [mid], "split_lse": [lse_s]}
    hazards = Counter()
    if np.isnan(out).any():
        hazards["nan_outputs"] += int(np.isnan(out).sum())
    return AttentionResult(mc.cast(out, "bf16").reshape(b, s_q, H, -1), mc.cast(lse, "bf16").reshape(b, s_q, H),
                           tr, hazards)


def _dequantized(mc: Machine, kv: np.ndarray, k_scale: np.float32) -> np.ndarray:
    """The cache as stage 1 reads it: BF16 as stored; E4M3 as ``(k.to(tl.float32) * ks).to(q.dtype)``, a function
    of the byte alone, so made once for the 256 of them and looked up."""
    if get_format(kv.dtype).name == "bf16":
        return mc.cast(kv, "bf16")
    every = np.arange(256, dtype=np.uint8).view(kv.dtype)
    table = mc.cast(mc.f(mc.f(every) * mc.f(k_scale)), "bf16")
    return table[np.ascontiguousarray(kv).view(np.uint8)]


def vllm_triton_mla_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "sm90-triton",
    schedule: str | Schedule = "reference",
    block: int = BLOCK_N,
    scale: float | None = None,
    kv_cache: str = "bf16",
    k_scale: float = 1.0,
    run_on: str | None = None,
    num_sms: int = 132,
    trace: bool = False,
) -> AttentionResult:
    """:func:`vllm_triton_mla` as the papers' algorithms are called (``run``, ``reproduce``, ``sweep``): BF16 q and
    kv, the cache stored as `kv_cache` (``bf16``, or ``fp8``: quantized as vLLM writes it, with `k_scale`), every
    request the whole of kv, vLLM's split count. run_on: a machine to run on in place of the sweep's (a table of CUDA
    kernels on ``sm90-cuda`` runs this Triton kernel on ``sm90-triton``, the same GPU under Triton). The kernel lays
    its work out itself, in blocks of its own 32 keys: `schedule` and `block` (the sweep's, a table's 64 included)
    are checked, not used."""
    check_kernel_layout(schedule, BLOCK_N, BLOCK_N)
    check_int(block, "block", lo=1)
    if kv_cache not in ("bf16", "fp8"):
        raise ValueError(f"kv_cache: expected 'bf16' or 'fp8', got {kv_cache!r}")
    cache = quantize_cache_fp8(kv, k_scale) if kv_cache == "fp8" else kv
    return vllm_triton_mla(q, cache, scale=scale, k_scale=k_scale if kv_cache == "fp8" else 1.0, sms=num_sms,
                           machine=machine if run_on is None else run_on, trace=trace)
