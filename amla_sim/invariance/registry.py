"""Which kernels the invariance study models: every concrete :class:`~.kernel.BatchKernel` class that a module of
:mod:`amla_sim.invariance` lists in its ``__all__``, found with :mod:`pkgutil` on first use. A new kernel family is
a new module; no list here names one.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator, Mapping
from functools import cache
from typing import Any

from .kernel import BatchKernel

__all__ = ["BATCH_KERNELS", "get_batch_kernel", "kernel_classes", "ByKernel"]


@cache
def kernel_classes() -> dict[str, type[BatchKernel]]:
    """Every modelled kernel: name -> its class, in the order of the modules' names and of their ``__all__``."""
    package = importlib.import_module(__package__)
    found: dict[str, type[BatchKernel]] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        for attr in getattr(module, "__all__", ()):
            cls = getattr(module, attr)
            if not (isinstance(cls, type) and issubclass(cls, BatchKernel)) or inspect.isabstract(cls):
                continue
            if found.setdefault(cls.name, cls) is not cls:
                raise RuntimeError(f"{module.__name__}.{attr}: kernel {cls.name!r} is already "
                                   f"{found[cls.name].__module__}.{found[cls.name].__name__}")
    return found


class ByKernel(Mapping[str, Any]):
    """Kernel name -> an attribute of its class (`attr`), read from the registry when first asked."""

    def __init__(self, attr: str):
        self.attr = attr

    def __getitem__(self, name: str) -> Any:
        return getattr(kernel_classes()[name], self.attr)

    def __iter__(self) -> Iterator[str]:
        return iter(kernel_classes())

    def __len__(self) -> int:
        return len(kernel_classes())

    def __repr__(self) -> str:
        return repr(dict(self))


#: The kernels whose scheduler amla-sim models: name -> a one-line summary.
BATCH_KERNELS: Mapping[str, str] = ByKernel("summary")


def get_batch_kernel(name: str) -> BatchKernel:
    """A fresh adapter for kernel `name` (one of :data:`BATCH_KERNELS`)."""
    classes = kernel_classes()
    if not isinstance(name, str) or name not in classes:
        raise ValueError(f"kernel: expected one of {sorted(classes)}, got {name!r}")
    return classes[name]()
