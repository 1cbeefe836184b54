"""The absorbed projections' device check (``scripts/capture_bmm.py``) and its replay: the inputs of each case drawn
from a recipe. A case is one absorbed layer's W_UK and W_UV products for T tokens and h heads: q_nope (T, h, 128)
~ N(0, 1), attn (T, h, 512) ~ N(0, 0.25), kv_b_proj's dequantized weight (h * 256, 512) ~ N(0, 0.02^2), all BF16.
"""

from __future__ import annotations

import numpy as np

from .._validate import check_int
from ..formats import round_to

__all__ = ["BMM_CASES", "bmm_inputs", "split_kv_b"]

#: (tokens, heads, seed): decode batches (1 to 64 tokens), a chunk of 300 and a prefill of 1,024, TP8's 16 heads and
#: TP1's 128
BMM_CASES = ((1, 16, 1), (5, 16, 2), (64, 16, 3), (300, 16, 4), (1024, 16, 5), (4, 128, 6))


def bmm_inputs(tokens: int, heads: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q_nope (T, h, 128), attn (T, h, 512) and kv_b_proj's weight (h * 256, 512), BF16 (see the module docstring)."""
    T, h = check_int(tokens, "tokens", lo=1), check_int(heads, "heads", lo=1)
    rng = np.random.default_rng([check_int(seed, "seed", lo=0), 52])
    return (round_to(rng.normal(0, 1, (T, h, 128)), "bf16"), round_to(rng.normal(0, 0.5, (T, h, 512)), "bf16"),
            round_to(rng.normal(0, 0.02, (h * 256, 512)), "bf16"))


def split_kv_b(w: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj's weight (h * 256, 512) -> W_UK (h, 128, 512) and W_UV (h, 512, 128), as both engines split it."""
    kv = w.reshape(heads, 256, 512)
    return np.ascontiguousarray(kv[:, :128]), np.ascontiguousarray(kv[:, 128:].transpose(0, 2, 1))
