"""Triton kernels of Base, AMLA, ETAP and SnapMLA for MLA decoding (d_k = 576 = 512 + 64 RoPE, V = the first 512 of K).

One program computes BLOCK_M = 64 query rows (s_q positions x heads, flattened) against every KV block of
BLOCK_N = 64 keys, for one half of d_v (256 columns; the grid's third axis picks the half, so the 64 x 256 FP32
accumulator fits one warpgroup's registers). The numerics mirror :mod:`amla_sim.algorithms` on the
``sm90-triton`` machines operation for operation:

- S = (q_nope k_nope^T, then q_pe k_pe^T chained into the same accumulator) * scale, masked keys at -inf
- EXP_MODE 0: ``tl.exp`` (ex2.approx, the hardware path); 1: ``_exp_poly``, the software exp that
  :func:`amla_sim.arith.elementwise.exp_poly` computes bit for bit
- DIV_MODE 0: ``/`` (div.full); 1: ``div_rn`` (IEEE)
- kernels are launched with ``enable_fp_fusion=False``; every FMA the algorithms mean is an explicit ``tl.fma``
- AMLA keeps O in global memory: an int32 ``tl.atomic_add`` of N on its bits, then an FP32 ``tl.atomic_add``
  of P~V (a store on the first block), then CANN's |O| > 1e10 clean-up and the final division
- DEBUG stores every block's S, P, m, l (and n, N for AMLA) and O after the block
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

# log2(e) = 1.4426950408889634 and ln(2) = 0.6931471805599453 appear as literals: @triton.jit functions read no
# Python globals, and Triton rounds them to fl32 (0x3FB8AA3B, 0x3F317218), as arith.elementwise's LOG2E_F32, LN2_F32


@triton.jit
def _pow2(k):
    """2^k for integer-valued FP32 k in [-126, 127], from its bits."""
    return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exp_poly(x):
    xc = tl.minimum(tl.maximum(x, -88.0), 88.0)
    n = libdevice.rint(xc * 1.4426950408889634)
    r = tl.fma(n, -0.693145751953125, xc)  # ln 2, high part (0x3F317200)
    r = tl.fma(n, -1.4286067653301870e-06, r)  # ln 2, low part (0x35BFBE8E)
    p = tl.fma(tl.full(r.shape, 1.0 / 720.0, tl.float32), r, 1.0 / 120.0)
    p = tl.fma(p, r, 1.0 / 24.0)
    p = tl.fma(p, r, 1.0 / 6.0)
    p = tl.fma(p, r, 0.5)
    p = tl.fma(p, r, 1.0)
    p = tl.fma(p, r, 1.0)
    nh = tl.floor(n * 0.5)
    y = (p * _pow2(nh)) * _pow2(n - nh)
    y = tl.where(y < 1.1754943508222875e-38, 0.0, y)  # flush results below 2^-126
    y = tl.where(x > 88.72283, float("inf"), y)
    return tl.where(x != x, x, y)


@triton.jit
def _exp(x, EXP_MODE: tl.constexpr):
    if EXP_MODE == 0:
        return tl.exp(x)
    else:
        return _exp_poly(x)


@triton.jit
def _div(a, b, DIV_MODE: tl.constexpr):
    if DIV_MODE == 0:
        return a / b
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def _load_q(q_base, offs_m, row_ok, offs_dn, offs_dr, D: tl.constexpr):
    """A program's query rows, split into the content (q_nope) and RoPE (q_pe) parts."""
    rows = q_base + offs_m[:, None] * D
    q_nope = tl.load(rows + offs_dn[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(rows + offs_dr[None, :], mask=row_ok[:, None], other=0.0)
    return q_nope, q_pe


@triton.jit
def _scores(q_nope, q_pe, kv_base, offs_n, S, limit, scale, offs_dn, offs_dr, D: tl.constexpr):
    """Masked, scaled scores of one KV block: (q_nope k_nope^T, then + q_pe k_pe^T) * scale."""
    kmask = offs_n < S
    k_nope = tl.load(kv_base + offs_n[:, None] * D + offs_dn[None, :], mask=kmask[:, None], other=0.0)
    k_pe = tl.load(kv_base + offs_n[:, None] * D + offs_dr[None, :], mask=kmask[:, None], other=0.0)
    qk = tl.dot(q_nope, tl.trans(k_nope))
    qk = tl.dot(q_pe, tl.trans(k_pe), qk)
    s = qk * scale
    return tl.where(offs_n[None, :] < limit[:, None], s, float("-inf"))


@triton.jit
def _softmax_step(s, m_i, EXP_MODE: tl.constexpr):
    """The online-softmax step of one block: the new max, it with -inf as 0, the rescale factor and P."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, m_safe, _exp(m_i - m_safe, EXP_MODE), _exp(s - m_safe[:, None], EXP_MODE)


@triton.jit
def _amla_scale(p, m_safe, EXP_MODE: tl.constexpr, DIV_MODE: tl.constexpr):
    """AMLA lines 6-10: n = round(-m / ln 2) (half away from zero), the BF16 scale S16, bf16(P S16), cof."""
    t = -m_safe * 1.4426950408889634
    n = tl.where(t < 0, -tl.floor(-t + 0.5), tl.floor(t + 0.5))
    c = _exp(tl.fma(m_safe, 1.4426950408889634, n) * 0.6931471805599453, EXP_MODE)
    c16 = c.to(tl.bfloat16).to(tl.float32)
    return n, c16, (p * c16[:, None]).to(tl.bfloat16), _div(c, c16, DIV_MODE)


@triton.jit
def _amla_accumulate(o_ptrs, o_int_ptrs, pv, row_ok, j, n, n_prev, cof, cof_prev, DIV_MODE: tl.constexpr,
                     BLOCK_M: tl.constexpr, DVH: tl.constexpr):
    """AMLA lines 11-18 on the output in global memory: the first block stored; then the int32 AtomicAdd of
    N 2^23 (a multiplication by 2^N) and the FP32 AtomicAdd of PV. Returns N_int (0 on the first block).

    The atomics of one element may be issued by different threads (Triton picks each op's layout), so every
    phase of the read-modify-write sequence is fenced by a CTA barrier: without them the int32 and FP32 adds
    race, and they do not commute."""
    tl.debug_barrier()
    N_int = tl.zeros((BLOCK_M,), tl.int32)
    if j == 0:
        tl.store(o_ptrs, pv, mask=row_ok[:, None])
    else:
        eps = _div(cof_prev, cof, DIV_MODE) - 1.0
        dn = tl.maximum(n - n_prev, -30.0)
        N = dn + 1.5 * eps + 1e-6
        N_int = libdevice.rint(N * 8388608.0).to(tl.int32)
        tl.atomic_add(o_int_ptrs, tl.broadcast_to(N_int[:, None], (BLOCK_M, DVH)), mask=row_ok[:, None])
        tl.debug_barrier()
        tl.atomic_add(o_ptrs, pv, mask=row_ok[:, None])
    tl.debug_barrier()
    return N_int


@triton.jit
def _store_stages(dbg_s, dbg_p, dbg_m, dbg_l, dbg_o, blk, offs_m, offs_v, row_ok, s, p, m_i, l_i, o_now,
                  BLOCK_N: tl.constexpr, DV: tl.constexpr):
    """The debug copies of one block's stages S, P, m, l and O."""
    tl.store(dbg_m + blk + offs_m, m_i, mask=row_ok)
    tl.store(dbg_l + blk + offs_m, l_i, mask=row_ok)
    cols = tl.arange(0, BLOCK_N)
    tl.store(dbg_s + (blk + offs_m[:, None]) * BLOCK_N + cols[None, :], s, mask=row_ok[:, None])
    tl.store(dbg_p + (blk + offs_m[:, None]) * BLOCK_N + cols[None, :], p, mask=row_ok[:, None])
    tl.store(dbg_o + (blk + offs_m[:, None]) * DV + offs_v[None, :], o_now, mask=row_ok[:, None])


@triton.jit
def mla_decode_kernel(
    q_ptr, kv_ptr, out_ptr, obuf_ptr, obuf_int_ptr,
    dbg_s, dbg_p, dbg_m, dbg_l, dbg_n, dbg_N, dbg_o,
    R, S, G, SQ, NBLK, scale,
    D: tl.constexpr, DV: tl.constexpr, DVH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ALGO: tl.constexpr, EXP_MODE: tl.constexpr, DIV_MODE: tl.constexpr, DEBUG: tl.constexpr,
):
    """ALGO 0: Base (Algorithm 1). ALGO 1: AMLA (Algorithm 2 as CANN ships it, its steps in _amla_scale and
    _amla_accumulate)."""
    pid_m = tl.program_id(0)
    bid = tl.program_id(1)
    half = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < R
    offs_dn = tl.arange(0, DV)
    offs_dr = DV + tl.arange(0, D - DV)
    offs_v = half * DVH + tl.arange(0, DVH)
    kv_base = kv_ptr + bid * S * D
    q_nope, q_pe = _load_q(q_ptr + bid * R * D, offs_m, row_ok, offs_dn, offs_dr, D)
    limit = S - SQ + 1 + offs_m // G  # causal within the MTP step: keys < limit are visible

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DVH), tl.float32)
    n_prev = tl.zeros((BLOCK_M,), tl.float32)
    cof_prev = tl.full((BLOCK_M,), 1.0, tl.float32)
    c16 = tl.full((BLOCK_M,), 1.0, tl.float32)
    o_ptrs = obuf_ptr + bid * R * DV + offs_m[:, None] * DV + offs_v[None, :]
    o_int_ptrs = obuf_int_ptr + bid * R * DV + offs_m[:, None] * DV + offs_v[None, :]  # the same bytes as int32
    for j in range(0, NBLK):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        s = _scores(q_nope, q_pe, kv_base, offs_n, S, limit, scale, offs_dn, offs_dr, D)
        m_new, m_safe, alpha, p = _softmax_step(s, m_i, EXP_MODE)
        l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
        v = tl.load(kv_base + offs_n[:, None] * D + offs_v[None, :], mask=(offs_n < S)[:, None], other=0.0)
        if ALGO == 0:
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(tl.bfloat16), v, acc)
        else:
            n, c16, p_t, cof = _amla_scale(p, m_safe, EXP_MODE, DIV_MODE)
            pv = tl.dot(p_t, v)
            N_int = _amla_accumulate(o_ptrs, o_int_ptrs, pv, row_ok, j, n, n_prev, cof, cof_prev, DIV_MODE,
                                     BLOCK_M, DVH)
            if DEBUG:
                tl.store(dbg_n + (bid * NBLK + j) * R + offs_m, n, mask=row_ok)
                if j > 0:
                    tl.store(dbg_N + (bid * NBLK + j) * R + offs_m, N_int, mask=row_ok)
            n_prev = n
            cof_prev = cof
        m_i = m_new
        if DEBUG:
            if ALGO == 0:
                o_now = acc
            else:
                o_now = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0, volatile=True)
            _store_stages(dbg_s, dbg_p, dbg_m, dbg_l, dbg_o, (bid * NBLK + j) * R, offs_m, offs_v, row_ok, s, p,
                          m_i, l_i, o_now, BLOCK_N, DV)
    if ALGO == 1:
        tl.debug_barrier()
        acc = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0, volatile=True)
        acc = tl.where(tl.abs(acc) > 1e10, 0.0, acc)  # CANN's clean-up
        denom = l_i * c16
    else:
        denom = l_i
    out = _div(acc, denom[:, None], DIV_MODE)
    tl.store(out_ptr + bid * R * DV + offs_m[:, None] * DV + offs_v[None, :], out.to(tl.bfloat16),
             mask=row_ok[:, None])


