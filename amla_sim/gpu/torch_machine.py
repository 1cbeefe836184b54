"""A machine whose units run as PyTorch ops on a torch device (``cuda``, ``cpu``; ``npu`` with torch_npu).

Matrix products widen their BF16/FP16/FP8 operands to FP32 (exactly) and run an FP32 GEMM: the FP32 accumulation
of an attention kernel, in the device library's own summation order.

The algorithms of :mod:`amla_sim.algorithms` keep their control flow and their elementwise IEEE FP32 arithmetic
(which every device computes alike); what differs between devices goes through torch units: matrix products
(cuBLAS / the NPU's Cube), exp, division, row sums, and the casts to BF16/FP16/FP8 (maxima are exact everywhere).
So the same algorithm code, op by op, tells what plain PyTorch on that device computes. ``npu`` is untested on
hardware here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..formats import Format
from ..machines import Machine
from ..units import CastUnit, DivUnit, ExpUnit, MatrixUnit, ReduceUnit
from . import to_torch

__all__ = ["torch_machine", "TorchMatrix", "TorchExp", "TorchDiv", "TorchReduce", "TorchCast"]


def _torch():
    import torch

    return torch


def _np(t, like: npt.DTypeLike = np.float32) -> np.ndarray:
    """A tensor's bits back in NumPy (BF16/FP8 as ml_dtypes `like`)."""
    torch = _torch()
    t = t.detach().cpu()
    if t.dtype in (torch.float32, torch.float64, torch.float16):
        return t.numpy()
    ints = {1: torch.int8, 2: torch.int16}[t.element_size()]
    return t.view(ints).numpy().view(np.dtype(like))


@dataclass(frozen=True)
class TorchMatrix(MatrixUnit):
    """``torch.matmul`` of the operands widened (exactly) to FP32: an FP32 GEMM (TF32 off, torch's default)."""

    columnwise = False  # cuBLAS picks its kernel, and so its summation order, by the shape

    device: str = "cpu"

    def matmul(self, a: np.ndarray, b: np.ndarray, acc: np.ndarray | None = None, *,
               dot_k: int | None = None) -> np.ndarray:
        torch = _torch()
        # torch.matmul of BF16 operands returns BF16; attention kernels accumulate in FP32
        out = torch.matmul(to_torch(a, self.device).to(torch.float32), to_torch(b, self.device).to(torch.float32))
        if acc is not None:
            out = out + to_torch(acc, self.device)
        return _np(out)


@dataclass(frozen=True)
class TorchExp(ExpUnit):
    """``torch.exp`` / ``torch.exp2`` on the device."""

    device: str = "cpu"

    def exp(self, x: np.ndarray) -> np.ndarray:
        return _np(_torch().exp(to_torch(x, self.device)))

    def exp2(self, x: np.ndarray) -> np.ndarray:
        return _np(_torch().exp2(to_torch(x, self.device)))


@dataclass(frozen=True)
class TorchDiv(DivUnit):
    """Tensor ``/`` on the device."""

    device: str = "cpu"

    def div(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = np.broadcast_arrays(a, b)
        return _np(to_torch(a, self.device) / to_torch(b, self.device))


@dataclass(frozen=True)
class TorchReduce(ReduceUnit):
    """``Tensor.sum(dim=-1)`` on the device, in its library's order (a schedule's layout does not apply)."""

    device: str = "cpu"

    def rowsum(self, x: np.ndarray, *, layout: tuple[int, int, int] | None = None) -> np.ndarray:
        return _np(to_torch(x, self.device).sum(dim=-1))


@dataclass(frozen=True)
class TorchCast(CastUnit):
    """``Tensor.to`` a torch float type (FP8 ``satfinite``: clamped to the format's range first)."""

    device: str = "cpu"

    def cast(self, x: np.ndarray, fmt: Format, *, overflow: str | None = None) -> np.ndarray:
        torch = _torch()
        tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "e4m3": torch.float8_e4m3fn,
               "e5m2": torch.float8_e5m2}[fmt.name]
        t = to_torch(np.asarray(x, dtype=np.float32), self.device)
        if self.overflow(fmt, overflow) == "satfinite":
            t = torch.clamp(t, -fmt.max_finite, fmt.max_finite)
        return _np(t.to(tdt), fmt.dtype)


def torch_machine(device: str = "cuda") -> Machine:
    """The torch-op machine on `device`; a clear error when torch (or the device) is missing."""
    from . import GPUUnavailable

    try:
        import torch
    except ImportError:
        raise GPUUnavailable("the torch-op machine needs torch (pip install 'amla-sim[gpu]')") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GPUUnavailable("device: no CUDA device is visible to torch")
    if device.startswith("npu"):
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise GPUUnavailable("device: 'npu' needs torch_npu") from None
    return Machine(f"torch-{device}", matrix=TorchMatrix(device=device), exponential=TorchExp(device=device),
                   division=TorchDiv(device=device), reduction=TorchReduce(device=device),
                   casts=TorchCast(device=device), source=f"PyTorch ops on {device}")
