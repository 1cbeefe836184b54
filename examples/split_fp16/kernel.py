"""A user's MLA decode kernel, not part of amla-sim: P rounded to FP16 (V converted to FP16 for the product), and
the KV range cut in two splits whose partial results a second kernel combines.

Launch settings that decide bits: BLOCK_M = BLOCK_N = 64, num_warps=4 (the row sums of P then follow the wgmma
accumulator layout), ``enable_fp_fusion=False`` (no FMA the code does not write).
"""

import math

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, D, DV = 64, 64, 576, 512


@triton.jit
def split_kernel(q_ptr, kv_ptr, o_ptr, m_ptr, l_ptr, R, S, G, SQ, NBLK, HALF, scale,
                 D: tl.constexpr, DV: tl.constexpr, DVH: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """One split (z // 2) of one half of d_v (z % 2) for BLOCK_M query rows: the online softmax over its blocks."""
    pid_m, bid, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    split, half = z // 2, z % 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < R
    offs_dn, offs_dr = tl.arange(0, DV), DV + tl.arange(0, D - DV)
    offs_v = half * DVH + tl.arange(0, DVH)
    q_rows = q_ptr + (bid * R + offs_m[:, None]) * D
    q_nope = tl.load(q_rows + offs_dn[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_rows + offs_dr[None, :], mask=row_ok[:, None], other=0.0)
    kv = kv_ptr + bid * S * D
    limit = S - SQ + 1 + offs_m // G  # causal within the query step
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DVH), tl.float32)
    for j in range(split * HALF, tl.minimum(split * HALF + HALF, NBLK)):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = (offs_n < S)[:, None]
        k_nope = tl.load(kv + offs_n[:, None] * D + offs_dn[None, :], mask=k_ok, other=0.0)
        k_pe = tl.load(kv + offs_n[:, None] * D + offs_dr[None, :], mask=k_ok, other=0.0)
        s = tl.dot(q_pe, tl.trans(k_pe), tl.dot(q_nope, tl.trans(k_nope))) * scale
        s = tl.where(offs_n[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
        v = tl.load(kv + offs_n[:, None] * D + offs_v[None, :], mask=k_ok, other=0.0).to(tl.float16)
        acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
        m_i = m_new
    part = (split * tl.num_programs(1) + bid) * R + offs_m
    tl.store(o_ptr + part[:, None] * DV + offs_v[None, :], acc, mask=row_ok[:, None])
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)


@triton.jit
def combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, ROWS, DV: tl.constexpr):
    """out = (O_0 a_0 + O_1 a_1) / (l_0 a_0 + l_1 a_1), a_i = exp(m_i - max(m_0, m_1)), in BF16."""
    row = tl.program_id(0)
    cols = tl.arange(0, DV)
    m0, m1 = tl.load(m_ptr + row), tl.load(m_ptr + ROWS + row)
    m = tl.maximum(m0, m1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    a0, a1 = tl.exp(m0 - m_safe), tl.exp(m1 - m_safe)
    l = tl.load(l_ptr + row) * a0 + tl.load(l_ptr + ROWS + row) * a1
    o = tl.load(o_ptr + row * DV + cols) * a0 + tl.load(o_ptr + (ROWS + row) * DV + cols) * a1
    tl.store(out_ptr + row * DV + cols, (o / l).to(tl.bfloat16))


def split_fp16_decode(q: torch.Tensor, kv: torch.Tensor, scale: float | None = None) -> dict[str, torch.Tensor]:
    """q (b, s_q, G, 576), kv (b, S, 576), BF16 on the GPU -> out (b, s_q, G, 512) BF16 and each split's m, l, O."""
    b, s_q, G, _ = q.shape
    S, R = kv.shape[1], s_q * G
    nblk = triton.cdiv(S, BLOCK_N)
    half = triton.cdiv(nblk, 2)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o = torch.zeros((2, b, R, DV), device=q.device, dtype=torch.float32)
    m = torch.full((2, b, R), float("-inf"), device=q.device, dtype=torch.float32)
    l = torch.zeros((2, b, R), device=q.device, dtype=torch.float32)
    split_kernel[(triton.cdiv(R, BLOCK_M), b, 4)](
        q.contiguous(), kv.contiguous(), o, m, l, R, S, G, s_q, nblk, half, scale,
        D=D, DV=DV, DVH=DV // 2, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4, num_stages=1, enable_fp_fusion=False)
    out = torch.empty((b, R, DV), device=q.device, dtype=torch.bfloat16)
    combine_kernel[(b * R,)](o, m, l, out, b * R, DV=DV, num_warps=4, enable_fp_fusion=False)
    return {"m": m, "l": l, "O": o, "out": out.view(b, s_q, G, DV)}
