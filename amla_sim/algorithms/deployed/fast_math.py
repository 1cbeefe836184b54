"""What the FlashAttention-derived CUDA decodes compute the same way under ``--use_fast_math``: ``__logf`` and
``M_LN2`` (the scale in log2 units is :func:`.scalars.scale_log2`). FlashMLA-ETAP (:mod:`.flashmla.etap`) and
FlashAttention-3's MLA decode (:mod:`.fa3.mla`) share them; FlashMLA's decodes take :func:`logf_plus`, which is
the same under fast math and libdevice's ``logf`` without it."""

from __future__ import annotations

import math

import numpy as np

from ...machines import Machine

__all__ = ["ln2", "logf", "logf_plus"]


def ln2(mc: Machine) -> np.ndarray:
    """``float(M_LN2)``: fl32(ln 2) on FP32 machines."""
    return mc.f(math.log(2.0))


def logf(mc: Machine, x: np.ndarray, plus: np.ndarray | None = None) -> np.ndarray:
    """``__logf(x)`` (``lg2.approx.ftz`` times fl32(ln 2)), or ``__logf(x) + plus`` with the multiply by ln 2
    contracted into the add."""
    if plus is None:
        return mc.f(mc.log2(x) * ln2(mc))
    return mc.mul_add(mc.log2(x), ln2(mc), plus)



def logf_plus(mc: Machine, x: np.ndarray, plus: np.ndarray) -> np.ndarray:
    """``logf(x) + plus`` as the machine's build compiles it: under fast math (a machine with no natural-log unit
    of its own: ``sm90-cuda``) ``__logf`` with its multiply contracted into the add (:func:`logf`); without it
    (``sm90-cuda-precise``) libdevice's ``logf``, then the add."""
    if mc.logarithm.ln is None:
        return logf(mc, x, plus)
    return mc.f(mc.log(x) + plus)
