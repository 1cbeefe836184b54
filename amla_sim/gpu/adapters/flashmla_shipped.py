"""FlashMLA as the serving engines ship it: the compiled libraries of vLLM's wheel and of SGLang's ``sgl-flash-mla``
package, loaded as they are (``torch.ops.load_library``; nothing is compiled) and called through the same four
functions as this project's builds of FlashMLA's sources (:mod:`amla_sim.gpu.adapters.flashmla`,
:mod:`amla_sim.gpu.adapters.vllm`), so that one case table
captures any build.

- ``vllm``: vLLM 0.33.0's wheel, unpacked: ``vllm/_flashmla_C.abi3.so`` (the dense decode, the sparse FP8 decode
  and the sparse prefill, op namespace ``_flashmla_C``; compiled without ``--use_fast_math``) and
  ``vllm/_flashmla_extension_C.abi3.so`` (the dense FP8 decode, ``_flashmla_extension_C``; with it). Their ops
  take the softmax scale as a double (``float`` in a torch schema). Python calls as
  ``vllm/third_party/flashmla/flash_mla_interface.py`` makes them: ``out_`` None, ``enable_batch_invariant``
  False.
- ``sglang``: ``sgl-flash-mla`` 1.0.0 (what SGLang 0.5.23 installs), unpacked: ``flash_mla/_C_legacy.abi3.so``,
  whose ``flash_mla_legacy`` namespace holds the sm90 kernels SGLang's wrapper routes to (``use_legacy=True``; its
  other library, ``cuda.abi3.so``, holds sm100's); calls as ``flash_mla/flash_mla_interface.py`` makes them (``kv_format`` None,
  the sparse prefill's statistics in natural log).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from .. import require_gpu

__all__ = ["SHIPPED", "load_shipped_flashmla"]

#: build -> (the files a folder must hold, relative; the op namespaces they register; what the folder is)
SHIPPED = {
    "vllm": (("vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so"),
             ("_flashmla_C", "_flashmla_extension_C"),
             "the folder vLLM 0.33.0's wheel unpacks to (it holds vllm/_flashmla_C.abi3.so)"),
    "sglang": (("flash_mla/_C_legacy.abi3.so",),
               ("flash_mla_legacy", "flash_mla_legacy"),
               "the folder sgl-flash-mla 1.0.0's wheel unpacks to (it holds flash_mla/_C_legacy.abi3.so)"),
}


def load_shipped_flashmla(root: str | Path, build: str) -> SimpleNamespace:
    """The shipped libraries of `build` (``vllm`` or ``sglang``) under `root`, loaded into this process, as an
    object with this project's call signatures: ``dense_decode_fwd``, ``sparse_decode_fwd``,
    ``sparse_prefill_fwd``, ``get_mla_decoding_metadata_dense_fp8`` and ``fwd_kvcache_mla_fp8``."""
    if build not in SHIPPED:
        raise ValueError(f"build: expected one of {tuple(SHIPPED)}, got {build!r}")
    files, namespaces, what = SHIPPED[build]
    folder = Path(root)
    for f in files:
        if not (folder / f).is_file():
            raise FileNotFoundError(f"build {build}: {root} has no {f}; it should be {what}")
    require_gpu()
    import torch

    for f in files:
        torch.ops.load_library(str(folder / f))
    dense, fp8 = (getattr(torch.ops, n) for n in namespaces)
    if build == "vllm":
        return SimpleNamespace(
            build=build,
            dense_decode_fwd=lambda *a: dense.dense_decode_fwd(*a, None),  # out_
            sparse_decode_fwd=lambda *a: dense.sparse_decode_fwd(*a, None, False),  # out_, enable_batch_invariant
            sparse_prefill_fwd=lambda *a: dense.sparse_prefill_fwd(*a, None),  # out_
            get_mla_decoding_metadata_dense_fp8=fp8.get_mla_decoding_metadata_dense_fp8,
            fwd_kvcache_mla_fp8=fp8.fwd_kvcache_mla_fp8)
    return SimpleNamespace(
        build=build,
        dense_decode_fwd=dense.dense_decode_fwd,
        sparse_decode_fwd=lambda *a: dense.sparse_decode_fwd(*a, None),  # kv_format
        sparse_prefill_fwd=lambda *a: dense.sparse_prefill_fwd(*a, False, True),  # natural-log statistics
        get_mla_decoding_metadata_dense_fp8=fp8.get_mla_decoding_metadata_dense_fp8,
        fwd_kvcache_mla_fp8=fp8.fwd_kvcache_mla_fp8)
