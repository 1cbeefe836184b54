"""The dense MLA layer's device check (``scripts/capture_layer.py``) and its replay: requests prefilled and decoded by
the real kernels, chained as each engine chains them, and cuBLAS's bmm on the absorbed shapes.

A layer case is a request (:func:`~amla_sim.invariance.dense_layer.layer_request`: its tokens, heads and seed), a mode
(:data:`~amla_sim.algorithms.deployed.mla_layer.LAYER_MODES`), the scheduler's budget and the tokens kept: the
device runs the prefill chunks that hold them and each one's decode, and keeps their layer outputs and stages.
"""

from __future__ import annotations

import zlib

import numpy as np

from .._validate import check_int
from ..formats import round_to

__all__ = ["CUBLAS_SHAPES", "LAYER_CASES", "crc_bits"]

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


def case_request(case: tuple):
    """A :data:`LAYER_CASES` case's inputs: :func:`~amla_sim.invariance.dense_layer.layer_request` with the weight
    scales its engine holds (vLLM: requantized to powers of two; SGLang on Hopper: the checkpoint's FP32 ones)."""
    from ..invariance.dense_layer import layer_request

    name, T, h, seed = case[:4]
    return layer_request(T, heads=h, seed=seed, weight_scales="fp32" if name.startswith("sglang") else "ue8m0")


def crc_bits(a: np.ndarray) -> int:
    """CRC-32 of an array's raw bytes, C order."""
    return zlib.crc32(np.ascontiguousarray(a).tobytes())


#: (kind, rows, seed) of vLLM's quantizer check (``scripts/capture_vllm_quant.py``): latents as the layer's requests
#: draw them, N(0, 1) at other magnitudes, and groups at the edges of the scale's rounding
QUANT_CASES = (("latent", 600, 11), ("normal", 256, 1), ("edges", 64, 2))


def quant_inputs(case: tuple) -> np.ndarray:
    """The (rows, 512) BF16 activations of a :data:`QUANT_CASES` case. "normal": each row N(0, 1) times 2^e, e drawn
    in [-30, 30]; "edges": each group's largest magnitude 448 2^e exactly, a BF16 ULP above or below it, tiny (under
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
