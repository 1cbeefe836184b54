"""Argument checks shared by the public API and the CLI: errors that name the argument, and strict JSON."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

__all__ = ["check_positive_int", "check_int", "from_registry", "dumps_strict", "strict_json", "quiet_fp"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def check_int(value: Any, name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi], or a ValueError/TypeError naming `name` (booleans are not sizes)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise ValueError(f"{name}: expected an int {rng}, got {v}")
    return v


def from_registry(value: Any, registry: Mapping[str, T], cls: type, name: str) -> T:
    """`value` itself when it is a `cls`, else its entry in `registry`, or an error naming the argument."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value in registry:
        return registry[value]
    raise ValueError(f"{name}: unknown {name} {value!r}; expected one of {sorted(registry)}")


def check_positive_int(value: Any, name: str) -> int:
    """`value` as an int >= 1, or an error naming `name`."""
    return check_int(value, name, lo=1)


def strict_json(value: Any) -> Any:
    """`value` with non-finite floats as the strings "inf", "-inf", "nan" and NumPy scalars as Python ones."""
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if isinstance(value, (np.bool_,)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else ("nan" if math.isnan(f) else ("inf" if f > 0 else "-inf"))
    return value


def dumps_strict(value: Any, **kwargs: Any) -> str:
    """JSON that every parser accepts (RFC 8259: no NaN or Infinity); see :func:`strict_json`."""
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)


def quiet_fp(fn: F) -> F:
    """Run `fn` with NumPy's floating-point warnings off: overflow, NaN and Inf in a simulation are the
    arithmetic being studied (and counted in hazards), not a fault to report on stderr."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class DataError(ValueError):
    """A file the user gave (a capture, a results folder) that is damaged or not what its format says."""
