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

__all__ = ["DEEPGEMM_CASES", "FI_GEMM_CASES", "deepgemm_inputs", "fi_gemm_inputs", "quantize_weight_blocks",
           "device_quant_act", "KEEP_COLUMNS"]

KEEP_COLUMNS = 256
#: (tokens M, N, activation scales UE8M0, weight scales "ue8m0" or "fp32", seed)
DEEPGEMM_CASES = ((300, 4096, True, "ue8m0", 1), (2048, 4096, True, "ue8m0", 2), (64, 32768, True, "ue8m0", 3),
                  (40, 4096, True, "ue8m0", 5), (300, 4096, False, "fp32", 4))


#: FlashInfer's block-scale GEMM as vLLM calls it under 32 tokens: (tokens M, N, K, seed, inputs "normal" or "edges"):
#: kv_b_proj (N = 16 heads x 256, K = 512), o_proj (7168, 16 x 128), q_b_proj (16 x 192, 1536) and the fused
#: q_a / kv_a projection (1536 + 576, 7168) at DeepSeek-V3's tensor-parallel 8 shapes
FI_GEMM_CASES = ((1, 4096, 512, 1, "normal"), (5, 4096, 512, 2, "normal"), (31, 4096, 512, 3, "normal"),
                 (16, 7168, 2048, 4, "normal"), (24, 3072, 1536, 5, "normal"), (8, 2112, 7168, 6, "normal"),
                 (8, 4096, 512, 7, "edges"))


def fi_gemm_inputs(tokens: int, n: int, k: int, seed: int, kind: str = "normal") -> tuple[np.ndarray, np.ndarray]:
    """x (M, K) ~ N(0, 1) and the weight (N, K) ~ N(0, 0.05^2), BF16. "edges": groups of 128 that test the quantizer,
    in rows 1-3 (an all-zero group, a lone value, an amax of 448 2^-3, amaxes of 2^127 and 1.5 2^126, a group of
    subnormals, a tiny normal amax over subnormals, an infinity) and rows 4-7 scaled by 2^-40 to 2^40."""
    rng = np.random.default_rng([check_int(seed, "seed", lo=0), 52, 2])
    x = rng.normal(0, 1, (check_int(tokens, "tokens", lo=1), check_int(k, "k", lo=128)))
    w = rng.normal(0, 0.05, (check_int(n, "n", lo=64), k))
    if kind == "edges":
        if tokens < 8 or k < 512:
            raise ValueError("tokens, k: the edges need 8 rows of 4 groups")
        g = [slice(i * 128, (i + 1) * 128) for i in range(4)]
        x[1, g[0]] = 0
        x[1, g[1]] = 0
        x[1, 130] = -3.25
        x[1, g[2]] *= 56 / np.abs(x[1, g[2]]).max()
        x[1, g[3]] *= 2.0**-20
        x[2, g[0]] *= 2.0**127 / np.abs(x[2, g[0]]).max()
        x[2, g[1]] *= 1.5 * 2.0**126 / np.abs(x[2, g[1]]).max()
        x[2, g[2]] = np.round(x[2, g[2]] * 8) * 2.0**-133
        x[2, g[3]] = np.round(x[2, g[3]] * 8) * 2.0**-133
        x[2, 3 * 128] = 2.0**-120
        x[3, 5] = np.inf
        for r in range(4, 8):
            x[r] *= 2.0 ** (-40 + 80 * (r - 4) / 3)
    elif kind != "normal":
        raise ValueError(f"kind: expected 'normal' or 'edges', got {kind!r}")
    return round_to(x, "bf16"), round_to(w, "bf16")


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
    nb = -(-N // 128)  # a last block of fewer rows (N a multiple of 64) has a scale of its own
    wg = np.pad(w.astype(np.float32), ((0, nb * 128 - N), (0, 0))).reshape(nb, 128, K // 128, 128)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = _scales(np.abs(wg).max(axis=(1, 3)), scales == "ue8m0")
        q = np.clip((wg / s[:, None, :, None]).astype(np.float32), -448, 448).reshape(nb * 128, K)[:N]
    return get_machine("ieee32").cast(q, "e4m3"), s
