"""GPU backend: the algorithms as Triton kernels on an H100/H200 (optional: ``pip install amla-sim[gpu]``).

Importing :mod:`amla_sim` never needs torch. This package imports torch and triton lazily; without them (or
without a CUDA device) :func:`require_gpu` raises :class:`GPUUnavailable` with a message that says what is missing.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["GPUUnavailable", "require_gpu", "gpu_status", "to_torch"]


class GPUUnavailable(RuntimeError):
    """torch, triton or a CUDA device is missing."""


def gpu_status() -> str | None:
    """None when torch, triton and a CUDA device are all there; otherwise what is missing."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'amla-sim[gpu]')"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'amla-sim[gpu]')"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return None


def require_gpu() -> None:
    """Raise GPUUnavailable with a clear message unless the GPU backend can run."""
    why = gpu_status()
    if why is not None:
        raise GPUUnavailable(f"the GPU backend cannot run: {why}")


def to_torch(x: npt.ArrayLike, device: str = "cuda"):
    """A NumPy or ml_dtypes array as a torch tensor of the same bits on `device` (BF16 and FP8 through an integer
    view: torch does not read ml_dtypes)."""
    import ml_dtypes
    import torch

    arr = np.ascontiguousarray(np.asarray(x))
    special = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn,
               np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2}
    if arr.dtype in special:
        ints = {1: np.int8, 2: np.int16}[arr.dtype.itemsize]
        return torch.from_numpy(arr.view(ints).copy()).to(device).view(special[arr.dtype])
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"x: expected a numeric array, got dtype {arr.dtype}")
    return torch.from_numpy(arr.copy()).to(device)
