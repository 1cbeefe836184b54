"""Machines: how a piece of hardware rounds, multiplies, accumulates, exponentiates, divides, reduces and adds.

Algorithms see hardware only through a :class:`Machine`; swap the machine and the same algorithm runs as the FP64
golden reference, as IEEE FP32, as Hopper under Triton, or as a (parametric, unverified) Ascend 910. A machine is
a named set of unit models (:mod:`amla_sim.units`: matrix unit, exp, division, logarithms, FMA contraction,
reductions, casts, memory), each row below with its source, plus the small methods algorithms call. How a kernel
lays the work out is not the machine's: see :mod:`amla_sim.schedules`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from ._validate import from_registry
from .arith import mma as _mma
from .arith.memory import GlobalMemory
from .engine import get_engine
from .formats import FormatLike, get_format
from .units import (
    CastUnit,
    DivUnit,
    ExpUnit,
    FMAUnit,
    LogUnit,
    MatrixUnit,
    MemoryUnit,
    ReduceUnit,
)

__all__ = ["Machine", "MACHINES", "UNITS", "get_machine"]


_PRODUCT_ELEMENTS = 1 << 15  # rows x columns of one product in matmul_blocks: far fewer calls, while the exact
# model's recomputation of uncertain elements stays within the memory that resources.run_bytes promises


@dataclass(frozen=True)
class Machine:
    """A hardware profile: a named set of unit models (:mod:`amla_sim.units`). Build a what-if machine by
    swapping a unit: ``get_machine("sm90-triton", matrix=MatrixUnit("exact"))``.

    working: the float type values live in between operations (``fp64`` on the golden machine). verified: every
    unit was checked against hardware captures. source: where the unit choices come from.
    """

    name: str
    matrix: MatrixUnit = MatrixUnit()
    exponential: ExpUnit = ExpUnit()
    division: DivUnit = DivUnit()
    logarithm: LogUnit = LogUnit()
    fma: FMAUnit = FMAUnit()
    reduction: ReduceUnit = ReduceUnit()
    casts: CastUnit = CastUnit()
    atomics: MemoryUnit = MemoryUnit()
    working: Literal["fp32", "fp64"] = "fp32"
    verified: bool = True
    source: str = ""

    # --- numbers -----------------------------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        """The working float type: float64 on golden, float32 elsewhere."""
        return np.dtype(np.float64 if self.working == "fp64" else np.float32)

    def f(self, x: npt.ArrayLike) -> np.ndarray:
        """`x` in the working float type (exact for every storage format)."""
        if isinstance(x, np.ndarray) and x.dtype == self.dtype:
            return x
        with np.errstate(invalid="ignore"):
            return np.asarray(x, dtype=self.dtype)  # no copy when it already is

    def cast(self, x: npt.ArrayLike, fmt: FormatLike, *, overflow: str | None = None) -> np.ndarray:
        """Round to a storage format (nearest even); FP8 overflow as the cast unit does. Exact casts: `x` in the
        working type."""
        if self.casts.exact:
            return self.f(x)
        return self.casts.cast(np.asarray(x), get_format(fmt), overflow=overflow)

    # --- arithmetic: each method hands its operands, in the working type, to one unit ---------------------

    def operand(self, x: npt.ArrayLike) -> np.ndarray:
        """`x` as the matrix unit reads it (convert an operand used many times once, ahead)."""
        return self.matrix.operand(x)

    def matmul(self, a: npt.ArrayLike, b: npt.ArrayLike, acc: npt.ArrayLike | None = None, *,
               dot_k: int | None = None) -> np.ndarray:
        """``acc + a @ b`` on the matrix unit; dot_k: the schedule's K extent of one ``tl.dot``."""
        return self.matrix.matmul(a, b, None if acc is None else self.f(acc), dot_k=dot_k)

    def block_width(self, rows: int, block: int) -> int:
        """Key columns one product over kernel blocks may take (:meth:`matmul_blocks`), `rows` being the rows of
        all its batches: `block` unless the matrix unit is columnwise; then as many whole blocks as make about
        2^15 outputs (the NumPy engine's working set, and the exact model's recomputation of uncertain elements),
        2^20 for the tensor-core models on the numba engine."""
        if not getattr(self.matrix, "columnwise", False):
            return block
        outputs = _PRODUCT_ELEMENTS
        if getattr(self.matrix, "tiles_itself", False) and get_engine() == "numba":
            outputs <<= 5  # the compiled chain works in cache-sized tiles itself; wide products keep its threads busy
        return max(block, outputs // max(rows, 1) // block * block)

    def matmul_blocks(self, a: npt.ArrayLike, b: npt.ArrayLike, *, block: int,
                      dot_k: int | None = None) -> np.ndarray:
        """``a @ b`` where b's columns are kernel blocks of `block` keys, each its own product in the kernel: as many
        blocks a product as :meth:`block_width` allows (the same bits, far fewer calls)."""
        b = np.asarray(b)
        rows = int(np.prod(np.broadcast_shapes(np.shape(a)[:-2], b.shape[:-2]), dtype=np.int64)) * np.shape(a)[-2]
        return self.by_blocks(lambda cols: self.matmul(a, cols, dot_k=dot_k), b, rows=rows, block=block)

    def by_blocks(self, product: Callable[[np.ndarray], np.ndarray], b: np.ndarray, *, rows: int,
                  block: int) -> np.ndarray:
        """``product(b)`` for a product whose columns are independent kernel blocks of b's last axis, made on as
        many blocks at a time as :meth:`block_width` allows and joined along the last axis (a kernel's own chain
        of products, such as Q_rope K_rope^T after Q_nope K_nope^T, goes in `product`)."""
        n, width = b.shape[-1], self.block_width(rows, block)
        if n <= width:
            return product(b)
        return np.concatenate([product(b[..., j:j + width]) for j in range(0, n, width)], axis=-1)

    def exp(self, x: npt.ArrayLike) -> np.ndarray:
        return self.exponential.exp(self.f(x))

    def exp2(self, x: npt.ArrayLike) -> np.ndarray:
        return self.exponential.exp2(self.f(x))

    def log(self, x: npt.ArrayLike) -> np.ndarray:
        """Natural log (Triton's ``tl.log``)."""
        if self.logarithm.ln is None:
            raise ValueError(f"machine: {self.name} has no model of its natural log")
        return self.logarithm.log(self.f(x))

    def require(self, *, kernel: str, suggest: str, natural_log: bool = False, log2: bool = False,
                e4m3_products: bool = False) -> None:
        """Refuse, naming ``machine``, before any work, to run `kernel` on a machine without a unit it needs
        (``tl.log``, ``lg2``, tensor cores that take E4M3 operands); `suggest` is the machine it runs on."""
        if natural_log and self.logarithm.ln is None:
            raise ValueError(f"machine: {kernel} takes tl.log (libdevice's logf), which {self.name} does not model; "
                             f"run it on {suggest}")
        if log2 and self.logarithm.lg2 is None:
            raise ValueError(f"machine: {kernel} takes lg2, which {self.name} does not model; run it on {suggest}")
        model = self.matrix.model
        if e4m3_products and model != "fp64":
            m = _mma.get_model(model)
            if m.kind == "tfdpa" and "e4m3" not in m.rows:
                raise ValueError(f"machine: {kernel} multiplies E4M3 operands, which {self.name}'s tensor cores "
                                 f"({m.name}: {', '.join(sorted(m.rows))}) do not take; run it on {suggest}")

    def log2(self, x: npt.ArrayLike) -> np.ndarray:
        """log2 (CUDA's ``log2f``; under ``--use_fast_math``: ``lg2.approx.ftz``)."""
        if self.logarithm.lg2 is None:
            raise ValueError(f"machine: {self.name} has no model of its log2 (Triton's tl.log2 is libdevice's "
                             "log2f, not modelled)")
        return self.logarithm.log2(self.f(x))

    def log_plus(self, x: npt.ArrayLike, plus: npt.ArrayLike) -> np.ndarray:
        """CUDA's ``logf(x) + plus``: ln x, then the add; on a machine with no natural-log unit of its own (CUDA
        under ``--use_fast_math``, whose ``__logf`` is lg2 x times fl(ln 2)) the multiply contracted into the
        add."""
        if self.logarithm.ln is None:
            return self.mul_add(self.log2(x), self.f(math.log(2.0)), plus)
        return self.f(self.log(x) + self.f(plus))

    def div(self, a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
        """``a / b`` in the division unit's way; on a build that flushes subnormals (:meth:`ftz`) its operands and
        quotient flushed."""
        return self.ftz(self.division.div(self.ftz(a), self.ftz(b)))

    def div_approx(self, a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
        """``__fdividef(a, b)``: the division unit's approximate division (``/`` itself unless the unit says),
        flushed as :meth:`div`."""
        return self.ftz(self.division.div_approx(self.ftz(a), self.ftz(b)))

    def mul(self, a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
        """``a * b`` rounded to the working type (``mul.f32``); on a build that flushes subnormals, operands and
        product flushed (``mul.ftz.f32``)."""
        return self.fma.mul(self.f(a), self.f(b))

    def mul_add(self, a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike) -> np.ndarray:
        """``a * b + c``: one FMA where the compiler contracts it, two roundings elsewhere."""
        return self.fma.mul_add(self.f(a), self.f(b), self.f(c))

    def ftz(self, x: npt.ArrayLike) -> np.ndarray:
        """`x` as the machine's FP32 instructions read it: a subnormal is a zero of its sign on a build that
        flushes them (``--use_fast_math``), `x` itself elsewhere."""
        return self.fma.read(self.f(x))

    def rowsum(self, x: npt.ArrayLike, *, layout: tuple[int, int, int] | None = None) -> np.ndarray:
        """Sum along the last axis in the reduction unit's order; layout: the schedule's (vec, lanes, warps)."""
        return self.reduction.rowsum(self.f(x), layout=layout)

    def rowmax(self, x: npt.ArrayLike) -> np.ndarray:
        return self.reduction.rowmax(self.f(x))

    def memory(self, data: npt.ArrayLike, *, seed: int | None = None) -> GlobalMemory:
        """A global-memory buffer of the machine's working type."""
        return self.atomics.buffer(self.f(data), seed=seed)


_SM90 = (
    "tests/data (H200 and H100 captures): MMA 100% of 272 Triton dots; exp via fl32(x*log2e) then ex2.approx "
    "(100%); '/' = div.full (100%); FMA contraction 100%; tl.sum order 100%; fp8 casts satfinite"
)

_SM90_TRITON = dict(matrix=MatrixUnit("sm90"), exponential=ExpUnit("sm90"), division=DivUnit("sm90"),
                    logarithm=LogUnit(ln="sm90", lg2=None), fma=FMAUnit(contract=True), reduction=ReduceUnit("triton"))

#: The named machines: which unit model each one uses.
MACHINES: dict[str, Machine] = {
    "golden": Machine(
        "golden", matrix=MatrixUnit("fp64"), exponential=ExpUnit("fp64"), division=DivUnit("fp64"),
        logarithm=LogUnit("fp64", "fp64"), reduction=ReduceUnit("numpy"), casts=CastUnit(exact=True), working="fp64",
        source="FP64 mathematics, no storage rounding",
    ),
    "ieee32": Machine("ieee32", source="IEEE FP32, BF16 matmul inputs, exact MMA, correctly rounded exp"),
    "ieee32-fast": Machine(
        "ieee32-fast", matrix=MatrixUnit("blas"), exponential=ExpUnit("numpy-fast"), logarithm=LogUnit("numpy-fast"),
        reduction=ReduceUnit("numpy"), source="ieee32 with BLAS and NumPy exp, for sweeps",
    ),
    "sm90-triton": Machine("sm90-triton", **_SM90_TRITON, source=_SM90),
    "sm90-triton-exact": Machine(
        "sm90-triton-exact",
        # the kernels' exact mode: software exp (FP32 FMA polynomial) and div_rn; tl.log is libdevice's logf,
        # FP32 FMAs, in both modes
        **{**_SM90_TRITON, "exponential": ExpUnit("poly"), "division": DivUnit("ieee")},
        source="amla_sim.gpu kernels in exact mode: software exp (FP32 FMA polynomial) and div_rn; " + _SM90,
    ),
    "sm90-cuda": Machine(
        "sm90-cuda",
        matrix=MatrixUnit("sm90-wgmma"),  # CUTLASS issues every wgmma with its accumulator: FP8 fused, 16-bit as sm90
        exponential=ExpUnit("sm90"),  # exp2f under --use_fast_math: ex2.approx.ftz
        division=DivUnit("sm90"),  # '/' under fast math: x * MUFU.RCP(y), the same bits as div.full for normal y
        logarithm=LogUnit(ln=None, lg2="sm90"),  # log2f under --use_fast_math: lg2.approx.ftz
        fma=FMAUnit(contract=True, ftz=True),  # --use_fast_math implies -ftz=true
        source="CUDA C++ built with nvcc --use_fast_math for sm_90a (FlashMLA): wgmma as the sm90 row (FP8 with "
               "its accumulator fused), MUFU exp2, log2 and reciprocal, FMA contraction; 100% of FlashMLA's out and "
               "LSE bits (tests/data/flashmla_decode.npz), of vLLM's dense FP8 decode's "
               "(tests/data/flashmla_dense_fp8_h100.npz)",
    ),
    "sm90-cuda-precise": Machine(
        "sm90-cuda-precise",
        matrix=MatrixUnit("sm90-wgmma"),
        exponential=ExpUnit("libdevice"),  # exp2f: ex2.approx.f32 (subnormal results kept); expf: __nv_expf
        division=DivUnit("ieee", approx="sm90"),  # '/': div.rn.f32; __fdividef: still div.approx
        logarithm=LogUnit(ln="sm90", lg2="libdevice"),  # logf, log2f: libdevice's polynomials
        fma=FMAUnit(contract=True),
        source="CUDA C++ built with nvcc for sm_90a without --use_fast_math (vLLM's FlashMLA library "
               "_flashmla_C): the sm90-cuda tensor cores, exp2f as ex2.approx.f32, IEEE division, libdevice's "
               "logf, log2f and expf (100% of tests/data/math_builds.npz); 100% of vLLM 0.33's FlashMLA out and LSE "
               "bits (tests/data/flashmla_vllm_h200.npz)",
    ),
    "ascend910": Machine(
        "ascend910", matrix=MatrixUnit("ascend910"), verified=False,
        source="parametric, UNVERIFIED: no public bit-level model",
    ),
}

#: The units a machine is made of.
UNITS = ("matrix", "exponential", "division", "logarithm", "fma", "reduction", "casts", "atomics")


def get_machine(machine: str | Machine, **units: object) -> Machine:
    """A named machine (or a Machine passed through), with units swapped: ``get_machine("sm90-triton",
    exponential=ExpUnit("correctly-rounded"))`` is Hopper under Triton with a correctly rounded exp. A machine
    with a unit swapped is named for it and not ``verified`` (unless `name` and `verified` are given)."""
    m = from_registry(machine, MACHINES, Machine, "machine")
    unknown = sorted(set(units) - {f.name for f in fields(Machine)})
    if unknown:
        raise TypeError(f"{unknown[0]}: not a unit of a machine; the units are {', '.join(UNITS)}")
    swapped = [u for u in UNITS if u in units and units[u] != getattr(m, u)]
    if swapped:  # a what-if machine: no longer the hardware its units were checked on, unless the caller says so
        units = {"name": f"{m.name} with {', '.join(f'{u}={units[u]}' for u in swapped)}", "verified": False,
                 **units}
    return replace(m, **units) if units else m
