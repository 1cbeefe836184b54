"""deepseek-ai/FlashMLA's decodes and its forks, compiled from an upstream checkout (``git clone --recursive``, CUTLASS
at ``csrc/cutlass``) by this project's build code with FlashMLA's setup.py flags:

- the sm90 dense decode (FlashMLA 9241ae3): ``build_flashmla``, about 2 minutes on 16 cores;
- the sm90 sparse FP8 decode (DeepSeek V3.2's and MODEL1's caches, the same checkout): ``build_sparse_fp8``,
  about 40 seconds, and FlashMLA's own quantizer (its ``tests/quant.py``): ``flashmla_quantize``;
- FlashMLA-ETAP (the ETAP paper's kernel, pengcuo/FlashMLA-ETAP 39e6160, BF16 and FP16): ``build_etap``, about 45
  seconds;
- the sm90 sparse prefill ``flash_mla_sparse_fwd`` (DeepSeek V3.2's sparse attention over a BF16 cache, the same
  checkout): ``build_sparse_prefill``, four instantiations (about 40 seconds).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import require_gpu, to_torch
from ._build import FLASHMLA_NVCC, added_source, checkout_files, compile_extension
from ._common import bits16, paged

__all__ = ["build_flashmla", "run_flashmla", "build_etap", "run_etap", "build_sparse_fp8", "run_sparse_fp8",
           "flashmla_quantize", "build_sparse_prefill", "run_sparse_prefill"]


_FLASHMLA = "a deepseek-ai/FlashMLA checkout with CUTLASS at csrc/cutlass (git clone --recursive)"
_ETAP = "a pengcuo/FlashMLA-ETAP checkout with CUTLASS at csrc/cutlass (git clone --recursive)"
_CUTLASS = "csrc/cutlass/include/cute/tensor.hpp"
# FlashMLA 9241ae3's setup.py: the include folders under csrc/ and the host flags
_FLASHMLA_INCLUDES = ["", "kerutils/include", "sm90", "api", "cutlass/include", "cutlass/tools/util/include"]
_FLASHMLA_CFLAGS = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"]

# This project's bindings: FlashMLA's api.cpp binds every kernel of the checkout (sm100 and prefill ones too); a
# build of one decode binds its interface function alone.
_DENSE_BINDING = """#include <pybind11/pybind11.h>
#include "dense_decode.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dense_decode_fwd", &dense_attn_decode_interface); }
"""
# sparse_decode.h dispatches to sm100 kernels too; this build compiles sm90's and defines sm100's as stand-ins that
# raise (sm90 never reaches them).
_SPARSE_BINDING = r"""#include <pybind11/pybind11.h>
#include <stdexcept>
#include "sparse_decode.h"
[[noreturn]] static void not_built() { throw std::runtime_error("amla-sim builds FlashMLA's sm90 kernels only"); }
namespace sm100::decode::head64 {
template <ModelType M> void run_flash_splitkv_mla_fp8_sparse_kernel(const SparseAttnDecodeParams &) { not_built(); }
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams &);
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams &);
}
namespace sm100::fwd_for_small_topk::head128 {
template <SparseAttnFwdMode F, int D> void run_fwd_for_small_topk_phase1_kernel(const SparseFwdArgT<F> &) {
    not_built(); }
template void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(
    const SparseFwdArgT<SparseAttnFwdMode::DecodeWithSplitKV> &);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("sparse_decode_fwd", &sparse_attn_decode_interface); }
"""
_DECODE_COMMON = ["smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu", "smxx/decode/combine/combine.cu"]


def _flashmla(checkout: str | Path, kernel: str, name: str, binding: str, header: str, sources: list[str], *,
              verbose: bool, defines: tuple[str, ...] = ()):
    """One decode of a FlashMLA checkout: `binding` (which includes ``csrc/api/<header>``) and `sources` (under
    csrc/), with FlashMLA's include folders and flags."""
    root = checkout_files(checkout, kernel, [f"csrc/api/{header}", _CUTLASS, *("csrc/" + f for f in sources)],
                          _FLASHMLA)
    c = root / "csrc"
    flags = [*_FLASHMLA_CFLAGS, *defines]
    return compile_extension(name, [added_source(name, "binding.cpp", binding), *(c / f for f in sources)],
                             [c / i for i in _FLASHMLA_INCLUDES], flags,
                             [*flags, *FLASHMLA_NVCC], verbose=verbose)


def build_flashmla(checkout: str | Path, *, verbose: bool = False):
    """FlashMLA's sm90 dense decode (BF16: the FP16 instantiation left out, ``-DFLASH_MLA_DISABLE_FP16``) with the
    split scheduler and the combine kernel, compiled from `checkout`; its one function is ``dense_decode_fwd``."""
    return _flashmla(checkout, "flashmla", "amla_flashmla_dense", _DENSE_BINDING, "dense_decode.h",
                     [*_DECODE_COMMON, "sm90/decode/dense/instantiations/bf16.cu"], verbose=verbose,
                     defines=("-DFLASH_MLA_DISABLE_FP16",))


