"""FlashAttention-3's MLA decode (vllm-project/flash-attention's ``hopper/`` forward for head dims 64 / 512),
compiled from a checkout of that fork by this project's build code with vLLM's switches, and called as vLLM calls
it (the scheduler metadata, then the varlen forward with ``q_v`` and a block table over shuffled pages) or, for a
cache that is not paged, as SGLang's ``flash_attn_with_kvcache``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .. import require_gpu
from ._build import CUDA_COMMON, SM90A, added_source, checkout_files, compile_extension
from ._common import bits16, shuffled_pages

__all__ = ["build_fa3", "load_shipped_fa3", "run_fa3", "fa3_varlen", "run_fa3_prefill", "run_vllm_prefill_chain", "run_fa3_sparse", "run_sgl_fa3", "run_sgl_fa3_sparse", "FORKS"]

_WHAT = "a vllm-project/flash-attention checkout with CUTLASS at csrc/cutlass (git clone --recursive)"
# The ten instantiations of head dims 64 x 512: {bf16, fp16} x {plain, packgqa, paged (non-TMA), paged + split,
# split}; with FLASHATTENTION_PACKGQA_ONLY these are every kernel the dispatch can reach for MLA.
_KERNELS = [f"instantiations/flash_fwd_hdim64_512_{t}_{v}sm90.cu" for t in ("bf16", "fp16")
            for v in ("", "packgqa_", "paged_", "paged_split_", "split_")]
# flash_api.cpp's dispatch also names the head-dim-64 kernels with v head dim 256 and 64, which this build leaves
# out: stand-ins that raise (the 64 x 512 path never reaches them).
_STAND_INS = r"""#include <stdexcept>
#include <cutlass/numeric_types.h>
#include "flash.h"
template <int Arch, typename T, int kHeadDim, int kHeadDimV, bool Split, bool PagedKVNonTMA, bool Has_softcap,
          bool PackGQA>
void run_mha_fwd_(Flash_fwd_params &, cudaStream_t) {
    throw std::runtime_error("amla-sim builds FA3's head dims 64 x 512 only");
}
#define AMLA_NOT_BUILT(T, DV, SPLIT, PAGED, PACK) \
    template void run_mha_fwd_<90, T, 64, DV, SPLIT, PAGED, false, PACK>(Flash_fwd_params &, cudaStream_t);
#define AMLA_NOT_BUILT_ALL(T, DV) AMLA_NOT_BUILT(T, DV, false, false, false) \
    AMLA_NOT_BUILT(T, DV, false, false, true) AMLA_NOT_BUILT(T, DV, false, true, true) \
    AMLA_NOT_BUILT(T, DV, true, false, true) AMLA_NOT_BUILT(T, DV, true, true, true)
AMLA_NOT_BUILT_ALL(cutlass::bfloat16_t, 256) AMLA_NOT_BUILT_ALL(cutlass::bfloat16_t, 64)
AMLA_NOT_BUILT_ALL(cutlass::half_t, 256) AMLA_NOT_BUILT_ALL(cutlass::half_t, 64)
"""
# vLLM's compile definitions for _vllm_fa3_C (the fork's CMakeLists.txt) ...
_VLLM_DEFINES = ["FLASHATTENTION_DISABLE_BACKWARD", "FLASHATTENTION_DISABLE_DROPOUT", "FLASHATTENTION_DISABLE_UNEVEN_K",
                 "FLASHATTENTION_DISABLE_PYBIND", "FLASHATTENTION_VARLEN_ONLY", "FLASHATTENTION_PACKGQA_ONLY",
                 "FLASHATTENTION_DISABLE_CLUSTER", "FLASHATTENTION_DISABLE_SM8x", "FLASHATTENTION_DISABLE_APPENDKV",
                 "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED", "CUTLASS_ENABLE_GDC_FOR_SM90",
                 "TORCH_TARGET_VERSION=0x020A000000000000ULL", "USE_CUDA", "ENABLE_FP8"]
# ... and this build's: the other head dims, FP8, softcap and local attention left out (none is on the MLA path).
_ONLY_MLA = ["FLASHATTENTION_DISABLE_HDIM96", "FLASHATTENTION_DISABLE_HDIM128", "FLASHATTENTION_DISABLE_HDIM192",
             "FLASHATTENTION_DISABLE_HDIM256", "FLASHATTENTION_DISABLE_HDIMDIFF192", "FLASHATTENTION_DISABLE_FP8",
             "FLASHATTENTION_DISABLE_SOFTCAP", "FLASHATTENTION_DISABLE_LOCAL"]
_NAME = "amla_fa3_mla"

#: SGLang's build (sgl-project/sgl-flash-attn, compiled into ``sglang-kernel``): its compile definitions for
#: ``flash_ops`` (sglang ``python/sglang/kernels/aot/CMakeLists.txt``) with the sm8x kernels left out (host dispatch
#: only), and no PACKGQA_ONLY, CLUSTER or APPENDKV switch (SGLang sets none).
_SGL_DEFINES = ["FLASHATTENTION_DISABLE_BACKWARD", "FLASHATTENTION_DISABLE_DROPOUT", "FLASHATTENTION_DISABLE_UNEVEN_K",
                "FLASHATTENTION_VARLEN_ONLY", "FLASHATTENTION_DISABLE_SPARSE_MASK", "FLASHATTENTION_DISABLE_SM8x",
                "CUTE_USE_PACKED_TUPLE=1", "CUTLASS_ENABLE_TENSOR_CORE_MMA=1", "CUTLASS_VERSIONS_GENERATED",
                "CUTLASS_TEST_LEVEL=0", "CUTLASS_TEST_ENABLE_CACHED_RESULTS=1", "CUTLASS_DEBUG_TRACE_LEVEL=0",
                "CUTLASS_ENABLE_GDC_FOR_SM90", "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"]
_SGL_WHAT = ("a sgl-project/sgl-flash-attn checkout with CUTLASS 57e3cfb (SGLang's pin, not the repository's "
             "submodule) at csrc/cutlass")
# sgl-flash-attn's flash_api.cpp defines mha_fwd and mha_fwd_get_scheduler_metadata but registers no op (SGLang does
# it in its own flash_extension.cc): this binding declares them (cb303cf's signatures, {extra} for later ones that
# add a sparse mask and only_qv) and exposes them with the arguments in mha_fwd's order.
_SGL_BINDING = r"""#include <torch/extension.h>
using OptT = std::optional<at::Tensor>;
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mha_fwd(
    at::Tensor, at::Tensor, at::Tensor, OptT, OptT, OptT, OptT, OptT, OptT, OptT, OptT, OptT,
    std::optional<int64_t>, std::optional<int64_t>, OptT, OptT, OptT, OptT, OptT, OptT, OptT, OptT, OptT,
    std::optional<double>, bool, int64_t, int64_t, int64_t, double, bool, OptT, int64_t, std::optional<bool>, int64_t,
    std::optional<const at::Tensor> &{decl});
