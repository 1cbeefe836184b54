"""What the FlashAttention-derived CUDA decodes compute the same way under ``--use_fast_math``: ``__logf`` and
``M_LN2`` (the scale in log2 units is :func:`.scalars.scale_log2`). FlashMLA-ETAP (:mod:`.flashmla.etap`) and
FlashAttention-3's MLA decode (:mod:`.fa3.mla`) share them. FlashMLA's kernels, which engines build with and
without fast math, take the machine's :meth:`~amla_sim.machines.Machine.log_plus` instead."""

from __future__ import annotations

import math

import numpy as np

from ...machines import Machine

__all__ = ["ln2", "logf"]


def ln2(mc: Machine) -> np.ndarray:
    """``float(M_LN2)``: fl32(ln 2) on FP32 machines."""
    return mc.f(math.log(2.0))


def logf(mc: Machine, x: np.ndarray, plus: np.ndarray | None = None) -> np.ndarray:
    """``__logf(x)`` (``lg2.approx.ftz`` times fl32(ln 2)), or ``__logf(x) + plus`` with the multiply by ln 2
    contracted into the add."""
    if plus is None:
        return mc.f(mc.log2(x) * ln2(mc))
    return mc.mul_add(mc.log2(x), ln2(mc), plus)


