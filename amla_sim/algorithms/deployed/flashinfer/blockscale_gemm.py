"""FlashInfer's sm90 FP8 block-scale GEMM, ``flashinfer.gemm.fp8_blockscale_gemm_sm90`` (flashinfer-python
0.7.2.post1, the version vLLM 0.33.0 pins): what vLLM runs for an FP8 block linear of fewer than 32 tokens on Hopper
(``kv_b_proj``, ``o_proj`` and the others of a DeepSeek-V3/R1 or Kimi-K2 checkpoint; from 32 tokens, and always
under ``VLLM_BATCH_INVARIANT``, DeepGEMM: ``model_executor/kernels/linear/scaled_mm/flashinfer.py:229-310``).

It takes BF16 activations and quantizes them itself, with TensorRT-LLM's ``scale_1x128_kernel``
(``data/csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm_kernel.cuh:
831-892``), compiled with FlashInfer's ``-use_fast_math``: per group of 128, ``amax = max |x|`` in BF16, the
multiplier ``s = 448 / amax`` an approximate division (``div.approx.ftz``: 448 times MUFU.RCP of amax; 1 for an
all-zero group), the stored scale ``1 / s`` (MUFU.RCP again), and ``q = e4m3(satfinite(x s))`` with subnormal x
read as zero (``.ftz``). So its scales are not powers of two, where vLLM's DeepGEMM path rounds them up to powers
of two (:func:`~amla_sim.algorithms.deployed.deepgemm.per_token_group_quant_fp8`).

The product is TensorRT-LLM's port of DeepGEMM (``tensorrt_llm/deep_gemm/fp8_gemm_impl.cuh:640-730``, compiled by
NVRTC without fast math), below 32 rows with A and B swapped (the weight's rows on the tensor cores' M side): per K
block of 128, four ``wgmma`` k32 from a cleared accumulator, then ``final += fl(s_w s_x) accum``, BF16 at the end:
each output is the same chain over K as DeepGEMM's (:func:`~amla_sim.algorithms.deployed.deepgemm.fp8_gemm_nt`),
whichever operand the tensor cores read as A.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ....arith.convert import cvt_e4m3_satfinite
from ....arith.elementwise import rcp_approx
from ....formats import flush_subnormals
from ...quantizers import E4M3_MAX
from ..deepgemm import FP8_GROUP, bf16_groups, fp8_gemm_nt

__all__ = ["FI_GEMM_SWAP_AB_MAX_M", "fp8_blockscale_gemm_sm90", "trtllm_quant_1x128"]

#: the M below which FlashInfer swaps A and B (``gemm_dispatch``'s ``m_threshold``), and vLLM calls FlashInfer
FI_GEMM_SWAP_AB_MAX_M = 32


def trtllm_quant_1x128(x: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """TensorRT-LLM's ``scale_1x128_kernel`` as FlashInfer builds it: x (M, K) BF16 (K a multiple of 128) -> q (M, K)
    E4M3 and the scales (M, K / 128) FP32 that the GEMM multiplies back."""
    xg = bf16_groups(x)
    M, K = xg.shape[0], xg.shape[1] * FP8_GROUP
    with np.errstate(over="ignore", invalid="ignore"):
        amax = np.fmax.reduce(np.abs(xg), axis=-1)  # __hmax: a NaN loses to a number
        s = np.where(amax != 0, np.float32(E4M3_MAX) * rcp_approx(amax), np.float32(1)).astype(np.float32)
        scale = rcp_approx(s)
        q = (flush_subnormals(xg, keep_sign=True) * s[..., None]).astype(np.float32)
    return cvt_e4m3_satfinite(q.reshape(M, K)), scale


def fp8_blockscale_gemm_sm90(x: npt.ArrayLike, weight: npt.ArrayLike, weight_scale: npt.ArrayLike) -> np.ndarray:
    """``fp8_blockscale_gemm_sm90(input=x, weight=weight, weight_scale=weight_scale, out_dtype=torch.bfloat16)`` as
    vLLM calls it: x (M, K) BF16, the weight (N, K) E4M3 with 128 x 128 block scales (ceil(N / 128), K / 128) FP32;
    returns x weight^T (M, N) BF16."""
    q, s = trtllm_quant_1x128(x)
    return fp8_gemm_nt(q, s, weight, weight_scale)
