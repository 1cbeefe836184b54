"""The launches checked on a GPU: per kernel, the request and the launches that ``scripts/capture_invariance.py``
ran on an H200, whose request bits the committed capture ``tests/data/invariance_h200.npz`` holds, and
:func:`device_launches` rebuilds."""

from __future__ import annotations

from typing import Any

from .launches import Launch, variations

import numpy as np

from ..comparison import ComparisonReport, compare

__all__ = ["DEVICE_CHECKS", "device_launches", "scheduler_batches", "replay_invariance"]

#: kernel -> the request (length, heads, dist, seed, the kernel's options) and its launches' settings
DEVICE_CHECKS: dict[str, dict[str, Any]] = {
    "flashmla": {"length": 4096, "heads": 128, "dist": "flashmla", "seed": 5, "batchmates": (1, 3, 7), "mixed": 3,
                 "s_q": (1, 2), "options": {}},
    "flashmla-sparse-fp8": {"length": 2048, "heads": 128, "dist": "flashmla", "seed": 6, "batchmates": (1, 3, 7),
                            "mixed": None, "s_q": (1, 2), "options": {"tokens": 8192}},
    "sglang-triton": {"length": 4096, "heads": 128, "dist": "normal:1", "seed": 7, "batchmates": (1, 3, 7),
                      "mixed": 3, "s_q": (1,), "num_kv_splits": (1, 8), "options": {}},
}


def device_launches(kernel: str, seed_offset: int = 0) -> list[Launch]:
    """The launches of `kernel`'s device check, the first the request alone (`seed_offset`: a fresh check's)."""
    c = DEVICE_CHECKS[kernel]
    return variations(c["length"], batchmates=c["batchmates"], mixed=c["mixed"], s_q=c["s_q"],
                      num_kv_splits=c.get("num_kv_splits", ()), seed=c["seed"] + seed_offset)


def scheduler_batches(n: int = 2000, seed: int = 2026, near: bool = False) -> list[tuple[np.ndarray, int, int]]:
    """Random decode batches (lengths, heads, max_kv_splits) on which SGLang's own split choice was run on the
    GPU: 1 to 299 requests of 1 to 64 .. 163,840 tokens, 16 to 128 heads, max_kv_splits 8, 64 or 256. `near`:
    2 to 299 requests within 10 to 40% of one length (where lengths within 25% count as one)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if near:
            base = int(rng.integers(64, 163841))
            spread = float(rng.choice([0.1, 0.2, 0.25, 0.3, 0.4]))
            lens = rng.integers(max(int(base * (1 - spread)), 1), base + 1, int(rng.integers(2, 300)))
        else:
            b = int(rng.integers(1, 300))
            hi = int(rng.choice([64, 1000, 8192, 65536, 163840]))
            lens = rng.integers(1, hi + 1, b)
        out.append((lens, int(rng.choice([16, 32, 64, 128])), int(rng.choice([8, 64, 256]))))
    return out


_PREFIX = {"flashmla": "flashmla", "flashmla-sparse-fp8": "sparse", "sglang-triton": "sglang"}


def replay_invariance(path: str, kernel: str) -> list[tuple[str, ComparisonReport]]:
    """The device check of `kernel` replayed on the CPU from a capture of ``scripts/capture_invariance.py``: per
    launch, the device's bits of the request against the model's for that launch, predicted from the launch's
    lengths alone (the request simulated on its own under the split plan the scheduler gives it there)."""
    from ..crosscheck.files import CaptureError, read_capture
    from .study import invariance

    if kernel not in DEVICE_CHECKS:
        raise ValueError(f"kernel: the device check covers {sorted(DEVICE_CHECKS)}, not {kernel!r}")
    _, arrays = read_capture(path, what="replay", need_meta=False)
    c = DEVICE_CHECKS[kernel]
    launches = device_launches(kernel)
    report = invariance(kernel, launches=launches, length=c["length"], heads=c["heads"], dist=c["dist"],
                        seed=c["seed"], **c["options"])
    out = []
    for i, r in enumerate(report.results):
        device = {}
        for stage in r.bits:  # every stage the model gives: out, and LSE where the kernel returns one
            key = f"{_PREFIX[kernel]}_l{i}_{stage}"
            if key not in arrays:
                raise CaptureError(f"replay: {path} holds no {key} (launch {r.launch.label!r})")
            device[stage] = arrays[key]
        out.append((r.launch.label, compare(device, r.bits, formats={s: v.dtype for s, v in r.bits.items()},
                                            meta={"kernel": kernel, "launch": r.launch.label,
                                                  "splits": len(r.plan)})))
    return out

