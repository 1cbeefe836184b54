"""Kernel schedules: how a kernel lays an algorithm's work out, where that changes bits but is not the hardware's.

A schedule is the second thing an algorithm runs on, beside the :class:`~amla_sim.machines.Machine`: the same
hardware runs the paper's pseudo-code and a Triton kernel of it with different bits when the kernel pads its last
KV block, sums P in the registers of the wgmma accumulator layout, or cuts a product into ``tl.dot`` calls.

The block size stays an argument of the algorithms (the papers' B_c, swept in every table). Deployed kernels with a
schedule of their own (FlashMLA's split scheduler, SGLang's KV splits) take it as their own arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from ._validate import from_registry

__all__ = ["Schedule", "SCHEDULES", "get_schedule"]


@dataclass(frozen=True)
class Schedule:
    """How the blocks of an attention algorithm are laid out on the machine.

    pad_blocks: the last KV block is padded to full size (zero keys, masked), as a kernel does.
    reduce_layout: (vec, lanes, warps) of the row sum of P in a ``triton`` reduction (None: Triton's blocked
    layout of the row). dot_k: the K extent of one ``tl.dot`` (None: one call over all of K).
    etap_lanes: ETAP's partial row sums per row, met at the end by a butterfly; ``wgmma``: one per key slot of the
    block, in the transposed (keys x rows) wgmma accumulator, reduced over keys in its layout.
    """

    name: str = "reference"
    pad_blocks: bool = False
    reduce_layout: tuple[int, int, int] | None = None
    dot_k: int | None = None
    etap_lanes: int | Literal["wgmma"] = 4
    source: str = ""

    def __post_init__(self) -> None:
        if self.reduce_layout is not None and (len(self.reduce_layout) != 3 or min(self.reduce_layout) < 1):
            raise ValueError(f"reduce_layout: expected (vec, lanes, warps) of positive ints, "
                             f"got {self.reduce_layout!r}")
        if self.dot_k is not None and (not isinstance(self.dot_k, int) or self.dot_k < 1):
            raise ValueError(f"dot_k: expected a positive int or None, got {self.dot_k!r}")
        if self.etap_lanes != "wgmma" and (not isinstance(self.etap_lanes, int) or self.etap_lanes < 1):
            raise ValueError(f"etap_lanes: expected a positive int or 'wgmma', got {self.etap_lanes!r}")

    @property
    def reduce_span(self) -> int:
        """Columns one pass of the row-sum layout covers: the block must be a multiple of it."""
        if self.reduce_layout is None:
            return 1
        vec, lanes, warps = self.reduce_layout
        return vec * lanes * warps


#: The named schedules: how a kernel lays its blocks out.
SCHEDULES: dict[str, Schedule] = {
    "reference": Schedule(source="the papers' pseudo-code: blocks as cut, P summed in the reduction unit's "
                                 "own order, 4 ETAP lanes"),
    "amla-sim-gpu": Schedule(
        "amla-sim-gpu", pad_blocks=True,
        reduce_layout=(2, 4, 1),  # P in the wgmma accumulator layout: 2 adjacent columns a thread, 4 a row
        etap_lanes="wgmma",
        source="the Triton kernels of amla_sim.gpu (num_warps=4): 100% of their bits on an H100 and an H200 "
               "(tests/data/crosscheck_*.npz)",
    ),
}


def get_schedule(schedule: str | Schedule, **fields: object) -> Schedule:
    """A named schedule (or a Schedule passed through), with optional field overrides."""
    s = from_registry(schedule, SCHEDULES, Schedule, "schedule")
    return replace(s, **fields) if fields else s