at::Tensor mha_fwd_get_scheduler_metadata(
    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, at::ScalarType, at::Tensor, OptT, OptT, OptT,
    OptT, OptT, std::optional<int64_t>, int64_t, bool, int64_t, int64_t, int64_t, bool, int64_t, std::optional<bool>,
    int64_t);
static std::vector<at::Tensor> fwd(
    at::Tensor q, at::Tensor k, at::Tensor v, OptT k_new, OptT v_new, OptT q_v, OptT out, OptT cu_seqlens_q,
    OptT cu_seqlens_k, OptT cu_seqlens_k_new, OptT seqused_q, OptT seqused_k, std::optional<int64_t> max_seqlen_q,
    std::optional<int64_t> max_seqlen_k, OptT page_table, OptT kv_batch_idx, OptT leftpad_k, OptT rotary_cos,
    OptT rotary_sin, OptT seqlens_rotary, OptT q_descale, OptT k_descale, OptT v_descale,
    std::optional<double> softmax_scale, bool is_causal, int64_t window_size_left, int64_t window_size_right,
    int64_t attention_chunk, double softcap, bool is_rotary_interleaved, OptT scheduler_metadata, int64_t num_splits,
    std::optional<bool> pack_gqa, int64_t sm_margin) {
    std::optional<const at::Tensor> sinks;
    auto [o, lse, o_accum, lse_accum] = mha_fwd(
        q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
        max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
        q_descale, k_descale, v_descale, softmax_scale, is_causal, window_size_left, window_size_right,
        attention_chunk, softcap, is_rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin,
        sinks{call});
    return {o, lse, o_accum, lse_accum};
}
static at::Tensor get_scheduler_metadata(
    int64_t batch_size, int64_t max_seqlen_q, int64_t max_seqlen_k, int64_t num_heads, int64_t num_heads_k,
    int64_t headdim, int64_t headdim_v, bool is_bf16, at::Tensor seqused_k, OptT cu_seqlens_q, OptT cu_seqlens_k,
    OptT cu_seqlens_k_new, OptT seqused_q, OptT leftpad_k, std::optional<int64_t> page_size,
    int64_t max_seqlen_k_new, bool is_causal, int64_t window_size_left, int64_t window_size_right,
    int64_t attention_chunk, bool has_softcap, int64_t num_splits, std::optional<bool> pack_gqa, int64_t sm_margin) {
    return mha_fwd_get_scheduler_metadata(
        batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v,
        is_bf16 ? at::ScalarType::BFloat16 : at::ScalarType::Half, seqused_k, cu_seqlens_q, cu_seqlens_k,
        cu_seqlens_k_new, seqused_q, leftpad_k, page_size, max_seqlen_k_new, is_causal, window_size_left,
        window_size_right, attention_chunk, has_softcap, num_splits, pack_gqa, sm_margin);
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("fwd", &fwd);
    m.def("get_scheduler_metadata", &get_scheduler_metadata);
}
"""
#: mha_fwd's arguments in order (sgl-flash-attn ``hopper/flash_api.cpp:653-688``), as the binding takes them.
_SGL_FWD_ARGS = ("q k v k_new v_new q_v out cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k "
                 "max_seqlen_q max_seqlen_k page_table kv_batch_idx leftpad_k rotary_cos rotary_sin seqlens_rotary "
                 "q_descale k_descale v_descale softmax_scale is_causal window_size_left window_size_right "
                 "attention_chunk softcap is_rotary_interleaved scheduler_metadata num_splits pack_gqa "
                 "sm_margin").split()
#: mha_fwd_get_scheduler_metadata's (``flash_api.cpp:502-525``), the dtype as ``is_bf16``.
_SGL_META_ARGS = ("batch_size max_seqlen_q max_seqlen_k num_heads num_heads_k headdim headdim_v is_bf16 seqused_k "
                  "cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q leftpad_k page_size max_seqlen_k_new "
                  "is_causal window_size_left window_size_right attention_chunk has_softcap num_splits pack_gqa "
                  "sm_margin").split()
_SGL_NAME = "amla_sgl_fa3_mla"
_SGL_PREFILL = "amla_sgl_fa3_prefill"
#: the MHA-form prefill's kernels in SGLang's build: 192 / 128, BF16 and E4M3, unsplit (no PackGQA: h == h_k, as the
#: MLA prefill calls it) and split
_SGL_PREFILL_KERNELS = [f"instantiations/flash_fwd_hdim192_128_{t}_{v}sm90.cu" for t in ("bf16", "e4m3")
                        for v in ("", "split_")]
# ... and the head dims and features this build leaves out (none is on that path; FP16 neither: SGLang's prefill is
# BF16, or E4M3 with an FP8 cache)
_ONLY_PREFILL = ["FLASHATTENTION_DISABLE_HDIM64", "FLASHATTENTION_DISABLE_HDIM96", "FLASHATTENTION_DISABLE_HDIM128",
                 "FLASHATTENTION_DISABLE_HDIM256", "FLASHATTENTION_DISABLE_FP16", "FLASHATTENTION_DISABLE_SOFTCAP",
                 "FLASHATTENTION_DISABLE_LOCAL"]


def _stand_in_template(build: str) -> list[str]:
    """The lines of a stand-in ``run_mha_fwd_`` (it raises), whose explicit instantiations follow, for `build`."""
    return ["#include <stdexcept>", "#include <cutlass/numeric_types.h>", '#include "flash.h"',
            "template <int Arch, typename T, int kHeadDim, int kHeadDimV, bool Split, bool PagedKVNonTMA, "
            "bool Has_softcap, bool PackGQA>",
            "void run_mha_fwd_(Flash_fwd_params &params, cudaStream_t stream) {",
            f'    throw std::runtime_error("amla-sim: this FA3 kernel is not compiled in the {build} build"); }}']


def _sgl_prefill_stand_ins() -> str:
    """Stand-ins (they raise) for the kernels ``run_mha_fwd``'s dispatch names on the 192 head dims that the prefill
    build does not compile: (Split, PagedKVNonTMA, PackGQA) of each variant, v 128 and 192, BF16 and E4M3."""
    variants = {"": "false, false, false, false", "packgqa_": "false, false, false, true",
                "paged_": "false, true, false, true", "paged_split_": "true, true, false, true",
                "split_": "true, false, false, true"}
    built = {(t, v) for t in ("bf16", "e4m3") for v in ("", "split_")}
    lines = _stand_in_template("prefill")
    for t, ct in (("bf16", "cutlass::bfloat16_t"), ("e4m3", "cutlass::float_e4m3_t")):
        for dv in (128, 192):
            for v, args in variants.items():
                if dv == 192 or (t, v) not in built:
                    lines.append(f"template void run_mha_fwd_<90, {ct}, 192, {dv}, {args}>(Flash_fwd_params &, "
                                 "cudaStream_t);")
    return "\n".join(lines) + "\n"


_SGL_MHA = "amla_sgl_fa3_mha"
#: the head dims of SGLang's build other than the MLA prefill's (every MHA model its ``fa3`` backend serves: 64, 96,
#: 128, 256), BF16 and E4M3, local windows compiled in; each (Split, PagedKVNonTMA, Has_softcap, PackGQA) unsplit,
#: packed or not (SGLang never splits), an instantiation of ``run_mha_fwd_`` written here as upstream's
#: instantiation files are (they are not in the prefill bundle); the split and paged ones the dispatch also names
#: are stand-ins
_SGL_MHA_DIMS = (64, 96, 128, 256)
_SGL_MHA_TYPES = {"bf16": "cutlass::bfloat16_t", "e4m3": "cutlass::float_e4m3_t"}
_SGL_MHA_VARIANTS = {"plain": "false, false, false, false", "packgqa": "false, false, false, true"}
_SGL_MHA_STAND_INS = ("false, true, false, true", "true, false, false, true", "true, true, false, true")
_ONLY_MHA = ["FLASHATTENTION_DISABLE_HDIM192", "FLASHATTENTION_DISABLE_HDIMDIFF64", "FLASHATTENTION_DISABLE_FP16",
             "FLASHATTENTION_DISABLE_SOFTCAP"]


def _sgl_mha_sources(name: str) -> list[Path]:
    """The MHA head dims' kernels (:data:`_SGL_MHA_DIMS`, :data:`_SGL_MHA_VARIANTS`), a file each as upstream
    compiles them, and the stand-ins (they raise) for the split and paged ones."""
    head = '#include "flash_fwd_launch_template.h"\n'
    kernel = "template void run_mha_fwd_<90, {t}, {d}, {d}, {a}>(Flash_fwd_params &, cudaStream_t);"
    files = [added_source(name, f"hdim{d}_{t}_{v}.cu", head + kernel.format(t=ct, d=d, a=a) + "\n")
             for d in _SGL_MHA_DIMS for t, ct in _SGL_MHA_TYPES.items() for v, a in _SGL_MHA_VARIANTS.items()]
    stand_ins = [*_stand_in_template("mha"), *(kernel.format(t=ct, d=d, a=a) for d in _SGL_MHA_DIMS
                                               for ct in _SGL_MHA_TYPES.values() for a in _SGL_MHA_STAND_INS)]
    return [*files, added_source(name, "stand_ins.cu", "\n".join(stand_ins) + "\n")]


FORKS = ("vllm", "sglang")


#: vLLM 0.33.0's FA3 library, relative to the folder its wheel unpacks to (flash-attention b273a02, op namespace
#: ``_vllm_fa3_C``, the same schema as :func:`build_fa3`'s ops)
SHIPPED_FA3 = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"


def load_shipped_fa3(root: str | Path) -> SimpleNamespace:
    """FA3 as vLLM 0.33.0 ships it: ``_vllm_fa3_C.abi3.so`` under `root` (the unpacked wheel), loaded as it is
    (``torch.ops.load_library``, nothing compiled): ``fwd`` and ``get_scheduler_metadata`` as :func:`build_fa3`
    gives them."""
    lib = Path(root) / SHIPPED_FA3
    if not lib.is_file():
        raise FileNotFoundError(f"build vllm: {root} has no {SHIPPED_FA3}; it should be the folder vLLM 0.33.0's "
                                f"wheel unpacks to")
    require_gpu()
    import torch

    torch.ops.load_library(str(lib))
    ops = torch.ops._vllm_fa3_C
    return SimpleNamespace(fwd=ops.fwd, get_scheduler_metadata=ops.get_scheduler_metadata)


def build_fa3(checkout: str | Path, *, fork: str = "vllm", path: str = "mla",
              verbose: bool = False) -> SimpleNamespace:
    """The MLA forward compiled from `checkout` (about 150 seconds on 16 cores): ``fwd`` and
    ``get_scheduler_metadata``, taking keyword arguments. fork "vllm": a vllm-project/flash-attention checkout,
    its two torch ops (vLLM's ``torch.ops._vllm_fa3_C.*``, argument for argument); "sglang": a
    sgl-project/sgl-flash-attn checkout built with SGLang's switches, mha_fwd's arguments by name. path: "mla"
    (the head dims 64 / 512 of the absorbed decode) or, for SGLang's fork, "prefill" (192 / 128, BF16 and E4M3: the
    MHA-form prefill; vLLM's is the binary its wheel ships, :func:`load_shipped_fa3`) or "mha" (64, 96, 128 and
    256, BF16 and E4M3, unsplit, local windows included: 277 s on an H200 machine's 16 cores)."""
    if fork not in FORKS:
        raise ValueError(f"fork: expected one of {', '.join(FORKS)}, got {fork!r}")
    if path not in ("mla", "prefill", "mha") or (path != "mla" and fork != "sglang"):
        raise ValueError(f"path: 'mla', or 'prefill' or 'mha' with fork 'sglang', got {path!r} with {fork!r}")
    if fork == "sglang":
        return _build_sgl(checkout, verbose, path)
    files = ["flash_api.cpp", "flash_api_torch_lib.cpp", "flash_fwd_combine.cu", "flash_prepare_scheduler.cu",
             *_KERNELS]
    root = checkout_files(checkout, "fa3-mla", ["csrc/common/registration.h", "csrc/cutlass/include/cute/tensor.hpp",
                                                *("hopper/" + f for f in files)], _WHAT)
    hopper = root / "hopper"
    defines = ["-D" + d for d in _VLLM_DEFINES + _ONLY_MLA]
    stand_ins = added_source(_NAME, "stand_ins.cu", _STAND_INS)
    cutlass = root / "csrc" / "cutlass"
    compile_extension(_NAME, [*(hopper / f for f in files), stand_ins],
                      [hopper, root / "csrc" / "common", cutlass / "include", cutlass / "tools" / "util" / "include"],
                      ["-O3", "-std=c++20", "-DNDEBUG", *defines],
                      # vLLM's nvcc flags for the fork (CMake: CUDA >= 12 drops torch's __CUDA_NO_* defines)
                      ["-std=c++17", *CUDA_COMMON, *SM90A, *defines], verbose=verbose)
    import torch

    ops = getattr(torch.ops, _NAME)
    return SimpleNamespace(fwd=ops.fwd, get_scheduler_metadata=ops.get_scheduler_metadata)


def _build_sgl(checkout: str | Path, verbose: bool, path: str = "mla") -> SimpleNamespace:
    """SGLang's FA3 (sgl-flash-attn ``hopper/``) with SGLang's nvcc flags (C++17 throughout): the MLA path's
    kernels, or the MHA-form prefill's (:data:`_SGL_PREFILL_KERNELS`, the rest of its dispatch stand-ins)."""
    kernels, stand_ins, only, name = {
        "mla": (_KERNELS, _STAND_INS, _ONLY_MLA, _SGL_NAME),
        "prefill": (_SGL_PREFILL_KERNELS, _sgl_prefill_stand_ins(), _ONLY_PREFILL, _SGL_PREFILL),
        "mha": ([], None, _ONLY_MHA, _SGL_MHA)}[path]
    files = ["flash_api.cpp", "flash_fwd_combine.cu", "flash_prepare_scheduler.cu", *kernels]
    root = checkout_files(checkout, f"sgl-fa3-{path}", ["csrc/cutlass/include/cute/tensor.hpp",
                                                        *("hopper/" + f for f in files)], _SGL_WHAT)
    hopper, cutlass = root / "hopper", root / "csrc" / "cutlass"
    later = "only_qv" in (hopper / "flash_api.cpp").read_text()  # f89bc23 and later: a sparse mask and only_qv
    binding = _SGL_BINDING.replace("{decl}", ", OptT, bool" if later else "").replace(
        "{call}", ", std::nullopt, false" if later else "")
    defines = ["-D" + d for d in _SGL_DEFINES + only]
    extra = _sgl_mha_sources(name) if stand_ins is None else [added_source(name, "stand_ins.cu", stand_ins)]
    sources = [*(hopper / f for f in files), *extra, added_source(name, "binding.cpp", binding)]
    mod = compile_extension(name, sources, [hopper, cutlass / "include", cutlass / "tools" / "util" / "include"],
                            ["-O3", "-std=c++17", "-DNDEBUG", *defines],
                            ["-std=c++17", *CUDA_COMMON, *SM90A, "-Xcompiler=-fno-strict-aliasing", *defines],
                            verbose=verbose)

    def fwd(**kw):
        return mod.fwd(*(kw[n] for n in _SGL_FWD_ARGS))

    def get_scheduler_metadata(**kw):
        return mod.get_scheduler_metadata(*(kw[n] for n in _SGL_META_ARGS))

    return SimpleNamespace(fwd=fwd, get_scheduler_metadata=get_scheduler_metadata, fork="sglang")


# fwd's arguments that the MLA decode leaves at their defaults (no new KV, rotary, FP8 descales, softcap, window,
# sink, context parallelism)
_FWD_UNUSED = {"k_new": None, "v_new": None, "out": None, "cu_seqlens_k": None, "cu_seqlens_k_new": None,
               "seqused_q": None, "kv_batch_idx": None, "leftpad_k": None, "rotary_cos": None, "rotary_sin": None,
               "seqlens_rotary": None, "q_descale": None, "k_descale": None, "v_descale": None,
               "window_size_left": -1, "window_size_right": -1, "softcap": 0.0, "is_rotary_interleaved": True,
               "pack_gqa": None, "sm_margin": 0, "s_aux": None, "cp_world_size": 1, "cp_rank": 0,
               "cp_tot_seqused_k": None}


def _fwd_options(softcap: float, window: tuple[int, int]) -> dict:
    """fwd's arguments that the MLA decode leaves at their defaults (:data:`_FWD_UNUSED`), with the call's softcap
    and local window."""
    return {**_FWD_UNUSED, "softcap": softcap, "window_size_left": window[0], "window_size_right": window[1]}


def _vllm_decode(fa3, q, cache, table, seqlens, s_q: int, scale: float, num_splits: int,
                 max_seqlen_k: int | None = None, softcap: float = 0.0, window: tuple[int, int] = (-1, -1)):
    """vLLM's FLASH_ATTN_MLA decode step (``flashattn_mla.py``: ``get_scheduler_metadata``, then
    ``flash_attn_varlen_func`` with q = q_rope, k = k_rope, v = kv_c, q_v = q_nope, causal): q (b s_q, h, 576),
    cache (pages, page, 576); max_seqlen_k: the call's (default the longest request). Returns out, lse and the
    scheduler metadata."""
    import torch

    b, h, page = len(seqlens), q.shape[1], cache.shape[1]
    longest = max_seqlen_k or max(seqlens)
    cu_q = torch.arange(0, (b + 1) * s_q, s_q, dtype=torch.int32, device="cuda")
    sl = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    meta = fa3.get_scheduler_metadata(
        batch_size=b, max_seqlen_q=s_q, max_seqlen_k=longest, num_heads=h, num_heads_k=1, headdim=64,
        headdim_v=512, qkv_dtype=q.dtype, seqused_k=sl, cu_seqlens_q=cu_q, cu_seqlens_k=None, cu_seqlens_k_new=None,
        seqused_q=None, leftpad_k=None, page_size=page, max_seqlen_k_new=0, is_causal=True,
        window_size_left=window[0], window_size_right=window[1], has_softcap=softcap > 0, num_splits=num_splits,
        pack_gqa=None, sm_margin=0)
    k_rope, kv_c = cache[..., 512:].unsqueeze(-2), cache[..., :512].unsqueeze(-2)
    out, lse, *_ = fa3.fwd(**_fwd_options(softcap, window), q=q[..., 512:], k=k_rope, v=kv_c,
                           q_v=q[..., :512], cu_seqlens_q=cu_q, seqused_k=sl, max_seqlen_q=s_q, max_seqlen_k=longest,
                           page_table=table, softmax_scale=scale, is_causal=True, scheduler_metadata=meta,
                           num_splits=num_splits)
    return out, lse, meta


def _with_kvcache(fa3, q, cache, seqlens, scale: float, causal: bool, num_splits: int, softcap: float = 0.0,
                  window: tuple[int, int] = (-1, -1)):
    """FA3's ``flash_attn_with_kvcache`` as SGLang's fa3 backend calls it, on a cache that is not paged: q (b, s_q,
    h, 576), cache (b, S_max, 576). Returns out and lse."""
    import torch

    sl = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    out, lse, *_ = fa3.fwd(**_fwd_options(softcap, window), q=q[..., 512:], k=cache[..., 512:].unsqueeze(-2),
                           v=cache[..., :512].unsqueeze(-2), q_v=q[..., :512], cu_seqlens_q=None, seqused_k=sl,
                           max_seqlen_q=None, max_seqlen_k=None, page_table=None, softmax_scale=scale,
                           is_causal=causal, scheduler_metadata=None, num_splits=num_splits)
    return out, lse


def run_fa3(fa3, q: np.ndarray, kv: np.ndarray, recipe: dict,
            head_swizzle: bool | None = None) -> dict[str, np.ndarray]:
    """One case on the GPU: q (b, s_q, h, 576) and kv (b, S_max, 576) bits of `recipe`'s format, its ``softcap`` and
    ``window`` where it has them. Returns out (b * s_q, h, 512) and lse (the kernel's layout) as raw bits, and each
    request's split count where the scheduler metadata holds one (`head_swizzle`: the call is causal or local as
    ``mha_fwd`` reads it; None: causal when s_q > 1)."""
    import torch

    b, sq, H, _ = q.shape
    lens, page, fmt = recipe["seqlens"], recipe["page_size"], recipe["format"]
    window = tuple(int(x) for x in recipe.get("window", (-1, -1)))
    qt = bits16(torch, q.reshape(b * sq, H, q.shape[-1]), fmt)
    res = {}
    if page is None:
        cache = bits16(torch, kv, fmt)
        out, lse = _with_kvcache(fa3, qt.view(b, sq, H, -1), cache, list(lens), recipe["scale"], recipe["causal"],
                                 recipe["num_splits"], float(recipe.get("softcap", 0.0)), window)
    else:
        reqs = [bits16(torch, kv[i, :n], fmt) for i, n in enumerate(lens)]
        cache, table = shuffled_pages(torch, reqs, page, recipe["seed"], reqs[0].dtype)
        out, lse, meta = _vllm_decode(fa3, qt, cache, table, list(lens), sq, recipe["scale"], recipe["num_splits"],
                                      recipe.get("max_seqlen_k"), float(recipe.get("softcap", 0.0)), window)
        m = meta.cpu().numpy()
        rounded = -(-b // 4) * 4  # vectors of b rounded up to 4: rows, [splits if dynamic], [heads in L2 if causal
        swizzle = sq > 1 if head_swizzle is None else head_swizzle  # or local]
        if (m.size - 1) // rounded - 1 - swizzle == 1:
            res["splits"] = m[rounded:rounded + b].astype(np.int32)
    torch.cuda.synchronize()
    res["out"] = out.reshape(b * sq, H, -1).view(torch.int16).cpu().numpy().view(np.uint16)
    res["lse"] = lse.float().contiguous().cpu().numpy().view(np.uint32)
    return res


def run_fa3_sparse(fa3, q: np.ndarray, rows: np.ndarray, indices: np.ndarray, valid: np.ndarray, recipe: dict,
                   keep: int) -> dict[str, np.ndarray]:
    """FA3's sparse call as vLLM's ``FLASH_ATTN_MLA_SPARSE`` makes it (``flashattn_mla_sparse.py:215-259``): q (T,
    h, 576) and the cache rows (N, 576) as bits of `recipe`'s format, indices (T, topk) int32 with -1 past each
    token's `valid` count; the cache seen as pages of one token (strided views, as ``flat_kv_row_view`` gives),
    no scheduler metadata, ``max_seqlen_k = topk``. Returns the first `keep` tokens' out (keep, h, 512), every
    token's lse (h, T) as raw bits, and the split counts that ``get_scheduler_metadata`` gives for the same call."""
    import torch

    T, H, _ = q.shape
    fmt, topk = recipe["format"], indices.shape[1]
    qt, kv = bits16(torch, q, fmt), bits16(torch, rows, fmt)
    k_rope, kv_c = kv[:, 512:].unsqueeze(1).unsqueeze(1), kv[:, :512].unsqueeze(1).unsqueeze(1)
    cu_q = torch.arange(T + 1, dtype=torch.int32, device="cuda")
    sl = torch.from_numpy(valid.astype(np.int32)).cuda()
    table = torch.from_numpy(indices.astype(np.int32)).cuda()
    out, lse, *_ = fa3.fwd(**_FWD_UNUSED, q=qt[..., 512:], k=k_rope, v=kv_c, q_v=qt[..., :512], cu_seqlens_q=cu_q,
                           seqused_k=sl, max_seqlen_q=1, max_seqlen_k=topk, page_table=table,
                           softmax_scale=recipe["scale"], is_causal=True, scheduler_metadata=None,
                           num_splits=recipe["num_splits"])
    meta = fa3.get_scheduler_metadata(
        batch_size=T, max_seqlen_q=1, max_seqlen_k=topk, num_heads=H, num_heads_k=1, headdim=64, headdim_v=512,
        qkv_dtype=qt.dtype, seqused_k=sl, cu_seqlens_q=cu_q, cu_seqlens_k=None, cu_seqlens_k_new=None,
        seqused_q=None, leftpad_k=None, page_size=1, max_seqlen_k_new=0, is_causal=True, window_size_left=-1,
        window_size_right=-1, has_softcap=False, num_splits=recipe["num_splits"], pack_gqa=None, sm_margin=0)
    torch.cuda.synchronize()
    res = {"out": out[:keep].contiguous().view(torch.int16).cpu().numpy().view(np.uint16),
           "lse": lse.float().contiguous().cpu().numpy().view(np.uint32)}
    m = meta.cpu().numpy()
    rounded = -(-T // 4) * 4  # as run_fa3: the metadata holds the split counts when the launch splits dynamically
    if (m.size - 1) // rounded - 1 == 1:
        res["splits"] = m[rounded:rounded + T].astype(np.int32)
    return res



# mha_fwd's arguments that SGLang's ``sgl_kernel.flash_attn.flash_attn_with_kvcache`` (sglang-kernel 0.4.10) leaves
# at their defaults for MLA: no new KV, rotary, descales, window, chunk, softcap or scheduler metadata;
# ``max_seqlen_k`` and ``cu_seqlens_k`` None (the bound is the page table's width), ``pack_gqa`` None, no sink.
_SGL_UNUSED = {"k_new": None, "v_new": None, "out": None, "cu_seqlens_k": None, "seqused_q": None,
               "max_seqlen_k": None, "kv_batch_idx": None, "leftpad_k": None, "rotary_cos": None, "rotary_sin": None,
               "seqlens_rotary": None, "q_descale": None, "k_descale": None, "v_descale": None,
               "window_size_left": -1, "window_size_right": -1, "attention_chunk": 0, "softcap": 0.0,
               "is_rotary_interleaved": True, "scheduler_metadata": None, "pack_gqa": None, "sm_margin": 0}


def _sgl_call(fa3, q, k_rope, kv_c, table, seqlens, s_q: int, scale: float, num_splits: int):
    """``flash_attn_with_kvcache(q=q_rope, k_cache=k_rope, v_cache=kv_c, qv=q_nope, page_table, cache_seqlens,
    cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal=True, num_splits)`` as SGLang's fa3 backend
    (``flashattention_backend.py:2364-2383``) and its DSA decode (``dsa_backend.py:2784-2800``) make it: q (b s_q,
    h, 576), pages (num_pages, page, 1, 64 | 512). Returns out, lse and the split counts that
    ``get_scheduler_metadata`` gives for the same launch (SGLang passes no metadata for MLA)."""
    import torch

    b, h = len(seqlens), q.shape[1]
    cu_q = torch.arange(0, (b + 1) * s_q, s_q, dtype=torch.int32, device="cuda")
    sl = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)).cuda()
    out, lse, *_ = fa3.fwd(**_SGL_UNUSED, q=q[..., 512:], k=k_rope, v=kv_c, q_v=q[..., :512], cu_seqlens_q=cu_q,
                           cu_seqlens_k_new=cu_k, seqused_k=sl, max_seqlen_q=s_q, page_table=table,
                           softmax_scale=scale, is_causal=True, num_splits=num_splits)
    # mha_fwd's bound on the splits: page_table.size(1) * page_size (flash_api.cpp:749)
    width = table.shape[1] * k_rope.shape[1]
    meta = fa3.get_scheduler_metadata(
        batch_size=b, max_seqlen_q=s_q, max_seqlen_k=width, num_heads=h, num_heads_k=1, headdim=64, headdim_v=512,
        is_bf16=q.dtype == torch.bfloat16, seqused_k=sl, cu_seqlens_q=cu_q, cu_seqlens_k=None,
        cu_seqlens_k_new=None, seqused_q=None, leftpad_k=None, page_size=k_rope.shape[1], max_seqlen_k_new=0,
        is_causal=True, window_size_left=-1, window_size_right=-1, attention_chunk=0, has_softcap=False,
        num_splits=num_splits, pack_gqa=None, sm_margin=0)
    torch.cuda.synchronize()
    # sgl's metadata: the dynamic split counts, the m-blocks and each entry's batch, in the order the prepare kernel
    # sorted the batches into (flash_api.cpp:604-613, flash_prepare_scheduler.cu:200-203)
    m, rounded = meta.cpu().numpy(), -(-b // 4) * 4
    splits = np.zeros(b, np.int32)
    splits[m[2 * rounded:2 * rounded + b]] = m[:b]
    return out, lse, splits


def run_sgl_fa3(fa3, q: np.ndarray, kv: np.ndarray, recipe: dict) -> dict[str, np.ndarray]:
    """One case of SGLang's dense fa3 backend on the GPU: q (b, s_q, h, 576) and kv (b, S_max, 576) bits of
    `recipe`'s format, each request's rows in shuffled pages of ``page_size`` and a page table
    ``table_pages`` wide (SGLang's CUDA-graph decode: ``ceil(max_context_len / page_size)``; eager: the batch's
    longest request in pages), zero past each request's pages. Returns out (b * s_q, h, 512), lse (h, b * s_q) as
    raw bits and the split counts."""
    import torch

    b, sq, H, _ = q.shape
    lens, page, fmt, width = recipe["seqlens"], recipe["page_size"], recipe["format"], recipe["table_pages"]
    qt = bits16(torch, q.reshape(b * sq, H, q.shape[-1]), fmt)
    reqs = [bits16(torch, kv[i, :n], fmt) for i, n in enumerate(lens)]
    cache, table = shuffled_pages(torch, reqs, page, recipe["seed"], reqs[0].dtype)
    full = torch.zeros((b, width), dtype=torch.int32, device="cuda")  # SGLang's table is 0 past a request
    full[:, :min(width, table.shape[1])] = table[:, :width]
    out, lse, splits = _sgl_call(fa3, qt, cache[..., 512:].unsqueeze(-2), cache[..., :512].unsqueeze(-2), full,
                                 list(lens), sq, recipe["scale"], recipe["num_splits"])
    return {"out": out.reshape(b * sq, H, -1).view(torch.int16).cpu().numpy().view(np.uint16),
            "lse": lse.float().contiguous().cpu().numpy().view(np.uint32), "splits": splits}


def run_sgl_fa3_sparse(fa3, q: np.ndarray, rows: np.ndarray, indices: np.ndarray, valid: np.ndarray, recipe: dict,
                       keep: int) -> dict[str, np.ndarray]:
    """SGLang's DSA decode (``dsa_backend.py:2737-2803``, ``_forward_fa3``) on the GPU: every token a one-token
    sequence whose page table is its top-k list (pages of one row), ``cache_seqlens`` its valid count (SGLang's
    ``dsa_cache_seqlens_int32``, clipped to topk), q (T, h, 576), rows (N, 576), indices (T, topk) with -1 past the
    valid count. Returns the first `keep` tokens' out, every token's lse (h, T) and the split counts."""
    import torch

    fmt = recipe["format"]
    qt, kv = bits16(torch, q, fmt), bits16(torch, rows, fmt)
    table = torch.from_numpy(indices.astype(np.int32)).cuda()
    out, lse, splits = _sgl_call(fa3, qt, kv[:, 512:].view(-1, 1, 1, 64), kv[:, :512].view(-1, 1, 1, 512), table,
                                 [int(n) for n in valid], 1, recipe["scale"], recipe["num_splits"])
    return {"out": out[:keep].contiguous().view(torch.int16).cpu().numpy().view(np.uint16),
            "lse": lse.float().contiguous().cpu().numpy().view(np.uint32), "splits": splits}


def fa3_varlen(fa3, q, k, v, qlens, klens, *, scale: float, causal: bool, num_splits: int,
               descales: dict | None = None, softcap: float = 0.0, window: tuple[int, int] = (-1, -1)):
    """``flash_attn_varlen_func`` with FA3 as vLLM's MLA prefill calls it (``v1/attention/backends/mla/prefill/
    flash_attn.py:463-507``: cu_seqlens, the longest lengths, ``return_softmax_lse``): q, k, v CUDA tensors (T, h,
    d), per request `qlens` queries and `klens` keys; `descales`: FP8's ``q_descale``, ``k_descale``,
    ``v_descale`` tensors (batch, h_k), where given; `softcap` and `window` (left, right) as ``mha_fwd`` takes them
    (vLLM's MLA prefill passes neither). Returns out (T, h, dv) and lse (h, T), and the two offset tensors."""
    import torch

    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(klens)]), dtype=torch.int32, device="cuda")
    args = {**_FWD_UNUSED, "q": q, "k": k, "v": v, "q_v": None, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "seqused_k": None, "max_seqlen_q": max(qlens), "max_seqlen_k": max(klens), "page_table": None,
            "softmax_scale": scale, "is_causal": causal, "scheduler_metadata": None, "num_splits": num_splits,
            "softcap": float(softcap), "window_size_left": int(window[0]), "window_size_right": int(window[1]),
            **(descales or {})}
    if getattr(fa3, "fork", "vllm") == "sglang":  # sgl-flash-attn's mha_fwd has attention chunking (off)
        args["attention_chunk"] = 0
    out, lse, *_ = fa3.fwd(**args)
    return out, lse, cu_q, cu_k


