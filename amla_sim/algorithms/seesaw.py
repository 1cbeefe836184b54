"""FlashMLA's "seesaw" schedule (FlashMLA deep dive): two KV blocks per step, O split into halves O_L, O_R.

Steps (bracket: warpgroup), with m shared and each scale = exp(m_old - m_new):
  1-2. p0 = q K0^T scale, p1 = q K1^T scale
  3-5. [0] m <- max(m, rowmax p0), p0 = exp(p0 - m), O_L <- O_L scale0 + bf16(p0) V0L
  6-8. [1] m <- max(m, rowmax p1), p1 = exp(p1 - m), O_R <- O_R (scale0 scale1) + bf16(p1) V1R
  9.   [0] p0 <- p0 scale1                         (in FP32: the right half sees bf16(p0 scale1))
  10.  [1] O_R <- O_R + bf16(p0) V0R
  11.  [0] O_L <- O_L scale1 + bf16(p1) V1L
The left half of O thus uses bf16(p0) and the right half bf16(fp32(p0 scale1)): P0 is rounded twice in
different ways, which Base never does. An odd last block runs steps 1, 3-5 and O_R <- O_R scale0 + bf16(p0) V0R.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt

from .._validate import quiet_fp
from ..machines import Machine
from ..schedules import Schedule
from ._common import D_V, AttentionResult, make_problem, online_softmax_step


@quiet_fp
def seesaw(
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
    """The 11-step seesaw schedule; q: (b, s_q, G, d_k), kv: (b, S, d_k); d_v must be even."""
    if d_v % 2:
        raise ValueError(f"d_v: the seesaw splits O into halves, so d_v must be even, got {d_v}")
    p = make_problem(q, kv, machine=machine, schedule=schedule, d_v=d_v, scale=scale, block=block, trace=trace)
    mc = p.machine
    b, R = p.Q.shape[:2]
    h = p.d_v // 2
    m = np.full((b, R), -np.inf, mc.dtype)
    l = np.zeros((b, R), mc.dtype)
    oL = np.zeros((b, R, h), mc.dtype)
    oR = np.zeros((b, R, h), mc.dtype)

    blocks = p.blocks()
    for i in range(0, len(blocks), 2):
        b0 = blocks[i]
        V0 = p.Vm[:, b0]
        p0 = p.scores(b0)  # step 1
        m, scale0, p0 = online_softmax_step(mc, m, p0)  # steps 3-4
        l = mc.mul_add(l, scale0, p.rowsum(p0))
        oL = p.matmul(mc.cast(p0, "bf16"), V0[..., :h], acc=oL * scale0[..., None])  # step 5
        if i + 1 == len(blocks):  # an odd last block
            oR = p.matmul(mc.cast(p0, "bf16"), V0[..., h:], acc=oR * scale0[..., None])
            break
        b1 = blocks[i + 1]
        V1 = p.Vm[:, b1]
        p1 = p.scores(b1)  # step 2
        m, scale1, p1 = online_softmax_step(mc, m, p1)  # steps 6-7
        l = mc.mul_add(l, scale1, p.rowsum(p1))
        oR = p.matmul(mc.cast(p1, "bf16"), V1[..., h:], acc=oR * (scale0 * scale1)[..., None])  # step 8
        p0 = p0 * scale1[..., None]  # step 9
        oR = p.matmul(mc.cast(p0, "bf16"), V0[..., h:], acc=oR)  # step 10
        oL = p.matmul(mc.cast(p1, "bf16"), V1[..., :h], acc=oL * scale1[..., None])  # step 11
        p.record(m=m, l=l, O=np.concatenate([oL, oR], axis=-1))
    out = mc.div(np.concatenate([oL, oR], axis=-1), l[..., None])
    return p.finish(out, l, m, Counter())
