"""A machine whose primitives run as PyTorch ops on a torch device (``cuda``, ``cpu``; ``npu`` with torch_npu).

Matrix products widen their BF16/FP16/FP8 operands to FP32 (exactly) and run an FP32 GEMM: the FP32 accumulation
of an attention kernel, in the device library's own summation order.

The algorithms of :mod:`amla_sim.algorithms` keep their control flow and their elementwise IEEE FP32 arithmetic
(which every device computes alike); what differs between devices goes through torch: matrix products
(cuBLAS / the NPU's Cube), exp, division, row sums and maxima, and the casts to BF16/FP16/FP8. So the same
algorithm code, op by op, tells what plain PyTorch on that device computes. ``npu`` is untested on hardware here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..formats import FormatLike, get_format
from ..machines import Machine
from . import to_torch

__all__ = ["TorchMachine", "torch_machine"]


@dataclass(frozen=True)
class TorchMachine(Machine):
    """Machine primitives as torch ops on `device` (BF16/FP16/FP8 kept in their torch dtypes)."""

    device: str = "cpu"

    def _torch(self):
        import torch

        return torch

    def _t(self, x: npt.ArrayLike):
        """A NumPy or ml_dtypes array as a tensor of the same bits on the device."""
        return to_torch(x, self.device)

    def _np(self, t, like: npt.DTypeLike = np.float32) -> np.ndarray:
        torch = self._torch()
        t = t.detach().cpu()
        if t.dtype in (torch.float32, torch.float64, torch.float16):
            return t.numpy()
        ints = {1: torch.int8, 2: torch.int16}[t.element_size()]
        return t.view(ints).numpy().view(np.dtype(like))

    def cast(self, x: npt.ArrayLike, fmt: FormatLike, *, overflow: str | None = None) -> np.ndarray:
        torch = self._torch()
        f = get_format(fmt)
        tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "e4m3": torch.float8_e4m3fn,
               "e5m2": torch.float8_e5m2}[f.name]
        t = self._t(self.f(x))
        if (overflow or (self.fp8_overflow if f.bits == 8 else "ieee")) == "satfinite":
            t = torch.clamp(t, -f.max_finite, f.max_finite)
        return self._np(t.to(tdt), f.dtype)

    def matmul(self, a: npt.ArrayLike, b: npt.ArrayLike, acc: npt.ArrayLike | None = None) -> np.ndarray:
        torch = self._torch()
        # torch.matmul of BF16 operands returns BF16; attention kernels accumulate in FP32, so the operands are
        # widened (exactly) and multiplied by an FP32 GEMM (TF32 left off, torch's default for matmul)
        ta, tb = self._t(a).to(torch.float32), self._t(b).to(torch.float32)
        out = torch.matmul(ta, tb)
        if acc is not None:
            out = out + self._t(self.f(acc))
        return self._np(out)

    def exp(self, x: npt.ArrayLike) -> np.ndarray:
        return self._np(self._torch().exp(self._t(self.f(x))))

    def exp2(self, x: npt.ArrayLike) -> np.ndarray:
        return self._np(self._torch().exp2(self._t(self.f(x))))

    def div(self, a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
        a, b = np.broadcast_arrays(self.f(a), self.f(b))
        return self._np(self._t(a) / self._t(b))

    def rowsum(self, x: npt.ArrayLike, *, layout: tuple[int, int, int] | None = None) -> np.ndarray:
        return self._np(self._t(self.f(x)).sum(dim=-1))

    def rowmax(self, x: npt.ArrayLike) -> np.ndarray:
        return self._np(self._t(self.f(x)).amax(dim=-1))


def torch_machine(device: str = "cuda") -> TorchMachine:
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
    return TorchMachine(f"torch-{device}", mma_model="exact", source=f"PyTorch ops on {device}", device=device)
