"""FlashMLA's sm90 dense decode, written against a machine.

Upstream: deepseek-ai/FlashMLA 9241ae3, ``csrc/sm90/decode/dense/splitkv_mla.cuh``, ``csrc/smxx/decode/combine/
combine.cu``, ``csrc/smxx/decode/get_decoding_sched_meta/``.
On ``sm90-cuda`` it predicts the kernel's output and LSE bit for bit.

Rows are the (query position, head) pairs of a request, 64 to an m-block; every row is independent. The scheduler
(:mod:`~amla_sim.algorithms.deployed.flashmla.scheduler`) cuts each request's 64-token blocks into splits. A split
runs its blocks in pairs, the seesaw of two warpgroups sharing one running max ``m`` (log2 units, from -1e30):

- warpgroup 0 takes block 0: ``S0 = Q K0^T`` on the tensor cores, k in order 0..575; masked keys get -1e33;
  ``m' = max(m, rowmax(S0) * c)`` with ``c = fl32(scale log2 e)``, ``s0 = exp2(m - m')``, ``P0 = exp2(fma(S0, c,
  -m'))``; its half of O (columns 0..255) ``O_L = O_L s0 + bf16(P0) V0_L``; its partial row sums (one per lane of
  the four that share a row: pairs of adjacent columns added, then summed over the row's eight column groups)
  ``l0 = fma(l0, s0, sum)``;
- warpgroup 1 takes block 1: ``S1`` with k in order 256..575 then 0..255; ``m'' = max(m', rowmax(S1) c)``,
  ``s1 = exp2(m' - m'')``; its half ``O_R = O_R fl(s1 s0) + bf16(P1) V1_R + bf16(P0 s1) V0_R`` (P0 rescaled by
  warpgroup 0 before it is shared); ``l1 = fma(l1, fl(s1 s0), sum)``;
- then warpgroup 0 finishes: ``O_L = O_L s1 + bf16(P1) V1_L``, ``l0 = l0 s1``.

At the end the four lanes' sums meet in a butterfly, ``L = l0 + l1`` (1 where it is 0 or NaN), ``O = O / L``
(``div.approx``: O times MUFU.RCP of L). A request with one split writes ``bf16(O)`` and
``fma(log2(L), ln 2, m ln 2)``; otherwise each split writes O and ``log2(L) + m``, and the combine kernel
computes ``M = max lse_s``, ``g = log2(sum_s exp2(lse_s - M)) + M`` (each lane summing its splits, then an xor
butterfly over 32 lanes), LSE ``g ln 2`` and ``bf16(sum_s fma(exp2(lse_s - g), O_s, .))``. exp2 and log2 are
``ex2.approx.ftz`` and ``lg2.approx.ftz`` (``--use_fast_math``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ...._validate import check_int, quiet_fp
from ....machines import Machine
from ....formats import get_format
from ....schedules import Schedule
from ..._common import D_K, D_V, AttentionResult, check_kernel_inputs, check_kernel_layout
from ..scalars import scale_log2, softmax_scale
from .builds import DEFAULT_BUILD, resolve_build
from .combine import combine_sum, combine_width
from .scheduler import BLOCK_SIZE_N, check_splits, num_sm_parts, request_splits

__all__ = ["flashmla", "flashmla_decode"]

_MAX_INIT_SM = -1e30  # the running max before the first block
_MAX_INIT = -1e33  # a masked score
_BLOCK_M = 64  # query rows (position, head) of a CTA: an m-block


class _Units:
    """The machine's operations as the kernel uses them (log2 units; golden: exact constants)."""

    def __init__(self, mc: Machine, fmt: str = "bf16"):
        self.mc = mc
        self.fmt = fmt  # the inputs' format, P's and the output's: BF16 or FP16 (the kernel's template type T)
        self.dt = mc.dtype
        self.ln2 = mc.f(math.log(2.0))  # fl32(ln 2) = 0x3F317218 on FP32 machines
        self.log2e = mc.f(math.log2(math.e))  # (float)M_LOG2E = 0x3FB8AA3B

    def c(self, x: float) -> np.ndarray:
        return self.mc.f(x)

    def lane_sums(self, p: np.ndarray) -> np.ndarray:
        """(..., 64) -> (..., 4): lane t adds its column pairs (8j + 2t, 8j + 2t + 1), then the 8 pairs in order."""
        q = p.reshape(*p.shape[:-1], 8, 4, 2)
        pair = (q[..., 0] + q[..., 1]).astype(self.dt)
        s = np.zeros(pair.shape[:-2] + (4,), self.dt)
        for j in range(8):
            s = (s + pair[..., j, :]).astype(self.dt)
        return s


