"""The model of kernel.py in amla-sim: an algorithm with the package's contract, so that every command takes it
(``--algorithms mine=split_fp16:split_fp16`` with this folder on PYTHONPATH)."""

from collections import Counter

import numpy as np

from amla_sim.algorithms import make_problem, online_softmax_step, safe_max


def split_fp16(q, kv, *, machine="sm90-triton", schedule="amla-sim-gpu", block=64, scale=None, trace=False):
    """Base with P (and V) in FP16 for P V, over two halves of the KV blocks, combined as kernel.py does."""
    p = make_problem(q, kv, machine=machine, schedule=schedule, scale=scale, block=block, trace=trace)
    mc, (b, R), V16 = p.machine, p.Q.shape[:2], p.machine.cast(p.Vm, "fp16")
    blocks = p.blocks()
    parts = []
    for split in (blocks[: -(-len(blocks) // 2)], blocks[-(-len(blocks) // 2):]):
        m, l, O = np.full((b, R), -np.inf, mc.dtype), np.zeros((b, R), mc.dtype), np.zeros((b, R, p.d_v), mc.dtype)
        for blk in split:
            m_new, alpha, P = online_softmax_step(mc, m, p.scores(blk))
            l = mc.mul_add(l, alpha, p.rowsum(P))
            O, m = p.matmul(mc.cast(P, "fp16"), V16[:, blk], acc=O * alpha[..., None]), m_new
        p.record(m=m, l=l, O=O)  # the trace: each split's partial result, as the kernel leaves it in memory
        parts.append((m, l, O))
    (m0, l0, O0), (m1, l1, O1) = parts
    m = np.maximum(m0, m1)
    a0, a1 = mc.exp(m0 - safe_max(m)), mc.exp(m1 - safe_max(m))
    l = l0 * a0 + l1 * a1
    return p.finish(mc.div(O0 * a0[..., None] + O1 * a1[..., None], l[..., None]), l, m, Counter())
