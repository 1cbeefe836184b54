"""The dense MLA layer's device check (``scripts/capture_layer.py``) and its replay: requests prefilled and decoded by
the real kernels, chained as each engine chains them, and cuBLAS's bmm on the absorbed shapes.

A layer case is a request (:func:`layer_request`: its tokens, heads and seed), a mode
(:data:`~amla_sim.algorithms.deployed.mla_layer.LAYER_MODES`), the scheduler's budget and the tokens kept: the
device runs the prefill chunks that hold them and each one's decode, and keeps their layer outputs and stages.
"""

from __future__ import annotations

import zlib

import numpy as np

from .._validate import check_int
from ..algorithms.deployed.mla_layer import KV_LORA, QK_NOPE, QK_ROPE, V_HEAD, LayerInputs
from ..formats import round_to
from .deepgemm import quantize_weight_blocks

__all__ = ["LAYER_CASES", "CUBLAS_SHAPES", "ACT_QUANT_CASES", "layer_request", "case_request", "act_quant_inputs",
           "crc_bits", "DEEPSEEK_V3_SCALE", "HIDDEN", "MAX_LAYER_TOKENS"]

#: DeepSeek-V3's softmax scale, 192^-0.5 mscale^2 with YaRN (what both engines pass)
DEEPSEEK_V3_SCALE = 0.1352337788608801
#: the longest request ``prefill-decode --model dense`` models
MAX_LAYER_TOKENS = 8192
#: DeepSeek-V3's hidden size: o_proj's output rows
HIDDEN = 7168

#: (mode, tokens, heads, seed, budget, tokens kept, decode batch): a 600-token prompt takes the MHA form in vLLM
#: (600 > 512) and the absorbed one in SGLang's deterministic mode; a 300-token prompt the absorbed form in vLLM;
#: 1,100 tokens under a budget of 1,024 leave a second chunk of 76 absorbed over 1,024 of context, under a budget of
#: 540 a second chunk of 540 in the MHA form with a context chunk merged; 128 heads (one GPU holding every head);
#: SGLang's default mode: a prompt of no prefix in the MHA form (its quantizer, FP32 scales), and a second chunk over
#: a prefix under 8,192 absorbed with FA3's heuristic (decodes bounded by a 163,840-page table)
LAYER_CASES = (
    ("vllm", 600, 16, 11, 8192, (300, 599), 1),
    ("vllm-batch-invariant", 600, 16, 11, 8192, (300, 599), 1),
    ("vllm", 300, 16, 12, 8192, (150, 299), 1),
    ("vllm-batch-invariant", 300, 16, 12, 8192, (150, 299), 1),
    ("vllm", 300, 16, 12, 8192, (299,), 8),
    ("sglang-deterministic", 600, 16, 13, 8192, (300, 599), 1),
    ("vllm", 1100, 16, 14, 1024, (1050, 1099), 1),
    ("vllm-batch-invariant", 1100, 16, 14, 1024, (1050, 1099), 1),
    ("vllm", 1100, 16, 15, 540, (600, 1079), 1),
    ("vllm-batch-invariant", 1100, 16, 15, 540, (600, 1079), 1),
    ("vllm", 32, 128, 16, 8192, (16, 31), 4),
    ("sglang-deterministic", 32, 128, 16, 8192, (16, 31), 1),
    ("sglang", 600, 16, 17, 8192, (300, 599), 1),
    ("sglang", 1100, 16, 18, 1024, (1050, 1099), 4),
)

#: (tokens, heads) of the cuBLAS W_UK and W_UV products captured (each engine's call), the first two heads' CRC
CUBLAS_SHAPES = tuple((m, h) for h in (16, 32, 64, 128) for m in (1, 2, 3, 4, 8, 16, 32, 64, 76, 128, 150, 256, 300,
                                                                    512))