def run_fa3_prefill(fa3, q: np.ndarray, k: np.ndarray, v: np.ndarray, recipe: dict,
                    head_swizzle: bool = False) -> dict[str, np.ndarray]:
    """One case of FA3's MHA-form prefill on the GPU (:func:`fa3_varlen`): q (T, h, 192), k (T_k, h_k, 192),
    v (T_k, h_k, 128) as bits of the recipe's ``format`` (``e4m3``: BF16 bits cast with ``.to(torch.float8_e4m3fn)``,
    as vLLM's FP8 prefill casts them; the recipe's ``q_descale``, ``k_descale``, ``v_descale`` where it has them).
    Returns out (T, h, 128) and lse (h, T) as raw bits, and the split counts that ``get_scheduler_metadata`` gives
    for the same call where it splits dynamically (`head_swizzle`: the call is causal or local as ``mha_fwd`` reads
    it, so the metadata holds the heads in L2 too)."""
    import torch

    fmt = recipe["format"]
    qt, kt, vt = (bits16(torch, x, "fp16" if fmt == "fp16" else "bf16") if x.shape[0] else
                  torch.empty(x.shape, dtype=torch.float16 if fmt == "fp16" else torch.bfloat16, device="cuda")
                  for x in (q, k, v))  # a k of no row: as torch makes one (the kernel checks its strides)
    if fmt == "e4m3":
        qt, kt, vt = (x.to(torch.float8_e4m3fn) for x in (qt, kt, vt))
    qlens, klens = recipe["qlens"], recipe["seqlens"]
    descales = {f"{x}_descale": torch.full((len(qlens), k.shape[1]), float(recipe[f"{x}_descale"]),
                                           dtype=torch.float32, device="cuda")
                for x in "qkv" if f"{x}_descale" in recipe}  # one value a call, as vLLM's per-tensor scales
    softcap, window_size = float(recipe.get("softcap", 0.0)), tuple(recipe.get("window", (-1, -1)))
    out, lse, cu_q, cu_k = fa3_varlen(fa3, qt, kt, vt, qlens, klens, scale=recipe["scale"], causal=recipe["causal"],
                                      num_splits=recipe["num_splits"], descales=descales, softcap=softcap,
                                      window=window_size)
    b, H, Hk, mq = len(qlens), q.shape[1], k.shape[1], max(qlens)
    # SGLang's binding takes the dtype as is_bf16 (its op's signature); a split bound of 1 reads no split count
    sgl = getattr(fa3, "fork", "vllm") == "sglang"
    dtype = {"is_bf16": qt.dtype != torch.float16, "attention_chunk": 0} if sgl else {"qkv_dtype": qt.dtype}
    meta = fa3.get_scheduler_metadata(
        batch_size=b, max_seqlen_q=mq, max_seqlen_k=max(klens), num_heads=H, num_heads_k=Hk, headdim=q.shape[2],
        headdim_v=v.shape[2], **dtype, seqused_k=torch.tensor(klens, dtype=torch.int32, device="cuda"),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, cu_seqlens_k_new=None, seqused_q=None, leftpad_k=None,
        page_size=None, max_seqlen_k_new=0, is_causal=recipe["causal"], window_size_left=window_size[0],
        window_size_right=window_size[1], has_softcap=softcap > 0, num_splits=recipe["num_splits"], pack_gqa=None,
        sm_margin=0)
    torch.cuda.synchronize()
    res = {"out": out.contiguous().view(torch.int16).cpu().numpy().view(np.uint16),
           "lse": lse.float().contiguous().cpu().numpy().view(np.uint32)}
    m = meta.cpu().numpy()
    rounded = -(-b // 4) * 4
    if sgl:  # split counts, m-blocks, [batch order unless local], [heads in L2 if causal or local], semaphore
        # (sgl-flash-attn cb303cf flash_api.cpp:604-623): the counts are 1 unless the call lets the launch split
        if (m.size - 1) // rounded >= 2 and recipe["num_splits"] != 1:
            res["splits"] = m[:b].astype(np.int32)
    elif (m.size - 1) // rounded - 1 - head_swizzle == 1:
        # prepare_seqlen_q, [split counts if dynamic], [heads in L2 if causal or local], semaphore
        res["splits"] = m[rounded:rounded + b].astype(np.int32)
    return res


def run_vllm_prefill_chain(fa3, merge, q, k, v, k_context, v_context, recipe: dict, chunks: list) -> np.ndarray:
    """vLLM 0.33's MLA prefill chained on the GPU as ``forward_mha`` chains it: the new tokens' causal call, a call
    per context chunk, the chunks' rows copied into the context partial or, for a continued request, merged into it
    in place (`merge`: vLLM's ``merge_attn_states`` op), then the final merge. chunks: per chunk (its query rows, the
    context rows it gathers, how many of its rows merge, its requests' query lengths, their key counts), as
    :func:`amla_sim.algorithms.deployed.vllm.mla_prefill.chunk_rows` gives them. BF16 bits in; the output's out."""
    import torch

    ql, cl, ns, scale = recipe["qlens"], recipe["context_lens"], recipe["num_splits"], recipe["scale"]
    qt, kt, vt, kc, vc = (bits16(torch, x) for x in (q, k, v, k_context, v_context))
    new, new_lse, _, _ = fa3_varlen(fa3, qt, kt, vt, ql, ql, scale=scale, causal=True, num_splits=ns)
    if not chunks:
        return new.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
    T = qt.shape[0]
    out = lse = None
    for rows, ctx, merged, chunk_q, chunk_k in chunks:
        idx = torch.from_numpy(ctx).cuda()
        o, l, _, _ = fa3_varlen(fa3, qt[rows], kc[idx], vc[idx], chunk_q, chunk_k, scale=scale, causal=False,
                                num_splits=ns)
        if out is None:
            if len(chunks) == 1 and all(n > 0 for n in cl):
                out, lse = o, l
                break
            out = torch.zeros((T, *o.shape[1:]), dtype=o.dtype, device="cuda")
            lse = torch.full((l.shape[0], T), float("-inf"), dtype=l.dtype, device="cuda")
        lo = rows.start
        if merged:
            m = slice(lo, lo + merged)
            merge(out[m], lse[:, m], out[m], lse[:, m], o[:merged], l[:, :merged], None, None)
        out[lo + merged:rows.stop].copy_(o[merged:])
        lse[:, lo + merged:rows.stop].copy_(l[:, merged:])
    final = torch.empty_like(new)
    merge(final, None, out, lse, new, new_lse, None, None)
    torch.cuda.synchronize()
    return final.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
