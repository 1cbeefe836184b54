"""SnapMLA (the FP8 pipeline as ported to Triton in FlagGems-vllm, flash_mla_ckv_fp8_per_token.py).

Cache (per token t): ``s_k = max(amax|c_t|, 1e-26) / 448`` over the 512 content dims, c8 = e4m3(c / s_k), RoPE kept
in BF16 pre-scaled: kr = bf16(k_rope / s_k). Query (per token and head): s_q over q_nope, q8 = e4m3(q_nope / s_q),
qr = bf16(q_rope / s_q). Per 64-token page, m in log2 units (notes Section 4):
  1. qk = q8 . c8 (FP8, tl.dot over 128-wide tiles) + qr . kr (BF16, last), FP32 accumulation
  2. x_t = qk_t (s_q softmax_scale log2 e) s_k[t];  m_new = max(m, max_t x_t);  e_t = 2^(x_t - m_new)
  3. f_t = e_t s_k[t];  sigma = max(amax f, 1e-26) / 448;  P8 = e4m3_satfinite(f / sigma)   (scale fusion)
  4. beta = 2^(m - m_new) sigma_old / sigma_new   (sigma_old = 1 on the first page)
  5. l = beta l + sum_t e_t / sigma_new            (the unquantized e)
  6. O = beta O + P8 . c8                          (FP8 x FP8; V8 is the content cache, never dequantized)
  7. out = O / l;  lse = (m + log2(l sigma)) ln 2
Configs of the paper's Table 2: ``snapmla`` (per-token, RoPE in BF16); ``A`` RoPE quantized per token with the
content (one FP8 scale over all 576 dims); ``B`` per-tensor static scale 1.0; ``C`` per-tensor dynamic;
``D`` per-block of ``quant_block`` tokens. B, C, D change the cache's scale granularity (the query keeps
per-token-per-head scales except under B, where both use 1.0); the RoPE part stays BF16, pre-scaled.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from .._validate import quiet_fp
from ..arith.elementwise import LOG2E
from ..machines import Machine
from ..schedules import Schedule
from ._common import (
    D_V,
    AttentionResult,
    Problem,
    make_problem,
    online_softmax_step,
)
from .quantizers import E4M3_MAX, SCALE_FLOOR, quantize

CONFIGS = ("snapmla", "A", "B", "C", "D")
CONTENT_DOT_K = 128  # the port's content product: tl.dot over 128-wide tiles of d_v
SATURATION = 464.0  # the E4M3 midpoint above 448: larger values would round to 480, outside e4m3fn


@quiet_fp
def snapmla(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine = "sm90-triton",
    schedule: str | Schedule = "reference",
    d_v: int = D_V,
    scale: float | None = None,
    block: int = 64,
    config: Literal["snapmla", "A", "B", "C", "D"] = "snapmla",
    quant_block: int = 64,
    trace: bool = False,
) -> AttentionResult:
    """SnapMLA decode; q: (b, s_q, G, 576), kv: (b, S, 576) in any float format (quantized here).

    Hazards: ``saturated`` counts FP8 casts clamped to +-448 (values that round past it: ``|v| > 464``), over q,
    kv and P; a quantizer's own amax lands on 448 and is not counted.
    """
    if config not in CONFIGS:
        raise ValueError(f"config: expected one of {CONFIGS}, got {config!r}")
    p = make_problem(q, kv, machine=machine, schedule=schedule, d_v=d_v, scale=scale, block=block, trace=trace,
                     input_format="fp32")
    mc = p.machine
    b, R = p.Q.shape[:2]
    hazards: Counter = Counter()
    qz = quantize_inputs(p, config, quant_block, hazards)
    q8, qr, row_scale, c8, kr, s_k = qz.q8, qz.qr, qz.row_scale, qz.c8, qz.kr, qz.s_k
    m = np.full((b, R), -np.inf, mc.dtype)
    l = np.zeros((b, R), mc.dtype)
    sigma = np.ones((b, R), mc.dtype)
    O = np.zeros((b, R, d_v), mc.dtype)
    for blk in p.blocks():
        # step 1: the content product in FP8, as the port's 128-wide tl.dot tiles (exact units ignore dot_k)
        qk = mc.matmul(q8, np.swapaxes(c8[:, blk], -1, -2), dot_k=CONTENT_DOT_K)
        qk = p.matmul(qr, np.swapaxes(kr[:, blk], -1, -2), acc=qk)  # RoPE tile last, BF16
        x = mc.f(qk) * row_scale[..., None] * s_k[:, None, blk]  # step 2
        x = np.where(p.valid[None, :, blk], x, -np.inf).astype(mc.dtype)
        m_new, a, e = online_softmax_step(mc, m, x, exp=mc.exp2)
        f = e * s_k[:, None, blk]  # step 3: scale fusion
        sigma_new = mc.div(np.maximum(mc.rowmax(f), mc.f(SCALE_FLOOR)), mc.f(E4M3_MAX))
        f_scaled = mc.div(f, sigma_new[..., None])
        P8 = mc.cast(f_scaled, "e4m3", overflow="satfinite")
        hazards["saturated"] += int((f_scaled > SATURATION).sum())
        beta = a * mc.div(sigma, sigma_new)  # step 4
        l = mc.mul_add(beta, l, mc.div(p.rowsum(e), sigma_new))  # step 5
        O = p.matmul(P8, c8[:, blk], acc=O * beta[..., None])  # step 6
        m, sigma = m_new, sigma_new
        p.record(S=x, m=m, l=l, P=P8, O=O)
    out = mc.div(O, l[..., None])  # step 7
    res = p.finish(out, l, m, hazards)
    with np.errstate(divide="ignore"):
        lse2 = mc.f(m) + np.log2(mc.f(l) * sigma)
    res.lse = (lse2 * mc.f(math.log(2.0))).reshape(res.lse.shape).astype(mc.dtype)
    return res



@dataclass
class Quantized:
    """SnapMLA's kernel inputs: FP8 content, BF16 (config A: FP8) RoPE, and the per-row / per-token scales."""

    q8: np.ndarray  # (b, R, d_v) e4m3
    qr: np.ndarray  # (b, R, 64)
    row_scale: np.ndarray  # (b, R): s_q softmax_scale log2 e
    c8: np.ndarray  # (b, S, d_v) e4m3: the content cache, also V
    kr: np.ndarray  # (b, S, 64)
    s_k: np.ndarray  # (b, S)


