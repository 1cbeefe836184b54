"""AMLA (AMLA paper, Algorithm 2, as Huawei CANN ships it): rescale O in global memory with integer adds.

Per KV block j, with m_j the running max (Alg. 2 lines 4-12; notes Section 3 for CANN's form):

    n_j   = round(-m_j / ln 2)                       half away from zero, AscendC CAST_ROUND
    c_j   = exp((m_j log2 e + n_j) ln 2)              e^{m_j} 2^{n_j}, in [2^-0.5, 2^0.5]
    c16_j = fp32(bf16(c_j)),  P~_j = bf16(P_j c16_j)  the PV input ("pre-multiplication")
    cof_j = c_j / c16_j
    N     = max(n_j - n_{j-1}, -30) + 1.5 (cof_{j-1} / cof_j - 1) + 1e-6,   N_int = round(N 2^23)
    O     = AS_FP32(AS_INT32(O) + N_int)              int32 AtomicAdd in global memory (j > 1)
    O     = O + P~_j V_j                              FP32 AtomicAdd (a plain store for j = 1)
    end:  O[|O| > 1e10] = 0;  out = O / (l c16_final)

Why the compensation is cof_{j-1}/cof_j: the buffer must hold sum_i e^{S_i} 2^{n_j} / cof_j V_i after block j,
so moving from j-1 to j multiplies it by 2^{n_j - n_{j-1}} cof_{j-1} / cof_j; Appendix A's trick turns the
factor 1 + eps into an integer add of 1.5 eps 2^23. The paper's Algorithm 2 line 9 writes eps with c_i / c_{i-1}
(the reciprocal, the opposite sign to first order): the variant ``compensation="paper"`` keeps it, and the tests
measure that it does worse than no compensation at all.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import numpy as np
import numpy.typing as npt

from .._validate import quiet_fp
from ..arith.elementwise import LN2, LOG2E
from ..bits import count_outside_lemma_domain
from ..machines import Machine
from ._common import D_V, AttentionResult, make_problem, online_softmax_step, safe_max

CLEANUP_THRESHOLD = 1e10  # CANN zeroes |O| above this: what the int add made of zeros and subnormals


def _round_half_away(x: np.ndarray) -> np.ndarray:
    return (np.sign(x) * np.floor(np.abs(x) + 0.5)).astype(x.dtype)


@quiet_fp
def amla(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "ieee32",
    d_v: int = D_V,
    scale: float | None = None,
    block: int = 64,
    compensation: Literal["cann", "paper", "none"] = "cann",
    scaling: Literal["pre", "post"] = "pre",
    cleanup: bool = True,
    trace: bool = False,
    seed: int | None = None,
) -> AttentionResult:
    """Algorithm 2 with its variants.

    compensation: ``cann`` (cof_{j-1}/cof_j, what compensates), ``paper`` (Alg. 2 line 9 as printed) or
    ``none``. scaling: ``pre`` (P c16 rounded to BF16 before PV, Appendix A's pre-multiplication) or ``post``
    (PV computed from bf16(P), then scaled by c_j in FP32: no BF16 error in the scale, nothing to compensate).
    cleanup: CANN's |O| > 1e10 -> 0 at the end (``False``: the literal algorithm). seed: for a machine whose
    atomics arrive in random order.

    Hazards: ``lemma_domain`` counts buffer elements the int add touched outside Lemma 3.1's domain,
    ``cleaned`` the elements the clean-up zeroed, ``garbage`` (without clean-up) elements left above 1e10.
    """
    for arg, val, allowed in (
        ("compensation", compensation, ("cann", "paper", "none")),
        ("scaling", scaling, ("pre", "post")),
    ):
        if val not in allowed:
            raise ValueError(f"{arg}: expected one of {allowed}, got {val!r}")
    p = make_problem(q, kv, machine=machine, d_v=d_v, scale=scale, block=block, trace=trace)
    mc = p.machine
    b, R = p.Q.shape[:2]
    hazards: Counter = Counter()
    int_unit = float(2 ** (52 if mc.golden else 23))  # 2^mantissa_bits of the output buffer
    m = np.full((b, R), -np.inf, mc.dtype)
    l = np.zeros((b, R), mc.dtype)
    mem = mc.memory(np.zeros((b, R, p.d_v)), seed=seed)
    n_prev = cof_prev = final_scale = None
    for j, blk in enumerate(p.blocks()):
        S = p.scores(blk)  # lines 4-5
        m_new, m_up, P = online_softmax_step(mc, m, S)  # lines 5-6: M_up and P
        l = mc.mul_add(l, m_up, mc.rowsum(P))  # line 6
        ms = safe_max(m_new)
        n = _round_half_away(mc.f(-ms) * mc.f(LOG2E))  # line 6: n_i = round(-m_i / ln 2)
        c = mc.exp(mc.mul_add(ms, mc.f(LOG2E), n) * mc.f(LN2))  # line 7: S32 = exp(ln2 (n_i + m_i / ln 2))
        if scaling == "pre":
            c16 = mc.f(mc.cast(c, "bf16"))  # line 8: S16
            P_tilde = mc.cast(P * c16[..., None], "bf16")  # line 10
            cof = mc.div(c, c16)  # line 9: c_i = S32 / S16
            final_scale = c16
        else:
            P_tilde = mc.cast(P, "bf16")
            cof = np.ones_like(c)
            final_scale = c
        if j > 0:
            if compensation == "cann":
                eps = mc.div(cof_prev, cof) - mc.f(1.0)
            elif compensation == "paper":
                eps = mc.div(cof, cof_prev) - mc.f(1.0)
            else:
                eps = np.zeros_like(cof)
            dn = np.maximum(n - n_prev, mc.f(-30.0))
            N = dn + mc.f(1.5) * eps + mc.f(mc.amla_guard)  # line 11
            N_int = np.rint(mc.f(N) * mc.f(int_unit)).astype(np.int64)  # line 12: Cast_to_int32(N 2^23)
            hazards["lemma_domain"] += count_outside_lemma_domain(mem.view, dn.astype(np.int64)[..., None])
            mem.atomic_add_int32(N_int[..., None])  # line 14: AtomicAdd(INT32) in GM
            p.record(N=N_int)
        PV = mc.matmul(P_tilde, p.Vm[:, blk])  # line 17
        if scaling == "post":
            PV = mc.f(PV) * c[..., None]
        if j == 0:
            mem.store(PV)
        else:
            mem.atomic_add_fp32(PV)  # line 18: AtomicAdd(FP32) in GM
        m, n_prev, cof_prev = m_new, n, cof
        if p.trace is not None:
            p.record(S=S, m=m, l=l, P=P, n=n, c=c, O=mem.fp32)
    O = mem.fp32
    big = np.abs(O) > CLEANUP_THRESHOLD
    if cleanup:
        hazards["cleaned"] += int(big.sum())
        O = np.where(big, mc.f(0.0), O)
    else:
        hazards["garbage"] += int(big.sum())
    out = mc.div(O, (l * final_scale)[..., None])  # line 20: O / (l_N S16)
    return p.finish(out, l, m, hazards)
