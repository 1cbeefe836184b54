"""GPU backend: the algorithms as Triton kernels on an H100/H200 (optional: ``pip install amla-sim[gpu]``).

Importing :mod:`amla_sim` never needs torch. This package imports torch and triton lazily; without them (or
without a CUDA device) :func:`require_gpu` raises :class:`GPUUnavailable` with a message that says what is missing.
"""

from __future__ import annotations

__all__ = ["GPUUnavailable", "require_gpu", "gpu_status"]


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
