"""The FP8 MLA decodes vLLM serves on Hopper, run as vLLM runs them (never vendored):

- vLLM's dense FP8 FlashMLA decode (the FLASHMLA backend with ``--kv-cache-dtype fp8``), compiled here from a
  checkout of vllm-project/FlashMLA (``csrc/extension/sm90/dense_fp8/`` and CUTLASS at ``csrc/cutlass``, as ``git
  clone --recursive`` gives) with FlashMLA's nvcc flags, then called as ``vllm/v1/attention/ops/flashmla.py`` calls
  it (the split metadata, then ``fwd_kvcache_mla_fp8``);
- vLLM's Triton MLA decode (TRITON_MLA): ``vllm/v1/attention/ops/triton_decode_attention.py`` from an installed
  vLLM or the file itself (its two vLLM imports provided), called as ``forward_mqa`` calls it.

The query and the cache are quantized on the GPU as vLLM does (``QuantFP8``'s ``x * reciprocal(scale)`` with a
clamp; ``concat_and_cache_mla``'s ``x / scale`` cast with saturation), and the bytes are returned beside the
outputs so that the capture can check :mod:`amla_sim.algorithms.deployed.vllm.fp8` against them.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np

from .. import require_gpu, to_torch
from ._build import FLASHMLA_NVCC, checkout_files, compile_extension
from ._common import shuffled_pages

__all__ = ["build_dense_fp8", "run_dense_fp8", "load_vllm_triton", "run_vllm_triton", "quantize_like_vllm"]

_DENSE_FP8 = ("csrc", "extension", "sm90", "dense_fp8")
_TRITON_FILE = ("vllm", "v1", "attention", "ops", "triton_decode_attention.py")


def build_dense_fp8(checkout: str | Path, *, verbose: bool = False):
    """The dense FP8 extension compiled from a vllm-project/FlashMLA checkout: ``pybind.cpp`` (its own module,
    ``-DNO_PYBIND11=1`` as FlashMLA's setup.py builds it), the kernel and the metadata kernel, with FlashMLA's
    flags (``-O3 --use_fast_math --expt-relaxed-constexpr --expt-extended-lambda``, sm_90a)."""
    files = ["pybind.cpp", "flash_fwd_mla_fp8_sm90.cu", "flash_fwd_mla_metadata.cu"]
    root = checkout_files(checkout, "flashmla-dense-fp8", ["csrc/cutlass/include/cute/tensor.hpp",
                                                           *("/".join((*_DENSE_FP8, f)) for f in files)],
                          "a vllm-project/FlashMLA checkout with CUTLASS at csrc/cutlass (git clone --recursive)")
    src = root.joinpath(*_DENSE_FP8)
    flags = ["-O3", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations", "-DNO_PYBIND11=1"]
    return compile_extension("flashmla_dense_fp8", [src / f for f in files],
                             [root / "csrc", src, root / "csrc" / "cutlass" / "include"], [*flags, "-std=c++20"],
                             [*flags, "-std=c++17", *FLASHMLA_NVCC], verbose=verbose)


def quantize_like_vllm(torch, x: np.ndarray, scale: float, *, query: bool):
    """`x` (BF16 bits) quantized to E4M3 on the GPU as vLLM does: the query with ``QuantFP8.forward_native``, the
    cache as ``concat_and_cache_mla`` (``x / scale`` saturated)."""
    t = to_torch(x, "cuda").float()
    s = torch.tensor([scale], dtype=torch.float32, device="cuda")
    y = t * s.reciprocal() if query else t / s
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _bits(t) -> np.ndarray:
    import torch

    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    out = t.contiguous().view(view).cpu().numpy()
    return out.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[t.element_size()])


def run_dense_fp8(mod, q_bits: np.ndarray, kv_bits: np.ndarray, recipe: dict) -> dict[str, np.ndarray]:
    """One case: q (b, s_q, h, 576) and kv (b, S_max, 576) BF16 bits quantized as vLLM does with the recipe's
    ``q_scale`` and ``k_scale``, the cache in shuffled pages of 64, then vLLM's two calls. Returns out (uint16),
    lse (uint32), each request's split count and the quantized q and kv bytes."""
    import torch

    lens = recipe["seqlens"]
    q8 = quantize_like_vllm(torch, q_bits, recipe["q_scale"], query=True)
    kv8 = quantize_like_vllm(torch, kv_bits, recipe["k_scale"], query=False)
    reqs = [kv8[i, :n] for i, n in enumerate(lens)]
    cache, table = shuffled_pages(torch, reqs, 64, recipe["seed"], torch.float8_e4m3fn)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    _, s_q, h, _ = q_bits.shape
    dq = torch.tensor([recipe["q_scale"]], dtype=torch.float32, device="cuda")
    dk = torch.tensor([recipe["k_scale"]], dtype=torch.float32, device="cuda")
    meta, num_splits = mod.get_mla_decoding_metadata_dense_fp8(sl, s_q * h, 1)
    out, lse = mod.fwd_kvcache_mla_fp8(q8, cache.unsqueeze(-2), 512, sl, table, recipe["scale"], True, meta,
                                       num_splits, dq, dk)
    torch.cuda.synchronize()
    ns = num_splits.cpu().numpy()
    return {"out": _bits(out), "lse": _bits(lse), "splits": np.diff(ns).astype(np.int32),
            "q8": _bits(q8), "kv8": _bits(kv8)}


def load_vllm_triton(path: str | Path | None = None):
    """vLLM's Triton decode module: from the installed vLLM when `path` is None, else that file (a vLLM checkout's
    ``vllm/v1/attention/ops/triton_decode_attention.py``, or a checkout holding it) executed unchanged with what it
    imports from vLLM provided (``current_platform.is_rocm()`` False, ``vllm.triton_utils`` the installed Triton)."""
    require_gpu()
    if path is None:
        try:
            from vllm.v1.attention.ops import triton_decode_attention
        except ImportError as e:
            raise FileNotFoundError(f"vllm-triton-mla: vLLM is not installed ({e}); pass its "
                                    f"{'/'.join(_TRITON_FILE)}") from None
        return triton_decode_attention
    path = Path(path)
    if path.is_dir():
        path = path.joinpath(*_TRITON_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"vllm-triton-mla: {path} is not a file")
    import triton
    import triton.language as tl

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_rocm=lambda: False)
    utils = types.ModuleType("vllm.triton_utils")
    utils.tl, utils.triton = tl, triton
    vllm = sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    sys.modules["vllm.platforms"], sys.modules["vllm.triton_utils"] = platforms, utils
    vllm.platforms, vllm.triton_utils = platforms, utils
    spec = importlib.util.spec_from_file_location("vllm_triton_decode_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_vllm_triton(mod, q_bits: np.ndarray, kv_bits: np.ndarray, recipe: dict, num_kv_splits: int
                    ) -> dict[str, np.ndarray]:
    """One case as ``TritonMLAImpl.forward_mqa`` runs it: q (b, s_q, h, 576) BF16 bits as b s_q rows, the cache
    (BF16, or quantized to E4M3 as vLLM writes it with the recipe's ``k_scale``) in shuffled pages of the recipe's
    size, causal rows' extents, `num_kv_splits` splits, ``k_scale`` as both scales. Returns out and lse (uint16
    BF16 bits; (b s_q, h, 512) and (b s_q, h)), stage 1's buffer ``mid`` (uint32 FP32 bits, (b s_q, h, splits,
    513): each split's partial output and LSE, NaN where a split is empty) and, for an FP8 cache, its bytes."""
    import torch

    b, s_q, h, _ = q_bits.shape
    lens, page = recipe["seqlens"], recipe["page_size"]
    fp8 = recipe["kv_cache"] == "fp8"
    kv = quantize_like_vllm(torch, kv_bits, recipe["k_scale"], query=False) if fp8 else to_torch(kv_bits, "cuda")
    cache, table = shuffled_pages(torch, [kv[i, :n] for i, n in enumerate(lens)], page, recipe["seed"], kv.dtype)
    q = to_torch(q_bits, "cuda").reshape(b * s_q, h, -1)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if s_q > 1:
        table = table.repeat_interleave(s_q, dim=0)
        off = torch.arange(1 - s_q, 1, device="cuda", dtype=sl.dtype)
        sl = (sl.unsqueeze(1) + off).flatten().clamp(min=0)
    o = torch.zeros(b * s_q, h, 512, dtype=q.dtype, device="cuda")
    lse = torch.zeros(b * s_q, h, dtype=q.dtype, device="cuda")
    # vLLM allocates it empty; NaN marks the splits stage 1 never writes (stage 2 reads only the others)
    logits = torch.full((b * s_q, h, num_kv_splits, 513), float("nan"), dtype=torch.float32, device="cuda")
    ks = torch.tensor(recipe["k_scale"] if fp8 else 1.0, dtype=torch.float32, device="cuda")
    c = cache.unsqueeze(2)
    mod.decode_attention_fwd(q, c, c[..., :512], o, lse, table, sl, logits, num_kv_splits, recipe["scale"], page,
                             k_scale=ks, v_scale=ks, is_mla=True)
    torch.cuda.synchronize()
    res = {"out": _bits(o), "lse": _bits(lse), "mid": _bits(logits)}
    if fp8:
        res["kv8"] = _bits(kv)
    return res