def layer_request(tokens: int, *, heads: int = 16, seed: int = 0, weight_scales: str = "ue8m0",
                  scale: float = DEEPSEEK_V3_SCALE, hidden: int | None = HIDDEN) -> LayerInputs:
    """A request's layer inputs drawn from `seed`: q_nope, q_pe, c_kv and k_pe ~ N(0, 1) in BF16 (c_kv as the
    RMSNorm leaves it), kv_b_proj's weight ~ N(0, 0.05^2) quantized in 128 x 128 blocks to E4M3 with `weight_scales`
    ("ue8m0", powers of two as vLLM requantizes them at load; "fp32", as a checkpoint holds them), and o_proj's
    weight (`hidden` rows; None: none) ~ N(0, 0.02^2) quantized alike, from a stream of its own."""
    T, h = check_int(tokens, "tokens", lo=1, hi=MAX_LAYER_TOKENS), check_int(heads, "heads", lo=1, hi=128)
    if weight_scales not in ("ue8m0", "fp32"):
        raise ValueError(f"weight_scales: expected 'ue8m0' or 'fp32', got {weight_scales!r}")
    rng = np.random.default_rng([check_int(seed, "seed", lo=0), 52, 2])
    draw = [round_to(rng.normal(0, 1, shape), "bf16") for shape in
            ((T, h, QK_NOPE), (T, h, QK_ROPE), (T, KV_LORA), (T, QK_ROPE))]
    w, s = quantize_weight_blocks(round_to(rng.normal(0, 0.05, (h * 256, KV_LORA)), "bf16"), weight_scales)
    if hidden is None:
        return LayerInputs(*draw, w, s, scale)
    n = check_int(hidden, "hidden", lo=64, hi=HIDDEN)
    if n % 64:
        raise ValueError(f"hidden: expected a multiple of 64, got {hidden}")
    wo = np.random.default_rng([seed, 52, 3]).standard_normal((n, h * V_HEAD), dtype=np.float32) * np.float32(0.02)
    return LayerInputs(*draw, w, s, scale, *quantize_weight_blocks(round_to(wo, "bf16"), weight_scales))


def case_request(case: tuple, *, hidden: int | None = HIDDEN) -> LayerInputs:
    """A :data:`LAYER_CASES` case's inputs: :func:`layer_request` with the weight scales its engine holds (vLLM:
    requantized to powers of two; SGLang on Hopper: the checkpoint's FP32 ones), o_proj's weight `hidden` rows."""
    name, T, h, seed = case[:4]
    return layer_request(T, heads=h, seed=seed, weight_scales="fp32" if name.startswith("sglang") else "ue8m0",
                         hidden=hidden)


def crc_bits(a: np.ndarray) -> int:
    """CRC-32 of an array's raw bytes, C order."""
    return zlib.crc32(np.ascontiguousarray(a).tobytes())


#: (kind, rows, seed) of vLLM's quantizer check (``scripts/capture_vllm_quant.py``): latents as the layer's requests
#: draw them, N(0, 1) at other magnitudes, and groups at the edges of the scale's rounding
ACT_QUANT_CASES = (("latent", 600, 11), ("normal", 256, 1), ("edges", 64, 2))


def act_quant_inputs(case: tuple) -> np.ndarray:
    """The (rows, 512) BF16 activations of a :data:`ACT_QUANT_CASES` case. "normal": each row N(0, 1) times 2^e, e
    drawn in [-30, 30]; "edges": each group's largest magnitude 448 2^e exactly, a BF16 ULP above or below it, tiny
    (under
    the 1e-10 floor) or zero, its other entries drawn below it."""
    kind, rows, seed = case
    rng = np.random.default_rng([check_int(seed, "seed", lo=0), 52, 3])
    n = check_int(rows, "rows", lo=1)
    if kind == "latent":
        return round_to(rng.normal(0, 1, (n, 512)), "bf16")  # as layer_request draws c_kv (its own stream)
    if kind == "normal":
        return round_to(rng.normal(0, 1, (n, 512)) * np.exp2(rng.integers(-30, 31, (n, 1))), "bf16")
    if kind != "edges":
        raise ValueError(f"case: expected kind latent, normal or edges, got {kind!r}")
    g = rng.uniform(-1, 1, (n, 4, 128))
    e = rng.integers(-40, 12, (n, 4))
    top = 448.0 * np.exp2(e.astype(np.float64)) * rng.choice([1.0, 1 + 2.0 ** -7, 1 - 2.0 ** -8], (n, 4))
    top[rng.random((n, 4)) < 0.08] = 1e-12
    x = g * top[..., None] * 0.999
    x[np.arange(n)[:, None], np.arange(4)[None], rng.integers(0, 128, (n, 4))] = top * rng.choice([-1, 1], (n, 4))
    x[rng.random((n, 4)) < 0.04] = 0.0
    return round_to(x.reshape(n, 512), "bf16")
