"""The launches checked on a GPU: per kernel, the request and the launches that ``scripts/capture_invariance.py``
ran on an H100/H200, which the committed capture ``tests/data/invariance_h100.npz`` holds the request's bits
of, and :func:`device_launches` rebuilds."""

from __future__ import annotations

from typing import Any

from .launches import Launch, variations

__all__ = ["DEVICE_CHECKS", "device_launches"]

#: kernel -> the request (length, heads, dist, seed, the kernel's options) and its launches' settings
DEVICE_CHECKS: dict[str, dict[str, Any]] = {
    "flashmla": {"length": 4096, "heads": 128, "dist": "flashmla", "seed": 5, "batchmates": (1, 3, 7), "mixed": 3,
                 "s_q": (1, 2), "options": {}},
    "flashmla-sparse-fp8": {"length": 2048, "heads": 128, "dist": "flashmla", "seed": 6, "batchmates": (1, 3, 7),
                            "mixed": None, "s_q": (1, 2), "options": {"tokens": 8192}},
    "sglang-triton": {"length": 4096, "heads": 128, "dist": "normal:1", "seed": 7, "batchmates": (1, 3, 7),
                      "mixed": 3, "s_q": (1,), "num_kv_splits": (1, 8), "options": {}},
}


def device_launches(kernel: str) -> list[Launch]:
    """The launches of `kernel`'s device check, the first the request alone."""
    c = DEVICE_CHECKS[kernel]
    return variations(c["length"], batchmates=c["batchmates"], mixed=c["mixed"], s_q=c["s_q"],
                      num_kv_splits=c.get("num_kv_splits", ()), seed=c["seed"])
