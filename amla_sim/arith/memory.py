"""Global memory with atomics: an FP32 buffer that writers update with int32 and FP32 AtomicAdds.

AMLA rescales its FP32 output in place by an int32 AtomicAdd of ``N`` on the buffer's bits (Lemma 3.1), then
accumulates ``P~V`` with an FP32 AtomicAdd. Both act on the same memory, which this object holds.

- ``atomic_add_int32``: two's-complement addition on the int32 view; the result does not depend on the order
  of the writers (integer addition modulo 2^32 is associative and commutative).
- ``atomic_add_fp32``: ``atom.global.add.f32``: each add rounds to nearest even, and subnormal operands and
  results are flushed to zero (measured on an H200: 0 + 3e-39 -> 0, 1.5e-38 - 1.4e-38 -> 0). The result depends
  on the order in which writers arrive, which the order policy fixes: ``"program"`` (writer 0 first),
  ``"reversed"``, or ``"random"`` (a permutation per call, from the seed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from ..formats import flush_subnormals
from .elementwise import as_f32

__all__ = ["GlobalMemory", "TraceEntry", "ORDER_POLICIES"]

OrderPolicy = Literal["program", "reversed", "random"]
#: The orders in which the atomics of one element may land.
ORDER_POLICIES = ("program", "reversed", "random")


@dataclass(frozen=True)
class TraceEntry:
    """One applied atomic: which op, which writer, in which position of its call."""

    op: Literal["int32", "fp32"]
    call: int
    writer: int
    position: int


def _ftz(x: np.ndarray) -> np.ndarray:
    """x with subnormals replaced by +0, as ``atom.add.f32`` leaves them (x itself when it has none)."""
    return flush_subnormals(x, keep_sign=False)


class GlobalMemory:
    """An FP32 buffer in global memory, updated by simulated writers through atomics.

    data: the initial FP32 contents (copied; float64 data makes an FP64 buffer, with an int64 view). order: the arrival order of the writers of each call.
    seed: for ``order="random"``. trace: record every applied atomic in :attr:`trace`.
    """

    def __init__(
        self,
        data: npt.ArrayLike,
        *,
        order: OrderPolicy = "program",
        seed: int | None = None,
        trace: bool = False,
    ) -> None:
        if order not in ORDER_POLICIES:
            raise ValueError(f"order: expected one of {ORDER_POLICIES}, got {order!r}")
        if order == "random" and seed is None:
            raise ValueError("seed: order='random' needs a seed")
        arr = np.asarray(data)
        if arr.dtype == np.float64:  # an FP64 buffer (the golden machine): int64 view, no flushing
            self._buf = np.array(arr, order="C", copy=True)
        else:
            self._buf = np.array(as_f32(data, "data"), dtype=np.float32, order="C", copy=True)
        self._ftz = self._buf.dtype == np.float32
        self._flushed = False  # the buffer holds no subnormal (known after an FP32 add)
        self.order = order
        self._rng = np.random.default_rng(seed)
        self.trace: list[TraceEntry] | None = [] if trace else None
        self._calls = 0

    @property
    def fp32(self) -> np.ndarray:
        """The contents as floats (a copy; float64 for an FP64 buffer)."""
        return self._buf.copy()

    @property
    def view(self) -> np.ndarray:
        """The contents, read-only and without a copy (valid until the next atomic)."""
        v = self._buf.view()
        v.flags.writeable = False
        return v

    @property
    def int32(self) -> np.ndarray:
        """The contents reinterpreted as signed integers of their width (a copy)."""
        return self._buf.view(np.int32 if self._ftz else np.int64).copy()

    def _arrival(self, n: int) -> np.ndarray:
        if self.order == "program":
            return np.arange(n)
        if self.order == "reversed":
            return np.arange(n)[::-1]
        return self._rng.permutation(n)

    def _writers(self, values: Sequence[npt.ArrayLike] | npt.ArrayLike, kind: str) -> list[np.ndarray]:
        vals = list(values) if isinstance(values, (list, tuple)) else [values]
        out = []
        for i, v in enumerate(vals):
            arr = np.asarray(v)
            if kind == "int32":
                if arr.dtype.kind not in "iu":
                    raise TypeError(f"values[{i}]: expected integers for an int32 atomic, got {arr.dtype}")
                arr = arr.astype(np.int64)
            elif self._ftz:
                arr = as_f32(arr, f"values[{i}]")
            else:
                arr = arr.astype(np.float64)
            try:
                np.broadcast_shapes(arr.shape, self._buf.shape)
            except ValueError:
                raise ValueError(f"values[{i}]: shape {arr.shape} does not broadcast to {self._buf.shape}") from None
            out.append(arr)
        return out

    def _log(self, op: Literal["int32", "fp32"], order: np.ndarray) -> None:
        if self.trace is not None:
            self.trace.extend(TraceEntry(op, self._calls, int(w), p) for p, w in enumerate(order))
        self._calls += 1

    def atomic_add_int32(self, values: Sequence[npt.ArrayLike] | npt.ArrayLike) -> None:
        """Each writer adds its integers to the int32 view, with wrap-around (one writer: pass one array)."""
        writers = self._writers(values, "int32")
        order = self._arrival(len(writers))
        bits = self._buf.view(np.uint32 if self._ftz else np.uint64)
        for w in order:
            # int64 -> unsigned is reduction modulo 2^width, and unsigned adds wrap: two's complement exactly
            np.add(bits, writers[w].astype(bits.dtype), out=bits)
        self._flushed = False
        self._log("int32", order)

    def atomic_add_fp32(self, values: Sequence[npt.ArrayLike] | npt.ArrayLike) -> None:
        """Each writer adds its FP32 values, one rounded add at a time, subnormals flushed, in arrival order."""
        writers = self._writers(values, "fp32")
        order = self._arrival(len(writers))
        flush = _ftz if self._ftz else (lambda v: v)
        with np.errstate(over="ignore", invalid="ignore"):
            for w in order:
                buf = self._buf if self._flushed else flush(self._buf)
                self._buf = flush(buf + flush(np.broadcast_to(writers[w], self._buf.shape)))
                self._flushed = True  # the next add need not flush the buffer again (an int32 add may unflush it)
        self._log("fp32", order)

    def store(self, values: npt.ArrayLike) -> None:
        """A plain store (AMLA writes block 1 instead of adding it)."""
        vals = as_f32(values, "values") if self._ftz else np.asarray(values, dtype=np.float64)
        self._buf = np.broadcast_to(vals, self._buf.shape).astype(self._buf.dtype).copy()
        self._flushed = False
