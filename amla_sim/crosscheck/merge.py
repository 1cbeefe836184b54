"""The merges' inputs for a device check (``scripts/capture_merges.py``) and its replay: partial attention states of a
chunked prefill drawn from a recipe, with the rows the kernels treat apart.

Each partial is an output (T, h, d) BF16 and an LSE (T, h) FP32. Token t's LSEs follow ``t % 8``: 0 drawn, 1 the
first partial empty (-inf), 2 the second empty, 3 both empty, 4 the first +inf (FA2's empty row), 5 and 6 the first
100 and 88 below the second (``expf`` of them subnormal, or flushed by a fast-math build), 7 the two equal. A
partial past the second takes drawn LSEs only.
"""

from __future__ import annotations

import numpy as np

from .._validate import check_int
from ..formats import round_to

__all__ = ["merge_inputs", "MERGE_CASES", "TRITON_MERGE_CASES"]

#: (tokens, heads, head size, partials, seed): the device check's cases
MERGE_CASES = ((64, 8, 128, 2, 1), (48, 8, 128, 4, 3), (32, 8, 512, 3, 4))
#: the Triton fallbacks' cases (the first two partials merged once): the CUDA kernels' shapes and a head size that
#: is not a multiple of 8, which only the fallbacks take
TRITON_MERGE_CASES = ((64, 8, 128, 2, 1), (32, 8, 512, 3, 4), (40, 4, 100, 2, 5))


def merge_inputs(tokens: int, heads: int, head_size: int, partials: int, seed: int
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`partials` outputs (T, h, d) BF16 and LSEs (T, h) FP32, drawn from `seed` (see the module docstring)."""
    T, h, d = (check_int(v, n, lo=1) for v, n in ((tokens, "tokens"), (heads, "heads"), (head_size, "head_size")))
    check_int(partials, "partials", lo=2)
    rng = np.random.default_rng([check_int(seed, "seed", lo=0), 61])
    outs = [round_to(rng.normal(0, 0.5, (T, h, d)), "bf16") for _ in range(partials)]
    lses = [rng.normal(5.0, 3.0, (T, h)).astype(np.float32) for _ in range(partials)]
    kind = np.arange(T) % 8
    p, s = lses[0], lses[1]
    p[kind == 1] = -np.inf
    s[kind == 2] = -np.inf
    p[kind == 3] = s[kind == 3] = -np.inf
    p[kind == 4] = np.inf
    p[kind == 5] = s[kind == 5] - np.float32(100)
    p[kind == 6] = s[kind == 6] - np.float32(88)
    p[kind == 7] = s[kind == 7]
    return outs, lses
