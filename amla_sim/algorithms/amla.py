"""AMLA (AMLA paper, Algorithm 2, as Huawei CANN ships it): rescale O in global memory with integer adds.

Per KV block j, with m_j the running max (Alg. 2 lines 4-12; notes Section 3 for CANN's form):

    n_j   = round(-m_j / ln 2)                       half away from zero, AscendC CAST_ROUND
    c_j   = exp((m_j log2 e + n_j) ln 2)              e^{m_j} 2^{n_j}, in [2^-0.5, 2^0.5]
    c16_j = fp32(bf16(c_j)),  P~_j = bf16(P_j c16_j)  the PV input ("pre-multiplication")
    cof_j = c_j / c16_j
    N     = max(n_j - n_{j-1}, -30) + 1.5 (cof_{j-1} / cof_j - 1) + 1e-6,   N_int = round(N 2^23)
    O     = AS_FP32(AS_INT32(O) + N_int)              int32 AtomicAdd in global memory (j > 1)
    O     = O + P~_j V_j                              FP32 AtomicAdd (a plain store for j = 1)
    end:  ``O[|O| > 1e10] = 0``;  out = O / (l c16_final)

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
from ..schedules import Schedule
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
    schedule: str | Schedule = "reference",
    d_v: int = D_V,
    scale: float | None = None,
    block: int = 64,
    compensation: Literal["cann", "paper", "none"] = "cann",
    scaling: Literal["pre", "post"] = "pre",
    cleanup: bool = True,
    guard: float = 1e-6,
    trace: bool = False,
    seed: int | None = None,
) -> AttentionResult:
    """Algorithm 2 with its variants.

    compensation: ``cann`` (cof_{j-1}/cof_j, what compensates), ``paper`` (Alg. 2 line 9 as printed) or
    ``none``. scaling: ``pre`` (P c16 rounded to BF16 before PV, Appendix A's pre-multiplication) or ``post``
    (PV computed from bf16(P), then scaled by c_j in FP32: no BF16 error in the scale, nothing to compensate).
    cleanup: CANN's ``|O| > 1e10 -> 0`` at the end (``False``: the literal algorithm). guard: CANN's ``+1e-6`` in N,
    which keeps Cast_to_int32(N 2^23) from falling one below an integer N (0: the exact mathematics). seed: for a
    machine whose atomics arrive in random order.

    Hazards: ``lemma_domain`` counts buffer elements the int add touched outside Lemma 3.1's domain,
    ``cleaned`` the elements the clean-up zeroed, ``garbage`` (without clean-up) elements left above 1e10.
    """
    _check_options(compensation, scaling, guard)
    p = make_problem(q, kv, machine=machine, schedule=schedule, d_v=d_v, scale=scale, block=block, trace=trace)
    mc = p.machine
    b, R = p.Q.shape[:2]
    hazards: Counter = Counter()
    m = np.full((b, R), -np.inf, mc.dtype)
    l = np.zeros((b, R), mc.dtype)
    mem = mc.memory(np.zeros((b, R, p.d_v)), seed=seed)
    n_prev = cof_prev = final_scale = None
    for j, blk in enumerate(p.blocks()):
        S = p.scores(blk)  # lines 4-5
        m_new, m_up, P = online_softmax_step(mc, m, S)  # lines 5-6: M_up and P
        l = mc.mul_add(l, m_up, p.rowsum(P))  # line 6
        n, c = _exponent_and_scale(mc, m_new)  # lines 6-7
        P_tilde, cof, final_scale = _scaled_p(mc, P, c, scaling)  # lines 8-10
        if j > 0:  # lines 11-14: rescale the output in memory by 2^N with an integer AtomicAdd
            dn = np.maximum(n - n_prev, mc.f(-30.0))
            N_int = _rescale_bits(mc, dn, _epsilon(mc, cof, cof_prev, compensation), guard)
            hazards["lemma_domain"] += count_outside_lemma_domain(mem.view, dn.astype(np.int64)[..., None])
            mem.atomic_add_int32(N_int[..., None])  # line 14: AtomicAdd(INT32) in GM
            p.record(N=N_int)
        PV = p.matmul(P_tilde, p.Vm[:, blk])  # line 17
        if scaling == "post":
            PV = mc.f(PV) * c[..., None]
        if j == 0:
            mem.store(PV)
        else:
            mem.atomic_add_fp32(PV)  # line 18: AtomicAdd(FP32) in GM
        m, n_prev, cof_prev = m_new, n, cof
        if p.trace is not None:
            p.record(S=S, m=m, l=l, P=P, n=n, c=c, O=mem.fp32)
    O = _clean_up(mc, mem.fp32, cleanup, hazards)
    out = mc.div(O, (l * final_scale)[..., None])  # line 20: O / (l_N S16)
    return p.finish(out, l, m, hazards)


def _check_options(compensation: str, scaling: str, guard: float) -> None:
    for arg, val, allowed in (("compensation", compensation, ("cann", "paper", "none")),
                              ("scaling", scaling, ("pre", "post"))):
        if val not in allowed:
            raise ValueError(f"{arg}: expected one of {allowed}, got {val!r}")
    if isinstance(guard, bool) or not isinstance(guard, (int, float, np.floating)) or not 0 <= guard < 1:
        raise ValueError(f"guard: expected a number in [0, 1), got {guard!r}")


def _exponent_and_scale(mc: Machine, m_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lines 6-7: n_i = round(-m_i / ln 2) and S32 = exp(ln 2 (n_i + m_i / ln 2)), the FP32 part of the scale."""
    ms = safe_max(m_new)
    n = _round_half_away(mc.f(-ms) * mc.f(LOG2E))
    return n, mc.exp(mc.mul_add(ms, mc.f(LOG2E), n) * mc.f(LN2))


def _scaled_p(mc: Machine, P: np.ndarray, c: np.ndarray, scaling: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lines 8-10: the BF16 P that goes into PV, the compensation cof_i = S32 / S16 and the final scale."""
    if scaling == "pre":
        c16 = mc.f(mc.cast(c, "bf16"))  # line 8: S16
        return mc.cast(P * c16[..., None], "bf16"), mc.div(c, c16), c16  # lines 10 and 9
    return mc.cast(P, "bf16"), np.ones_like(c), c


def _epsilon(mc: Machine, cof: np.ndarray, cof_prev: np.ndarray, compensation: str) -> np.ndarray:
    """The BF16 error of the scale that line 11 compensates: CANN's cof_{i-1}/cof_i - 1, the paper's line 9 as
    printed, or none."""
    if compensation == "cann":
        return mc.div(cof_prev, cof) - mc.f(1.0)
    if compensation == "paper":
        return mc.div(cof, cof_prev) - mc.f(1.0)
    return np.zeros_like(cof)


def _rescale_bits(mc: Machine, dn: np.ndarray, eps: np.ndarray, guard: float) -> np.ndarray:
    """Lines 11-12: N = dn + 1.5 eps (+ CANN's guard), dn = n_i - n_{i-1} (at least -30), as
    Cast_to_int32(N 2^23), the integer that multiplies the FP32 output by 2^N when added to its bits (2^52 for a
    machine whose buffer is FP64)."""
    int_unit = float(2 ** np.finfo(mc.dtype).nmant)  # 2^mantissa_bits of the output buffer's format
    N = dn + mc.f(1.5) * eps + mc.f(guard)
    return np.rint(mc.f(N) * mc.f(int_unit)).astype(np.int64)


def _clean_up(mc: Machine, O: np.ndarray, cleanup: bool, hazards: Counter) -> np.ndarray:
    """CANN's ``|O| > 1e10 -> 0`` (counted as ``cleaned``), or, without it, the count of such ``garbage``."""
    big = np.abs(O) > CLEANUP_THRESHOLD
    if not cleanup:
        hazards["garbage"] += int(big.sum())
        return O
    hazards["cleaned"] += int(big.sum())
    return np.where(big, mc.f(0.0), O)