def run_flashmla(mod, q_bits: np.ndarray, kv_bits: np.ndarray, seqlens, scale: float,
                 causal: bool = False, fmt: str = "bf16") -> dict[str, np.ndarray]:
    """``dense_decode_fwd`` on (b, s_q, H, 576) queries and a (b, S_max, 576) cache (paged in blocks of 64), BF16 or
    FP16 bits (`fmt`), causal within the step where `causal` (vLLM's multi-token call): out (uint16 bits), lse
    (uint32 bits), the split schedule and the cumulative split counts."""
    import torch

    kc, bt = paged(torch, kv_bits, fmt)
    sl = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out, lse, sched, num_splits = mod.dense_decode_fwd(bits16(torch, q_bits, fmt), kc, 512, sl, bt, scale,
                                                       bool(causal),
                                                       None, None)
    torch.cuda.synchronize()
    return {"out": out.view(torch.int16).cpu().numpy().view(np.uint16), "lse": lse.cpu().numpy().view(np.uint32),
            "sched": sched.cpu().numpy(), "num_splits": num_splits.cpu().numpy()}


def build_etap(checkout: str | Path, *, name: str = "amla_flashmla_etap", verbose: bool = False):
    """FlashMLA-ETAP (BF16 and FP16) compiled from `checkout` with the authors' setup.py flags (``--use_fast_math``
    included: ``exp2f`` and the divisions are the MUFU approximations); its functions are ``get_mla_metadata``
    and ``fwd_kvcache_mla``, bound by the checkout's own ``flash_api.cpp``. `name`: the extension's (a modified
    copy of the sources needs its own)."""
    files = ["flash_api.cpp", "flash_fwd_mla_bf16_sm90.cu", "flash_fwd_mla_fp16_sm90.cu", "flash_fwd_mla_metadata.cu"]
    root = checkout_files(checkout, "flashmla-etap", [_CUTLASS, *("csrc/" + f for f in files)], _ETAP)
    c = root / "csrc"
    flags = ["-O3", "-std=c++17", "-DNDEBUG", "-Wno-deprecated-declarations"]
    return compile_extension(name, [c / f for f in files], [c, c / "cutlass" / "include"], flags,
                             [*flags, *FLASHMLA_NVCC, "--ptxas-options=--register-usage-level=10"], verbose=verbose)


def run_etap(mod, q_bits: np.ndarray, kv_bits: np.ndarray, seqlens, scale: float, causal: bool,
             fmt: str) -> dict[str, np.ndarray]:
    """``get_mla_metadata`` and ``fwd_kvcache_mla`` on (b, s_q, H, 576) queries and a (b, S_max, 576) cache (paged
    in blocks of 64), both `fmt` (``bf16`` or ``fp16``): out (uint16 bits), lse (uint32 bits), the tile-scheduler
    metadata (the 5 ints of each part the kernel writes; the other 3 are never written) and the cumulative split
    counts."""
    import torch

    _, s_q, H, _ = q_bits.shape
    kc, bt = paged(torch, kv_bits, fmt)
    sl = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    meta, num_splits = mod.get_mla_metadata(sl, s_q * H, 1)
    out, lse = mod.fwd_kvcache_mla(bits16(torch, q_bits, fmt), kc, None, 512, sl, bt, scale, causal, meta, num_splits)
    torch.cuda.synchronize()
    return {"out": out.view(torch.int16).cpu().numpy().view(np.uint16), "lse": lse.cpu().numpy().view(np.uint32),
            "sched": meta.cpu().numpy()[:, :5], "num_splits": num_splits.cpu().numpy()}


def build_sparse_fp8(checkout: str | Path, *, verbose: bool = False):
    """FlashMLA's sm90 sparse FP8 decode (V3.2's and MODEL1's layouts, 64 and 128 heads) with the split scheduler
    and the combine kernel, compiled from `checkout`; its one function is ``sparse_decode_fwd``."""
    inst = "sm90/decode/sparse_fp8/instantiations/"
    kernels = [inst + f"{m}_persistent_h{h}.cu" for m in ("v32", "model1") for h in (64, 128)]
    return _flashmla(checkout, "flashmla-sparse-fp8", "amla_flashmla_sparse_fp8", _SPARSE_BINDING, "sparse_decode.h",
                     [*_DECODE_COMMON, *kernels], verbose=verbose)


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


def flashmla_quantize(checkout: str | Path, kv_pages: np.ndarray, layout: str) -> np.ndarray:
    """FlashMLA's own quantizer (the checkout's ``tests/quant.py``) on BF16 pages
    (num_blocks, page, 1, d), on the GPU: the cache as (num_blocks, page, 1, bytes) uint8, each page's bytes
    contiguous (FlashMLA's own tensor has padded page strides)."""
    require_gpu()
    import torch

    path = checkout_files(checkout, "flashmla-sparse-fp8", ["tests/quant.py"], _FLASHMLA) / "tests" / "quant.py"
    spec = importlib.util.spec_from_file_location("flashmla_tests_quant", path)
    quant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quant)
    kind = {"v32": quant.FP8KVCacheLayout.V32_FP8Sparse, "model1": quant.FP8KVCacheLayout.MODEL1_FP8Sparse}[layout]
    got = quant.quantize_k_cache(bits16(torch, np.asarray(kv_pages).astype(ml_dtypes.bfloat16)), kind)  # exact
    return got.view(torch.uint8).contiguous().cpu().numpy()


