"""The kernels whose batch dependence amla-sim can explain, each as a :class:`BatchKernel`: the request's inputs,
its split plan in a launch (the kernel's scheduler, run on the host over every request's length), its bits under
a plan (the kernel's model, the request alone: rows of different requests never meet), a batch-invariant plan to
compare with, and the whole batch as a device would run it.

A model run covers the request only, because the scheduler is the one place its batchmates enter: the plan comes
from every length in the launch, the arithmetic from the request's own rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .._validate import check_int
from ..algorithms.deployed.fa3.mla import fa3_mla
from ..algorithms.deployed.fa3.scheduler import Fa3Schedule, fa3_schedule
from ..algorithms.deployed.flashmla.dense import flashmla
from ..algorithms.deployed.flashmla.etap import flashmla_etap
from ..algorithms.deployed.flashmla.fp8_cache import pages, quantize_kv_cache
from ..algorithms.deployed.flashmla.scheduler import (BLOCK_SIZE_N, FIXED_OVERHEAD_BLOCKS,
                                                      etap_num_sm_parts, etap_schedule, fixed_splits, metadata_splits,
                                                      num_sm_parts, request_splits)
from ..algorithms.deployed.flashmla.sparse_fp8 import flashmla_sparse_fp8
from ..algorithms.deployed.sglang.decode import splitkv_decode, split_ranges
from ..algorithms.deployed.sglang.scheduler import (deterministic_kv_splits, mla_max_kv_splits,
                                                    num_kv_splits)
from ..algorithms.deployed.vllm.triton_mla import VLLM_VERSION, vllm_num_kv_splits, vllm_triton_mla
from ..experiments.inputs import make_inputs
from .launches import Launch
from .races import RaceExposure, etap_race_exposure

__all__ = ["Request", "BatchKernel", "BATCH_KERNELS", "get_batch_kernel", "Plan", "describe_plan"]

Plan = list[tuple[int, int]]  # a request's splits: token (or slot) ranges [start, end), in order
DEEPSEEK_CONTEXT = 163840  # DeepSeek-V3's max_position_embeddings: SGLang's max_context_len for it


@dataclass
class Request:
    """The request under study: its inputs for up to `s_q` query rows (the row of interest is the last), its
    length as the scheduler counts it, and what drew it (to draw batchmates alike)."""

    arrays: dict[str, np.ndarray]
    heads: int
    length: int
    s_q: int
    recipe: dict[str, Any] = field(default_factory=dict)


def describe_plan(plan: Plan) -> str:
    """``"32 splits of 128"``, ``"4 of 832, 1 of 768"``, ``"1 split of 4096"``: runs of equal sizes, in order."""
    runs: list[list[int]] = []
    for a, b in plan:
        if runs and runs[-1][1] == b - a:
            runs[-1][0] += 1
        else:
            runs.append([1, b - a])
    text = ", ".join(f"{n} of {size}" for n, size in runs)
    return text.replace(" of ", " splits of " if runs[0][0] > 1 else " split of ", 1)


class BatchKernel(ABC):
    """A kernel whose scheduler sees the whole batch. `row_tile`: the query rows one unit of work (a CTA or
    program) holds."""

    name: str
    summary: str
    row_tile: int
    takes_s_q: bool = True
    lengths_vary: bool = True  # False: every request of a launch is as long as the scheduler counts (sparse V3.2)
    takes_num_kv_splits: bool = False
    what_if: str = ""

    def options(self, **given: Any) -> dict[str, Any]:
        """The kernel's own options (a sparse decode's topk, ...), checked; unknown ones are errors."""
        if given:
            raise ValueError(f"{next(iter(given))}: not an option of {self.name}")
        return {}

    @abstractmethod
    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        """The request, drawn from `dist` and `seed`."""

    def from_arrays(self, q: np.ndarray, kv: np.ndarray, *, s_q: int) -> Request:
        """The request from a user's arrays: q (s_q, heads, 576) and kv (length, 576) BF16; batchmates for a
        device run are drawn from N(0, 1)."""
        return Request({"q": q, "kv": kv}, q.shape[1], kv.shape[0], q.shape[0], {"dist": "normal:1", "seed": 0,
                                                                                   "heads": q.shape[1], "file": True})

    def races(self, req: Request, launch: Launch) -> RaceExposure | None:
        """The rows a data race of the published kernel can change from run to run (None: it has none)."""
        return None

    @abstractmethod
    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        """Every request's splits in `launch`, as the kernel's scheduler cuts them."""

    @abstractmethod
    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        """The request's row of interest under `plan`: stage name -> array, in the kernel's storage formats."""

    def adopt(self, req: Request) -> Request:
        """Another kernel's request (q and kv drawn for a dense decode) as this kernel takes it."""
        if not self.takes_s_q and req.s_q != 1:
            raise ValueError(f"s_q: {self.name} takes one query a request")
        return req

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        """Every request's splits under a plan that looks at the request alone: splits of `split_tokens` (None:
        one split each)."""
        return fixed_splits(launch.lengths, split_tokens)

    def reason(self, req: Request, launch: Launch) -> str:
        """What the scheduler read to cut the request as it did in `launch`."""
        return ""

    def units(self, req: Request, launch: Launch, plans: list[Plan]) -> dict[str, float]:
        """The parallelism of `plans` in `launch`: units of work (splits times row tiles), per SM, and the
        longest split in tokens."""
        tiles = -(-launch.s_q * req.heads // self.row_tile)
        n = sum(len(p) for p in plans) * tiles
        return {"units": n, "per_sm": n / launch.num_sms, "longest": max(b - a for p in plans for a, b in p)}

    @abstractmethod
    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        """The whole launch's inputs as the kernel takes them (batchmates drawn from the request's recipe), for a
        device run; the request's own rows at `launch.position`."""


def _rows(req: Request, s_q: int) -> np.ndarray:
    if s_q > req.s_q:
        raise ValueError(f"s_q: the request was drawn with {req.s_q} query rows, a launch asks for {s_q}")
    return req.arrays["q"][-s_q:]


def _mate_seed(req: Request, j: int) -> int:
    return int(req.recipe.get("seed", 0)) * 1000 + 17 + j


class _FlashMLAFamily(BatchKernel):
    """What FlashMLA's dense decode and FlashMLA-ETAP share: BF16 (or FP16) q and a cache of the request's
    tokens; the payload walk of :func:`~amla_sim.algorithms.deployed.flashmla.scheduler.decoding_schedule`."""

    fmt = "bf16"

    def _with_format(self, kernel: str, given: dict[str, Any]) -> dict[str, Any]:
        """The ``format`` option of a kernel that takes BF16 or FP16 inputs; others refused by the base class."""
        fmt = given.pop("format", "bf16")
        if fmt not in ("bf16", "fp16"):
            raise ValueError(f"format: {kernel} takes bf16 or fp16, got {fmt!r}")
        BatchKernel.options(self, **given)
        return {"format": fmt}

    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        opts = self.options(**options)
        q, kv = make_inputs(dist, batch=1, heads=heads, sq=s_q, context=length, seed=seed,
                            fmt=opts.get("format", self.fmt))
        return Request({"q": q[0], "kv": kv[0]}, heads, length, s_q,
                       {"dist": dist, "seed": seed, "heads": heads, **opts})

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        b, top = launch.batch, max(launch.lengths)
        fmt = req.recipe.get("format", self.fmt)
        q = np.zeros((b, launch.s_q, req.heads, 576), req.arrays["q"].dtype)
        kv = np.zeros((b, top, 576), req.arrays["kv"].dtype)
        for j, n in enumerate(launch.lengths):
            if j == launch.position:
                q[j], kv[j, :n] = _rows(req, launch.s_q), req.arrays["kv"]
            else:
                qj, kj = make_inputs(req.recipe["dist"], batch=1, heads=req.heads, sq=launch.s_q, context=n,
                                     seed=_mate_seed(req, j), fmt=fmt)
                q[j], kv[j, :n] = qj[0], kj[0]
        return {"q": q, "kv": kv, "seqlens": list(launch.lengths)}

    def reason(self, req: Request, launch: Launch) -> str:
        parts = self._parts(req, launch)
        blocks = sum(max(n - 1, 0) // BLOCK_SIZE_N + 1 for n in launch.lengths)
        total = blocks + FIXED_OVERHEAD_BLOCKS * launch.batch
        return (f"{parts} SM parts share {total} units of work ({blocks} blocks of 64 tokens in {launch.batch} "
                f"request{'s' * (launch.batch > 1)}, {FIXED_OVERHEAD_BLOCKS} a request): "
                f"{-(-total // parts) + FIXED_OVERHEAD_BLOCKS} a part")

    def _parts(self, req: Request, launch: Launch) -> int:
        return num_sm_parts(s_q=launch.s_q, heads_q=req.heads, num_sms=launch.num_sms)


class _Dense(_FlashMLAFamily):
    name = "flashmla"
    summary = "FlashMLA's sm90 dense decode"
    row_tile = 64
    what_if = "splits of a fixed size (or one split) in place of the scheduler's, whoever shares the launch"

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        return request_splits(launch.lengths, self._parts(req, launch))

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        res = flashmla(_rows(req, launch.s_q)[None], req.arrays["kv"][None], seqlens=[req.length],
                       num_sms=launch.num_sms, splits=[plan])
        return {"out": res.out[0, -1], "lse": res.lse[0, :, -1]}


class _Etap(_FlashMLAFamily):
    name = "flashmla-etap"
    summary = "FlashMLA-ETAP (the ETAP paper's kernel), race-free"
    row_tile = 16
    what_if = _Dense.what_if

    def options(self, **given: Any) -> dict[str, Any]:
        return self._with_format("FlashMLA-ETAP", given)

    def _parts(self, req: Request, launch: Launch) -> int:
        return etap_num_sm_parts(s_q=launch.s_q, heads_q=req.heads, num_sms=launch.num_sms)

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        meta, _ = etap_schedule(launch.lengths, self._parts(req, launch))
        return [[(lo * BLOCK_SIZE_N, min(hi * BLOCK_SIZE_N, n)) for lo, hi in blocks]
                for blocks, n in zip(metadata_splits(meta, list(launch.lengths)), launch.lengths)]

    def races(self, req: Request, launch: Launch) -> RaceExposure:
        return etap_race_exposure(launch.lengths, s_q=launch.s_q, heads=req.heads, num_sms=launch.num_sms)

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        res = flashmla_etap(_rows(req, launch.s_q)[None], req.arrays["kv"][None], seqlens=[req.length],
                            num_sms=launch.num_sms, splits=[plan])
        return {"out": res.out[0, -1], "lse": res.lse[0, :, -1]}


class _Fa3(_FlashMLAFamily):
    """FlashAttention-3's MLA decode as vLLM calls it: the launch's split bound (the caller's ``num_splits``, else
    FA3's heuristic) and each request's count from the whole batch's blocks
    (:mod:`~amla_sim.algorithms.deployed.fa3.scheduler`)."""

    name = "fa3-mla"
    summary = "FlashAttention-3's MLA decode (vLLM's FLASH_ATTN_MLA, SGLang's fa3), vLLM's call"
    row_tile = 64
    takes_num_kv_splits = True
    what_if = "vLLM's batch-invariant mode, num_splits = 1: one split a request"

    def options(self, **given: Any) -> dict[str, Any]:
        return self._with_format("FA3's MLA decode", given)

    def _schedule(self, req: Request, launch: Launch) -> Fa3Schedule:
        return fa3_schedule(list(launch.lengths), s_q=launch.s_q, heads=req.heads,
                            num_splits=launch.num_kv_splits or 0, causal=launch.s_q > 1, num_sms=launch.num_sms)

    def _cut(self, req: Request, launch: Launch, sched: Fa3Schedule, i: int, n: int) -> Plan:
        m = (launch.s_q * req.heads - 1) // 64  # the m-block of the row of interest's last head
        return [(lo * BLOCK_SIZE_N, min(hi * BLOCK_SIZE_N, n))
                for lo, hi in sched.blocks(i, n, m, s_q=launch.s_q, heads=req.heads) if hi > lo]  # an empty
        # split writes O = 0 and LSE = -inf, which the combine skips: it changes no bit

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        sched = self._schedule(req, launch)
        return [self._cut(req, launch, sched, i, n) for i, n in enumerate(launch.lengths)]

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        if split_tokens is not None:
            raise ValueError("split_tokens: FA3 takes a split count, not a split size; its batch-invariant mode is "
                             "one split a request ('one')")
        return [[(0, n)] for n in launch.lengths]

    def reason(self, req: Request, launch: Launch) -> str:
        sched = self._schedule(req, launch)
        blocks = sum(-(-n // BLOCK_SIZE_N) for n in launch.lengths) * -(-(launch.s_q * req.heads) // 64)
        bound = (f"num_splits = {launch.num_kv_splits} handed to the kernel" if launch.num_kv_splits else
                 f"FA3's heuristic bound {sched.bound} (the longest request, {max(launch.lengths)} tokens)")
        return (f"{bound}; {blocks} blocks of 64 rows x 64 keys in {launch.batch} request"
                f"{'s' * (launch.batch > 1)} on {launch.num_sms} SMs: {sched.splits[launch.position]} split"
                f"{'s' * (sched.splits[launch.position] > 1)}")

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        one = Launch("alone", (req.length,), s_q=launch.s_q, num_sms=launch.num_sms)
        sched = self._schedule(req, one)
        want = [tuple(r) for r in plan]
        count = next((n for n in range(len(plan), 257)
                      if self._cut(req, one, replace(sched, splits=(n,)), 0, req.length) == want), None)
        if count is None:
            raise ValueError(f"plan: FA3 cuts a request's blocks into a count of equal splits; {plan} is not such "
                             "a cut")
        res = fa3_mla(_rows(req, launch.s_q)[None], req.arrays["kv"][None], seqlens=[req.length],
                      num_sms=launch.num_sms, splits=[count])
        return {"out": res.out[0, -1], "lse": res.lse[:, -1]}


class _SparseFP8(BatchKernel):
    """FlashMLA's sparse FP8 decode on DeepSeek V3.2's cache: every request attends `topk` slots of its `tokens`
    cached tokens (seeded choice), so the scheduler sees the batch size only."""

    name = "flashmla-sparse-fp8"
    summary = "FlashMLA's sm90 sparse FP8 decode (DeepSeek V3.2's cache)"
    row_tile = 64
    lengths_vary = False
    what_if = _Dense.what_if

    def options(self, **given: Any) -> dict[str, Any]:
        tokens = given.pop("tokens", None)
        super().options(**given)
        return {} if tokens is None else {"tokens": check_int(tokens, "tokens", lo=1)}

    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        opts = self.options(**options)
        topk = check_int(length, "length", lo=BLOCK_SIZE_N)
        if topk % BLOCK_SIZE_N:
            raise ValueError(f"length: the sparse decode's topk is a multiple of 64, got {topk}")
        if heads not in (64, 128):
            raise ValueError(f"heads: the sparse decode takes 64 or 128 heads, got {heads}")
        tokens = opts.get("tokens", 4 * topk)
        if tokens < topk:
            raise ValueError(f"tokens: a request's cache must hold its topk ({topk}) tokens, got {tokens}")
        arrays = self._draw(dist, seed, heads, s_q, tokens, topk)
        return Request(arrays, heads, topk, s_q, {"dist": dist, "seed": seed, "heads": heads, "tokens": tokens})

    @staticmethod
    def _draw(dist: str, seed: int, heads: int, s_q: int, tokens: int, topk: int) -> dict[str, np.ndarray]:
        q, kv = make_inputs(dist, batch=1, heads=heads, sq=s_q, context=tokens, seed=seed)
        rng = np.random.default_rng([seed, 7])
        idx = np.stack([rng.choice(tokens, topk, replace=False) for _ in range(s_q)]).astype(np.int32)
        return {"q": q[0], "kv": kv[0], "indices": idx}

    def from_arrays(self, q: np.ndarray, kv: np.ndarray, *, s_q: int) -> Request:
        """Every query attends to all of kv's tokens: topk = the length rounded up to 64, the rest empty slots."""
        if q.shape[1] not in (64, 128):
            raise ValueError(f"inputs: the sparse decode takes 64 or 128 heads, q has {q.shape[1]}")
        n = kv.shape[0]
        topk = -(-n // BLOCK_SIZE_N) * BLOCK_SIZE_N
        idx = np.full((q.shape[0], topk), -1, np.int32)
        idx[:, :n] = np.arange(n)
        return Request({"q": q, "kv": kv, "indices": idx}, q.shape[1], topk, q.shape[0],
                       {"dist": "normal:1", "seed": 0, "heads": q.shape[1], "tokens": n, "file": True})

    def adopt(self, req: Request) -> Request:
        """The dense request's q and kv, every token attended."""
        return self.from_arrays(req.arrays["q"], req.arrays["kv"], s_q=req.s_q)

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        parts = num_sm_parts(s_q=launch.s_q, heads_q=req.heads, num_sms=launch.num_sms)
        return request_splits(launch.lengths, parts)

    def reason(self, req: Request, launch: Launch) -> str:
        parts = num_sm_parts(s_q=launch.s_q, heads_q=req.heads, num_sms=launch.num_sms)
        total = launch.batch * (req.length // BLOCK_SIZE_N + FIXED_OVERHEAD_BLOCKS)
        return (f"{parts} SM parts share {total} units of work ({launch.batch} request{'s' * (launch.batch > 1)} of "
                f"{req.length // BLOCK_SIZE_N} blocks, {FIXED_OVERHEAD_BLOCKS} a request): "
                f"{-(-total // parts) + FIXED_OVERHEAD_BLOCKS} a part")

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        paged, _ = pages(req.arrays["kv"][None], BLOCK_SIZE_N)
        cache = quantize_kv_cache(paged, "v32")
        res = flashmla_sparse_fp8(_rows(req, launch.s_q)[None], cache, req.arrays["indices"][None, -launch.s_q:],
                                  num_sms=launch.num_sms, scale=576**-0.5, splits=[plan])
        return {"out": res.out[0, -1], "lse": res.lse[0, :, -1]}

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        b, tokens = launch.batch, req.recipe["tokens"]
        q = np.zeros((b, launch.s_q, req.heads, 576), req.arrays["q"].dtype)
        kv = np.zeros((b, tokens, 576), req.arrays["kv"].dtype)
        idx = np.zeros((b, launch.s_q, req.length), np.int32)
        for j in range(b):
            if j == launch.position:
                a = {"q": _rows(req, launch.s_q), "kv": req.arrays["kv"], "indices": req.arrays["indices"][-launch.s_q:]}
            else:
                d = self._draw(req.recipe["dist"], _mate_seed(req, j), req.heads, launch.s_q, tokens, req.length)
                a = {"q": d["q"], "kv": d["kv"], "indices": d["indices"]}
            q[j], kv[j], idx[j] = a["q"], a["kv"], a["indices"]
        paged, base = pages(kv, BLOCK_SIZE_N)
        return {"q": q, "kv_cache": quantize_kv_cache(paged, "v32"), "indices": idx + base[:, None, None].astype(np.int32)}


class _SGLang(BatchKernel):
    """SGLang's Triton MLA decode with the split counts its Triton backend chooses (:mod:`~amla_sim.algorithms.deployed.sglang.scheduler`)."""

    name = "sglang-triton"
    summary = "SGLang's Triton MLA decode (sglang 0.5.23) with its backend's split counts"
    row_tile = 16  # BLOCK_H
    takes_s_q = False
    takes_num_kv_splits = True
    what_if = "SGLang's deterministic inference: cdiv(length, split_tokens) splits (split_tile_size, 256 by default)"

    def options(self, **given: Any) -> dict[str, Any]:
        ctx = given.pop("max_context_len", DEEPSEEK_CONTEXT)
        super().options(**given)
        return {"max_context_len": check_int(ctx, "max_context_len", lo=1)}

    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        opts = self.options(**options)
        if s_q != 1:
            raise ValueError(f"s_q: SGLang's decode takes one query a request, got {s_q}")
        if length > opts["max_context_len"]:
            raise ValueError(f"length: {length} tokens, past max_context_len ({opts['max_context_len']})")
        q, kv = make_inputs(dist, batch=1, heads=heads, context=length, seed=seed)
        return Request({"q": q[0], "kv": kv[0]}, heads, length, 1, {"dist": dist, "seed": seed, "heads": heads, **opts})

    def max_kv_splits(self, req: Request, launch: Launch) -> int:
        return mla_max_kv_splits(req.recipe.get("max_context_len", DEEPSEEK_CONTEXT), sms=launch.num_sms)

    def split_counts(self, req: Request, launch: Launch) -> np.ndarray:
        if launch.num_kv_splits is not None:
            return np.full(launch.batch, launch.num_kv_splits, np.int64)
        return num_kv_splits(np.array(launch.lengths), heads=req.heads, max_kv_splits=self.max_kv_splits(req, launch),
                             sms=launch.num_sms)

    @staticmethod
    def _ranges(lengths, counts) -> list[Plan]:
        top = int(np.max(counts))
        return [[(int(a), int(b)) for a, b in r if b > a] for r in split_ranges(lengths, counts, top)]

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        return self._ranges(launch.lengths, self.split_counts(req, launch))

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        counts = np.ones(launch.batch, np.int64) if split_tokens is None else \
            deterministic_kv_splits(launch.lengths, split_tokens)
        return self._ranges(launch.lengths, counts)

    def reason(self, req: Request, launch: Launch) -> str:
        if launch.num_kv_splits is not None:
            return f"num_kv_splits = {launch.num_kv_splits} handed to the kernel"
        n = int(self.split_counts(req, launch)[launch.position])
        return (f"get_num_kv_splits over {launch.batch} request{'s' * (launch.batch > 1)} (longest "
                f"{max(launch.lengths)}, shortest {min(launch.lengths)}, {launch.num_sms} SMs, max_kv_splits "
                f"{self.max_kv_splits(req, launch)}): {n} splits")

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        n = len(plan)
        if split_ranges([req.length], [n], n)[0].tolist() != [list(r) for r in plan]:
            raise ValueError(f"plan: SGLang's decode cuts a request into equal splits of a multiple of 32 tokens; "
                             f"{plan} is not such a cut")
        res = splitkv_decode(req.arrays["q"][None, -1:], req.arrays["kv"][None], seqlens=[req.length],
                             num_kv_splits=[n])
        return {"out": res.out[0, 0]}  # the decode returns no LSE

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        b, top = launch.batch, max(launch.lengths)
        q = np.zeros((b, req.heads, 576), req.arrays["q"].dtype)
        kv = np.zeros((b, top, 576), req.arrays["kv"].dtype)
        for j, n in enumerate(launch.lengths):
            if j == launch.position:
                q[j], kv[j, :n] = req.arrays["q"][-1], req.arrays["kv"]
            else:
                qj, kj = make_inputs(req.recipe["dist"], batch=1, heads=req.heads, context=n, seed=_mate_seed(req, j))
                q[j], kv[j, :n] = qj[0, 0], kj[0]
        return {"q": q, "kv": kv, "seqlens": list(launch.lengths),
                "num_kv_splits": self.split_counts(req, launch).tolist(),
                "max_kv_splits": self.max_kv_splits(req, launch)}


class _VllmTriton(_SGLang):
    """vLLM's Triton MLA decode with its backend's split count (``_compute_num_kv_splits``): one count for the whole
    launch, from its longest request (:mod:`~amla_sim.algorithms.deployed.vllm.triton_mla`)."""

    name = "vllm-triton-mla"
    summary = f"vLLM's Triton MLA decode (vLLM {VLLM_VERSION}, TRITON_MLA) with its backend's split count"
    what_if = "VLLM_BATCH_INVARIANT: one split a request (or, with split_tokens, cdiv(length, split_tokens) splits)"

    def options(self, **given: Any) -> dict[str, Any]:
        return BatchKernel.options(self, **given)

    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        self.options(**options)
        if s_q != 1:
            raise ValueError(f"s_q: the study takes one query a request for {self.name}, got {s_q}")
        q, kv = make_inputs(dist, batch=1, heads=heads, context=length, seed=seed)
        return Request({"q": q[0], "kv": kv[0]}, heads, length, 1, {"dist": dist, "seed": seed, "heads": heads})

    def max_kv_splits(self, req: Request, launch: Launch) -> int:
        return int(self.split_counts(req, launch).max())

    def split_counts(self, req: Request, launch: Launch) -> np.ndarray:
        n = launch.num_kv_splits or vllm_num_kv_splits(max(launch.lengths), launch.num_sms)
        return np.full(launch.batch, n, np.int64)

    @staticmethod
    def _ranges(lengths, counts) -> list[Plan]:
        top = int(np.max(counts))
        return [[(int(a), int(b)) for a, b in r if b > a] for r in split_ranges(lengths, counts, top, min_block_kv=1)]

    def reason(self, req: Request, launch: Launch) -> str:
        if launch.num_kv_splits is not None:
            return f"num_kv_splits = {launch.num_kv_splits} handed to the kernel"
        n = int(self.split_counts(req, launch)[0])
        return (f"_compute_num_kv_splits of the launch's longest request ({max(launch.lengths)} tokens, "
                f"{launch.num_sms} SMs): {n} splits for every request")

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        n = len(plan)  # empty splits add nothing: n splits cut as the launch's count does
        if split_ranges([req.length], [n], n, min_block_kv=1)[0].tolist() != [list(r) for r in plan]:
            raise ValueError(f"plan: vLLM's decode cuts a request into splits of cdiv(length, n) tokens; {plan} is "
                             "not such a cut")
        res = vllm_triton_mla(req.arrays["q"][None, -1:], req.arrays["kv"][None], seqlens=[req.length],
                              num_kv_splits=n)
        return {"out": res.out[0, 0], "lse": res.lse[0, 0]}

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        out = super().batch(req, launch)
        return {"q": out["q"], "kv": out["kv"], "seqlens": out["seqlens"],
                "num_kv_splits": int(self.split_counts(req, launch)[0])}


_FACTORIES: dict[str, Callable[[], BatchKernel]] = {k.name: k for k in (_Dense, _SparseFP8, _Etap, _SGLang, _Fa3,
                                                                         _VllmTriton)}
#: The kernels whose scheduler amla-sim models: name -> a one-line summary.
BATCH_KERNELS = {name: f().summary for name, f in _FACTORIES.items()}


def get_batch_kernel(name: str) -> BatchKernel:
    """A fresh adapter for kernel `name` (one of :data:`BATCH_KERNELS`)."""
    if name not in _FACTORIES:
        raise ValueError(f"kernel: expected one of {sorted(_FACTORIES)}, got {name!r}")
    return _FACTORIES[name]()
