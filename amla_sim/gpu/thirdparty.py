"""Adapters that run the MLA decode kernels people deploy, from their own packages or builds (never vendored).

- SGLang's Triton decode: the installed ``sglang`` package's ``sglang.kernels.ops.attention.decode_attention``, or
  that file from the wheel (``pip download --no-deps sglang==0.5.23``) loaded with its sibling imports stubbed: on
  CUDA the kernel module needs only ``is_hip``, the SM count and ``unpack_aux_tensors`` from them.
- FlashMLA's sm90 dense decode: the ``flash_mla_dense`` extension that ``build_flashmla.py`` (FlashMLA's sources
  and CUTLASS's headers, ``shared/third_party/flashmla``) builds in about 2 minutes.
- FlashMLA's sm90 sparse FP8 decode (DeepSeek V3.2's and MODEL1's caches): the ``flash_mla_sparse_fp8``
  extension that ``build_sparse_fp8.py`` (``shared/third_party/flashmla-sparse-fp8``, with ``../flashmla`` beside
  it for CUTLASS) builds in about 40 seconds; FlashMLA's own quantizer (its ``tests/quant.py``) from the same
  sources.
- FlashMLA-ETAP (the ETAP paper's kernel, BF16 and FP16): the ``flash_mla_etap`` extension that ``build_etap.py``
  (pengcuo/FlashMLA-ETAP 39e6160 and CUTLASS 3.9.0's headers, ``shared/third_party/flashmla-etap``) builds in
  about 45 seconds.

Inputs and outputs are NumPy arrays of raw bits, so that the crosscheck layer never needs torch.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np

from . import require_gpu, to_torch

__all__ = ["load_sglang", "run_sglang", "load_flashmla", "run_flashmla", "load_etap", "run_etap", "load_sparse_fp8",
           "run_sparse_fp8", "flashmla_quantize"]


def _bits16(torch, bits: np.ndarray, fmt: str = "bf16"):
    """BF16 (or FP16, `fmt`) bits, as uint16 or the float type, as a CUDA tensor."""
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    return to_torch(np.ascontiguousarray(bits).view(np.int16), "cuda").view(dtype)


def _paged(torch, kv_bits: np.ndarray, fmt: str = "bf16"):
    """A (b, S_max, 576) cache as pages of 64 tokens (num_blocks, 64, 1, 576), zero past S_max, and its block
    table (request i owns pages i * n .. i * n + n - 1)."""
    b, L, d = kv_bits.shape
    nblk = -(-L // 64)
    kpad = np.zeros((b, nblk * 64, d), np.uint16)
    kpad[:, :L] = kv_bits.view(np.uint16)
    kc = _bits16(torch, kpad, fmt).view(b * nblk, 64, 1, d)
    return kc, torch.arange(b * nblk, dtype=torch.int32, device="cuda").view(b, nblk)


def _load_built(folder: str | Path, script: str, kernel: str):
    """The extension that `folder`/`script` builds (its ``build()``)."""
    require_gpu()
    folder = Path(folder)
    if not (folder / script).is_file():
        raise FileNotFoundError(f"{kernel}: {folder} has no {script}")
    sys.path.insert(0, str(folder))
    try:
        build = importlib.import_module(Path(script).stem).build
    finally:
        sys.path.remove(str(folder))
    return build()


def load_sglang(path: str | Path | None = None):
    """The kernel module: from the installed sglang when `path` is None, else from that file."""
    require_gpu()
    import torch

    if path is None:
        try:
            from sglang.kernels.ops.attention import decode_attention
        except ImportError as e:
            raise FileNotFoundError(f"sglang: not installed ({e}); pass the kernel file from the wheel "
                                    "(pip download --no-deps sglang==0.5.23)") from None
        return decode_attention
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sglang: {path} is not a file")

    def module(name: str, **attrs) -> None:
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = []
            m.__dict__.update(attrs)
            sys.modules[name] = m

    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention", "sglang.srt"):
        module(name)

    def unpack_aux_tensors(score_mod, aux_tensors):  # what the wheel's score_mod.py returns without a score_mod
        if score_mod is not None:
            raise ValueError("score_mod: not supported by this adapter")
        return None, 0, 0, 0

    module("sglang.kernels.ops.attention.score_mod", unpack_aux_tensors=unpack_aux_tensors)
    module("sglang.srt.environ", envs=None)
    module("sglang.srt.utils", is_hip=lambda: False, is_gfx95_supported=lambda: False,
           is_gfx1250_supported=lambda: False,
           get_device_core_count=lambda i=0: torch.cuda.get_device_properties(i).multi_processor_count)
    spec = importlib.util.spec_from_file_location("sglang.kernels.ops.attention.decode_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_sglang(mod, q_bits: np.ndarray, kv_bits: np.ndarray, seqlens, num_kv_splits, max_kv_splits: int,
               scale: float) -> dict[str, np.ndarray]:
    """``decode_attention_fwd`` on (b, H, 576) BF16 queries and a (b, S_max, 576) cache of which request i uses
    its first seqlens[i] rows: the output (uint16 bits), stage 1's partial outputs and LSEs (uint32 bits)."""
    import torch

    b, H, _ = q_bits.shape
    rows = np.concatenate([kv_bits[i, :n] for i, n in enumerate(seqlens)])
    kbuf = _bits16(torch, rows).view(-1, 1, rows.shape[-1])
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(seqlens)]), dtype=torch.int32, device="cuda")
    indices = torch.arange(int(sum(seqlens)), dtype=torch.int32, device="cuda")
    o = torch.full((b, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    mid = torch.full((b, H, max_kv_splits, 512), float("nan"), dtype=torch.float32, device="cuda")
    lse = torch.full((b, H, max_kv_splits), float("nan"), dtype=torch.float32, device="cuda")
    splits = torch.tensor(np.broadcast_to(num_kv_splits, (b,)), dtype=torch.int32, device="cuda")
    mod.decode_attention_fwd(_bits16(torch, q_bits), kbuf, kbuf[..., :512], o, indptr, indices, mid, lse, splits,
                             max_kv_splits, scale, 1.0, 1.0, has_mla=True)
    torch.cuda.synchronize()
    return {"o": o.view(torch.int16).cpu().numpy().view(np.uint16), "lse": lse.cpu().numpy().view(np.uint32),
            "mid": mid.cpu().numpy().view(np.uint32)}


def load_flashmla(folder: str | Path):
    """FlashMLA's dense decode extension, built from `folder` (which holds build_flashmla.py and its archives)."""
    return _load_built(folder, "build_flashmla.py", "flashmla")


def run_flashmla(mod, q_bits: np.ndarray, kv_bits: np.ndarray, seqlens, scale: float) -> dict[str, np.ndarray]:
    """``dense_decode_fwd`` on (b, s_q, H, 576) BF16 queries and a (b, S_max, 576) cache (paged in blocks of 64):
    out (uint16 bits), lse (uint32 bits), the split schedule and the cumulative split counts."""
    import torch

    kc, bt = _paged(torch, kv_bits)
    sl = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out, lse, sched, num_splits = mod.dense_decode_fwd(_bits16(torch, q_bits), kc, 512, sl, bt, scale, False, None,
                                                       None)
    torch.cuda.synchronize()
    return {"out": out.view(torch.int16).cpu().numpy().view(np.uint16), "lse": lse.cpu().numpy().view(np.uint32),
            "sched": sched.cpu().numpy(), "num_splits": num_splits.cpu().numpy()}


def load_etap(folder: str | Path):
    """FlashMLA-ETAP's extension (BF16 and FP16), built from `folder` (which holds build_etap.py and its
    archives)."""
    return _load_built(folder, "build_etap.py", "flashmla-etap")


def run_etap(mod, q_bits: np.ndarray, kv_bits: np.ndarray, seqlens, scale: float, causal: bool,
             fmt: str) -> dict[str, np.ndarray]:
    """``get_mla_metadata`` and ``fwd_kvcache_mla`` on (b, s_q, H, 576) queries and a (b, S_max, 576) cache (paged
    in blocks of 64), both `fmt` (``bf16`` or ``fp16``): out (uint16 bits), lse (uint32 bits), the tile-scheduler
    metadata (the 5 ints of each part the kernel writes; the other 3 are never written) and the cumulative split
    counts."""
    import torch

    b, s_q, H, _ = q_bits.shape
    kc, bt = _paged(torch, kv_bits, fmt)
    sl = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    meta, num_splits = mod.get_mla_metadata(sl, s_q * H, 1)
    out, lse = mod.fwd_kvcache_mla(_bits16(torch, q_bits, fmt), kc, None, 512, sl, bt, scale, causal, meta, num_splits)
    torch.cuda.synchronize()
    return {"out": out.view(torch.int16).cpu().numpy().view(np.uint16), "lse": lse.cpu().numpy().view(np.uint32),
            "sched": meta.cpu().numpy()[:, :5], "num_splits": num_splits.cpu().numpy()}


def load_sparse_fp8(folder: str | Path):
    """FlashMLA's sparse FP8 decode extension, built from `folder` (which holds build_sparse_fp8.py and its
    archive; ``folder/../flashmla`` holds the CUTLASS headers)."""
    return _load_built(folder, "build_sparse_fp8.py", "flashmla-sparse-fp8")


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
    out, lse, sched, num_splits = mod.sparse_decode_fwd(_bits16(torch, np.asarray(q).view(np.uint16)), cache, idx,
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
    got = quant.quantize_k_cache(_bits16(torch, np.asarray(kv_pages).astype(ml_dtypes.bfloat16)), kind)  # exact
    return got.view(torch.uint8).contiguous().cpu().numpy()
