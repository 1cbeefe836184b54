"""Algorithm specs of sweeps: a name, an optional label, options as ``:key=value``."""

from __future__ import annotations

import inspect
from typing import Any

from ..algorithms import ALGORITHMS

__all__ = ["parse_algorithm"]

_FIXED = frozenset(("q", "kv", "machine", "block", "trace", "d_v", "scale"))  # set by the sweep, not by options


def parse_algorithm(spec: str) -> tuple[str, str, dict[str, Any]]:
    """``"amla"`` -> ("amla", "amla", {}); ``"A=snapmla:config=A"`` -> ("A", "snapmla", {"config": "A"}).

    An optional label before ``=`` names the row; options follow as ``:key=value`` (ints, floats, true/false,
    or strings), checked against the algorithm's keyword arguments.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"algorithms: expected a name like 'amla' or 'snapmla:config=A', got {spec!r}")
    head, *opts = spec.split(":")
    label, _, name = head.rpartition("=")
    label = label or name
    if name not in ALGORITHMS:
        raise ValueError(f"algorithms: unknown algorithm {name!r} in {spec!r}; expected one of {sorted(ALGORITHMS)}")
    params = inspect.signature(ALGORITHMS[name]).parameters
    options: dict[str, Any] = {}
    for opt in opts:
        key, eq, raw = opt.partition("=")
        if not eq or key not in params or key in _FIXED:
            allowed = sorted(k for k in params if k not in _FIXED)
            raise ValueError(f"algorithms: {spec!r}: option {opt!r} is not key=value with a key of {name} "
                             f"({allowed})")
        options[key] = _value(raw)
    return label, name, options


def _value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
