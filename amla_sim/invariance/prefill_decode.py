"""Does a token's prefill give the same bits as its decode? DeepSeek V3.2's sparse attention as each serving stack
runs it on Hopper with a BF16 cache.

A request's tokens are prefilled in one launch and, token by token, decoded in others; reinforcement learning
recomputes a sampled token's log-probabilities with a prefill and compares them with the decode's. The token's
query and top-k list are the same in both (the indexer is deterministic), so attention can part only through the
kernel each launch runs and how that kernel's plan depends on the launch:

- ``sglang-dsa`` (SGLang 0.5.23's DSA backend, ``dsa_backend.py``): prefill through FlashMLA's sparse prefill kernel
  (:func:`~amla_sim.algorithms.deployed.flashmla.sparse_prefill.flashmla_sparse_prefill`, heads zero-padded to 64),
  decode through FA3's sparse call (:func:`~amla_sim.algorithms.deployed.fa3.sparse.fa3_mla_sparse`, num_splits 0;
  ``sglang-dsa-deterministic``: 1): two kernels, so two arithmetics;
- ``vllm-fa3-sparse`` (vLLM 0.33's ``FLASH_ATTN_MLA_SPARSE``): both through FA3's sparse call, whose split count of a
  token comes from every token of its launch (none past 992 tokens): the same arithmetic, cut differently;
- ``vllm-flashmla-sparse`` (vLLM 0.33's ``FLASHMLA_SPARSE`` with a BF16 cache): both through the sparse prefill
  kernel, which has no split and computes each (token, head) row alone: bit for bit the same.

:func:`prefill_vs_decode` runs the models of both launches and says, per token, which output elements and LSE
values differ and why.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .._validate import check_int
from ..algorithms.deployed.fa3.sparse import fa3_mla_sparse
from ..algorithms.deployed.flashmla.sparse_prefill import flashmla_sparse_prefill, padded_heads
from ..experiments.inputs import make_inputs
from ..testing import row_ulp_distance, ulp_distance

__all__ = ["STACKS", "Stack", "TokenVerdict", "PrefillDecodeReport", "prefill_vs_decode", "request_inputs",
           "stack_work"]


@dataclass(frozen=True)
class Stack:
    """A serving stack's sparse attention: the kernel of its prefill and of its decode, as it calls them."""

    name: str
    prefill: str  # "flashmla-sparse-prefill" or "fa3-mla-sparse"
    decode: str
    num_splits: int = 0  # what the stack passes FA3 (SGLang's deterministic mode: 1)
    what: str = ""


STACKS: dict[str, Stack] = {s.name: s for s in (
    Stack("sglang-dsa", "flashmla-sparse-prefill", "fa3-mla-sparse",
          what="SGLang 0.5.23 DSA on Hopper, BF16 cache: flashmla_sparse prefill, fa3 decode"),
    Stack("sglang-dsa-deterministic", "flashmla-sparse-prefill", "fa3-mla-sparse", num_splits=1,
          what="the same with --enable-deterministic-inference (FA3 num_splits = 1)"),
    Stack("vllm-fa3-sparse", "fa3-mla-sparse", "fa3-mla-sparse",
          what="vLLM 0.33 FLASH_ATTN_MLA_SPARSE: FA3's sparse call for prefill and decode"),
    Stack("vllm-flashmla-sparse", "flashmla-sparse-prefill", "flashmla-sparse-prefill",
          what="vLLM 0.33 FLASHMLA_SPARSE, BF16 cache: FlashMLA's sparse prefill kernel for both"),
)}


