"""Plots (matplotlib, from the ``notebooks`` extra): imported only when a plot is asked for."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from ._files import atomic_write


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'amla-sim[notebooks]'") from None
    return plt


def save_png(fig: Any, path: str | Path) -> None:
    """Write a figure as a PNG atomically (no half-written picture), without the software stamp, and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    _pyplot().close(fig)
    atomic_write(Path(path), buf.getvalue())


def error_bar(sem: float | None) -> float:
    """An error bar's half-length: the standard error where there is a finite one, else 0."""
    return sem if sem is not None and math.isfinite(sem) else 0.0


GANTT_MAX_STAGES = 600  # a chart labels every stage instance: more are unreadable, and take minutes to draw


def gantt(timeline: Any, path: str | Path, *, title: str = "") -> None:
    """A Gantt chart of a :class:`amla_sim.pipeline.Timeline` as a PNG: Cube and Vector rows, Preload shaded."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 2.6))
    colors = {"C": "#4C72B0", "V": "#DD8452"}
    for unit, label, t, cyc, s, e in timeline.intervals:
        if e <= s:
            continue
        y = 1 if unit == "cube" else 0
        phase = cyc < timeline.preload_cycles or cyc >= timeline.iterations
        ax.barh(y, e - s, left=s, color=colors[label[0]], alpha=0.45 if phase else 0.95, edgecolor="black",
                linewidth=0.5)
        ax.text((s + e) / 2, y, f"{label}\n#{t}", ha="center", va="center", fontsize=6)
    ax.set_yticks([0, 1], ["Vector", "Cube"])
    ax.set_xlabel("time")
    ax.set_title(title or "Preload pipeline (pale: Preload and drain)", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)
