"""Algorithms from outside the package, usable wherever a built-in one is: ``run``, ``sweep``, ``reproduce``.

An algorithm is any callable with the contract of :mod:`amla_sim.algorithms`::

    def my_algo(q, kv, *, machine="ieee32", schedule="reference", block=64, scale=None, trace=False,
                **options) -> AttentionResult

``q`` is (b, s_q, G, d_k), ``kv`` (b, S, d_k), V the first d_v columns of kv; ``out`` is (b, s_q, G, d_v). It is
found by name, in this order:

1. a built-in (:data:`amla_sim.algorithms.ALGORITHMS`);
2. ``module:attribute``, an import path in the spelling of Python's entry points (``my_pkg.kernels:my_algo``):
   the module must be importable where the samples run (installed, or on ``PYTHONPATH`` for local workers and
   every Dask worker);
3. a name that an installed package declares in the entry-point group ``amla_sim.algorithms``::

       [project.entry-points."amla_sim.algorithms"]
       my-algo = "my_pkg.kernels:my_algo"

``q`` and ``kv`` are read-only: every algorithm of a sample sees the same draw, so an algorithm that wants to
change them works on a copy. A plugin that cannot be imported, lacks a keyword of the contract, writes into its
inputs, exits, raises on a tiny problem or returns anything but an :class:`AttentionResult` of the right shape is
one :class:`PluginError` naming it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import sys
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

import numpy as np

from .algorithms import ALGORITHMS, AttentionResult
from .algorithms._common import D_V

__all__ = ["ENTRY_POINT_GROUP", "CONTRACT", "PluginError", "get_algorithm", "algorithm_names", "is_builtin",
           "call_algorithm"]

#: The entry-point group in which installed packages declare algorithms.
ENTRY_POINT_GROUP = "amla_sim.algorithms"
#: The keywords every algorithm takes.
CONTRACT = ("machine", "schedule", "block", "scale", "trace")  # the keywords every algorithm takes


class PluginError(ValueError):
    """A user algorithm that cannot be found, imported or run as the contract says."""


def is_builtin(name: str) -> bool:
    return name in ALGORITHMS


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def algorithm_names() -> dict[str, str]:
    """Every algorithm that can be named without an import path: name -> where it comes from."""
    out = {name: "built-in" for name in ALGORITHMS}
    for name, ep in sorted(_entry_points().items()):
        out.setdefault(name, f"entry point {ep.value}")
    return out


def _load(path: str, what: str) -> Callable:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise PluginError(f"{what}: expected an import path module:function, got {path!r}")
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):  # ours are for amla-sim's output
            obj: Any = importlib.import_module(module)
    except (Exception, SystemExit) as e:  # an import runs the user's module: any error (an exit too) is theirs
        last = said.getvalue().strip().splitlines()[-1:]
        printed = f"; it printed {last[0]!r}" if last else ""
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name == module.partition(".")[0]:
            hint = ("; install it, or put its folder on PYTHONPATH (the amla-sim command does not look in the "
                    "current folder: PYTHONPATH=. amla-sim ...)")
        raise PluginError(f"{what}: cannot import {module!r} ({_raised(e)}{printed}){hint}") from None
    sys.stderr.write(said.getvalue())
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what}: {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{what}: {path} is a {type(obj).__name__}, not a callable")
    _check_signature(obj, what)
    return obj


def _check_signature(fn: Callable, what: str) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the tiny problem will tell
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    missing = [k for k in CONTRACT if k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY]
    if missing:
        raise PluginError(f"{what}: takes no keyword {', '.join(map(repr, missing))} of the algorithm contract "
                          f"(q, kv, *, {', '.join(CONTRACT)})")


def get_algorithm(name: str) -> Callable:
    """The algorithm a name stands for: a built-in, ``module:attribute``, or an entry point's name."""
    if not isinstance(name, str) or not name:
        raise PluginError(f"algorithm: expected a name or module:function, got {name!r}")
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" in name:
        return _load(name, f"algorithm {name!r}")
    eps = _entry_points()
    if name in eps:
        return _load(eps[name].value, f"algorithm {name!r} (entry point {eps[name].value})")
    raise PluginError(f"algorithm: unknown algorithm {name!r}; expected one of {sorted(algorithm_names())} or an "
                      "import path module:function")


def _read_only(a: np.ndarray) -> np.ndarray:
    view = np.asarray(a).view()
    view.flags.writeable = False
    return view


def _raised(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    return f"{type(e).__name__}: {e}"


def call_algorithm(name: str, fn: Callable, q: np.ndarray, kv: np.ndarray, **kwargs: Any) -> AttentionResult:
    """``fn(q, kv, **kwargs)`` on read-only views of q and kv, its result checked; a plugin's exception (or exit)
    becomes a PluginError naming it (a built-in's propagates as it is)."""
    q, kv = _read_only(q), _read_only(kv)
    if is_builtin(name):
        return fn(q, kv, **kwargs)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is amla-sim's (its --json); the plugin's goes to stderr
            res = fn(q, kv, **kwargs)
    except ValueError as e:
        if "read-only" in str(e):
            raise PluginError(f"algorithm {name!r} wrote into q or kv, which every algorithm of the sample shares "
                              f"and which are read-only; work on a copy (np.array(q)) ({e})") from e
        raise PluginError(f"algorithm {name!r} raised {_raised(e)}") from e
    except (Exception, SystemExit) as e:  # the user's code: whatever it raises is reported as its failure
        raise PluginError(f"algorithm {name!r} raised {_raised(e)}") from e
    check_result(name, res, q, kv)
    return res


def check_result(name: str, res: object, q: np.ndarray, kv: np.ndarray) -> None:
    """An AttentionResult whose out is (b, s_q, G, d_v) floats with d_v = 512 (V, the first d_v columns of kv) and
    whose hazards map names to counts."""
    if not isinstance(res, AttentionResult):
        raise PluginError(f"algorithm {name!r} returned a {type(res).__name__}, not an AttentionResult")
    out = np.asarray(res.out)
    b, sq, G, d_k = q.shape
    d_v = D_V
    if out.shape != (b, sq, G, d_v) or out.dtype.kind not in "fV":
        raise PluginError(f"algorithm {name!r} returned out of dtype {out.dtype} and shape {out.shape}; expected "
                          f"floats of shape ({b}, {sq}, {G}, {d_v}) (d_v = {d_v}: V is the first {d_v} columns of "
                          "kv)")
    hazards = res.hazards
    if not isinstance(hazards, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (int, np.integer)) and not isinstance(v, bool)
            for k, v in hazards.items()):
        raise PluginError(f"algorithm {name!r} returned hazards {hazards!r}; expected a mapping of names to counts "
                          "(a collections.Counter)")
