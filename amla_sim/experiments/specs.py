"""Algorithm specs of sweeps: a name, an optional label, options as ``:key=value``.

``[label=]name[:key=value...]`` where name is a built-in, an entry point's name, or an import path
``module:function`` (:mod:`amla_sim.plugins`). An option always holds ``=``; the segment after ``module`` never
does, so the two cannot be confused: ``mine=my_pkg.kernels:my_algo:block_scale=2``.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from ..plugins import PluginError, algorithm_names, get_algorithm
from .layer import LAYER_ALGORITHMS

__all__ = ["parse_algorithm"]

_FIXED = frozenset(("q", "kv", "machine", "block", "trace", "d_v", "scale"))  # set by the sweep, not by options


def parse_algorithm(spec: str) -> tuple[str, str, dict[str, Any]]:
    """``"amla"`` -> ("amla", "amla", {}); ``"A=snapmla:config=A"`` -> ("A", "snapmla", {"config": "A"});
    ``"my_pkg.kernels:my_algo:p=fp16"`` -> ("my_algo", "my_pkg.kernels:my_algo", {"p": "fp16"}).

    An optional label before ``=`` names the row (default: the name, or an import path's function); options
    follow as ``:key=value`` (ints, floats, true/false, or strings), checked against the algorithm's keyword
    arguments (any key, where it takes ``**options``) and against the kind of each one's default or its
    ``Literal`` choices: ``cleanup=no`` is an error, not a truthy string.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"algorithms: expected a name like 'amla' or 'snapmla:config=A', got {spec!r}")
    head, *opts = spec.split(":")
    label, _, name = head.rpartition("=")
    if opts and "=" not in opts[0]:  # module:function
        if name in algorithm_names():
            raise ValueError(f"algorithms: {spec!r}: option {opts[0]!r} of {name} is not key=value")
        attr = opts.pop(0)
        name = f"{name}:{attr}"
        label = label or attr.rpartition(".")[2]
    label = label or name
    try:  # a layer grid's paths by their names (the grid checks which it may run)
        fn = LAYER_ALGORITHMS[name] if name in LAYER_ALGORITHMS else get_algorithm(name)
    except PluginError as e:
        raise PluginError(f"algorithms: {spec!r}: {e}") from None
    params = inspect.signature(fn).parameters
    any_key = any(p.kind is p.VAR_KEYWORD for p in params.values())
    options: dict[str, Any] = {}
    for opt in opts:
        key, eq, raw = opt.partition("=")
        if not eq or not key or key in _FIXED or not (any_key or key in params):
            allowed = sorted(k for k in params if k not in _FIXED and params[k].kind is not params[k].VAR_KEYWORD)
            raise ValueError(f"algorithms: {spec!r}: option {opt!r} is not key=value with a key of {name} "
                             f"({allowed})")
        if key in options:
            raise ValueError(f"algorithms: {spec!r}: option {key} is given twice")
        options[key] = _checked(_value(raw), params.get(key), f"algorithms: {spec!r}: option {key}", fn)
    return label, name, options


def _checked(value: Any, param: inspect.Parameter | None, what: str, fn: Any) -> Any:
    """`value` if it is of the kind the parameter takes (its ``Literal`` choices, or its default's type)."""
    if param is None:  # taken by **options: the algorithm checks it
        return value
    try:
        hint = typing.get_type_hints(fn).get(param.name)
    except Exception:  # a plugin's annotations need not resolve
        hint = None
    if typing.get_origin(hint) is typing.Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{what}: expected one of {list(typing.get_args(hint))}, got {value!r}")
        return value
    default = param.default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{what}: expected true or false, got {value!r}")
    elif isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{what}: expected an int, got {value!r}")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{what}: expected a number, got {value!r}")
        return float(value)
    return value


def _value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
