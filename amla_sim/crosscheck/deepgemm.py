"""DeepGEMM's kv_b_proj GEMM: the device check's cases (``scripts/capture_deepgemm.py``) and their inputs. A case is
one ``fp8_gemm_nt`` of M tokens' latents (K = 512) by kv_b_proj's weight (N = heads x 256): x ~ N(0, 1) and the
weight ~ N(0, 0.05^2) drawn in BF16, the weight quantized in 128 x 128 blocks (UE8M0 scales as vLLM requantizes
them, or FP32 ones as a checkpoint holds them) and the activations by vLLM's per-token-group quantizer. The capture
keeps the first 256 output columns (two weight blocks; each column's chain is its own).
"""

from __future__ import annotations

import numpy as np

from .._validate import check_int
from ..arith.logarithm import log2f
from ..formats import round_to
from ..machines import get_machine

__all__ = ["DEEPGEMM_CASES", "deepgemm_inputs", "quantize_weight_blocks", "device_quant_act", "KEEP_COLUMNS"]

KEEP_COLUMNS = 256
#: (tokens M, N, activation scales UE8M0, weight scales "ue8m0" or "fp32", seed)
DEEPGEMM_CASES = ((300, 4096, True, "ue8m0", 1), (2048, 4096, True, "ue8m0", 2), (64, 32768, True, "ue8m0", 3),
                  (40, 4096, True, "ue8m0", 5), (300, 4096, False, "fp32", 4))


def deepgemm_inputs(tokens: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """x (M, 512) and the weight (N, 512), BF16."""
    rng = np.random.default_rng([check_int(seed, "seed", lo=0), 52, 1])
    return (round_to(rng.normal(0, 1, (check_int(tokens, "tokens", lo=1), 512)), "bf16"),
            round_to(rng.normal(0, 0.05, (check_int(n, "n", lo=128), 512)), "bf16"))


_INV_448 = np.float32(1) / np.float32(448)  # torch divides by a scalar as a multiply by its reciprocal


def _scales(amax: np.ndarray, ue8m0: bool) -> np.ndarray:
    """The device check's scales (torch): ``amax * fl(1 / 448)``; UE8M0: ``2^ceil(log2(max(s, 1e-10)))``."""
    s = (amax * _INV_448).astype(np.float32)
    if ue8m0:
        s = np.exp2(np.ceil(log2f(np.maximum(s, np.float32(1e-10))))).astype(np.float32)
    return s


def device_quant_act(x: np.ndarray, ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
    """The activations as the device check quantizes them (the bundle's torch rendering of vLLM's quantizer, which
    multiplies by fl(1 / 448) where vLLM's kernel divides by 448; the same scales with UE8M0 on these inputs):
    ``q = e4m3(clamp(x fl(1 / s)))``."""
    M, K = x.shape
    xg = x.astype(np.float32).reshape(M, K // 128, 128)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = _scales(np.abs(xg).max(axis=-1), ue8m0)
        q = np.clip((xg * (np.float32(1) / s)[..., None]).astype(np.float32), -448, 448).reshape(M, K)
    return get_machine("ieee32").cast(q, "e4m3"), s


def quantize_weight_blocks(w: np.ndarray, scales: str) -> tuple[np.ndarray, np.ndarray]:
    """The weight (N, K) BF16 in 128 x 128 blocks as the device check makes it (torch): ``s = amax fl(1 / 448)``
    (UE8M0: ``2^ceil(log2 s)``), ``q = e4m3(clamp(w / s))``."""
    N, K = w.shape
    wg = w.astype(np.float32).reshape(N // 128, 128, K // 128, 128)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = _scales(np.abs(wg).max(axis=(1, 3)), scales == "ue8m0")
        q = np.clip((wg / s[:, None, :, None]).astype(np.float32), -448, 448).reshape(N, K)
    return get_machine("ieee32").cast(q, "e4m3"), s