@dataclass(frozen=True)
class TokenVerdict:
    """One token: how many of its output elements and LSE values differ between its prefill and its decode, the
    largest difference between two numbers in ULPs and in ULPs of its row's largest magnitude
    (:func:`~amla_sim.testing.row_ulp_distance`), its NaN (out and LSE, each side; NaN against a number has no ULP
    distance), and why."""

    token: int
    out_differ: int
    out_total: int
    lse_differ: int
    max_ulp: int  # between two numbers
    why: str
    max_row_ulp: float = 0.0
    nan_prefill: int = 0
    nan_decode: int = 0
    nan_vs_number: int = 0

    @property
    def bits_identical(self) -> bool:
        return self.out_differ == 0 and self.lse_differ == 0

    @property
    def identical(self) -> bool:
        """The same bits and no NaN among them: NaN against NaN is the same bits, not the same answer."""
        return self.bits_identical and not (self.nan_prefill or self.nan_decode)

    def describe(self) -> str:
        nan = f"{self.nan_prefill} NaN in the prefill, {self.nan_decode} in the decode"
        if self.bits_identical:
            return f"bits identical, but {nan}: NaN against NaN is the same bits, not an answer"
        against = f", {self.nan_vs_number} NaN against a number" if self.nan_vs_number else ""
        return (f"{self.out_differ} of {self.out_total} output elements (max {self.max_ulp} ULP between numbers, "
                f"{self.max_row_ulp:.3g} ULP of the row's largest |value|{against}), {self.lse_differ} LSE values "
                f"differ" + (f" ({nan})" if self.nan_prefill or self.nan_decode else "") + f": {self.why}")


@dataclass(frozen=True)
class PrefillDecodeReport:
    """Every compared token's verdict for one stack; the prefill's and the decode's outputs and LSEs of those
    tokens, (tokens, h, 512) BF16 and (tokens, h) natural log, for a device check to compare with; the whole
    prefill launch (every token's out, lse and split count), to compare other decodes with; and the models'
    hazard counts (``nan_outputs``...) of the prefill launch and of the decode launches together."""

    stack: Stack
    tokens: list[TokenVerdict]
    prefill: dict[str, np.ndarray] = field(repr=False)
    decode: dict[str, np.ndarray] = field(repr=False)
    prefill_launch: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    hazards: dict[str, dict[str, int]] = field(default_factory=dict)

    def format(self) -> str:
        same = sum(v.identical for v in self.tokens)
        nan = sum(v.bits_identical and not v.identical for v in self.tokens)
        lines = [f"{self.stack.name} ({self.stack.what}): {same} of {len(self.tokens)} tokens bit-identical "
                 f"between prefill and decode" + (f"; {nan} more with identical bits that hold NaN (no answer)"
                                                  if nan else "")]
        lines += [f"  token {v.token}: {v.describe()}" for v in self.tokens if not v.identical]
        counts = "; ".join(f"{side} " + ", ".join(f"{k} {n}" for k, n in h.items())
                           for side, h in self.hazards.items() if h)
        if counts:
            lines.append(f"  hazards (the models' counts, whole launches): {counts}")
        return "\n".join(lines)


