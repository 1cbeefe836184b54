"""Unit models: the pieces a machine is made of, one job each, each a named model with its source.

A :class:`~amla_sim.machines.Machine` composes one of each: the matrix unit (a row of the tensor-core table), exp,
division, logarithms, multiply-add contraction, row reductions, casts to storage formats and global memory. Every
unit takes arrays already in the machine's working type (FP32, or FP64 on the golden machine) and has an ``fp64``
model (or its equivalent) that computes the exact mathematics in float64: the golden machine is those units, the
torch machine (:mod:`amla_sim.gpu.torch_machine`) is torch units, and a what-if machine swaps one unit::

    get_machine("sm90-triton", division=DivUnit("ieee"))

Where work is laid out (block padding, the layout a row sum runs in, the K extent of one ``tl.dot``) is not a unit
but the kernel's :class:`~amla_sim.schedules.Schedule`; those facts arrive here as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from . import _blas_clock
from .arith import elementwise as ew
from .arith import logarithm as _log
from .arith import mma as _mma
from .arith.memory import GlobalMemory
from .arith.reductions import row_sum
from .formats import Format, flush_subnormals, round_to

__all__ = ["MatrixUnit", "ExpUnit", "DivUnit", "LogUnit", "FMAUnit", "ReduceUnit", "CastUnit", "MemoryUnit"]


def _check_mode(unit: str, argname: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{argname}: {unit} expects one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class MatrixUnit:
    """``acc + a @ b``. model: a row of :data:`amla_sim.arith.mma.MODEL_TABLE` (``sm90``, ``exact``, ``blas``,
    ...; or an :class:`~amla_sim.arith.mma.MMAModel` of your own) or ``fp64`` (FP64 BLAS: the mathematics)."""

    model: str | _mma.MMAModel = "exact"

    def __post_init__(self) -> None:
        if self.model != "fp64":
            _mma.get_model(self.model)  # an unknown name is an error naming `model`

    def operand(self, x: np.ndarray) -> np.ndarray:
        """`x` as the unit reads it: float32 for ``blas``, float64 for ``fp64`` (both exact for every storage
        format, so converting once ahead changes nothing), `x` itself for the bit-level models, which need its
        format."""
        if self.model == "blas":
            return np.asarray(x, dtype=np.float32)
        if self.model == "fp64":
            return np.asarray(x, dtype=np.float64)
        return np.asarray(x)

    @property
    def columnwise(self) -> bool:
        """Each output column computed on its own, whatever the columns beside it (every bit-level model): then one
        product over many kernel blocks gives each block's bits. BLAS (``blas``, ``fp64``) may not."""
        return self.model not in ("blas", "fp64")

    @property
    def tiles_itself(self) -> bool:
        """A T-FDPA model (``sm90``, ...): its products go in cache-sized tiles of columns, whatever their width."""
        return self.model not in ("blas", "fp64") and _mma.get_model(self.model).kind == "tfdpa"

    def matmul(self, a: np.ndarray, b: np.ndarray, acc: np.ndarray | None = None, *,
               dot_k: int | None = None) -> np.ndarray:
        """acc: in the working type; dot_k: the K extent of one ``tl.dot`` (models it does not affect ignore it)."""
        if self.model == "fp64":
            out = _blas_clock.matmul(self.operand(a), self.operand(b))
            return out if acc is None else out + acc
        return _mma.matmul(self.operand(a), self.operand(b), acc, model=self.model, dot_k=dot_k)


@dataclass(frozen=True)
class ExpUnit:
    """e^x and 2^x. mode: a mode of :func:`amla_sim.arith.elementwise.exp` (``sm90``: ``tl.exp``'s
    ``ex2.approx`` of ``fl32(x log2 e)``; ``libdevice``: CUDA's ``expf`` and ``exp2f`` without fast math;
    ``poly``: the kernels' exact software exp) or ``fp64``."""

    mode: Literal["correctly-rounded", "sm90", "libdevice", "poly", "numpy-fast", "fp64"] = "correctly-rounded"

    def __post_init__(self) -> None:
        _check_mode("ExpUnit", "mode", self.mode,
                    ("correctly-rounded", "sm90", "libdevice", "poly", "numpy-fast", "fp64"))

    def exp(self, x: np.ndarray) -> np.ndarray:
        return np.exp(x) if self.mode == "fp64" else ew.exp(x, mode=self.mode)

    def exp2(self, x: np.ndarray) -> np.ndarray:
        return np.exp2(x) if self.mode == "fp64" else ew.exp2(x, mode=self.mode)