def kernel_inputs(q: npt.ArrayLike, kv: npt.ArrayLike, *, scale: float | None = None,
                  block: int = 64) -> dict[str, np.ndarray]:
    """The inputs of SnapMLA's decode kernel (``amla_sim.gpu``): the FP8 content cache and query, the BF16 RoPE
    parts, their scales, as this port quantizes them on ``sm90-triton`` (the cache padded to whole blocks, as the
    kernel reads it); ``context`` is the unpadded length."""
    p = make_problem(q, kv, machine="sm90-triton", schedule="amla-sim-gpu", scale=scale, block=block,
                     input_format="fp32")
    qz = quantize_inputs(p, "snapmla", block, Counter())
    return {"q8": qz.q8, "qr": qz.qr, "row_scale": qz.row_scale.astype(np.float32), "c8": qz.c8, "kr": qz.kr,
            "s_k": qz.s_k.astype(np.float32), "context": np.asarray(np.shape(kv)[1])}


def quantize_inputs(p: Problem, config: str, quant_block: int, hazards: Counter) -> Quantized:
    """The cache and query quantization of the port (or of an ablation config), on the problem's machine."""
    mc = p.machine
    d_v = p.d_v

    def count_sat(x: np.ndarray, s: np.ndarray) -> None:
        with np.errstate(divide="ignore", invalid="ignore"):
            hazards["saturated"] += int((np.abs(mc.f(x) / s) > SATURATION).sum())

    content, rope = p.K[..., :d_v], p.K[..., d_v:]
    q_nope, q_rope = p.Q[..., :d_v], p.Q[..., d_v:]
    if config == "A":  # one scale over all 576 dims, RoPE in FP8 too
        k8, s_k = quantize(p.K, "per-token", mc)
        q8, s_q = quantize(p.Q, "per-token", mc)
        count_sat(p.K, s_k)
        c8, kr, qr = k8[..., :d_v], k8[..., d_v:], q8[..., d_v:]
        q8 = q8[..., :d_v]
    else:
        gran = {"snapmla": "per-token", "B": "per-tensor-static", "C": "per-tensor-dynamic", "D": "per-block"}[config]
        c8, s_k = quantize(content, gran, mc, block=quant_block)
        count_sat(content, s_k)
        s_k = np.broadcast_to(s_k, content.shape[:-1] + (1,))
        kr = mc.cast(mc.f(rope) / s_k, "bf16")
        q8, s_q = quantize(q_nope, "per-tensor-static" if config == "B" else "per-token", mc)
        count_sat(q_nope, s_q)
        s_q = np.broadcast_to(s_q, q_nope.shape[:-1] + (1,))
        qr = mc.cast(mc.f(q_rope) / s_q, "bf16")
    s_k = np.ascontiguousarray(np.broadcast_to(s_k, p.K.shape[:-1] + (1,))[..., 0])
    s_q = np.broadcast_to(s_q, p.Q.shape[:-1] + (1,))[..., 0]
    row_scale = (s_q * mc.f(p.scale * LOG2E)).astype(mc.dtype)
    return Quantized(q8, qr, row_scale, c8, kr, s_k)
