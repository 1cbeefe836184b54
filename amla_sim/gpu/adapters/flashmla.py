"""deepseek-ai/FlashMLA's decodes and its forks, each the extension its folder's build script makes:

- the sm90 dense decode: ``flash_mla_dense``, built by ``build_flashmla.py`` (FlashMLA 9241ae3's sources and
  CUTLASS's headers) in about 2 minutes;
- the sm90 sparse FP8 decode (DeepSeek V3.2's and MODEL1's caches): ``flash_mla_sparse_fp8``, built by
  ``build_sparse_fp8.py`` (with ``../flashmla`` beside it for CUTLASS) in about 40 seconds, and FlashMLA's own
  quantizer (its ``tests/quant.py``) from the same sources;
- FlashMLA-ETAP (the ETAP paper's kernel, BF16 and FP16): ``flash_mla_etap``, built by ``build_etap.py``
  (pengcuo/FlashMLA-ETAP 39e6160 and CUTLASS 3.9.0's headers) in about 45 seconds.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import require_gpu, to_torch
from ._common import bits16, load_built, paged

__all__ = ["load_flashmla", "run_flashmla", "load_etap", "run_etap", "load_sparse_fp8", "run_sparse_fp8",
           "flashmla_quantize"]


def load_flashmla(folder: str | Path):
    """FlashMLA's dense decode extension, built from `folder` (which holds build_flashmla.py and its archives)."""
    return load_built(folder, "build_flashmla.py", "flashmla")


def run_flashmla(mod, q_bits: np.ndarray, kv_bits: np.ndarray, seqlens, scale: float) -> dict[str, np.ndarray]:
    """``dense_decode_fwd`` on (b, s_q, H, 576) BF16 queries and a (b, S_max, 576) cache (paged in blocks of 64):
    out (uint16 bits), lse (uint32 bits), the split schedule and the cumulative split counts."""
    import torch

    kc, bt = paged(torch, kv_bits)
    sl = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out, lse, sched, num_splits = mod.dense_decode_fwd(bits16(torch, q_bits), kc, 512, sl, bt, scale, False, None,
                                                       None)
    torch.cuda.synchronize()
    return {"out": out.view(torch.int16).cpu().numpy().view(np.uint16), "lse": lse.cpu().numpy().view(np.uint32),
            "sched": sched.cpu().numpy(), "num_splits": num_splits.cpu().numpy()}


def load_etap(folder: str | Path):
    """FlashMLA-ETAP's extension (BF16 and FP16), built from `folder` (which holds build_etap.py and its
    archives)."""
    return load_built(folder, "build_etap.py", "flashmla-etap")


def run_etap(mod, q_bits: np.ndarray, kv_bits: np.ndarray, seqlens, scale: float, causal: bool,
             fmt: str) -> dict[str, np.ndarray]:
    """``get_mla_metadata`` and ``fwd_kvcache_mla`` on (b, s_q, H, 576) queries and a (b, S_max, 576) cache (paged
    in blocks of 64), both `fmt` (``bf16`` or ``fp16``): out (uint16 bits), lse (uint32 bits), the tile-scheduler
    metadata (the 5 ints of each part the kernel writes; the other 3 are never written) and the cumulative split
    counts."""
    import torch

    b, s_q, H, _ = q_bits.shape
    kc, bt = paged(torch, kv_bits, fmt)
    sl = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    meta, num_splits = mod.get_mla_metadata(sl, s_q * H, 1)
    out, lse = mod.fwd_kvcache_mla(bits16(torch, q_bits, fmt), kc, None, 512, sl, bt, scale, causal, meta, num_splits)
    torch.cuda.synchronize()
    return {"out": out.view(torch.int16).cpu().numpy().view(np.uint16), "lse": lse.cpu().numpy().view(np.uint32),
            "sched": meta.cpu().numpy()[:, :5], "num_splits": num_splits.cpu().numpy()}