@dataclass(frozen=True)
class DivUnit:
    """a / b. mode: ``ieee`` (correctly rounded, ``div_rn``), ``sm90`` (Triton's ``/``: ``div.full.f32``; also
    CUDA's ``/`` under ``--use_fast_math`` for normal divisors) or ``fp64``. approx: what the approximate
    intrinsic (CUDA's ``__fdividef``) is where it is not `mode` (``sm90`` on a CUDA build without fast math, whose
    ``/`` is IEEE); None: `mode`."""

    mode: Literal["ieee", "sm90", "fp64"] = "ieee"
    approx: Literal["sm90"] | None = None

    def __post_init__(self) -> None:
        _check_mode("DivUnit", "mode", self.mode, ("ieee", "sm90", "fp64"))
        _check_mode("DivUnit", "approx", self.approx, ("sm90", None))

    def div(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.mode == "fp64":
            with np.errstate(divide="ignore", invalid="ignore"):
                return a / b
        return ew.div(a, b, mode=self.mode)

    def __repr__(self) -> str:
        return f"DivUnit(mode={self.mode!r}" + ("" if self.approx is None else f", approx={self.approx!r}") + ")"

    def div_approx(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``__fdividef(a, b)``: the approximate division whatever ``/`` compiles to."""
        return self.div(a, b) if self.approx is None else ew.div(a, b, mode=self.approx)


@dataclass(frozen=True)
class LogUnit:
    """Logarithms. ln: a mode of :func:`amla_sim.arith.logarithm.log` (``sm90``: ``tl.log``, libdevice's logf);
    lg2: ``correctly-rounded``, ``sm90`` (``lg2.approx.ftz``, CUDA's ``log2f`` under ``--use_fast_math``) or
    ``libdevice`` (CUDA's ``log2f`` without it: :func:`amla_sim.arith.logarithm.log2f`); ``fp64`` for either;
    None: not modelled on this machine (using it is an error)."""

    ln: Literal["correctly-rounded", "sm90", "numpy-fast", "fp64"] | None = "correctly-rounded"
    lg2: Literal["correctly-rounded", "sm90", "libdevice", "fp64"] | None = "correctly-rounded"

    def __post_init__(self) -> None:
        _check_mode("LogUnit", "ln", self.ln, ("correctly-rounded", "sm90", "numpy-fast", "fp64", None))
        _check_mode("LogUnit", "lg2", self.lg2, ("correctly-rounded", "sm90", "libdevice", "fp64", None))

    def log(self, x: np.ndarray) -> np.ndarray:
        if self.ln == "fp64":
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.log(x)
        return _log.log(x, mode=self.ln)

    def log2(self, x: np.ndarray) -> np.ndarray:
        if self.lg2 == "sm90":
            return _log.lg2_approx(x, ftz=True)
        if self.lg2 == "libdevice":
            return _log.log2f(x)
        with np.errstate(divide="ignore", invalid="ignore"):  # fp64, or float64 rounded once to the working type
            return np.log2(x.astype(np.float64)).astype(x.dtype)


@dataclass(frozen=True)
class FMAUnit:
    """``a * b + c``. contract: the compiler fuses it into one FMA (one rounding); otherwise a product and a sum,
    each rounded in the working type (on FP64, the golden machine's mathematics). ftz: the build flushes FP32
    subnormals (``-ftz=true``, which ``--use_fast_math`` implies): an instruction reads a subnormal operand as a
    zero of its sign and writes a subnormal result as one (:meth:`read`): :meth:`mul`, :meth:`mul_add`, the machine's
    divisions, and the constants a kernel derives from its scalars."""

    contract: bool = False
    ftz: bool = False

    def read(self, x: np.ndarray) -> np.ndarray:
        """`x` as the unit's instructions read it: subnormals as signed zeros under ftz, `x` itself otherwise."""
        return flush_subnormals(x, keep_sign=True) if self.ftz and x.dtype == np.float32 else x

    def mul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a * b`` (``mul.f32``; under ftz ``mul.ftz.f32``: subnormal operands read as zeros, a subnormal product
        written as one, each of its sign)."""
        with np.errstate(invalid="ignore", over="ignore"):
            return self.read(self.read(a) * self.read(b))

    def mul_add(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        """``a * b + c``: one ``fma.rn`` where contracted, a product and a sum otherwise; under ftz each
        instruction's operands and result flushed as :meth:`mul`'s."""
        a, b, c = self.read(a), self.read(b), self.read(c)
        if not self.contract:  # both paths broadcast the operands together
            with np.errstate(invalid="ignore", over="ignore"):
                return self.read(self.read(a * b) + c)
        return self.read(ew.fma(a, b, c))  # ew.fma's own ftz, the same flush, would bypass the numba engine


@dataclass(frozen=True)
class ReduceUnit:
    """Row sums. order: ``sequential``, ``pairwise``, ``triton`` (a thread's registers in order, then butterflies
    over lanes and warps, in the layout the schedule gives) or ``numpy`` (``np.sum``: the golden machine's, and
    fast sweeps')."""

    order: Literal["sequential", "pairwise", "triton", "numpy"] = "sequential"

    def __post_init__(self) -> None:
        _check_mode("ReduceUnit", "order", self.order, ("sequential", "pairwise", "triton", "numpy"))

    def rowsum(self, x: np.ndarray, *, layout: tuple[int, int, int] | None = None) -> np.ndarray:
        """Sum along the last axis; layout: (vec, lanes, warps) of a ``triton`` reduction (None: Triton's blocked
        layout of the row)."""
        if self.order == "numpy":
            return np.sum(x, axis=-1)
        if self.order == "triton" and x.shape[-1] & (x.shape[-1] - 1):
            # a partial block: Triton pads to a power of two with zeros, which change no sum
            n = 1 << int(x.shape[-1] - 1).bit_length()
            x = np.concatenate([x, np.zeros((*x.shape[:-1], n - x.shape[-1]), x.dtype)], axis=-1)
        return row_sum(x, order=self.order, layout=layout)

    def rowmax(self, x: np.ndarray) -> np.ndarray:
        """The maximum is exact: the same on every machine and in every order."""
        return np.max(x, axis=-1)


@dataclass(frozen=True)
class CastUnit:
    """Casts to storage formats: nearest even, FP8 overflow ``satfinite`` (Hopper's ``cvt``) or ``ieee`` (to inf);
    exact: no rounding at all (the golden machine keeps FP64)."""

    fp8_overflow: Literal["ieee", "satfinite"] = "satfinite"
    exact: bool = False

    def __post_init__(self) -> None:
        _check_mode("CastUnit", "fp8_overflow", self.fp8_overflow, ("ieee", "satfinite"))

    def overflow(self, fmt: Format, overflow: str | None) -> str:
        """What an overflowing cast to `fmt` does (`overflow` overrides the unit)."""
        return overflow or (self.fp8_overflow if fmt.bits == 8 else "ieee")

    def cast(self, x: np.ndarray, fmt: Format, *, overflow: str | None = None) -> np.ndarray:
        if self.exact:
            return x
        return round_to(x, fmt, overflow=self.overflow(fmt, overflow))


@dataclass(frozen=True)
class MemoryUnit:
    """Global memory: order is the arrival order of the writers of one atomic call."""

    atomic_order: Literal["program", "reversed", "random"] = "program"

    def __post_init__(self) -> None:
        _check_mode("MemoryUnit", "atomic_order", self.atomic_order, ("program", "reversed", "random"))

    def buffer(self, data: np.ndarray, *, seed: int | None = None) -> GlobalMemory:
        """A buffer of `data`'s type (FP32, or FP64 with an int64 view)."""
        random = self.atomic_order == "random"
        return GlobalMemory(data, order=self.atomic_order, seed=(seed or 0) if random else None)