def request_inputs(length: int, *, heads: int, topk: int, dist: str = "normal:1",
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A request of `length` tokens as V3.2 sees it: q (T, h, 576) BF16, its cache rows (T, 576), and each token's
    top-k list (T, topk) int32: token t attends to min(t + 1, topk) rows of its prefix, itself included (the
    indexer's choice, drawn from the seed), in the order drawn, -1 after them."""
    check_int(length, "length", lo=1, hi=1 << 17)
    check_int(topk, "topk", lo=128, hi=1 << 14)
    if topk % 128:
        raise ValueError(f"topk: the prefill kernel takes a multiple of 128, got {topk}")
    q, kv = make_inputs(dist, batch=1, heads=check_int(heads, "heads", lo=1, hi=128), sq=length, context=length,
                        seed=seed)
    rng = np.random.default_rng([seed, 17])
    idx = np.full((length, topk), -1, np.int32)
    for t in range(length):
        n = min(t + 1, topk)
        idx[t, :n] = np.concatenate([[t], rng.choice(t, n - 1, replace=False)]) if n > 1 else [t]
    return q[0], kv[0], idx


_B_TOPK_PAIR = 128  # the sparse prefill kernel walks a token's list in pairs of 64-slot blocks (phase1.cuh:398)
_GATHER_BYTES = 6  # FA3's model gathers each token's keys, (T, longest count, 576) BF16, and widens what it reads


def stack_work(stack: str | Stack, valid: npt.ArrayLike, *, heads: int, tokens: int,
               decode_batch: int = 1) -> tuple[int, int]:
    """What modelling `stack` on a request costs: ((key, head) products, bytes held at once), counting what the
    kernels run, not what the request holds. valid: (T,) each token's valid count; `tokens` tokens are decoded,
    each in a launch of `decode_batch` (their counts taken as the longest, an upper bound).

    FlashMLA's sparse prefill kernel runs the heads padded to 64 and walks a token's list to its count rounded up
    to 128 slots; FA3's sparse call walks each token's count, after its model gathers every token's keys (the
    launch's tokens by the longest count, 576 wide)."""
    st = STACKS.get(stack) if isinstance(stack, str) else stack
    if not isinstance(st, Stack):
        raise ValueError(f"stack: expected one of {tuple(STACKS)}, got {stack!r}")
    v = np.asarray(valid, np.int64)
    top = int(v.max(initial=0))
    work = held = 0
    for kernel, counts in ((st.prefill, v), (st.decode, np.full(tokens * decode_batch, top, np.int64))):
        if kernel == "flashmla-sparse-prefill":
            work += padded_heads(heads) * int((-(-counts // _B_TOPK_PAIR) * _B_TOPK_PAIR).sum())
        else:
            work += heads * int(counts.sum())
            held = max(held, _GATHER_BYTES * int(counts.size) * max(top, 1) * 576 if kernel == st.prefill
                       else _GATHER_BYTES * decode_batch * max(top, 1) * 576)
    return work, held


def _run(kernel: str, q: np.ndarray, kv: np.ndarray, idx: np.ndarray, valid: np.ndarray, *, scale: float | None,
         num_splits: int) -> dict[str, np.ndarray]:
    """One launch of `kernel` over the tokens of `q`: out (T, h, 512), lse (T, h), FA3's split counts, and the
    model's hazards (``hazards``, a Counter)."""
    if kernel == "fa3-mla-sparse":
        res = fa3_mla_sparse(q, kv, idx, valid_counts=valid, scale=scale, num_splits=num_splits, trace=True)
        return {"out": res.out, "lse": res.lse.T, "splits": np.array(res.trace["schedule"][0].splits),
                "hazards": Counter(res.hazards)}
    h = q.shape[1]
    padded = padded_heads(h)  # vLLM and SGLang pad the heads with zeros up to 64
    qp = np.concatenate([q, np.zeros((q.shape[0], padded - h, q.shape[2]), q.dtype)], axis=1) if padded > h else q
    # the build the device checks ran (tests/data/prefill_decode_*.npz): FlashMLA's sources with its own flags
    res = flashmla_sparse_prefill(qp, kv[:, None], idx[:, None], topk_length=valid, scale=scale, build="upstream")
    return {"out": res.out[:, :h], "lse": res.lse[:, :h], "splits": np.ones(len(q), np.int64),
            "hazards": Counter(res.hazards)}


def _why(stack: Stack, pre: dict, dec: dict, t: int, j: int) -> str:
    if stack.prefill != stack.decode:
        return f"two kernels ({stack.prefill} in the prefill, {stack.decode} in the decode)"
    if stack.prefill == "fa3-mla-sparse" and pre["splits"][t] != dec["splits"][j]:
        return (f"FA3 cuts the token's {int(dec['valid'][j])} keys into {int(pre['splits'][t])} split(s) in the "
                f"prefill launch and {int(dec['splits'][j])} in the decode launch")
    return "the same kernel and plan: not expected"


def prefill_vs_decode(stack: str | Stack, q: npt.ArrayLike, kv: npt.ArrayLike, indices: npt.ArrayLike, *,
                      tokens: list[int] | None = None, decode_batch: int = 1, scale: float | None = None,
                      prefill_launch: dict[str, np.ndarray] | None = None) -> PrefillDecodeReport:
    """`stack`'s prefill of the whole request (one launch of all its tokens) against the decode of each of
    `tokens` (default: the last 4), each in a launch of `decode_batch` tokens (the token and copies of it, standing
    for batchmates with lists as long). q (T, h, 576) BF16, kv (T, 576) the request's cache rows, indices (T,
    topk) each token's list, -1 after its valid entries (:func:`request_inputs` makes all three). prefill_launch:
    an earlier report's ``.prefill_launch`` for the same stack and inputs, to compare other decodes without
    modelling the prefill again."""
    st = STACKS[stack] if isinstance(stack, str) and stack in STACKS else stack
    if not isinstance(st, Stack):
        raise ValueError(f"stack: expected one of {tuple(STACKS)}, got {stack!r}")
    qa, kva, idx = np.asarray(q), np.asarray(kv), np.asarray(indices)
    T = qa.shape[0]
    check_int(decode_batch, "decode_batch", lo=1, hi=4096)
    todo = list(range(max(0, T - 4), T)) if tokens is None else [check_int(t, "tokens", lo=0, hi=T - 1)
                                                                  for t in tokens]
    if len(set(todo)) != len(todo):
        raise ValueError(f"tokens: each position once, got {tokens}")
    valid = (idx >= 0).sum(axis=1)
    pre = prefill_launch or _run(st.prefill, qa, kva, idx, valid, scale=scale, num_splits=st.num_splits)
    dec: dict[str, list] = {"out": [], "lse": [], "splits": [], "valid": []}
    hazards = Counter()
    for t in todo:
        rep = np.repeat(np.array([t]), decode_batch)
        got = _run(st.decode, qa[rep], kva, idx[rep], valid[rep], scale=scale, num_splits=st.num_splits)
        for k in ("out", "lse", "splits"):
            dec[k].append(got[k][0])
        dec["valid"].append(valid[t])
        hazards.update(got["hazards"])
    decode = {k: np.array(v) for k, v in dec.items()}
    verdicts = [_verdict(st, pre, decode, t, j) for j, t in enumerate(todo)]
    return PrefillDecodeReport(st, verdicts, {k: pre[k][todo] for k in ("out", "lse")}, decode, pre,
                               {"prefill": dict(pre.get("hazards", {})), "decode": dict(hazards)})


def _verdict(st: Stack, pre: dict, decode: dict, t: int, j: int) -> TokenVerdict:
    """Token `t` (the `j`-th decoded): its bits, its distances between numbers, its NaN."""
    po, do = pre["out"][t], decode["out"][j]
    pl, dl = pre["lse"][t].astype(np.float32), decode["lse"][j].astype(np.float32)
    differ = int((po.view(np.uint16) != do.view(np.uint16)).sum())
    lse_differ = int((pl.view(np.uint32) != dl.view(np.uint32)).sum())
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens a NaN
        nan_p, nan_d = np.isnan(po.astype(np.float32)), np.isnan(do.astype(np.float32))
    ulp = ulp_distance(po, do)
    row = row_ulp_distance(po, do)
    why = "" if differ == lse_differ == 0 else _why(st, pre, decode, t, j)
    return TokenVerdict(t, differ, po.size, lse_differ, int(ulp.max(initial=0)), why,
                        max_row_ulp=float(np.nanmax(row, initial=0.0)),
                        nan_prefill=int(nan_p.sum() + np.isnan(pl).sum()),
                        nan_decode=int(nan_d.sum() + np.isnan(dl).sum()),
                        nan_vs_number=int((nan_p ^ nan_d).sum() + (np.isnan(pl) ^ np.isnan(dl)).sum()))

