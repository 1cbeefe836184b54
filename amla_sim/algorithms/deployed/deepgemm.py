"""``kv_b_proj`` of an FP8 checkpoint as vLLM 0.33 runs it on Hopper: the activations quantized per token in groups of
128 (vLLM's ``per_token_group_quant_fp8``) and DeepGEMM's FP8 block-scaled GEMM ``fp8_gemm_nt``
(``sm90_fp8_gemm_1d2d``), BF16 out.

Upstream: vLLM 0.33.0 ``csrc/quantization/w8a8/fp8/per_token_group_quant.cu:44-100`` (compiled without fast math):
per group, ``absmax = max(eps, max |x|)`` (eps 1e-10), ``y_s = absmax / 448``; with UE8M0 scales (vLLM's default on
Hopper too, ``VLLM_USE_DEEP_GEMM_E8M0``) ``y_s = exp2f(ceilf(log2f(max(|y_s|, 1e-10))))``; ``q = e4m3(clamp(x
fl(1 / y_s), -448, 448))``: every byte and scale of the kernel in vLLM's wheel (``tests/data/vllm_quant_h200.npz``).
DeepGEMM as vLLM vendors it (vllm-project/DeepGEMM 0820030,
``deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh:254-416``, nvcc without fast math): per K block of 128,
four ``wgmma`` k32 instructions from a cleared accumulator (the FP8 tensor cores' truncated sum, the accumulator
fused), then ``final += fl(scale_a scale_b) accum`` (one FMA) with the row's activation scale and the column's
weight-block scale; the tile's BF16 round-to-nearest at the end. Tiles, stages and multicast (chosen from M, N and K)
change no bit: each output is its row's and column's chain over K in order.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ...arith.convert import canonical_nan, cvt_e4m3_satfinite
from ...arith.elementwise import rcp_approx
from ...arith.logarithm import log2f
from ...formats import get_format
from ...machines import Machine, get_machine
from ..quantizers import E4M3_MAX

__all__ = ["FP8_GROUP", "bf16_groups", "fp8_gemm_nt", "per_token_group_quant_fp8", "sglang_per_token_group_quant_fp8"]

#: the quantization group and DeepGEMM's K block
FP8_GROUP = 128
_EPS = np.float32(1e-10)


def per_token_group_quant_fp8(x: npt.ArrayLike, *, ue8m0: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ``per_token_group_quant_fp8(x, 128, use_ue8m0=ue8m0)``: x (M, K) BF16 (K a multiple of 128) ->
    q (M, K) E4M3 and the scales (M, K / 128) FP32."""
    xa = np.asarray(x)
    fmt = get_format(xa.dtype).name if xa.dtype.kind in "fV" else None
    if xa.ndim != 2 or fmt not in ("bf16", "fp16", "fp32") or xa.shape[1] % FP8_GROUP:
        raise ValueError(f"x: expected (tokens, K) BF16, FP16 or FP32, K a multiple of {FP8_GROUP}, got {xa.dtype} "
                         f"{xa.shape}")
    M, K = xa.shape
    xg = xa.astype(np.float32).reshape(M, K // FP8_GROUP, FP8_GROUP)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        absmax = np.maximum(_EPS, np.abs(xg).max(axis=-1))
        y_s = (absmax / np.float32(E4M3_MAX)).astype(np.float32)
        if ue8m0:
            y_s = np.exp2(np.ceil(log2f(np.maximum(np.abs(y_s), _EPS)))).astype(np.float32)
        inv = (np.float32(1) / y_s).astype(np.float32)
        q = np.clip((xg * inv[..., None]).astype(np.float32), -E4M3_MAX, E4M3_MAX)
    return get_machine("ieee32").cast(q.reshape(M, K), "e4m3"), y_s


def bf16_groups(x: npt.ArrayLike) -> np.ndarray:
    """Activations x (M, K) BF16, K a multiple of 128, as FP32 groups (M, K / 128, 128); a ValueError names x."""
    xa = np.asarray(x)
    fmt = get_format(xa.dtype).name if xa.dtype.kind in "fV" else None
    if xa.ndim != 2 or fmt != "bf16" or xa.shape[1] % FP8_GROUP:
        raise ValueError(f"x: expected (tokens, K) BF16, K a multiple of {FP8_GROUP}, got {xa.dtype} {xa.shape}")
    return xa.astype(np.float32).reshape(xa.shape[0], -1, FP8_GROUP)


def sglang_per_token_group_quant_fp8(x: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """SGLang 0.5.23's quantizer of kv_b_proj's activations on Hopper (FP32 scales), every byte and scale of its
    kernel compiled with SGLang's JIT flags (``tests/data/sglang_quant_h200.npz``): its JIT kernel
    ``per_token_group_quant`` (``sglang/kernels/jit/csrc/gemm/per_token_group_quant.cuh:319-362``, built with
    ``--use_fast_math``) takes ``amax = max(max |x|, 1e-10)``, stores ``y_s = amax fl(1 /
    448)`` (a multiply) and quantizes ``e4m3(satfinite(x q))`` with ``q = 448 / amax`` an approximate division
    (``div.approx.ftz``: 448 times MUFU.RCP of amax). x (M, K) BF16 -> q (M, K) E4M3 and y_s (M, K / 128) FP32."""
    xg = bf16_groups(x)
    M, K = xg.shape[0], xg.shape[1] * FP8_GROUP
    with np.errstate(over="ignore", invalid="ignore"):
        amax = np.maximum(_EPS, np.abs(xg).max(axis=-1))
        y_s = (amax * (np.float32(1) / np.float32(E4M3_MAX))).astype(np.float32)
        q = (np.float32(E4M3_MAX) * rcp_approx(amax)).astype(np.float32)
        scaled = (xg * q[..., None]).astype(np.float32)
    return cvt_e4m3_satfinite(scaled.reshape(M, K)), y_s


def fp8_gemm_nt(a: npt.ArrayLike, a_scales: npt.ArrayLike, b: npt.ArrayLike, b_scales: npt.ArrayLike, *,
                machine: str | Machine = "sm90-cuda") -> np.ndarray:
    """DeepGEMM's ``fp8_gemm_nt((a, a_scales), (b, b_scales), out)``: a (M, K) E4M3 with per-token-group scales
    (M, K / 128), b (N, K) E4M3 with 128 x 128 block scales (ceil(N / 128), K / 128), FP32; returns a b^T (M, N)
    BF16."""
    mc = get_machine(machine)
    A, B = np.asarray(a), np.asarray(b)
    for name, x in (("a", A), ("b", B)):
        if x.ndim != 2 or x.dtype.kind not in "fV" or get_format(x.dtype).name != "e4m3":
            raise ValueError(f"{name}: expected a 2-D FP8 E4M3 array, got {x.dtype} {x.shape}")
    M, K = A.shape
    N = B.shape[0]
    if B.shape[1] != K or K % FP8_GROUP:
        raise ValueError(f"b: expected (N, {K}) with K a multiple of {FP8_GROUP}, got {B.shape}")
    sa, sb = np.asarray(a_scales, np.float32), np.asarray(b_scales, np.float32)
    if sa.shape != (M, K // FP8_GROUP):
        raise ValueError(f"a_scales: expected {(M, K // FP8_GROUP)}, got {sa.shape}")
    if sb.shape != (-(-N // FP8_GROUP), K // FP8_GROUP):
        raise ValueError(f"b_scales: expected {(-(-N // FP8_GROUP), K // FP8_GROUP)}, got {sb.shape}")
    col_block = np.arange(N) // FP8_GROUP
    acc = np.zeros((M, N), np.float32)
    for j in range(K // FP8_GROUP):
        k = slice(j * FP8_GROUP, (j + 1) * FP8_GROUP)
        part = mc.matmul(mc.operand(A[:, k]), mc.operand(np.ascontiguousarray(B[:, k].T)))  # a cleared accumulator
        scale = mc.f(sa[:, j][:, None] * sb[col_block, j][None, :])
        acc = mc.mul_add(scale, part, acc)
    return canonical_nan(mc.cast(acc, "bf16"))  # the epilogue's cvt: NaN 0x7FFF (captured)
