"""FlashMLA's sm90 sparse prefill (``flash_mla_sparse_fwd``, DeepSeek V3.2's sparse attention over a BF16 cache),
written against a machine.

Upstream: deepseek-ai/FlashMLA 9241ae3, ``csrc/sm90/prefill/sparse/phase1.cuh`` (the kernel), ``config.h`` (tiles
and wgmma atoms), ``csrc/api/sparse_fwd.h`` (checks, ``sm_scale * LOG_2_E``). The line numbers below are
``phase1.cuh``'s unless another file is named. vLLM's ``FLASHMLA_SPARSE`` backend (BF16 cache) and SGLang's DSA
prefill on Hopper call it. On ``sm90-cuda`` it predicts out, max_logits and lse bit for bit: 100% of an H100's
capture of the cross-check's 8 cases (``crosscheck --kernel flashmla-sparse-prefill``).

Every query token i attends to the cache rows ``indices[i, 0, :]`` names; a slot is empty where its index is
negative, ``>= s_kv``, or (with ``topk_length``) at a position ``>= topk_length[i]`` (producer, 485-488). One CTA
takes one token and 64 heads (46-47, 629: a grid of ``s_q h_q / 64``), each head a row, every row independent, and no
split: a token's bits depend on nothing else in the launch. The CTA walks ``ceil(topk_length / 64)`` (or
``topk / 64``) blocks of 64 slots, two at a time (398, 306: a last odd block is paired with an empty one). With
``c = fl32(fl32(scale) fl32(log2 e))`` (``sparse_fwd.h:171``), ``m`` the shared running max in log2 units from
-1e30 (``config.h:29``, 96), per pair (blocks b, b + 1):

- warpgroup 0: ``S0 = Q K_b^T`` on the tensor cores, k in order 0..575 (264-279); empty slots -inf (119-131);
  ``m0 = max(m, fl(rowmax(S0) c))`` (145-156), ``s0 = exp2(fl(m - m0))`` (159), ``P0 = exp2(fma(S0, c, -m0))``
  (170), ``O_L = fl(O_L s0) + bf16(P0) V_b[:, :256]`` (161-163, 172, 325), lanes' sums ``l0 = fma(l0, s0, sum)``
  (174-176);
- warpgroup 1: ``S1 = Q K_{b+1}^T`` with k in order 256..575, then 0..255 (380-394); ``m' = max(m0, fl(rowmax(S1)
  c))`` (139, 156), ``s1 = exp2(fl(m - m'))`` (its own previous max, 159), ``P1 = exp2(fma(S1, c, -m'))``,
  ``O_R = fl(O_R s1) + bf16(P1) V_{b+1}[:, 256:]`` (416), ``l1 = fma(l1, s1, sum)``;
- warpgroup 0 again: ``t = exp2(fl(m0 - m'))`` (339), shares ``bf16(fl(P0 t))`` (288, 342-343), ``O_L = fl(O_L t)``,
  ``l0 = fl(l0 t)`` (294-303, 351), ``O_L += bf16(P1) V_{b+1}[:, :256]`` (352); warpgroup 1 ``O_R +=
  bf16(fl(P0 t)) V_b[:, 256:]`` (422); ``m = m'``.

A lane's sum adds its column pairs ``(8j + 2t, 8j + 2t + 1)`` first, then the 8 pairs in order from 0 (167-175).
At the end ``L = ((l0_0 + l0_1) + (l0_2 + l0_3)) + (the same of l1)`` (186-199); out ``bf16(fl(O r))`` with ``r =
MUFU.RCP(L + exp2(fl(fl(attn_sink fl32(log2 e)) - m)))`` (-inf without a sink), 0 where L = 0 (201-228);
max_logits ``fl(m ln 2)`` and lse ``fma(lg2(L), ln 2, fl(m ln 2))`` (``__logf`` under fast math), -inf and +inf
where L = 0 (443-450); the sink changes neither. exp2 and lg2 are ``ex2.approx.ftz`` and ``lg2.approx.ftz``
(``--use_fast_math``). The module-level functions named in :data:`CHOICES` are the modelled choices least sure
from the source alone; against the H100 capture, each alternative named there changes bits (but ``div.full`` for
the reciprocal, which differs only past 2^126).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ...._validate import quiet_fp
from ....machines import Machine
from ....schedules import Schedule
from ..._common import D_V, AttentionResult, _check_storage, causal_lists, check_kernel_layout
from ..scalars import scale_log2_f32, softmax_scale
from .builds import DEFAULT_BUILD, resolve_build

__all__ = ["flashmla_sparse_prefill", "SparsePrefillResult", "B_TOPK", "HEADS", "D_QK", "CHOICES", "padded_heads",
           "flashmla_sparse_prefill_decode"]

#: Slots per block (``B_TOPK``, config.h:27); topk must be a multiple of two blocks (phase1.cuh:577).
B_TOPK = 64
#: The head counts the API takes (``sparse_fwd.h:192-198``), 64 to a CTA.
HEADS = (64, 128)
#: q's and kv's head dims: DeepSeek V3.2's 576 (512 + 64 RoPE) and MODEL1's 512 (``sparse_fwd.h:131``).
D_QK = (576, 512)
_HALF = D_V // 2  # each warpgroup's half of O's columns (phase1.cuh:98, rO of D_V/2)
_MAX_INIT = -1e30  # MAX_INIT_VAL (config.h:29): the running max before the first block
_LOG2E = math.log2(math.e)  # CUDART_L2E_F: fl32(log2 e) on FP32 machines, exact on golden
_ROWS_PER_CHUNK = 16384  # (token, head) rows simulated at once: tokens are independent, so chunking changes no bit
_PAIRS_AT_ONCE = 8  # pairs whose scores one product takes at most: 512 columns, the compiled chain's fastest
# width (of 1 to 16 pairs; benchmarks/notes/v32-kernel-models.md)

#: The modelled choices the source leaves least certain (module functions a test may replace), and their
#: alternatives; tests/test_flashmla_sparse_prefill.py shows each alternative changing the H100 capture's bits.
CHOICES = {
    "_second_wg_scores": "warpgroup 1's k order 256..575 then 0..255 (380-394); alternative: 0..575",
    "_lane_sums": "pairs first, then the pairs in order (cur_sum += P(i) + P(i+1)); alternative: one at a time",
    "_row_total": "(l0 + l1) + (l2 + l3) per warpgroup, then wg0 + wg1; alternative: ((l0 + l1) + l2) + l3",
    "_probabilities": "exp2(fma(S, c, -m)); alternative: exp2(fl(fl(S c) - m))",
    "_sink_term": "exp2(fl(fl(sink log2e) - m)) (the select before the subtract keeps the product apart); "
                  "alternative: exp2(fma(sink, log2e, -m))",
    "_reciprocal": "rcp.approx.ftz (1.0f / x under -prec-div=false); alternatives: div.full (differs only for "
                   "x > 2^126), IEEE division",
    "_lse": "fma(lg2(L), ln2, fl(m ln2)) (__logf's multiply contracted); alternatives: fma(m, ln2, fl(lg2(L) ln2)), "
            "fl(fl(lg2(L) ln2) + fl(m ln2))",
}


@dataclass
class SparsePrefillResult(AttentionResult):
    """:class:`AttentionResult` plus the kernel's third output. out: (s_q, h_q, 512) BF16; lse and max_logits:
    (s_q, h_q), natural log (FP32; float64 on golden)."""

    max_logits: np.ndarray | None = None


def _check(q, kv, indices, topk_length, attn_sink, scale, double=False):
    """Everything ``sparse_attn_prefill_interface`` checks or the kernel asserts (``sparse_fwd.h:117-198``,
    ``phase1.cuh:576-579``), refused by argument name before any work."""
    qa = _check_storage(q, "q", ("bf16",))
    if qa.ndim != 3 or qa.shape[0] < 1 or qa.shape[2] not in D_QK:
        raise ValueError(f"q: expected (s_q, h_q, 576 or 512) with s_q >= 1, got {qa.shape}")
    s_q, h_q, d_qk = qa.shape
    if h_q not in HEADS:
        raise ValueError(f"q: the kernel takes h_q = 64 or 128 heads (vLLM and SGLang pad fewer with zero heads), "
                         f"got {h_q}")
    kva = _check_storage(kv, "kv", ("bf16",))
    if kva.ndim != 3 or kva.shape[0] < 1 or kva.shape[2] != d_qk:
        raise ValueError(f"kv: expected (s_kv, 1, {d_qk}) with s_kv >= 1 (q's head dim), got {kva.shape}")
    if kva.shape[1] != 1:
        raise ValueError(f"kv: the kernel takes one KV head (h_kv = 1), got {kva.shape[1]}")
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu" or idx.ndim != 3 or idx.shape[:2] != (s_q, 1):
        raise ValueError(f"indices: expected ints ({s_q}, 1, topk), got {idx.dtype} {idx.shape}")
    topk = idx.shape[2]
    if topk < 2 * B_TOPK or topk % (2 * B_TOPK):
        raise ValueError(f"indices: topk must be a positive multiple of {2 * B_TOPK}, got {topk}")
    has_len = topk_length is not None
    if has_len:
        tl_ = np.asarray(topk_length)
        if tl_.dtype.kind not in "iu" or tl_.shape != (s_q,) or tl_.min() < 0 or tl_.max() > topk:
            raise ValueError(f"topk_length: expected {s_q} ints in 0..{topk}, got {topk_length!r}")
        lengths = tl_.astype(np.int64)
    else:
        lengths = np.full(s_q, topk, np.int64)
    sink = None
    if attn_sink is not None:
        sink = np.asarray(attn_sink)
        if sink.dtype != np.float32 or sink.shape != (h_q,) or np.isnan(sink).any():
            raise ValueError(f"attn_sink: expected float32 ({h_q},) without NaN, got {sink.dtype} {sink.shape}")
    sm = softmax_scale(scale, default=d_qk ** -0.5, double=double)
    return qa, kva, idx.astype(np.int64)[:, 0], lengths, has_len, sink, sm


def padded_heads(h: int) -> int:
    """The heads the kernel runs for `h` query heads: vLLM and SGLang pad q with zero heads to 64 (or 128)."""
    return 64 if h <= 64 else 128


@quiet_fp
def flashmla_sparse_prefill(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    indices: npt.ArrayLike,
    *,
    topk_length: npt.ArrayLike | None = None,
    attn_sink: npt.ArrayLike | None = None,
    scale: float | None = None,
    build: str = DEFAULT_BUILD,
    machine: str | Machine | None = None,
    trace: bool = False,
) -> SparsePrefillResult:
    """FlashMLA's sparse prefill ``flash_mla_sparse_fwd`` as `build` compiles it (see the module docstring;
    ``vllm``, the default, ``sglang`` or ``upstream``, as :mod:`.builds` says; `machine`: other arithmetic
    instead, a what-if).

    q: (s_q, h_q, d_qk) BF16, h_q 64 or 128, d_qk 576 (V3.2) or 512 (MODEL1); kv: (s_kv, 1, d_qk) BF16, V its
    first 512 columns; indices: (s_q, 1, topk) ints (any width), topk a positive multiple of 128, -1 (any
    negative) or >= s_kv for an empty slot; topk_length: (s_q,) ints in 0..topk (token i attends to its first
    topk_length[i] slots); attn_sink: (h_q,) float32 without NaN (-inf: no effect, +inf: out 0); scale: the
    softmax scale (the API's ``float sm_scale``; None: d_qk^-0.5).

    Returns ``.out`` (s_q, h_q, 512) BF16, ``.lse`` and ``.max_logits`` (s_q, h_q), natural log, as the kernel
    returns them: a row that attends to nothing gets out 0, max_logits -inf and lse +inf; the sink scales out by
    ``exp(lse) / (exp(lse) + exp(sink))`` and leaves both statistics. With `trace`, ``trace`` holds each token's
    block count (``num_blocks``), the rows' final max in log2 units (``m``) and row sums (``L``).

    Fewer heads (heads_padded): vLLM and SGLang pad q with zero heads up to 64 (and the sink with zeros) and keep
    the first h heads of the result. Rows are independent, so the real heads' bits are those of the padded call:
    pad here the same way (``np.concatenate([q, zeros], axis=1)``) and slice ``out[:, :h]``.
    """
    mc, double = resolve_build("sparse_prefill", build, machine)
    mc.require(kernel="flashmla-sparse-prefill", log2=True, suggest="sm90-cuda")
    qa, kva, idx, lengths, has_len, sink, sm = _check(q, kv, indices, topk_length, attn_sink, scale, double)
    s_q, H, _ = qa.shape
    s_kv, topk = kva.shape[0], idx.shape[1]
    Q = mc.cast(qa, "bf16")
    keys = mc.cast(kva[:, 0, :], "bf16")
    c = scale_log2_f32(mc, sm)  # sparse_fwd.h:171, params.sm_scale_div_log2 = sm_scale * LOG_2_E
    ok = (idx >= 0) & (idx < s_kv)  # phase1.cuh:485
    if has_len:
        ok &= np.arange(topk) < lengths[:, None]  # 486-488
        n_blocks = -(-lengths // B_TOPK)  # 81: ceil_div(topk_length, B_TOPK)
    else:
        n_blocks = np.full(s_q, topk // B_TOPK, np.int64)
    pairs = _pairs_walked(ok, (n_blocks + 1) // 2)  # 398: block_idx += 2 while block_idx < num_topk_blocks
    dt = mc.dtype
    sink_row = np.full((1, H), -np.inf, dt) if sink is None else mc.f(sink)[None, :]  # 205: -inf without a sink
    ln2 = mc.f(math.log(2.0))  # CUDART_LN2_F
    out = np.zeros((s_q, H, D_V), dt)
    L_all, m_all = np.zeros((s_q, H), dt), np.zeros((s_q, H), dt)
    step = max(1, _ROWS_PER_CHUNK // H)
    for lo in range(0, s_q, step):
        sl = slice(lo, min(lo + step, s_q))
        O, L, m = _token_rows(mc, Q[sl], keys, idx[sl], ok[sl], pairs[sl], c)
        r = np.where(L == 0, mc.f(0.0), _reciprocal(mc, mc.f(L + _sink_term(mc, sink_row, m))))  # 206-208
        out[sl] = mc.mul(O, r[..., None])  # 228: bf16(rO * scale_factor), rounded below
        L_all[sl], m_all[sl] = L, m
    empty = L_all == 0  # 447: is_no_valid_tokens
    max_logits = np.where(empty, -np.inf, _max_logits(mc, m_all, ln2)).astype(dt)  # 448
    lse = np.where(empty, np.inf, _lse(mc, L_all, m_all, ln2)).astype(dt)  # 449
    hazards = Counter()
    if np.isnan(out).any():
        hazards["nan_outputs"] += int(np.isnan(out).sum())
    tr = {"num_blocks": [n_blocks], "m": [m_all], "L": [L_all]} if trace else {}
    return SparsePrefillResult(mc.cast(out, "bf16"), lse, tr, hazards, max_logits)


def _pairs_walked(ok: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """The pairs of blocks the model walks of the `pairs` the kernel walks: up to each token's last pair with an
    attended slot. Past it nothing changes (the max stays, both rescales are ex2(0) = 1, P is 0, and a product of
    zeros onto O adds nothing), so the model stops where the kernel goes on; a test holds the two to the same bits."""
    attended = ok.reshape(ok.shape[0], -1, 2 * B_TOPK).any(axis=2)  # topk is a multiple of two blocks
    last = np.where(attended.any(axis=1), attended.shape[1] - np.argmax(attended[:, ::-1], axis=1), 0)
    return np.minimum(pairs, last)


def _token_rows(mc: Machine, Q: np.ndarray, keys: np.ndarray, idx: np.ndarray, ok: np.ndarray, pairs: np.ndarray,
                c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CTAs of n tokens, Q (n, H, d), in lockstep, a pair of blocks at a time (a token past its last pair keeps
    its state): O (n, H, 512) not yet scaled, L and m (n, H).

    The scores do not depend on the softmax state, so each warpgroup's scores of several pairs come from one
    product (as many as :meth:`Machine.block_width` allows: one pair unless the matrix unit computes each column on
    its own), and where it does, P1's two products with V (warpgroup 0's left half, warpgroup 1's right half) are
    one product of 512 columns: the same bits, fewer and wider products."""
    dt = mc.dtype
    n, H, _ = Q.shape
    m = np.full((n, H), mc.f(_MAX_INIT), dt)  # 96: rM
    OL, OR = np.zeros((n, H, _HALF), dt), np.zeros((n, H, _HALF), dt)  # 98, 101: each warpgroup's rO
    l0, l1 = np.zeros((n, H, 4), dt), np.zeros((n, H, 4), dt)  # 97: rL, per lane of a row's four
    last = int(pairs.max(initial=0))
    p = 0
    while p < last:
        live0 = np.nonzero(pairs > p)[0]  # the tokens of this group of pairs (some may stop within it)
        rows = len(live0) * H
        group = min(last - p, _PAIRS_AT_ONCE, max(1, mc.block_width(rows, B_TOPK) // B_TOPK))
        whole = mc.block_width(rows, _HALF) >= D_V  # the unit computes each column on its own
        Q0, idx0, ok0_ = Q[live0], idx[live0], ok[live0]
        K0s, ok0s = _block(keys, idx0, ok0_, range(2 * p, 2 * (p + group), 2))  # warpgroup 0's blocks
        K1s, ok1s = _block(keys, idx0, ok0_, range(2 * p + 1, 2 * (p + group), 2))  # warpgroup 1's
        S0s = _masked(mc, _scores(mc, _first_wg_scores, Q0, K0s, rows), ok0s)
        S1s = _masked(mc, _scores(mc, _second_wg_scores, Q0, K1s, rows), ok1s)
        for j in range(group):
            at = np.nonzero(pairs[live0] > p + j)[0]  # this pair's tokens, as rows of the group's arrays
            live = live0[at]
            at = slice(None) if len(at) == len(live0) else at  # (every token of the group: views, no copies)
            cols = slice(j * B_TOPK, (j + 1) * B_TOPK)
            K0, K1 = K0s[at, cols], K1s[at, cols]
            S0, S1 = S0s[at, :, cols], S1s[at, :, cols]
            mp = m[live]
            # warpgroup 0, block 2p (online_softmax_and_rescale_o, 133-184; then 325)
            m0 = np.fmax(mp, _scaled_max(mc, S0, c))  # 145-156: fmaxf ignores NaN
            s0 = mc.exp2(mc.f(mp - m0))  # 159
            P0 = _probabilities(mc, S0, c, m0)  # 170
            P0b = mc.cast(P0, "bf16")  # 172: rS = (bf16)rP
            oL = mc.matmul(mc.operand(P0b), mc.operand(K0[..., :_HALF]), mc.mul(OL[live], s0[..., None]))  # 161-163, 325
            a0 = _lane_update(mc, l0[live], s0, _lane_sums(mc, P0))  # 167-176
            # warpgroup 1, block 2p + 1: its old max is its own rM (= mp), its new one the max with warpgroup 0's sM
            m1 = np.fmax(m0, _scaled_max(mc, S1, c))  # 139, 156
            s1 = mc.exp2(mc.f(mp - m1))  # 159
            P1 = _probabilities(mc, S1, c, m1)
            P1b = mc.operand(mc.cast(P1, "bf16"))
            a1 = _lane_update(mc, l1[live], s1, _lane_sums(mc, P1))
            # warpgroup 0 reads the new max, rescales its P for warpgroup 1, its O and its sums (336-352)
            t = mc.exp2(mc.f(m0 - m1))  # 339
            P0s = mc.cast(mc.mul(P0, t[..., None]), "bf16")  # 288: rS = (bf16)(rP * scales)
            accL, accR = mc.mul(oL, t[..., None]), mc.mul(OR[live], s1[..., None])  # 299-302; 416's rescale
            if whole:  # 351-352 (rO0 += sS1 @ sV1l) and 416 (rO1 = sS1 @ sV1r) as one product
                o = mc.matmul(P1b, mc.operand(K1[..., :D_V]), np.concatenate([accL, accR], axis=-1))
                oL, oR = o[..., :_HALF], o[..., _HALF:]
            else:
                oR = mc.matmul(P1b, mc.operand(K1[..., _HALF:D_V]), accR)  # 416
                oL = mc.matmul(P1b, mc.operand(K1[..., :_HALF]), accL)  # 351-352
            a0 = mc.mul(a0, t[..., None])  # 302: rL *= scales
            oR = mc.matmul(mc.operand(P0s), mc.operand(K0[..., _HALF:D_V]), oR)  # 422: rO1 += sS0 @ sV0r
            OL[live], OR[live], l0[live], l1[live], m[live] = oL, oR, a0, a1, m1
        p += group
    L = mc.f(_row_total(mc, l0) + _row_total(mc, l1))  # 186-199: the quad's butterfly, then the peer warpgroup's
    return np.concatenate([OL, OR], axis=-1), L, m


def _block(keys: np.ndarray, idx: np.ndarray, ok: np.ndarray, blocks: range) -> tuple[np.ndarray, np.ndarray]:
    """Blocks `blocks` of n tokens, side by side: their keys (n, 64 len(blocks), d), an empty slot's row zero
    (cp.async with src-size 0 zero-fills, helpers.h:16-22), and which slots are attended (n, 64 len(blocks))."""
    cols = (np.asarray(blocks)[:, None] * B_TOPK + np.arange(B_TOPK)).ravel()
    okb = ok[:, cols]
    K = keys[np.where(okb, idx[:, cols], 0)]
    K[~okb] = 0
    return K, okb


def _scores(mc: Machine, warpgroup, Q: np.ndarray, K: np.ndarray, rows: int) -> np.ndarray:
    """A warpgroup's scores (n, H, 64 j) of j blocks side by side, K (n, 64 j, d): as few products as
    :meth:`Machine.by_blocks` allows (one a block unless the unit computes each column on its own)."""
    return mc.by_blocks(lambda kt: warpgroup(mc, Q, np.swapaxes(kt, -1, -2)), np.swapaxes(K, -1, -2), rows=rows,
                        block=B_TOPK)


def _first_wg_scores(mc: Machine, Q: np.ndarray, K: np.ndarray) -> np.ndarray:
    """Warpgroup 0's ``Q K^T`` (n, H, 64): wgmma m64n64k16 over k tiles 0..8 in order, one accumulator (264-279)."""
    return mc.matmul(mc.operand(Q), mc.operand(np.swapaxes(K, -1, -2)))


def _second_wg_scores(mc: Machine, Q: np.ndarray, K: np.ndarray) -> np.ndarray:
    """Warpgroup 1's ``Q K^T``: k tiles 4..8 (columns 256..d) first, then 0..3, chained in one accumulator
    (380-394)."""
    KT = mc.operand(np.swapaxes(K, -1, -2))
    Qm = mc.operand(Q)
    return mc.matmul(Qm[..., :_HALF], KT[..., :_HALF, :], mc.matmul(Qm[..., _HALF:], KT[..., _HALF:, :]))


def _masked(mc: Machine, S: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """mask_rP (119-131): an empty slot's score -inf."""
    return np.where(ok[:, None, :], mc.f(S), -np.inf).astype(mc.dtype)


def _scaled_max(mc: Machine, S: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``cur_max *= scale`` (147-152): the raw scores' row max (fmaxf over the quad, NaN ignored) times c."""
    return mc.mul(np.fmax.reduce(S, axis=-1), c)


def _probabilities(mc: Machine, S: np.ndarray, c: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``exp2f(rP * scale - new_max)`` (170): the multiply contracted into an FMA."""
    return mc.exp2(mc.mul_add(S, c, -m[..., None]))


def _lane_sums(mc: Machine, P: np.ndarray) -> np.ndarray:
    """(..., 64) -> (..., 4): lane t's ``cur_sum += rP(i) + rP(i+1)`` (167-175): its pairs (8j + 2t, 8j + 2t + 1)
    added, then the 8 pairs in order from 0."""
    q = P.reshape(*P.shape[:-1], 8, 4, 2)
    pair = mc.f(q[..., 0] + q[..., 1])
    s = np.zeros(P.shape[:-1] + (4,), mc.dtype)
    for j in range(8):
        s = mc.f(s + pair[..., j, :])
    return s


def _lane_update(mc: Machine, l: np.ndarray, s: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """``rL = rL * scale_for_o + cur_sum`` (176), one FMA."""
    return mc.mul_add(l, s[..., None], sums)


def _row_total(mc: Machine, lanes: np.ndarray) -> np.ndarray:
    """reduce_L's xor shuffles 1 and 2 (189-192): ``(l0 + l1) + (l2 + l3)``."""
    return mc.f(mc.f(lanes[..., 0] + lanes[..., 1]) + mc.f(lanes[..., 2] + lanes[..., 3]))


def _sink_term(mc: Machine, sink: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``exp2f(attn_sink - rM)`` (206) with ``attn_sink = sink * CUDART_L2E_F`` (205; -inf without a sink): the
    product is one arm of a select, so it is rounded on its own, not contracted into the subtract."""
    return mc.exp2(mc.f(mc.f(sink * mc.f(_LOG2E)) - m))


def _reciprocal(mc: Machine, x: np.ndarray) -> np.ndarray:
    """``1.0f / x`` (206): the machine's ``1 / x``. Under ``-prec-div=false`` NVPTX selects ``rcp.approx.ftz.f32``
    for a numerator of 1.0 (MUFU.RCP has ``div.full``'s bits for x in [2^-126, 2^126], and x here is a row sum of
    at most topk + 1 terms of at most 1); without fast math it is IEEE division."""
    return mc.div(mc.f(1.0), x)


def _max_logits(mc: Machine, m: np.ndarray, ln2: np.ndarray) -> np.ndarray:
    """``rM * CUDART_LN2_F`` (448)."""
    return mc.f(m * ln2)


def _lse(mc: Machine, L: np.ndarray, m: np.ndarray, ln2: np.ndarray) -> np.ndarray:
    """``logf(rL) + rM * CUDART_LN2_F`` (449). Under fast math ``fma(lg2(L), ln 2, fl(m ln 2))`` (``__logf``'s
    multiply contracted into the add; the other product is max_logits' too, rounded once for both), as the
    decodes' LSE; without it libdevice's ``logf``, then the add (that product is still not contracted)."""
    return mc.log_plus(L, _max_logits(mc, m, ln2))


def flashmla_sparse_prefill_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine | None = None,
    schedule: str | Schedule = "reference",
    block: int = 64,
    scale: float | None = None,
    build: str = DEFAULT_BUILD,
    trace: bool = False,
) -> AttentionResult:
    """:func:`flashmla_sparse_prefill` as the papers' algorithms are called (``run``, ``reproduce``, ``sweep``):
    query s of request i a token of the launch whose list is request i's rows up to its causal end ``S - s_q + s``
    (topk the next multiple of 128 above S, -1 after), the heads zero-padded to 64 as vLLM and SGLang pad them,
    the LSE as (b, s_q, h).
    The kernel lays its work out itself: `block` must be its 64 and `schedule` is checked, not used."""
    check_kernel_layout(schedule, block, 64)
    qa, kva = np.asarray(q), np.asarray(kv)
    if qa.ndim != 4 or kva.ndim != 3 or kva.shape[0] != qa.shape[0]:
        raise ValueError(f"q, kv: expected (b, s_q, h, 576) and (b, S, 576), got {qa.shape} and {kva.shape}")
    b, s_q, H, d = qa.shape
    S = kva.shape[1]
    if not 1 <= H <= 128:
        raise ValueError(f"q: the kernel takes 1 to 128 heads (padded to 64 or 128), got {H}")
    topk = -(-S // 128) * 128
    idx = causal_lists(b, s_q, S, topk)
    padded = padded_heads(H)
    qp = np.zeros((b * s_q, padded, d), qa.dtype)
    qp[:, :H] = qa.reshape(b * s_q, H, d)
    res = flashmla_sparse_prefill(qp, kva.reshape(b * S, 1, d), idx[:, None], scale=scale, build=build,
                                  machine=machine, trace=trace)
    return AttentionResult(res.out[:, :H].reshape(b, s_q, H, -1), res.lse[:, :H].reshape(b, s_q, H), res.trace,
                           res.hazards)