def load_sparse_fp8(folder: str | Path):
    """FlashMLA's sparse FP8 decode extension, built from `folder` (which holds build_sparse_fp8.py and its
    archive; ``folder/../flashmla`` holds the CUTLASS headers)."""
    return load_built(folder, "build_sparse_fp8.py", "flashmla-sparse-fp8")


def run_sparse_fp8(mod, q: np.ndarray, kv_cache: np.ndarray, indices: np.ndarray, topk_length: np.ndarray | None,
                   attn_sink: np.ndarray | None, scale: float,
                   schedule: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """``sparse_decode_fwd`` on (b, s_q, h, d) BF16 queries, a packed uint8 cache (num_blocks, page, 1, bytes),
    int32 indices, optional topk_length (b,) and attn_sink (h,): out (uint16 bits), lse (b, h, s_q) (uint32
    bits, the kernel's transposed view made contiguous), the tile-scheduler metadata (the 7 ints of each part; the
    8th is padding, never written), the split counts, and this GPU's SM count. schedule: (metadata (parts, 7),
    cumulative split counts (b + 1,)) to hand the kernel instead of its own (the kernel's other parts get no
    work: their first request is past the batch)."""
    import torch

    b, s_q, H, _ = np.shape(q)
    gpu_sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = splits = None
    if schedule is not None:
        rows = np.zeros((max(gpu_sms // s_q // (H // 64), 1), 8), np.int32)  # the kernel's num_sm_parts
        given, cum = schedule
        if len(given) > len(rows):
            raise ValueError(f"schedule: {len(given)} parts, more than this GPU's {len(rows)}")
        rows[:, 0] = b
        rows[:len(given), :7] = np.asarray(given)[:, :7]
        meta = torch.from_numpy(rows).cuda()
        splits = torch.from_numpy(np.asarray(cum, np.int32)).cuda()
    cache = to_torch(kv_cache, "cuda").view(torch.float8_e4m3fn)
    tl_ = None if topk_length is None else torch.from_numpy(np.asarray(topk_length, np.int32)).cuda()
    sink = None if attn_sink is None else torch.from_numpy(np.asarray(attn_sink, np.float32)).cuda()
    idx = torch.from_numpy(np.ascontiguousarray(indices, np.int32)).cuda()
    out, lse, sched, num_splits = mod.sparse_decode_fwd(bits16(torch, np.asarray(q).view(np.uint16)), cache, idx,
                                                        tl_, sink, meta, splits, None, None, None, 512, scale)
    torch.cuda.synchronize()
    return {"out": out.view(torch.int16).cpu().numpy().view(np.uint16),
            "lse": lse.contiguous().cpu().numpy().view(np.uint32),
            "sched": sched.cpu().numpy()[:, :7], "num_splits": num_splits.cpu().numpy(),  # the 8th int: padding
            "num_sms": gpu_sms}


def flashmla_quantize(folder: str | Path, kv_pages: np.ndarray, layout: str) -> np.ndarray:
    """FlashMLA's own quantizer (``tests/quant.py``, run from its sources in `folder`) on BF16 pages
    (num_blocks, page, 1, d), on the GPU: the cache as (num_blocks, page, 1, bytes) uint8, each page's bytes
    contiguous (FlashMLA's own tensor has padded page strides)."""
    require_gpu()
    import torch

    folder = Path(folder)
    sys.path.insert(0, str(folder))
    try:
        quant = importlib.import_module("build_sparse_fp8").load_quant()
    finally:
        sys.path.remove(str(folder))
    kind = {"v32": quant.FP8KVCacheLayout.V32_FP8Sparse, "model1": quant.FP8KVCacheLayout.MODEL1_FP8Sparse}[layout]
    got = quant.quantize_k_cache(bits16(torch, np.asarray(kv_pages).astype(ml_dtypes.bfloat16)), kind)  # exact
    return got.view(torch.uint8).contiguous().cpu().numpy()
