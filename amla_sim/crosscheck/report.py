"""What a replay says: per case of a capture, the stage-by-stage comparison of :func:`amla_sim.compare`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._validate import dumps_strict
from ..comparison import ComparisonReport

__all__ = ["ReplayReport"]


@dataclass(frozen=True)
class ReplayReport:
    """A capture replayed: the kernel and its version, the device that ran it, one comparison per case.

    title: the report's first line; case_labels: a line per case (empty for a capture of one unlabelled case)."""

    kernel: str
    version: str | None
    device: str | None
    cases: list[ComparisonReport]
    title: str
    case_labels: tuple[str, ...] = ()

    @property
    def bit_exact(self) -> bool:
        """Whether every stage of every case has the device's bits (false for a report of no case)."""
        return bool(self.cases) and all(r.bit_exact for r in self.cases)

    def format(self) -> str:
        """The report as a person reads it: the title, then each case's table."""
        lines = [self.title]
        if not self.case_labels:
            return "\n".join(lines + [r.format() for r in self.cases])
        for label, r in zip(self.case_labels, self.cases):
            lines += [f"  {label}", r.format(indent="    ")]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "version": self.version, "device": self.device, "bit_exact": self.bit_exact,
                "cases": [r.to_dict() for r in self.cases]}

    def to_json(self, **kwargs: Any) -> str:
        """Strict JSON (non-finite numbers as strings)."""
        return dumps_strict(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return self.format()
