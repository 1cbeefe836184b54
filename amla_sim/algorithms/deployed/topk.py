"""The gather of a sparse MLA call over a cache of one-token pages: each query token's keys are the cache rows its
top-k list names, read through the list as a page table. FA3's sparse call
(:mod:`amla_sim.algorithms.deployed.fa3.sparse`) and vLLM's FlashInfer sparse call
(:mod:`amla_sim.algorithms.deployed.flashinfer.sparse`) both run their dense kernel over these rows."""

from __future__ import annotations

import numpy as np

__all__ = ["sparse_rows"]


def sparse_rows(kv_cache: np.ndarray, indices: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Each token's keys as the kernel gathers them: (T, w, d), the first ``valid[t]`` rows of token t the cache
    rows its first ``valid[t]`` slots name, zeros past them. The kernels read no slot past a token's count, so w is
    the longest count (at least 1), not the list's width: a 400-token prefill at topk 2048 gathers a fifth."""
    width = max(1, int(np.max(valid, initial=0)))
    keys = np.zeros((indices.shape[0], width, kv_cache.shape[-1]), kv_cache.dtype)
    take = np.arange(width)[None, :] < valid[:, None]
    keys[take] = kv_cache[indices[:, :width][take]]
    return keys