# sparse_fwd.h's dispatch names sm100's prefill kernels too (sparse_fwd.h:8-10, 50-99); this build compiles sm90's
# phase-1 kernel and defines sm100's as stand-ins that raise (an sm90 GPU never reaches them).
_PREFILL_BINDING = r"""#include <pybind11/pybind11.h>
#include <stdexcept>
#include "sparse_fwd.h"
[[noreturn]] static void not_built() { throw std::runtime_error("amla-sim builds FlashMLA's sm90 kernels only"); }
namespace sm100::fwd::head64 {
template <int D_QK> void run_fwd_phase1_kernel(const SparseAttnFwdParams &) { not_built(); }
template void run_fwd_phase1_kernel<512>(const SparseAttnFwdParams &);
template void run_fwd_phase1_kernel<576>(const SparseAttnFwdParams &);
}
namespace sm100::fwd::head128 {
template <int D_QK> void run_fwd_phase1_kernel(const SparseAttnFwdParams &) { not_built(); }
template void run_fwd_phase1_kernel<512>(const SparseAttnFwdParams &);
template void run_fwd_phase1_kernel<576>(const SparseAttnFwdParams &);
}
namespace sm100::fwd_for_small_topk::head128 {
template <SparseAttnFwdMode F, int D> void run_fwd_for_small_topk_phase1_kernel(const SparseFwdArgT<F> &) {
    not_built(); }
template void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::Prefill, 512>(
    const SparseFwdArgT<SparseAttnFwdMode::Prefill> &);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("sparse_prefill_fwd", &sparse_attn_prefill_interface); }
"""
_INT32 = np.iinfo(np.int32)


def build_sparse_prefill(checkout: str | Path, *, verbose: bool = False):
    """FlashMLA's sm90 sparse prefill (``flash_mla_sparse_fwd``: d_qk 576 and 512, with and without topk_length,
    64 and 128 heads), compiled from `checkout`; its one function is ``sparse_prefill_fwd``, the API's
    ``sparse_attn_prefill_interface`` (what FlashMLA's Python wrapper calls with its arguments unchanged)."""
    inst = "sm90/prefill/sparse/instantiations/"
    kernels = [inst + f"phase1_k{d}{t}.cu" for d in (576, 512) for t in ("", "_topklen")]
    return _flashmla(checkout, "flashmla-sparse-prefill", "amla_flashmla_sparse_prefill", _PREFILL_BINDING,
                     "sparse_fwd.h", kernels, verbose=verbose)


def run_sparse_prefill(mod, q_bits: np.ndarray, kv_bits: np.ndarray, indices: np.ndarray,
                       topk_length: np.ndarray | None, attn_sink: np.ndarray | None, scale: float) -> dict:
    """``sparse_prefill_fwd`` on (s_q, h_q, d_qk) BF16 queries (bits or values), a (s_kv, 1, d_qk) BF16 cache,
    (s_q, 1, topk) indices (int32 on the GPU, as the API requires), optional topk_length (s_q,) and attn_sink
    (h_q,) float32, and the softmax scale (a C++ float): out (s_q, h_q, 512) uint16 bits, max_logits and lse
    (s_q, h_q) uint32 bits, natural log."""
    import torch

    idx = np.asarray(indices)
    wide = idx.size and idx.dtype.kind in "iu" and (idx.min() < _INT32.min or idx.max() > _INT32.max)
    if idx.dtype.kind not in "iu" or idx.ndim != 3 or wide:
        raise ValueError(f"indices: expected ints (s_q, 1, topk) within int32, got {idx.dtype} {idx.shape}")
    q = bits16(torch, np.asarray(q_bits).view(np.uint16))
    kv = bits16(torch, np.asarray(kv_bits).view(np.uint16))
    if q.dim() != 3 or kv.dim() != 3:
        raise ValueError(f"q, kv: expected (s_q, h_q, d_qk) and (s_kv, 1, d_qk), got {tuple(q.shape)} and "
                         f"{tuple(kv.shape)}")
    idx_t = torch.from_numpy(np.ascontiguousarray(idx, np.int32)).cuda()
    tl_ = None if topk_length is None else torch.from_numpy(np.ascontiguousarray(topk_length, np.int32)).cuda()
    sink = None if attn_sink is None else torch.from_numpy(np.ascontiguousarray(attn_sink, np.float32)).cuda()
    out, max_logits, lse = mod.sparse_prefill_fwd(q, kv, idx_t, float(scale), 512, sink, tl_)
    torch.cuda.synchronize()
    return {"out": out.contiguous().view(torch.int16).cpu().numpy().view(np.uint16),
            "max_logits": max_logits.contiguous().cpu().numpy().view(np.uint32),
            "lse": lse.contiguous().cpu().numpy().view(np.uint32)}
