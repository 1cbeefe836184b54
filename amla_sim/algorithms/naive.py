"""Eq. 3 of the AMLA paper taken literally: O^ = sum_i exp(m_i) P_i V_i, which overflows FP32 once m > 88."""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt

from .._validate import quiet_fp
from ..machines import Machine
from ..schedules import Schedule
from ._common import D_V, AttentionResult, make_problem, safe_max


@quiet_fp
def naive(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "ieee32",
    schedule: str | Schedule = "reference",
    d_v: int = D_V,
    scale: float | None = None,
    block: int = 64,
    trace: bool = False,
) -> AttentionResult:
    """Accumulate exp(m_i) P_i V_i and exp(m_i) rowsum(P_i) unnormalised; divide at the end.

    Hazards: ``overflow`` counts rows whose exp(m_i) overflowed (Inf), ``nan_outputs`` what that did to out.
    """
    p = make_problem(q, kv, machine=machine, schedule=schedule, d_v=d_v, scale=scale, block=block, trace=trace)
    mc = p.machine
    b, R = p.Q.shape[:2]
    hazards: Counter = Counter()
    l = np.zeros((b, R), mc.dtype)
    O = np.zeros((b, R, p.d_v), mc.dtype)
    for blk in p.blocks():
        S = p.scores(blk)
        m_i = mc.rowmax(S)  # the block's own max: no running max, no rescaling
        P = mc.exp(S - safe_max(m_i)[..., None])
        e = mc.exp(m_i)  # exp(m_i): Inf once m_i > 88.72 in FP32
        hazards["overflow"] += int(np.isinf(e).sum())
        with np.errstate(invalid="ignore", over="ignore"):
            l = l + e * p.rowsum(P)
            O = O + e[..., None] * mc.f(p.matmul(mc.cast(P, "bf16"), p.Vm[:, blk]))
        p.record(S=S, m=m_i, P=P, O=O)
    out = mc.div(O, l[..., None])
    return p.finish(out, l, np.zeros_like(l), hazards)
