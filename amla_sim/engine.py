"""Which implementation runs the hot loops of the bit-exact machines: ``numpy`` (the reference, the default) or
``numba`` (compiled kernels from the optional ``[fast]`` extra, held bit-identical to the reference by the tests).

The choice changes speed, never a bit. It is read from ``AMLA_SIM_ENGINE`` at import, so that worker processes
inherit it, and set with :func:`set_engine` or, for a block of code, :func:`use_engine`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

__all__ = ["ENGINES", "get_engine", "set_engine", "use_engine", "numba_available"]

#: The engines: ``numpy`` (the reference) and ``numba`` (compiled, the same bits).
ENGINES = ("numpy", "numba")
_ENV = "AMLA_SIM_ENGINE"


@lru_cache(maxsize=1)
def numba_available() -> bool:
    """True when numba imports (``pip install "amla-sim[fast]"``)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _check(name: object, argname: str) -> str:
    if name not in ENGINES:
        raise ValueError(f"{argname}: expected one of {ENGINES}, got {name!r}")
    if name == "numba" and not numba_available():
        raise ImportError(f"{argname}: the numba engine needs numba: pip install \"amla-sim[fast]\"")
    return str(name)


_current = os.environ.get(_ENV, "numpy") or "numpy"  # checked when used: a bad value never breaks the import


def get_engine() -> str:
    """The engine in use; a bad ``AMLA_SIM_ENGINE``, or ``numba`` without numba installed, is an error here."""
    if _current not in ENGINES:
        raise ValueError(f"{_ENV}: expected one of {ENGINES}, got {_current!r}")
    if _current == "numba" and not numba_available():
        raise ImportError(f"{_ENV}=numba: the numba engine needs numba: pip install \"amla-sim[fast]\"")
    return _current


def set_engine(name: str) -> None:
    """Use `name` (``"numpy"`` or ``"numba"``) from now on, in this process and in the workers it starts."""
    global _current
    _current = _check(name, "engine")
    os.environ[_ENV] = _current


@contextmanager
def use_engine(name: str) -> Iterator[None]:
    """Run a block of code on engine `name`, then restore the previous one."""
    previous, saved_env = _current, os.environ.get(_ENV)
    set_engine(name)
    try:
        yield
    finally:
        _set_raw(previous, saved_env)


def _set_raw(name: str, env: str | None) -> None:
    global _current
    _current = name
    if env is None:
        os.environ.pop(_ENV, None)
    else:
        os.environ[_ENV] = env
