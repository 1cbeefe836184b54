"""The launches checked on a GPU: per kernel, the request and the launches that ``scripts/capture_invariance.py``
ran on an H200, whose request bits the committed capture ``tests/data/invariance_h200.npz`` holds, and
:func:`device_launches` rebuilds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .._validate import check_int
from ..comparison import ComparisonReport, compare
from ..crosscheck.files import CaptureError
from ..formats import get_format
from .launches import Launch, variations

__all__ = ["DEVICE_CHECKS", "device_launches", "scheduler_batches", "replay_invariance", "MAX_SCHEDULER_BATCHES"]

#: The most random batches :func:`scheduler_batches` draws (the device check ran 2,000 of each kind).
MAX_SCHEDULER_BATCHES = 100_000

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
    if kernel == "flashinfer-mla":
        raise ValueError("kernel: flashinfer-mla's device check rebuilds its launches from its capture's meta "
                         "(amla_sim.invariance.flashinfer.replay_flashinfer)")
    if not isinstance(kernel, str) or kernel not in DEVICE_CHECKS:
        raise ValueError(f"kernel: the device check covers {sorted(DEVICE_CHECKS)}, not {kernel!r:.60}")
    c = DEVICE_CHECKS[kernel]
    return variations(c["length"], batchmates=c["batchmates"], mixed=c["mixed"], s_q=c["s_q"],
                      num_kv_splits=c.get("num_kv_splits", ()), seed=c["seed"] + seed_offset)


def scheduler_batches(n: int = 2000, seed: int = 2026, near: bool = False) -> list[tuple[np.ndarray, int, int]]:
    """Random decode batches (lengths, heads, max_kv_splits) on which SGLang's own split choice was run on the
    GPU: 1 to 299 requests of 1 to 64 .. 163,840 tokens, 16 to 128 heads, max_kv_splits 8, 64 or 256. `near`:
    2 to 299 requests within 10 to 40% of one length (where lengths within 25% count as one). At most
    :data:`MAX_SCHEDULER_BATCHES` batches."""
    check_int(n, "n", lo=0, hi=MAX_SCHEDULER_BATCHES)
    check_int(seed, "seed", lo=0)
    if not isinstance(near, (bool, np.bool_)):
        raise TypeError(f"near: expected True or False, got {near!r:.60}")
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


def replay_invariance(path: str | Path, kernel: str) -> list[tuple[str, ComparisonReport]]:
    """The device check of `kernel` replayed on the CPU from a capture of ``scripts/capture_invariance.py``: per
    launch, the device's bits of the request against the model's for that launch, predicted from the launch's
    lengths alone (the request simulated on its own under the split plan the scheduler gives it there).

    Every array the replay reads is checked (its name, shape and format) before the models run; an error names
    the file and the launch. Stages may be raw bits or the format itself, BF16 also as ``np.save`` writes it
    (void words, dtype ``|V2``), as :func:`amla_sim.compare` reads them."""
    from ..crosscheck.files import read_capture
    from .registry import get_batch_kernel
    from .study import invariance

    if kernel == "flashinfer-mla":  # its check has a replay of its own (the launches rebuilt from its meta)
        from .flashinfer import replay_flashinfer

        return replay_flashinfer(path)
    if not isinstance(kernel, str) or kernel not in DEVICE_CHECKS:
        raise ValueError(f"kernel: the device check covers {sorted(DEVICE_CHECKS)}, not {kernel!r}")
    if not isinstance(path, (str, Path)):
        raise TypeError(f"replay: expected a capture file's path, got {path!r:.60}")
    _, arrays = read_capture(path, what="replay", need_meta=False)
    c = DEVICE_CHECKS[kernel]
    launches = device_launches(kernel)
    stages = get_batch_kernel(kernel).stages
    device = [_launch_bits(arrays, path, kernel, i, L, stages, c["heads"]) for i, L in enumerate(launches)]
    report = invariance(kernel, launches=launches, length=c["length"], heads=c["heads"], dist=c["dist"],
                        seed=c["seed"], **c["options"])
    out = []
    for i, (r, dev) in enumerate(zip(report.results, device)):
        try:
            rep = compare(dev, r.bits, formats={s: v.dtype for s, v in r.bits.items()},
                          meta={"kernel": kernel, "launch": r.launch.label, "splits": len(r.plan)})
        except (ValueError, TypeError) as e:
            raise CaptureError(f"replay: {path}: launch {i} ({r.launch.label!r}): {e}") from None
        out.append((r.launch.label, rep))
    return out


def _launch_bits(arrays: dict[str, np.ndarray], path: str | Path, kernel: str, i: int, launch: Launch,
                 stages: dict[str, str], heads: int) -> dict[str, np.ndarray]:
    """The device's stages of launch `i` in the capture, checked: the row of interest's out (heads, 512) and
    LSE (heads,) where the kernel returns one, each as raw bits of its format or the format itself."""
    got = {}
    for stage, fmt in stages.items():
        key = f"{_PREFIX[kernel]}_l{i}_{stage}"
        where = f"replay: {path}: {key} (launch {i}, {launch.label!r})"
        if key not in arrays:
            raise CaptureError(f"replay: {path} holds no {key} (launch {i}, {launch.label!r})")
        a = arrays[key]
        if a.dtype.kind == "V":  # np.save writes ml_dtypes' types as void words: the bits they are
            a = a.view(f"u{a.dtype.itemsize}")
        f = get_format(fmt)
        if not (a.dtype == f.dtype or (a.dtype.kind in "iu" and a.dtype.itemsize == f.dtype.itemsize)):
            raise CaptureError(f"{where}: expected {f.name} or its {8 * f.dtype.itemsize}-bit words, got {a.dtype}")
        want = (heads, 512) if stage == "out" else (heads,)
        if a.shape != want:
            raise CaptureError(f"{where}: expected shape {want}, got {a.shape}")
        got[stage] = a
    return got
