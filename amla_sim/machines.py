"""Machines: how a piece of hardware rounds, multiplies, accumulates, exponentiates, divides, reduces and adds.

Algorithms see hardware only through a :class:`Machine`; swap the machine and the same algorithm runs as the FP64
golden reference, as IEEE FP32, as Hopper under Triton, or as a (parametric, unverified) Ascend 910. A machine is
data (the parameter table below, each row with its source) plus the small methods algorithms call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from . import _blas_clock
from .arith import elementwise as ew
from .arith import logarithm as _log
from .arith import mma as _mma
from .arith.memory import GlobalMemory
from .arith.reductions import row_sum
from .formats import FormatLike, get_format, round_to

__all__ = ["Machine", "MACHINES", "get_machine"]


@dataclass(frozen=True)
class Machine:
    """A hardware profile. Build a custom one with ``dataclasses.replace(get_machine("ieee32"), ...)``.

    golden: FP64 everywhere, and casts to storage formats do nothing (the exact mathematics).
    mma_model: a model of :mod:`amla_sim.arith.mma` (ignored on golden). exp_mode / div_mode: modes of
    :mod:`amla_sim.arith.elementwise`. contraction: ``a * b + c`` is one FMA. reduce_order: the row-sum order.
    reduce_layout: (vec, lanes, warps) of a ``triton`` reduction (None: Triton's blocked layout of the row).
    pad_blocks: the last KV block is padded to full size (zero keys, masked), as a kernel does.
    fp8_overflow: what FP32 -> FP8 casts do with overflow. dot_k: K extent of one ``tl.dot``.
    atomic_order: the writers' arrival order in global memory. amla_guard: AMLA's ``+1e-6`` in N.
    """

    name: str
    golden: bool = False
    mma_model: str = "exact"
    exp_mode: Literal["correctly-rounded", "sm90", "poly", "numpy-fast"] = "correctly-rounded"
    div_mode: Literal["ieee", "sm90"] = "ieee"
    log_mode: Literal["correctly-rounded", "sm90", "numpy-fast"] | None = "correctly-rounded"
    log2_mode: Literal["correctly-rounded", "sm90"] | None = "correctly-rounded"
    contraction: bool = False
    reduce_order: Literal["sequential", "pairwise", "triton", "numpy"] = "sequential"
    reduce_layout: tuple[int, int, int] | None = None
    pad_blocks: bool = False
    fp8_overflow: Literal["ieee", "satfinite"] = "satfinite"
    dot_k: int | None = None
    atomic_order: Literal["program", "reversed", "random"] = "program"
    amla_guard: float = 1e-6
    verified: bool = True
    source: str = ""

    # --- numbers -----------------------------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        """The working float type: float64 on golden, float32 elsewhere."""
        return np.dtype(np.float64 if self.golden else np.float32)

    def f(self, x: npt.ArrayLike) -> np.ndarray:
        """`x` in the working float type (exact for every storage format)."""
        if isinstance(x, np.ndarray) and x.dtype == self.dtype:
            return x
        with np.errstate(invalid="ignore"):
            return np.asarray(x, dtype=self.dtype)  # no copy when it already is

    def cast(self, x: npt.ArrayLike, fmt: FormatLike, *, overflow: str | None = None) -> np.ndarray:
        """Round to a storage format (nearest even); FP8 overflow as the machine does. Golden: no rounding."""
        if self.golden:
            return self.f(x)
        f = get_format(fmt)
        ov = overflow or (self.fp8_overflow if f.bits == 8 else "ieee")
        return round_to(np.asarray(x), f, overflow=ov)

    # --- arithmetic --------------------------------------------------------------------------------------

    def operand(self, x: npt.ArrayLike) -> np.ndarray:
        """`x` as the matrix unit reads it: float32 for the ``blas`` model (every storage format converts exactly,
        so converting once ahead changes nothing), `x` itself for the bit-level models, which need its format."""
        if not self.golden and self.mma_model == "blas":
            return np.asarray(x, dtype=np.float32)
        return np.asarray(x)

    def matmul(self, a: npt.ArrayLike, b: npt.ArrayLike, acc: npt.ArrayLike | None = None) -> np.ndarray:
        """``acc + a @ b`` on the machine's matrix unit."""
        if self.golden:
            out = _blas_clock.matmul(self.f(a), self.f(b))
            return out if acc is None else out + self.f(acc)
        a, b = self.operand(a), self.operand(b)
        return _mma.matmul(a, b, None if acc is None else self.f(acc), model=self.mma_model, dot_k=self.dot_k)

    def exp(self, x: npt.ArrayLike) -> np.ndarray:
        if self.golden:
            return np.exp(self.f(x))
        return ew.exp(self.f(x), mode=self.exp_mode)

    def exp2(self, x: npt.ArrayLike) -> np.ndarray:
        if self.golden:
            return np.exp2(self.f(x))
        return ew.exp2(self.f(x), mode=self.exp_mode)

    def log(self, x: npt.ArrayLike) -> np.ndarray:
        """Natural log (Triton's ``tl.log``)."""
        if self.golden:
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.log(self.f(x))
        if self.log_mode is None:
            raise ValueError(f"machine: {self.name} has no model of its natural log")
        return _log.log(self.f(x), mode=self.log_mode)

    def log2(self, x: npt.ArrayLike) -> np.ndarray:
        """log2 (CUDA's ``log2f``; under ``--use_fast_math``: ``lg2.approx.ftz``)."""
        xf = self.f(x)
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.golden or self.log2_mode == "correctly-rounded":
                return np.log2(xf.astype(np.float64)).astype(self.dtype)
        if self.log2_mode == "sm90":
            return _log.lg2_approx(xf, ftz=True)
        raise ValueError(f"machine: {self.name} has no model of its log2 (Triton's tl.log2 is libdevice's log2f, "
                         "not modelled)")

    def div(self, a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
        if self.golden:
            with np.errstate(divide="ignore", invalid="ignore"):
                return self.f(a) / self.f(b)
        return ew.div(self.f(a), self.f(b), mode=self.div_mode)

    def mul_add(self, a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike) -> np.ndarray:
        """``a * b + c``: one FMA where the compiler contracts it, two roundings elsewhere."""
        a, b, c = np.broadcast_arrays(self.f(a), self.f(b), self.f(c))
        if self.golden or not self.contraction:
            with np.errstate(invalid="ignore", over="ignore"):
                return a * b + c
        return ew.fma(a, b, c)

    def rowsum(self, x: npt.ArrayLike, *, layout: tuple[int, int, int] | None = None) -> np.ndarray:
        """Sum along the last axis in the machine's order (`layout` overrides the machine's Triton layout)."""
        xf = self.f(x)
        if self.golden or self.reduce_order == "numpy":
            return np.sum(xf, axis=-1)
        if self.reduce_order == "triton" and xf.shape[-1] & (xf.shape[-1] - 1):
            # a partial block: Triton pads to a power of two with zeros, which change no sum
            n = 1 << int(xf.shape[-1] - 1).bit_length()
            xf = np.concatenate([xf, np.zeros((*xf.shape[:-1], n - xf.shape[-1]), xf.dtype)], axis=-1)
        return row_sum(xf, order=self.reduce_order, layout=layout or self.reduce_layout)

    def rowmax(self, x: npt.ArrayLike) -> np.ndarray:
        return np.max(self.f(x), axis=-1)

    def memory(self, data: npt.ArrayLike, *, seed: int | None = None) -> GlobalMemory:
        """A global-memory buffer of the machine's working type."""
        order = self.atomic_order
        return GlobalMemory(self.f(data), order=order, seed=(seed or 0) if order == "random" else None)


_SM90 = (
    "tests/data (H200 and H100 captures): MMA 100% of 272 Triton dots; exp via fl32(x*log2e) then ex2.approx "
    "(100%); '/' = div.full (100%); FMA contraction 100%; tl.sum order 100%; fp8 casts satfinite"
)

MACHINES: dict[str, Machine] = {
    "golden": Machine("golden", golden=True, amla_guard=0.0, source="FP64 mathematics, no storage rounding"),
    "ieee32": Machine("ieee32", mma_model="exact", source="IEEE FP32, BF16 matmul inputs, exact MMA, correctly rounded exp"),
    "ieee32-fast": Machine(
        "ieee32-fast", mma_model="blas", exp_mode="numpy-fast", log_mode="numpy-fast", reduce_order="numpy", source="ieee32 with BLAS and NumPy exp, for sweeps"
    ),
    "sm90-triton": Machine(
        "sm90-triton",
        mma_model="sm90",
        exp_mode="sm90",
        div_mode="sm90",
        log_mode="sm90",
        log2_mode=None,
        contraction=True,
        reduce_order="triton",
        reduce_layout=(2, 4, 1),  # P in the wgmma accumulator layout: 2 adjacent columns a thread, 4 a row
        pad_blocks=True,
        source=_SM90,
    ),
    "sm90-triton-exact": Machine(
        "sm90-triton-exact",
        mma_model="sm90",
        exp_mode="poly",
        div_mode="ieee",
        log_mode="sm90",  # tl.log is libdevice's logf, FP32 FMAs, in both kernel modes
        log2_mode=None,
        contraction=True,
        reduce_order="triton",
        reduce_layout=(2, 4, 1),
        pad_blocks=True,
        source="amla_sim.gpu kernels in exact mode: software exp (FP32 FMA polynomial) and div_rn; " + _SM90,
    ),
    "sm90-cuda": Machine(
        "sm90-cuda",
        mma_model="sm90",
        exp_mode="sm90",  # exp2f under --use_fast_math: ex2.approx.ftz
        div_mode="sm90",  # '/' under --use_fast_math: x * MUFU.RCP(y), the same bits as div.full for normal y
        log_mode=None,
        log2_mode="sm90",  # log2f under --use_fast_math: lg2.approx.ftz
        contraction=True,
        source="CUDA C++ built with nvcc --use_fast_math for sm_90a (FlashMLA): wgmma as the sm90 row, MUFU exp2, "
               "log2 and reciprocal, FMA contraction; 100% of FlashMLA's out and LSE bits (tests/data/flashmla_decode.npz)",
    ),
    "ascend910": Machine(
        "ascend910", mma_model="ascend910", verified=False, source="parametric, UNVERIFIED: no public bit-level model"
    ),
}


def get_machine(machine: str | Machine, **overrides: object) -> Machine:
    """A named machine (or a Machine passed through), with optional field overrides."""
    if isinstance(machine, Machine):
        m = machine
    elif isinstance(machine, str) and machine in MACHINES:
        m = MACHINES[machine]
    else:
        raise ValueError(f"machine: unknown machine {machine!r}; expected one of {sorted(MACHINES)}")
    return replace(m, **overrides) if overrides else m
