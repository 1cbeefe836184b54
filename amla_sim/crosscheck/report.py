"""What a replay says: per case of a capture, the stage-by-stage comparison of :func:`amla_sim.compare`, and what
the capture holds that the replay did not compare."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._validate import dumps_strict
from ..comparison import ComparisonReport

__all__ = ["ReplayReport"]


@dataclass(frozen=True)
class ReplayReport:
    """A capture replayed: the kernel and its version, the device that ran it, one comparison per case.

    title: the report's first line; case_labels: a line per case (empty for a capture of one unlabelled case).
    held_not_compared: member -> why, for the arrays the capture holds that no stage compares (a record of the
    kernel's schedule, a buffer the algorithm never writes); never counted as compared. not_replayed: the cases
    of the capture left out of a replay of some of them."""

    kernel: str
    version: str | None
    device: str | None
    cases: list[ComparisonReport]
    title: str
    case_labels: tuple[str, ...] = ()
    held_not_compared: Mapping[str, str] = field(default_factory=dict)
    not_replayed: tuple[int, ...] = ()

    @property
    def bit_exact(self) -> bool:
        """Whether every stage of every case has the device's bits (false for a report of no case)."""
        return bool(self.cases) and all(r.bit_exact for r in self.cases)

    def format(self) -> str:
        """The report as a person reads it: the title, then each case's table, then what was not compared."""
        lines = [self.title]
        if not self.case_labels:
            lines += [r.format() for r in self.cases]
        for label, r in zip(self.case_labels, self.cases):
            lines += [f"  {label}", r.format(indent="    ")]
        if not self.cases:
            lines.append("  no case replayed: not bit-exact")
        by_reason: dict[str, list[str]] = {}
        for name, why in self.held_not_compared.items():
            by_reason.setdefault(why, []).append(name)
        lines += [f"  held, not compared ({why}): {', '.join(names)}" for why, names in by_reason.items()]
        if self.not_replayed:
            lines.append(f"  cases not replayed (not asked for): {', '.join(map(str, self.not_replayed))}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "version": self.version, "device": self.device, "bit_exact": self.bit_exact,
                "cases": [r.to_dict() for r in self.cases], "held_not_compared": dict(self.held_not_compared),
                "not_replayed": list(self.not_replayed)}

    def to_json(self, **kwargs: Any) -> str:
        """Strict JSON (non-finite numbers as strings)."""
        return dumps_strict(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return self.format()