@triton.jit
def _exp2(x, EXP_MODE: tl.constexpr):
    if EXP_MODE == 0:
        return tl.exp2(x)  # ex2.approx.ftz.f32
    else:
        return _exp_poly(x * 0.6931471805599453)


@triton.jit
def snapmla_decode_kernel(
    q8_ptr, qr_ptr, rs_ptr, c8_ptr, kr_ptr, sk_ptr, out_ptr,
    dbg_s, dbg_p, dbg_m, dbg_l, dbg_o,
    R, S, S_PAD, G, SQ, NBLK,
    DV: tl.constexpr, DR: tl.constexpr, DVH: tl.constexpr, TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EXP_MODE: tl.constexpr, DIV_MODE: tl.constexpr, DEBUG: tl.constexpr,
):
    """SnapMLA as ported (notes Section 4): FP8 content tiles, BF16 RoPE, scale fusion into P, FP8 P V.

    The quantized inputs come from :func:`amla_sim.algorithms.snapmla.quantize_inputs`; the cache is padded
    to whole blocks (S_PAD) and S is the real context for the causal mask.
    """
    pid_m = tl.program_id(0)
    bid = tl.program_id(1)
    half = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < R
    offs_t = tl.arange(0, TILE)
    offs_r = tl.arange(0, DR)
    offs_v = half * DVH + tl.arange(0, DVH)
    q_rows = q8_ptr + bid * R * DV + offs_m[:, None] * DV
    q0 = tl.load(q_rows + offs_t[None, :], mask=row_ok[:, None], other=0.0)
    q1 = tl.load(q_rows + (TILE + offs_t)[None, :], mask=row_ok[:, None], other=0.0)
    q2 = tl.load(q_rows + (2 * TILE + offs_t)[None, :], mask=row_ok[:, None], other=0.0)
    q3 = tl.load(q_rows + (3 * TILE + offs_t)[None, :], mask=row_ok[:, None], other=0.0)
    qr = tl.load(qr_ptr + bid * R * DR + offs_m[:, None] * DR + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    rs = tl.load(rs_ptr + bid * R + offs_m, mask=row_ok, other=0.0)
    limit = S - SQ + 1 + offs_m // G

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    sigma = tl.full((BLOCK_M,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_M, DVH), tl.float32)
    for j in range(0, NBLK):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        c_rows = c8_ptr + bid * S_PAD * DV + offs_n[:, None] * DV
        qk = tl.dot(q0, tl.trans(tl.load(c_rows + offs_t[None, :])))  # step 1: four 128-wide FP8 tiles
        qk += tl.dot(q1, tl.trans(tl.load(c_rows + (TILE + offs_t)[None, :])))
        qk += tl.dot(q2, tl.trans(tl.load(c_rows + (2 * TILE + offs_t)[None, :])))
        qk += tl.dot(q3, tl.trans(tl.load(c_rows + (3 * TILE + offs_t)[None, :])))
        kr = tl.load(kr_ptr + bid * S_PAD * DR + offs_n[:, None] * DR + offs_r[None, :])
        qk = tl.dot(qr, tl.trans(kr), qk)  # the BF16 RoPE tile, last
        sk = tl.load(sk_ptr + bid * S_PAD + offs_n)
        x = qk * rs[:, None] * sk[None, :]  # step 2, in log2 units
        x = tl.where(offs_n[None, :] < limit[:, None], x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = _exp2(x - m_safe[:, None], EXP_MODE)
        f = e * sk[None, :]  # step 3: scale fusion
        sigma_new = _div(tl.maximum(tl.max(f, 1), 1e-26), 448.0, DIV_MODE)
        p8 = _div(f, sigma_new[:, None], DIV_MODE).to(tl.float8e4nv)  # cvt.rn.satfinite
        beta = _exp2(m_i - m_safe, EXP_MODE) * _div(sigma, sigma_new, DIV_MODE)  # step 4
        l_i = tl.fma(beta, l_i, _div(tl.sum(e, 1), sigma_new, DIV_MODE))  # step 5
        v = tl.load(c8_ptr + bid * S_PAD * DV + offs_n[:, None] * DV + offs_v[None, :])
        acc = acc * beta[:, None]
        acc += tl.dot(p8, v)  # step 6: FP8 x FP8
        m_i = m_new
        sigma = sigma_new
        if DEBUG:
            blk = (bid * NBLK + j) * R
            cols = tl.arange(0, BLOCK_N)
            tl.store(dbg_m + blk + offs_m, m_i, mask=row_ok)
            tl.store(dbg_l + blk + offs_m, l_i, mask=row_ok)
            tl.store(dbg_s + (blk + offs_m[:, None]) * BLOCK_N + cols[None, :], x, mask=row_ok[:, None])
            tl.store(dbg_p + (blk + offs_m[:, None]) * BLOCK_N + cols[None, :], p8.to(tl.float32),
                     mask=row_ok[:, None])
            tl.store(dbg_o + (blk + offs_m[:, None]) * DV + offs_v[None, :], acc, mask=row_ok[:, None])
    out = _div(acc, l_i[:, None], DIV_MODE)  # step 7
    tl.store(out_ptr + bid * R * DV + offs_m[:, None] * DV + offs_v[None, :], out.to(tl.bfloat16),
             mask=row_ok[:, None])


@triton.jit
def etap_decode_kernel(
    q_ptr, kv_ptr, out_ptr,
    dbg_s, dbg_p, dbg_m, dbg_o,
    R, S, G, SQ, NBLK, scale,
    D: tl.constexpr, DV: tl.constexpr, DVH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EXP_MODE: tl.constexpr, DIV_MODE: tl.constexpr, DEBUG: tl.constexpr,
):
    """ETAP: S^T = K Q^T and O^T = V^T P^T (keys and d_v on the MMA's M side), KV blocks last to first, and the
    row sums kept per key slot in a (keys x rows) FP32 tile that is reduced across threads once, at the end."""
    pid_m = tl.program_id(0)
    bid = tl.program_id(1)
    half = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows, on the N side
    row_ok = offs_m < R
    offs_dn = tl.arange(0, DV)
    offs_dr = DV + tl.arange(0, D - DV)
    offs_v = half * DVH + tl.arange(0, DVH)
    kv_base = kv_ptr + bid * S * D
    q_nope, q_pe = _load_q(q_ptr + bid * R * D, offs_m, row_ok, offs_dn, offs_dr, D)
    limit = S - SQ + 1 + offs_m // G

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_t = tl.zeros((DVH, BLOCK_M), tl.float32)
    for jj in range(0, NBLK):
        j = NBLK - 1 - jj  # backward block order
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        kmask = offs_n < S
        k_nope = tl.load(kv_base + offs_n[:, None] * D + offs_dn[None, :], mask=kmask[:, None], other=0.0)
        k_pe = tl.load(kv_base + offs_n[:, None] * D + offs_dr[None, :], mask=kmask[:, None], other=0.0)
        st = tl.dot(k_nope, tl.trans(q_nope))  # S^T = K Q^T
        st = tl.dot(k_pe, tl.trans(q_pe), st)
        st = st * scale
        st = tl.where(offs_n[:, None] < limit[None, :], st, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _exp(m_i - m_safe, EXP_MODE)
        p_t = _exp(st - m_safe[None, :], EXP_MODE)
        l_acc = l_acc * alpha[None, :]
        l_acc = l_acc + p_t  # each key slot keeps its own FP32 partial sum of the unrounded P
        v = tl.load(kv_base + offs_n[:, None] * D + offs_v[None, :], mask=kmask[:, None], other=0.0)
        acc_t = acc_t * alpha[None, :]
        acc_t = tl.dot(tl.trans(v), p_t.to(tl.bfloat16), acc_t)  # O^T = V^T P^T
        m_i = m_new
        if DEBUG:
            blk = (bid * NBLK + jj) * R
            cols = tl.arange(0, BLOCK_N)
            tl.store(dbg_m + blk + offs_m, m_i, mask=row_ok)
            tl.store(dbg_s + (blk + offs_m[None, :]) * BLOCK_N + cols[:, None], st, mask=row_ok[None, :])
            tl.store(dbg_p + (blk + offs_m[None, :]) * BLOCK_N + cols[:, None], p_t, mask=row_ok[None, :])
            tl.store(dbg_o + (blk + offs_m[None, :]) * DV + offs_v[:, None], acc_t, mask=row_ok[None, :])
    l_i = tl.sum(l_acc, 0)  # the one reduction across threads
    out_t = _div(acc_t, l_i[None, :], DIV_MODE)
    tl.store(out_ptr + bid * R * DV + offs_m[None, :] * DV + offs_v[:, None], out_t.to(tl.bfloat16),
             mask=row_ok[None, :])
