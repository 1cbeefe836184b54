"""Base: FlashAttention-2's online softmax (AMLA paper, Algorithm 1), as the MLA decode kernels run it."""

from __future__ import annotations

from collections import Counter
from typing import Literal

import numpy as np
import numpy.typing as npt

from .._validate import quiet_fp
from ..machines import Machine
from ..schedules import Schedule
from ._common import D_V, AttentionResult, make_problem, online_softmax_step


@quiet_fp
def base(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "ieee32",
    schedule: str | Schedule = "reference",
    d_v: int = D_V,
    scale: float | None = None,
    block: int = 64,
    order: Literal["forward", "backward"] = "forward",
    p_format: str = "bf16",
    io_format: str = "bf16",
    trace: bool = False,
) -> AttentionResult:
    """Algorithm 1: per KV block, rescale O by exp(m_old - m_new) in FP32 and add bf16(P) V.

    q: (b, s_q, G, d_k), kv: (b, S, d_k). order: the block order (ETAP runs backward). p_format: the format P
    is rounded to before PV (bf16; fp16 as FA3 measured). io_format: the storage format of the inputs and of
    the output.
    """
    if order not in ("forward", "backward"):
        raise ValueError(f"order: expected 'forward' or 'backward', got {order!r}")
    p = make_problem(q, kv, machine=machine, schedule=schedule, d_v=d_v, scale=scale, block=block, trace=trace,
                     input_format=io_format, out_format=io_format)
    mc = p.machine
    b, R = p.Q.shape[:2]
    m = np.full((b, R), -np.inf, mc.dtype)
    l = np.zeros((b, R), mc.dtype)
    O = np.zeros((b, R, p.d_v), mc.dtype)
    for blk in p.blocks(order):
        S = p.scores(blk)  # lines 4-5
        m_new, alpha, P = online_softmax_step(mc, m, S)  # lines 5-6; alpha = exp(m_{i-1} - m_i)
        l = mc.mul_add(l, alpha, p.rowsum(P))  # line 6: l_i = l_{i-1} exp(..) + rowsum(P_i)
        O = p.matmul(mc.cast(P, p_format), p.Vm[:, blk], acc=O * alpha[..., None])  # lines 7-8
        m = m_new
        p.record(S=S, m=m, l=l, P=P, O=O)
    out = mc.div(O, l[..., None])  # line 10
    return p.finish(out, l, m, Counter())