@quiet_fp
def flashmla(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    seqlens: npt.ArrayLike,
    scale: float | None = None,
    causal: bool = False,
    num_sms: int = 132,
    splits: Sequence[Sequence[tuple[int, int]]] | None = None,
    build: str = DEFAULT_BUILD,
    machine: str | Machine | None = None,
    trace: bool = False,
) -> AttentionResult:
    """FlashMLA's dense decode as `build` compiles it (see the module docstring).

    q: (b, s_q, h_q, 576) BF16 or FP16; kv: (b, S_max, 576) in q's format, rows past ``seqlens[i]`` ignored, V its first 512
    columns. causal: the mask within the step (vLLM's multi-token call; FlashMLA ignores it where s_q = 1): query
    position j of s_q sees the request's first ``seqlen - (s_q - 1 - j)`` keys, none where that is not positive.
    build: ``vllm`` (the default: vLLM 0.33's library), ``sglang`` (sgl-flash-mla 1.0.0) or ``upstream``
    (FlashMLA's sources with their own flags and binding); :mod:`.builds` says what each changes. machine: run the
    build's algorithm on other arithmetic instead (a what-if; default the build's). Returns ``.out`` (b, s_q, h_q,
    512) in the inputs' format and ``.lse`` (b, h_q, s_q) natural log, FlashMLA's layouts (+inf for a row that sees no key); with
    `trace`, per request the splits' token ranges, partial outputs and LSEs (``split_ranges``, ``split_out``,
    ``split_lse``). splits: per request, token ranges to run as its splits in place of the scheduler's (a what-if;
    the kernel's own plan is :func:`~amla_sim.algorithms.deployed.flashmla.scheduler.request_splits`;
    :func:`~amla_sim.algorithms.deployed.flashmla.scheduler.check_splits` says what a plan may be).
    """
    mc, double = resolve_build("dense", build, machine)
    mc.require(kernel="flashmla", log2=True, suggest="sm90-cuda")
    qa, kva, lens = check_kernel_inputs(q, kv, seqlens, empty=True, formats=("bf16", "fp16"))
    sm = softmax_scale(scale, double=double)
    check_int(num_sms, "num_sms", lo=1)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    lens = [int(n) for n in lens]
    b, s_q, H, _ = qa.shape
    fmt = get_format(qa.dtype).name
    u = _Units(mc, fmt)
    c = mc.ftz(scale_log2(mc, sm))  # dense_decode.h:139, params.scale_softmax_log2 = float(softmax_scale * M_LOG2E)
    parts = num_sm_parts(s_q=s_q, heads_q=H, num_sms=num_sms)
    max_splits = combine_width(parts, num_sms)
    plan = request_splits(lens, parts) if splits is None else check_splits(splits, lens, max_splits)
    # dense_decode.h:71: one query token is never causal; rows are (position, head), position-major
    mask_len = (s_q - 1 - np.arange(s_q * H) // H) if causal and s_q > 1 else None
    Q, K = mc.cast(qa, fmt), mc.cast(kva, fmt)
    out = np.zeros((b, s_q * H, D_V), mc.dtype)
    lse = np.zeros((b, s_q * H), mc.dtype)
    tr: dict[str, list] = {}
    for i, ranges in enumerate(plan):
        rows = Q[i].reshape(s_q * H, D_K)
        res = [_split_rows(u, rows, K[i], lens[i], lo // BLOCK_SIZE_N, -(-hi // BLOCK_SIZE_N), c, mask_len)
               for lo, hi in ranges]
        if not res:  # a request of no key: a split of no block (get_decoding_sched_meta.cu:95), out 0, LSE +inf
            out[i], lse[i] = 0, np.inf
        elif len(res) == 1:
            O, L, m = res[0]
            out[i] = O
            empty = (L == 0) | np.isnan(L)  # splitkv_mla.cuh:1236, the unpruned sum
            lse[i] = np.where(empty, np.inf, mc.log_plus(L, mc.div(m, u.log2e)))
        else:
            out[i], lse[i] = _combine(u, res, max_splits)
        if trace:
            tr.setdefault("split_ranges", []).append(np.array(ranges))
            tr.setdefault("split_out", []).append(np.stack([r[0] for r in res]) if res else
                                                  np.zeros((0, s_q * H, D_V), mc.dtype))
            tr.setdefault("split_lse", []).append(np.stack([_split_lse(u, r) for r in res]) if res else
                                                  np.zeros((0, s_q * H), mc.dtype))
    hazards = Counter()
    if np.isnan(out).any():
        hazards["nan_outputs"] += int(np.isnan(out).sum())
    out = mc.cast(out.reshape(b, s_q, H, D_V), fmt)
    return AttentionResult(out, np.swapaxes(lse.reshape(b, s_q, H), 1, 2), tr, hazards)


def flashmla_decode(
    q: npt.ArrayLike,
    kv: npt.ArrayLike,
    *,
    machine: str | Machine | None = None,
    schedule: str | Schedule = "reference",
    block: int = BLOCK_SIZE_N,
    scale: float | None = None,
    num_sms: int = 132,
    build: str = DEFAULT_BUILD,
    trace: bool = False,
) -> AttentionResult:
    """:func:`flashmla` as the papers' algorithms are called (``run``, ``reproduce``, ``sweep``): every request
    the whole of kv. The kernel lays its work out itself: `block` must be its 64 and `schedule` is checked, not
    used."""
    check_kernel_layout(schedule, block, BLOCK_SIZE_N)
    return flashmla(q, kv, seqlens=None, scale=scale, num_sms=num_sms, build=build, machine=machine, trace=trace)


def _blocks(u: _Units, Q: np.ndarray, K: np.ndarray, seqlen: int, blks: range, first_half: bool,
            border: np.ndarray, masked_from: int):
    """Scores of the 64-token blocks `blks`, (n, R, 64), and their V (rows past `seqlen` zero), (n, 64, 512). A
    score gets -1e33 where its key is at or past its row's `border`, in the blocks from `masked_from` on (the
    kernel masks a split's last two blocks alone, 350-356, 425-435). Scores do not depend on the softmax state, so
    the blocks a warpgroup takes go in few products (:meth:`Machine.block_width`: each element is the same chain
    of T-FDPA blocks whatever the columns beside it)."""
    mc = u.mc
    t = np.asarray(blks, dtype=np.int64)[:, None] * BLOCK_SIZE_N + np.arange(BLOCK_SIZE_N)  # (n, 64)
    ok = t < seqlen
    Kb = np.where(ok[..., None], K[np.minimum(t, seqlen - 1)], 0).astype(K.dtype)  # (n, 64, 576)
    KT = np.ascontiguousarray(Kb.reshape(-1, Kb.shape[-1]).T)  # (576, 64 n)
    Qm = mc.operand(Q)

    def product(kt: np.ndarray) -> np.ndarray:
        kt = mc.operand(kt)
        if first_half:  # warpgroup 0: k tiles 0..8
            return mc.matmul(Qm, kt)
        return mc.matmul(Qm[:, :256], kt[:256], mc.matmul(Qm[:, 256:], kt[256:]))  # warpgroup 1: tiles 4..8, 0..3

    S = mc.by_blocks(product, KT, rows=Q.shape[0], block=BLOCK_SIZE_N)
    tt = t.reshape(1, -1)
    live = (tt < border[:, None]) | (np.repeat(np.asarray(blks, np.int64), BLOCK_SIZE_N)[None, :] < masked_from)
    S = np.where(live, mc.f(S), u.c(_MAX_INIT)).astype(u.dt)  # (R, 64 n)
    return np.moveaxis(S.reshape(S.shape[0], -1, BLOCK_SIZE_N), 1, 0), Kb[..., :D_V]


def _split_rows(u: _Units, Q: np.ndarray, K: np.ndarray, seqlen: int, b0: int, b1: int, c: np.ndarray,
                mask_len: np.ndarray | None):
    """One split over blocks [b0, b1) of every row: (O / L, L, m), L the rows' unpruned sums. Causal
    (`mask_len`: the keys each row may not see at the end, 947-956), each m-block of 64 rows ends at the block
    its last row's mask lets it reach (1036-1061: the common mask; 0 for a row past the rows), and masks each row
    at its own border; an m-block left no block keeps the initial state (O = 0, L = 0, m = -1e30)."""
    if mask_len is None:
        return _split(u, Q, K, seqlen, b0, b1, c, np.full(Q.shape[0], seqlen, np.int64))
    R, dt = Q.shape[0], u.dt
    O, L, m = np.zeros((R, D_V), dt), np.zeros(R, dt), np.full(R, u.c(_MAX_INIT_SM), dt)
    for r0 in range(0, R, _BLOCK_M):
        r1 = min(r0 + _BLOCK_M, R)
        common = int(mask_len[r0 + _BLOCK_M - 1]) if r0 + _BLOCK_M <= R else 0
        end = min(b1, -(-(seqlen - common) // BLOCK_SIZE_N))
        if end <= b0:
            continue
        border = np.minimum(seqlen - mask_len[r0:r1], end * BLOCK_SIZE_N)
        O[r0:r1], L[r0:r1], m[r0:r1] = _split(u, Q[r0:r1], K, seqlen, b0, end, c, border)
    return O, L, m


def _split(u: _Units, Q: np.ndarray, K: np.ndarray, seqlen: int, b0: int, b1: int, c: np.ndarray,
           border: np.ndarray):
    """One split over blocks [b0, b1): (O / L, L, m) per row, L the unpruned sum (O divided by 1 where it is 0 or
    NaN, 1211-1218)."""
    mc, dt = u.mc, u.dt
    R = Q.shape[0]
    m = np.full(R, u.c(_MAX_INIT_SM), dt)
    OL, OR = np.zeros((R, 256), dt), np.zeros((R, 256), dt)
    l0, l1 = np.zeros((R, 4), dt), np.zeros((R, 4), dt)

    def softmax(S):
        m_new = np.maximum(m, mc.mul(np.max(S, axis=1), c))
        return m_new, mc.exp2(m - m_new), mc.exp2(mc.mul_add(S, c, -m_new[:, None]))

    S0s, V0s = _blocks(u, Q, K, seqlen, range(b0, b1, 2), True, border, b1 - 2)
    S1s, V1s = _blocks(u, Q, K, seqlen, range(b0 + 1, b1, 2), False, border, b1 - 2)
    for i, blk in enumerate(range(b0, b1, 2)):
        S0, V0 = S0s[i], V0s[i]
        m, s0, P0 = softmax(S0)
        OL = mc.matmul(mc.operand(mc.cast(P0, u.fmt)), mc.operand(V0[:, :256]), mc.mul(OL, s0[:, None]))
        l0 = mc.mul_add(l0, s0[:, None], u.lane_sums(P0))
        if blk + 1 < b1:
            S1, V1 = S1s[i], V1s[i]
            m, s1, P1 = softmax(S1)
            sum1 = u.lane_sums(P1)
        else:  # an odd block count: warpgroup 1's block lies past the split, every score -1e33 (433-434); it
            # adds nothing to the sums but moves the max where -1e33 c exceeds it (a negative scale, 440-447)
            m_new = np.maximum(m, mc.f(u.c(_MAX_INIT) * c))
            s1, sum1, m = mc.exp2(m - m_new), np.zeros((R, 4), dt), m_new
        c1 = mc.mul(s1, s0)
        OR = mc.mul(OR, c1[:, None])
        l1 = mc.mul_add(l1, c1[:, None], sum1)
        if blk + 1 < b1:
            OR = mc.matmul(mc.operand(mc.cast(P1, u.fmt)), mc.operand(V1[:, 256:]), OR)
        OR = mc.matmul(mc.operand(mc.cast(mc.mul(P0, s1[:, None]), u.fmt)), mc.operand(V0[:, 256:]), OR)
        if blk + 1 < b1:
            OL, l0 = mc.mul(OL, s1[:, None]), mc.mul(l0, s1[:, None])
            OL = mc.matmul(mc.operand(mc.cast(P1, u.fmt)), mc.operand(V1[:, :256]), OL)

    def lanes(x):  # the butterfly over the four lanes of a row
        return mc.f(mc.f(x[:, 0] + x[:, 1]) + mc.f(x[:, 2] + x[:, 3]))

    L = mc.f(lanes(l0) + lanes(l1))
    Lp = np.where((L == 0) | np.isnan(L), u.c(1.0), L).astype(dt)
    return mc.div(np.concatenate([OL, OR], axis=1), Lp[:, None]), L, m


def _split_lse(u: _Units, res: tuple) -> np.ndarray:
    """A split's ``log2f(L) + m``, -inf where L is 0 or NaN (1258)."""
    _, L, m = res
    return np.where((L == 0) | np.isnan(L), -np.inf, u.mc.f(u.mc.log2(L) + m)).astype(u.dt)


def _combine(u: _Units, res: list, max_splits: int) -> tuple[np.ndarray, np.ndarray]:
    """combine.cu:81-117: ``g = log2f(sum) + M`` (+inf where the sum is 0), LSE ``g / (float)M_LOG2E``, and the
    splits' outputs weighted by ``exp2f(lse_s - g)``."""
    mc, dt = u.mc, u.dt
    lse_s = np.stack([_split_lse(u, r) for r in res], axis=1)  # (R, n)
    M, total = combine_sum(mc, lse_s, max_splits, mc.exp2)
    g = np.where((total == 0) | np.isneginf(total), np.inf, mc.f(mc.log2(total) + M)).astype(dt)
    scales = mc.exp2(lse_s - g[:, None])
    acc = np.zeros((lse_s.shape[0], D_V), dt)
    for s in range(lse_s.shape[1]):
        acc = mc.mul_add(scales[:, s:s + 1], res[s][0], acc)
    return acc, mc.div(g, u.log2e)
