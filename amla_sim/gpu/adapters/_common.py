"""What the adapters share: raw bits as CUDA tensors, a contiguous cache as FlashMLA's pages, an extension built
by its folder's build script."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np

from .. import require_gpu, to_torch

__all__ = ["bits16", "paged", "load_built"]


def bits16(torch, bits: np.ndarray, fmt: str = "bf16"):
    """BF16 (or FP16, `fmt`) bits, as uint16 or the float type, as a CUDA tensor."""
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    return to_torch(np.ascontiguousarray(bits).view(np.int16), "cuda").view(dtype)


def paged(torch, kv_bits: np.ndarray, fmt: str = "bf16"):
    """A (b, S_max, 576) cache as pages of 64 tokens (num_blocks, 64, 1, 576), zero past S_max, and its block
    table (request i owns pages i * n .. i * n + n - 1)."""
    b, L, d = kv_bits.shape
    nblk = -(-L // 64)
    kpad = np.zeros((b, nblk * 64, d), np.uint16)
    kpad[:, :L] = kv_bits.view(np.uint16)
    kc = bits16(torch, kpad, fmt).view(b * nblk, 64, 1, d)
    return kc, torch.arange(b * nblk, dtype=torch.int32, device="cuda").view(b, nblk)


def load_built(folder: str | Path, script: str, kernel: str):
    """The extension that `folder`/`script` builds (its ``build()``)."""
    require_gpu()
    folder = Path(folder)
    if not (folder / script).is_file():
        raise FileNotFoundError(f"{kernel}: {folder} has no {script}")
    sys.path.insert(0, str(folder))
    try:
        build = importlib.import_module(Path(script).stem).build
    finally:
        sys.path.remove(str(folder))
    return build()
