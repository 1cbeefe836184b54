"""The reference: softmax(Q K^T * scale) V in one piece, in FP64 (or FP32, as the AMLA paper's Golden)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

from .. import _blas_clock
from .._validate import quiet_fp
from ._common import D_V, AttentionResult, make_problem


@quiet_fp
def golden(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    d_v: int = D_V,
    scale: float | None = None,
    precision: Literal["fp64", "fp32"] = "fp64",
) -> AttentionResult:
    """Attention of the inputs exactly as given, in `precision`, with no intermediate rounding to BF16.

    q: (b, s_q, G, d_k), kv: (b, S, d_k); returns out (b, s_q, G, d_v) and lse (b, s_q, G) in `precision`.
    """
    if precision not in ("fp64", "fp32"):
        raise ValueError(f"precision: expected 'fp64' or 'fp32', got {precision!r}")
    p = make_problem(q, kv, machine="golden", d_v=d_v, scale=scale, block=1)
    dt = np.float64 if precision == "fp64" else np.float32
    Q, K = np.asarray(p.Q, dtype=dt), np.asarray(p.K, dtype=dt)  # no copies: make_problem made float64
    S = _blas_clock.matmul(Q, np.swapaxes(K, -1, -2))
    S *= dt(p.scale)
    if not p.valid.all():
        S = np.where(p.valid[None], S, -np.inf)
    m = S.max(axis=-1, keepdims=True)
    E = np.exp(np.subtract(S, m, out=S), out=S)
    l = E.sum(axis=-1, keepdims=True)
    out = _blas_clock.matmul(E, K[..., : p.d_v]) / l
    b, s_q, G = p.shape
    lse = (m + np.log(l))[..., 0]
    return AttentionResult(out.reshape(b, s_q, G, p.d_v), lse.reshape(b, s_q, G))
