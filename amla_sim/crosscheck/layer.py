"""The dense MLA layer's device check (``scripts/capture_layer.py``) and its replay: requests prefilled and decoded by
the real kernels, chained as each engine chains them, and cuBLAS's bmm on the absorbed shapes.

A layer case is a request (:func:`~amla_sim.invariance.dense_layer.layer_request`: its tokens, heads and seed), a mode
(:data:`~amla_sim.algorithms.deployed.mla_layer.LAYER_MODES`), the scheduler's budget and the tokens kept: the
device runs the prefill chunks that hold them and each one's decode, and keeps their layer outputs and stages.
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["CUBLAS_SHAPES", "LAYER_CASES", "crc_bits"]

#: (mode, tokens, heads, seed, budget, tokens kept, decode batch): a 600-token prompt takes the MHA form in vLLM
#: (600 > 512) and the absorbed one in SGLang's deterministic mode; a 300-token prompt the absorbed form in vLLM;
#: 1,100 tokens under a budget of 1,024 leave a second chunk of 76 absorbed over 1,024 of context, under a budget of
#: 540 a second chunk of 540 in the MHA form with a context chunk merged; 128 heads (one GPU holding every head)
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
)

#: (tokens, heads) of the cuBLAS W_UK and W_UV products captured (each engine's call), the first two heads' CRC
CUBLAS_SHAPES = tuple((m, h) for h in (16, 32, 64, 128) for m in (1, 2, 3, 4, 8, 16, 32, 64, 76, 128, 150, 256, 300,
                                                                    512))


def crc_bits(a: np.ndarray) -> int:
    """CRC-32 of an array's raw bytes, C order."""
    return zlib.crc32(np.ascontiguousarray(a).tobytes())
