"""ETAP (FlashMLA-ETAP, Section 3): the transposed computation S^T = K Q^T, O^T = V^T P^T.

Kernel numerics as published (pengcuo/FlashMLA-ETAP): P rounded to BF16 (or FP16) before PV; KV blocks run last
to first; each thread keeps an FP32 running sum of the unrounded P it holds (``lanes`` partial sums per row,
rescaled with the online softmax) and the partials are reduced across threads once, at the end.
On a tensor core the transposed products are the same products in the same K order, so S^T is S transposed
bit for bit; the numerics differ from Base through the block order, the row-sum order and the P format.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt

from .._validate import quiet_fp
from ..machines import Machine
from ..schedules import Schedule
from ._common import (
    D_V,
    AttentionResult,
    make_problem,
    online_softmax_step,
)


@quiet_fp
def etap(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "ieee32",
    schedule: str | Schedule = "reference",
    d_v: int = D_V,
    scale: float | None = None,
    block: int = 64,
    p_format: str = "bf16",
    io_format: str = "bf16",
    trace: bool = False,
) -> AttentionResult:
    """ETAP's transposed decode. The schedule's ``etap_lanes`` are the partial row sums each row keeps, which
    meet at the end (the reference: 4; amla_sim.gpu's ETAP kernel: one per key slot of the block).

    p_format: the format of P before PV (bf16 or fp16); io_format: the inputs' and the output's format.
    """
    p = make_problem(q, kv, machine=machine, schedule=schedule, d_v=d_v, scale=scale, block=block, trace=trace,
                     input_format=io_format, out_format=io_format)
    mc = p.machine
    wgmma = p.schedule.etap_lanes == "wgmma"
    lanes = p.block if wgmma else p.schedule.etap_lanes
    if p.block % lanes:
        raise ValueError(f"schedule: etap_lanes must divide block ({p.block}), got {lanes}")
    b, R = p.Q.shape[:2]
    m = np.full((b, R), -np.inf, mc.dtype)
    l_part = np.zeros((b, R, lanes), mc.dtype)
    OT = np.zeros((b, p.d_v, R), mc.dtype)
    QT = np.swapaxes(p.Qm, -1, -2)
    for blk in p.blocks("backward"):
        n = blk.stop - blk.start
        ST = mc.f(p.matmul(p.Km[:, blk], QT)) * mc.f(p.scale)  # S^T = K Q^T: (b, n, R)
        S = np.where(p.valid[None, :, blk], np.swapaxes(ST, -1, -2), -np.inf).astype(mc.dtype)
        m_new, alpha, P = online_softmax_step(mc, m, S)
        l_part = l_part * alpha[..., None]
        padded = np.concatenate([P, np.zeros((b, R, -n % lanes), mc.dtype)], axis=-1)
        for chunk in padded.reshape(b, R, -1, lanes).transpose(2, 0, 1, 3):  # each thread's keys, in order
            l_part = l_part + chunk
        PT = mc.cast(np.swapaxes(P, -1, -2), p_format)  # (b, n, R)
        OT = p.matmul(np.swapaxes(p.Vm[:, blk], -1, -2), PT, acc=OT * alpha[:, None, :])  # O^T = V^T P^T
        m = m_new
        p.record(S=S, m=m, P=P, O=np.swapaxes(OT, -1, -2))
    if wgmma and lanes == 64:  # the (keys x rows) accumulator reduced over keys in the wgmma layout
        l = mc.rowsum(l_part[..., _MMA_M_ORDER], layout=(1, 8, 4))
    else:  # the one cross-thread reduction: a butterfly over the lanes
        l = mc.rowsum(l_part, layout=(1, lanes, 1))
    out = mc.div(np.swapaxes(OT, -1, -2), l[..., None])
    return p.finish(out, l, m, Counter())


# Key slot k = 16 w + 8 h + g of a 64-row wgmma accumulator: warp w, register h, lane group g. Triton reduces a
# thread's registers first (h), then the lane groups (g), then the warps (w); in the (vec, lanes, warps) = (1, 8, 4)
# layout of amla_sim.arith.reductions that is position 32 h + 8 w + g.
_MMA_M_ORDER = np.array([16 * w + 8 * h + g for h in range(2) for w in range(4) for g in range(8)])
