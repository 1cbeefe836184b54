"""An FP8 block linear layer of a DeepSeek-V3/R1 or Kimi-K2 checkpoint (an E4M3 weight in 128 x 128 blocks with FP32
scales, BF16 in and out: ``kv_b_proj``, ``o_proj``, the q and kv projections) as each engine runs it on Hopper, and
which kernel a launch of M rows takes.

- **vLLM 0.33** (``model_executor/kernels/linear/scaled_mm/flashinfer.py:229-310``,
  ``FlashInferFp8DeepGEMMDynamicBlockScaledKernel``, first in ``_POSSIBLE_FP8_BLOCK_KERNELS``): fewer than 32 rows
  go to FlashInfer's block-scale GEMM, which quantizes the activations itself with FP32 scales
  (:func:`~amla_sim.algorithms.deployed.flashinfer.blockscale_gemm.fp8_blockscale_gemm_sm90`); 32 rows or more, and
  every launch under ``VLLM_BATCH_INVARIANT``, to vLLM's quantizer with power-of-two (UE8M0) scales and DeepGEMM
  (:mod:`~amla_sim.algorithms.deployed.deepgemm`).
- **SGLang 0.5.23** (``fp8_utils.py`` ``deepgemm_w8a8_block_fp8_linear_with_fallback``): its quantizer with FP32
  scales and DeepGEMM at every M (its fork, ``sgl-deep-gemm`` 0.2.3.post2, taken as vLLM's DeepGEMM: the same
  block-128 branch in its source, not run on a device).

M is the launch's: vLLM pads a step of at most 512 tokens to its CUDA graph's size (``[1, 2, 4]``, then steps of 8
to 248, of 16 from 256; ``config/vllm.py:2560-2605``), so a launch of 25 to 31 rows runs DeepGEMM; the projections
inside the attention op (``kv_b_proj`` of a prefill and its context chunks) run eagerly at their own row count.
Each output row is its own row's chain through the kernel its launch takes: a row's bits depend on its batchmates
only through that choice.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..._validate import check_int
from .deepgemm import fp8_gemm_nt, per_token_group_quant_fp8, sglang_per_token_group_quant_fp8
from .flashinfer.blockscale_gemm import FI_GEMM_SWAP_AB_MAX_M, fp8_blockscale_gemm_sm90

__all__ = ["FP8_LINEAR_KERNELS", "fp8_block_linear", "fp8_linear_kernel", "vllm_graph_tokens"]

#: each kernel path: what it is, in a verdict's words
FP8_LINEAR_KERNELS = {
    "flashinfer": "FlashInfer's block-scale GEMM (its own quantizer, FP32 scales)",
    "deepgemm-ue8m0": "DeepGEMM (vLLM's quantizer, power-of-two scales)",
    "deepgemm-fp32": "DeepGEMM (SGLang's quantizer, FP32 scales)",
}


def vllm_graph_tokens(tokens: int, graph_max: int = 512) -> int:
    """The rows of a vLLM step of `tokens` tokens as its CUDA graph runs them: the smallest capture size at least
    `tokens` (``[1, 2, 4] + range(8, 256, 8) + range(256, graph_max + 1, 16)``, `graph_max` a multiple of 16), or
    `tokens` above `graph_max` (eager)."""
    check_int(tokens, "tokens", lo=1)
    if check_int(graph_max, "graph_max", lo=16) % 16:
        raise ValueError(f"graph_max: a multiple of 16, got {graph_max}")
    if tokens > graph_max:
        return tokens
    if tokens <= 4:
        return 1 << max(tokens - 1, 0).bit_length()
    step = 8 if tokens <= 248 else 16
    return -(-tokens // step) * step


def fp8_linear_kernel(engine: str, deterministic: bool, rows: int) -> str:
    """The kernel path (a key of :data:`FP8_LINEAR_KERNELS`) of a launch of `rows` rows."""
    check_int(rows, "rows", lo=1)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic: expected True or False, got {deterministic!r}")
    if engine == "sglang":
        return "deepgemm-fp32"
    if engine != "vllm":
        raise ValueError(f"engine: expected 'vllm' or 'sglang', got {engine!r}")
    return "flashinfer" if not deterministic and rows < FI_GEMM_SWAP_AB_MAX_M else "deepgemm-ue8m0"


def fp8_block_linear(x: npt.ArrayLike, weight: npt.ArrayLike, weight_scale: npt.ArrayLike, *,
                     kernel: str) -> np.ndarray:
    """x (M, K) BF16 times the block-quantized weight (N, K) E4M3 (scales (ceil(N / 128), K / 128) FP32), through
    `kernel`: (M, N) BF16."""
    if kernel == "flashinfer":
        return fp8_blockscale_gemm_sm90(x, weight, weight_scale)
    if kernel == "deepgemm-ue8m0":
        a, sa = per_token_group_quant_fp8(x, ue8m0=True)
    elif kernel == "deepgemm-fp32":
        a, sa = sglang_per_token_group_quant_fp8(x)
    else:
        raise ValueError(f"kernel: expected one of {tuple(FP8_LINEAR_KERNELS)}, got {kernel!r}")
    return fp8_gemm_nt(a, sa, weight, weight_scale)
