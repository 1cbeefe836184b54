"""DeepSeek V3.2's two sparse-attention kernels on a BF16 cache in the invariance study: FA3's sparse call
(``fa3-mla-sparse``, :func:`~amla_sim.algorithms.deployed.fa3.sparse.fa3_mla_sparse`) and FlashMLA's sparse
prefill kernel (``flashmla-sparse-prefill``,
:func:`~amla_sim.algorithms.deployed.flashmla.sparse_prefill.flashmla_sparse_prefill`).

The request is one query token and its top-k list; its batchmates are the launch's other tokens (the other
requests' tokens of a decode batch, or the other tokens of a prefill chunk). The study's flags map onto a token so:

- ``length`` (``--length``) is the token's context: the cached tokens its indexer chooses from (its position + 1,
  itself the last). Its valid count, the keys it attends and what FA3's scheduler counts, is ``min(length,
  topk)``: every token of a length up to topk attends its whole prefix, a longer one topk rows of it (itself
  first, then a seeded choice, in the order drawn; -1 after the valid entries). A batchmate of length ``n``
  (``--batchmates``, ``--mixed``) is a token of ``min(n, topk)`` valid entries.
- ``topk`` (an option, Python only) is V3.2's ``index_topk``, 2048: FA3's ``max_seqlen_k`` (its split bound
  comes from it) and the width of the prefill kernel's list (a multiple of 128). A request from arrays
  (``--inputs``) or another kernel's request (``diff``) attends every row of its kv in order, and topk grows to the
  rows rounded up to 128 where they are more than 2048.
- ``heads`` (``--heads``) are the token's query heads: any count for FA3; 1 to 128 for the prefill kernel, whose
  API takes 64 or 128 (the serving stacks pad with zero heads, as the model does here). One query a token: no
  ``s_q`` (MTP rows are tokens of the launch, batchmates).

FA3 gives every token a split count from the whole launch (``fa3_schedule`` over every token's valid count with
``page_size=1`` and ``max_seqlen_k=topk``, none split past 992 tokens), so a token's bits follow its batchmates
through that count; its batch-invariant mode is ``num_splits = 1`` (SGLang's deterministic inference; vLLM's
batch invariance), and ``num_kv_splits`` hands a count to the call. The prefill kernel has no split plan: a CTA
takes one token and 64 heads and walks its whole list, so its plan is the same in every launch and its bits never
change with the batchmates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._validate import check_int
from ..algorithms.deployed.fa3.mla import fa3_mla
from ..algorithms.deployed.fa3.scheduler import (KBLOCK_M, KBLOCK_N, MAX_SPLIT_BATCH, Fa3Schedule, fa3_schedule,
                                                 n_block_max, split_blocks)
from ..algorithms.deployed.topk import sparse_rows
from ..algorithms.deployed.flashmla.sparse_prefill import B_TOPK, HEADS, flashmla_sparse_prefill, padded_heads
from ..experiments.inputs import make_inputs
from .fa3 import MAX_NUM_SPLITS, Fa3MLA, Fa3SplitCount, split_bounds
from .kernel import RCP_NORMALISE, BatchKernel, Plan, Request, mate_seed
from .launches import Launch

__all__ = ["SparseTokenKernel", "Fa3MLASparse", "FlashMLASparsePrefill", "V32_TOPK", "MAX_TOPK"]

#: DeepSeek V3.2's ``index_topk``: the keys a token's list holds.
V32_TOPK = 2048
#: The longest list the study takes (the gathered keys of one token are (topk, 576)).
MAX_TOPK = 1 << 20
_LIST_ALIGN = 2 * B_TOPK  # the prefill kernel's topk: a multiple of two blocks


def _s(n: int) -> str:
    return "s" * (n != 1)


class SparseTokenKernel(BatchKernel):
    """A V3.2 sparse-attention kernel whose request is one query token and its top-k list (see the module
    docstring): q (1, heads, 576), the token's context kv (length, 576) and its list (1, topk) of rows of it."""

    row_tile = 64
    stages = {"out": "bf16", "lse": "fp32"}
    takes_s_q = False
    topk_align = 1  # the list's width must be a multiple of this
    max_heads: int | None = None

    def options(self, **given: Any) -> dict[str, Any]:
        topk = given.pop("topk", V32_TOPK)
        BatchKernel.options(self, **given)
        check_int(topk, "topk", lo=self.topk_align, hi=MAX_TOPK)
        if topk % self.topk_align:
            raise ValueError(f"topk: {self.name} takes a list of a multiple of {self.topk_align} entries, got {topk}")
        return {"topk": int(topk)}

    def _check_heads(self, heads: int, what: str = "heads") -> int:
        check_int(heads, what, lo=1)
        if self.max_heads is not None and heads > self.max_heads:
            raise ValueError(f"{what}: {self.name} takes 1 to {self.max_heads} heads (64 or 128, fewer padded with "
                             f"zero heads), got {heads}")
        return heads

    def _check_s_q(self, s_q: int) -> None:
        if check_int(s_q, "s_q", lo=1) != 1:
            raise ValueError(f"s_q: {self.name} takes one query a token (more query rows are more tokens of the "
                             f"launch), got {s_q}")

    def check_request(self, *, length: int, heads: int, s_q: int, options: Mapping[str, Any]) -> int:
        self._check_heads(heads)
        self._check_s_q(s_q)
        check_int(length, "length", lo=1)
        return length + min(length, options.get("topk", V32_TOPK))  # its context and its gathered keys

    @staticmethod
    def _draw(dist: str, seed: int, heads: int, length: int, topk: int) -> dict[str, np.ndarray]:
        """A token of context `length`: q (1, heads, 576), kv (length, 576), its list (1, topk): itself (the last
        row) first, then min(length, topk) - 1 other rows of its context in a seeded order, -1 after."""
        q, kv = make_inputs(dist, batch=1, heads=heads, sq=1, context=length, seed=seed)
        valid = min(length, topk)
        rng = np.random.default_rng([seed, 17])
        idx = np.full((1, topk), -1, np.int32)
        idx[0, :valid] = np.concatenate([[length - 1], rng.choice(length - 1, valid - 1, replace=False)])
        return {"q": q[0], "kv": kv[0], "indices": idx}

    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        opts = self.options(**options)
        self.check_request(length=length, heads=heads, s_q=s_q, options=opts)
        topk = opts["topk"]
        return Request(self._draw(dist, seed, heads, length, topk), heads, length, 1,
                       {"dist": dist, "seed": seed, "heads": heads, "topk": topk, "valid": min(length, topk)})

    def from_arrays(self, q: np.ndarray, kv: np.ndarray, *, s_q: int, **options: Any) -> Request:
        """The token attends every row of kv, in order; topk is the option's (2048) or, for more rows, the rows
        rounded up to a multiple of 128."""
        try:
            self._check_heads(q.shape[1])
            self._check_s_q(s_q)
        except ValueError as e:  # the file's request, not an argument, is at fault
            raise ValueError(f"inputs: {e}") from None
        n = kv.shape[0]
        topk = max(self.options(**options)["topk"], -(-n // _LIST_ALIGN) * _LIST_ALIGN)
        idx = np.full((1, topk), -1, np.int32)
        idx[0, :n] = np.arange(n)
        return Request({"q": q[-1:], "kv": kv, "indices": idx}, q.shape[1], n, 1,
                       {"dist": "normal:1", "seed": 0, "heads": q.shape[1], "topk": topk, "valid": n, "file": True})

    def adopt(self, req: Request) -> Request:
        """A dense decode's request: its last query row attends every one of its tokens."""
        self.adopted_length(length=req.length, heads=req.heads, s_q=req.s_q)
        return self.from_arrays(req.arrays["q"], req.arrays["kv"], s_q=1)

    def adopted_length(self, *, length: int, heads: int, s_q: int) -> int:
        self._check_heads(heads)
        self._check_s_q(s_q)
        return check_int(length, "length", lo=1)

    @staticmethod
    def _valid(req: Request, launch: Launch) -> list[int]:
        """Every token's valid count in `launch`: its length, at most the list's width."""
        return [min(n, req.recipe["topk"]) for n in launch.lengths]

    def _tokens(self, req: Request, launch: Launch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The launch's tokens: q (T, heads, 576), a cache of each token's listed rows (R, 576), the lists (T,
        topk) as rows of it, -1 after the valid entries, and the valid counts (T,). Batchmates are drawn from
        their own seeds (:func:`.kernel.mate_seed`); a token's cache is the rows it lists, in its list's order
        (the kernel gathers the same rows)."""
        topk = req.recipe["topk"]
        valid = np.array(self._valid(req, launch), np.int64)
        q = np.zeros((launch.batch, req.heads, 576), req.arrays["q"].dtype)
        rows = np.zeros((int(valid.sum()), 576), req.arrays["kv"].dtype)
        idx = np.full((launch.batch, topk), -1, np.int32)
        at = 0
        for j, n in enumerate(launch.lengths):
            a = ({"q": req.arrays["q"], "kv": req.arrays["kv"], "indices": req.arrays["indices"]}
                 if j == launch.position else self._draw(req.recipe["dist"], mate_seed(req, j), req.heads, n, topk))
            v = int(valid[j])
            q[j], rows[at:at + v] = a["q"][-1], a["kv"][a["indices"][0, :v]]
            idx[j, :v] = np.arange(at, at + v)
            at += v
        return q, rows, idx, valid


class Fa3MLASparse(Fa3SplitCount, SparseTokenKernel):
    """FA3's sparse MLA call: a split count a token from the whole launch's valid counts."""

    name = "fa3-mla-sparse"
    unit = "token"
    summary = ("FA3's sparse MLA call, DeepSeek V3.2 on a BF16 cache (the request: one query token of --length "
               "context, min(length, topk 2048) keys; batchmates: the launch's other tokens)")
    takes_num_kv_splits = True
    what_if = "num_splits = 1 (SGLang's deterministic inference, vLLM's batch invariance): one split a token"
    numerics = {
        **Fa3MLA.numerics,
        "keys": ("bf16", "BF16 rows gathered through the token's top-k list (pages of one token)"),
        "schedule": ("fa3-prepare-scheduler", "the launch's split bound (num_splits, or FA3's heuristic from "
                                              "max_seqlen_k = topk), each token cdiv(n_blocks, ceilf(total_blocks "
                                              "1.1 / SMs)) splits over every token of the launch (none past 992 "
                                              "tokens), cdiv(n_block_max, splits) blocks a split"),
    }

    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        return split_bounds(launch)

    def _schedule(self, req: Request, launch: Launch) -> Fa3Schedule:
        """What ``fa3_mla_sparse`` decides for the launch: one query a token, pages of one token, max_seqlen_k
        the list's width."""
        return fa3_schedule(self._valid(req, launch), s_q=1, heads=req.heads, num_splits=launch.num_kv_splits or 0,
                            page_size=1, num_sms=launch.num_sms, max_seqlen_k=req.recipe["topk"])

    def _cut(self, heads: int, valid: int, count: int) -> Plan:
        """A token's non-empty splits, as slot ranges, when cut into `count` (an empty split writes O = 0 and
        LSE = -inf, which the combine skips)."""
        end = n_block_max(valid, (heads - 1) // KBLOCK_M, s_q=1, heads=heads, causal=False)
        return [(lo * KBLOCK_N, min(hi * KBLOCK_N, valid)) for lo, hi in split_blocks(end, count) if hi > lo]

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        sched = self._schedule(req, launch)
        return [self._cut(req.heads, v, n) for v, n in zip(self._valid(req, launch), sched.splits)]

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        self.check_split_tokens(split_tokens)
        return [[(0, v)] for v in self._valid(req, launch)]

    def reason(self, req: Request, launch: Launch) -> str:
        valid = self._valid(req, launch)
        sched = self._schedule(req, launch)
        n = sched.splits[launch.position]
        tokens = f"{launch.batch} token{_s(launch.batch)}"
        if launch.batch > MAX_SPLIT_BATCH:
            return f"{tokens} in the launch, more than FA3 splits ({MAX_SPLIT_BATCH}): 1 split"
        bound = (f"num_splits = {launch.num_kv_splits} handed to the kernel" if launch.num_kv_splits else
                 f"FA3's heuristic bound {sched.bound} (max_seqlen_k = topk {req.recipe['topk']})")
        blocks = sum(-(-v // KBLOCK_N) for v in valid) * -(-req.heads // KBLOCK_M)
        counts = f"{min(valid)}" if min(valid) == max(valid) else f"{min(valid)} to {max(valid)}"
        cut = len(self._cut(req.heads, valid[launch.position], n))
        return (f"{bound}; {blocks} blocks of 64 rows x 64 keys in {tokens} ({counts} valid keys a token) on "
                f"{launch.num_sms} SMs: {n} split{_s(n)}" + (f", {cut} with keys" if cut < n else ""))

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        valid = req.recipe["valid"]
        keys = sparse_rows(req.arrays["kv"], req.arrays["indices"].astype(np.int64), np.array([valid]))  # its gather
        want = [tuple(r) for r in plan]
        count = next((n for n in range(max(len(plan), 1), MAX_NUM_SPLITS + 1)
                      if self._cut(req.heads, valid, n) == want), None)
        if count is None:
            raise ValueError(f"plan: FA3 cuts a token's blocks into a count of equal splits; {plan} is not such a "
                             "cut")
        res = fa3_mla(req.arrays["q"][None], keys, seqlens=[valid], causal=True, page_size=1, varlen_q=True,
                      num_sms=launch.num_sms, max_seqlen_k=req.recipe["topk"], splits=[count])
        return {"out": res.out[0, 0], "lse": res.lse[:, 0]}

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        """``fa3_mla_sparse``'s arguments for the whole launch (``fa3_mla_sparse(**batch)``); the token's row at
        `launch.position`."""
        q, rows, idx, valid = self._tokens(req, launch)
        return {"q": q, "kv_cache": rows, "topk_indices": idx, "valid_counts": valid,
                "num_splits": launch.num_kv_splits or 0, "num_sms": launch.num_sms}


class FlashMLASparsePrefill(SparseTokenKernel):
    """FlashMLA's sparse prefill kernel: one CTA a (token, 64 heads), the whole list, no split; nothing of the
    launch but the token's own inputs enters its bits."""

    name = "flashmla-sparse-prefill"
    summary = ("FlashMLA's sm90 sparse prefill, DeepSeek V3.2 on a BF16 cache, no split (the request: one query "
               "token of --length context, min(length, topk 2048) keys, 1 to 128 heads; batchmates: the launch's "
               "other tokens)")
    topk_align = _LIST_ALIGN
    max_heads = max(HEADS)
    what_if = "its own plan: no split, one CTA a (token, 64 heads), whatever shares the launch"
    numerics = {
        "keys": ("bf16", "BF16 rows gathered through the token's top-k list"),
        "schedule": ("no-split", "none: one CTA a token and 64 heads, its whole list"),
        "scores": ("wgmma-seesaw-k", "wgmma, blocks of 64 slots in pairs: k 0..575 (warpgroup 0), 256..575 then "
                                     "0..255 (warpgroup 1)"),
        "max": ("log2-units", "a running max shared by the warpgroups, fl(rowmax(S) c), c = fl(fl(scale) "
                              "fl(log2 e)), from -1e30"),
        "exp": ("ex2(fma(S, c, -m))", "ex2.approx.ftz of fma(S, c, -m), m in log2 units"),
        "P": ("bf16, P0 rescaled and rounded again", "BF16; warpgroup 1 gets P0 rescaled by exp2(m0 - m') and "
                                                     "rounded again"),
        "row sum": ("4 lanes: adjacent pairs, 8 groups", "4 lanes a row: pairs of adjacent columns, then the 8 "
                                                         "pairs in order; fma(l, s, sum); (l0 + l1) + (l2 + l3) "
                                                         "per warpgroup, then the two"),
        "normalise": RCP_NORMALISE,
        "LSE": ("fma(lg2 L, ln 2, fl(m ln 2))", "fma(lg2(L), ln 2, fl(m ln 2)), natural log"),
        "combine": ("none", "none: no split"),
    }

    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        self._check_heads(heads)
        return 1, launch.batch

    def max_splits(self, launch: Launch, *, heads: int) -> int:
        return 1

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        return [[(0, v)] for v in self._valid(req, launch)]

    def check_split_tokens(self, split_tokens: int | None) -> None:
        if split_tokens is not None:
            raise ValueError("split_tokens: FlashMLA's sparse prefill never splits a token; its plan, one split a "
                             "token ('one'), is already batch-invariant")

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        self.check_split_tokens(split_tokens)
        return self.plans(req, launch)

    def reason(self, req: Request, launch: Launch) -> str:
        return (f"no scheduler: one CTA a token and 64 heads walks its whole list ({req.recipe['valid']} keys); "
                f"nothing else of the launch is read: not its {launch.batch} token{_s(launch.batch)}, not the SM "
                f"count ({launch.num_sms})")

    @staticmethod
    def _padded(q: np.ndarray) -> np.ndarray:
        """q (T, h, 576) with zero heads up to 64 or 128, as vLLM and SGLang pad it."""
        h = q.shape[1]
        pad = padded_heads(h) - h
        return np.concatenate([q, np.zeros((q.shape[0], pad, q.shape[2]), q.dtype)], axis=1) if pad else q

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        valid = req.recipe["valid"]
        if [tuple(r) for r in plan] != [(0, valid)]:
            raise ValueError(f"plan: FlashMLA's sparse prefill runs a token in one split of its {valid} keys, got "
                             f"{plan}")
        res = flashmla_sparse_prefill(self._padded(req.arrays["q"]), req.arrays["kv"][:, None],
                                      req.arrays["indices"][:, None], topk_length=np.array([valid]),
                                      build="upstream")  # the build its device check ran (prefill_decode_*.npz)
        return {"out": res.out[0, :req.heads], "lse": res.lse[0, :req.heads]}

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        """``flashmla_sparse_prefill``'s arguments for the whole launch (``flashmla_sparse_prefill(**batch)``, then
        the first `heads` heads of its out and lse); the token's row at `launch.position`."""
        q, rows, idx, valid = self._tokens(req, launch)
        return {"q": self._padded(q), "kv": rows[:, None], "indices": idx[:, None], "topk_length": valid}
