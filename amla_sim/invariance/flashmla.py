"""FlashMLA's decodes in the invariance study: the sm90 dense decode (``flashmla``), FlashMLA-ETAP
(``flashmla-etap``) and the sparse FP8 decode on DeepSeek V3.2's cache (``flashmla-sparse-fp8``).

All three cut a request with FlashMLA's payload walk over the batch's blocks of 64
(:mod:`~amla_sim.algorithms.deployed.flashmla.scheduler`): ``get_decoding_sched_meta``, or ``get_mla_metadata`` in
FlashMLA-ETAP. Their bound is the combine kernel's: at most 160 scheduler parts
(:func:`~amla_sim.algorithms.deployed.flashmla.combine.combine_width`), which the SM count sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._validate import check_int
from ..algorithms.deployed.flashmla.combine import combine_width
from ..algorithms.deployed.flashmla.dense import flashmla
from ..algorithms.deployed.flashmla.etap import flashmla_etap
from ..algorithms.deployed.flashmla.fp8_cache import pages, quantize_kv_cache
from ..algorithms.deployed.flashmla.scheduler import (BLOCK_SIZE_N, FIXED_OVERHEAD_BLOCKS, etap_num_sm_parts,
                                                      etap_schedule, fixed_splits, metadata_splits, num_sm_parts,
                                                      request_splits)
from ..algorithms.deployed.flashmla.sparse_fp8 import flashmla_sparse_fp8
from ..experiments.inputs import make_inputs
from .kernel import RCP_NORMALISE, BatchKernel, DenseDecode, Plan, Request, mate_seed, query_rows
from .launches import Launch
from .races import RaceExposure, etap_race_exposure

__all__ = ["FlashMLADense", "FlashMLASparseFP8", "FlashMLAEtap", "PayloadWalkDecode"]

#: The FlashMLA build these batch-invariance models predict: the one their device checks ran
#: (tests/data/invariance_h200.npz, FlashMLA's sources built with its own flags). Which splits a batch makes is the
#: same in every build; the bits of each split follow the build (:mod:`amla_sim.algorithms.deployed.flashmla.builds`).
DEVICE_CHECK_BUILD = "upstream"

_COMBINE = ("flashmla-combine", "splits' LSEs in log2 units; 32 lanes sum exp2(lse_s - M) over splits j, j + 32, "
                                "...; then an xor butterfly; out = sum fma(exp2(lse_s - g), O_s, .)")
_EX2_FMA = ("ex2(fma(S, c, -m))", "ex2.approx.ftz of fma(S, c, -m), c = scale log2 e, m in log2 units")
_PAYLOAD = ("flashmla-payload-walk", "FlashMLA's payload walk over the batch's blocks of 64 (get_decoding_sched_meta, "
                                     "or get_mla_metadata in FlashMLA's forks)")
_LSE = ("fma(lg2 L, ln 2, fl(m ln 2))", "fma(lg2(L), ln 2, fl(m ln 2)) for one split, log2 L + m per split")
_WHAT_IF = "splits of a fixed size (or one split) in place of the scheduler's, whoever shares the launch"


def _payload_reason(parts: int, total: int, work: str) -> str:
    return f"{parts} SM parts share {total} units of work ({work}): {-(-total // parts) + FIXED_OVERHEAD_BLOCKS} a part"


class PayloadWalkDecode(DenseDecode):
    """The dense decodes of FlashMLA's scheduler: q and a cache of the request's tokens, cut by the payload walk
    over every request's blocks."""

    row_tile = 64
    stages = {"out": "bf16", "lse": "fp32"}
    what_if = _WHAT_IF

    def _parts(self, launch: Launch, heads: int) -> int:
        return num_sm_parts(s_q=launch.s_q, heads_q=heads, num_sms=launch.num_sms)

    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        parts = self._parts(launch, heads)
        if parts < 1:  # get_mla_metadata's num_sm_parts of 0: a launch of no CTA
            raise ValueError(f"num_sms, heads, s_q: {launch.num_sms} SMs give no scheduler part for {launch.s_q} x "
                             f"{heads} query rows (one part needs an SM for each 64 rows)")
        combine_width(parts, launch.num_sms)  # the model's own bound, naming num_sms
        # a part cuts one request at most, a split holds a block at least
        return min(parts, -(-launch.length // BLOCK_SIZE_N)), parts + launch.batch

    def max_splits(self, launch: Launch, *, heads: int) -> int:
        return combine_width(self._parts(launch, heads), launch.num_sms)

    def check_split_tokens(self, split_tokens: int | None) -> None:
        fixed_splits([1], split_tokens)  # the model's own check: a multiple of 64

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        return fixed_splits(launch.lengths, split_tokens)

    def reason(self, req: Request, launch: Launch) -> str:
        blocks = sum(max(n - 1, 0) // BLOCK_SIZE_N + 1 for n in launch.lengths)
        total = blocks + FIXED_OVERHEAD_BLOCKS * launch.batch
        return _payload_reason(self._parts(launch, req.heads), total,
                               f"{blocks} blocks of 64 tokens in {launch.batch} request{'s' * (launch.batch > 1)}, "
                               f"{FIXED_OVERHEAD_BLOCKS} a request")


class FlashMLADense(PayloadWalkDecode):
    name = "flashmla"
    summary = "FlashMLA's sm90 dense decode"
    numerics = {
        "keys": ("bf16", "BF16"),
        "schedule": _PAYLOAD,
        "scores": ("wgmma-seesaw-k", "wgmma, k 0..575 (warpgroup 0) or 256..575 then 0..255 (warpgroup 1), blocks of "
                                     "64 keys in pairs"),
        "max": ("log2-units", "running max of fl(S c), c = fl(scale log2 e)"),
        "exp": _EX2_FMA,
        "P": ("bf16, P0 rescaled and rounded again", "BF16; warpgroup 1 gets P0 rescaled by s1 and rounded again"),
        "row sum": ("4 lanes: adjacent pairs, 8 groups", "4 lanes a row: pairs of adjacent columns, then the 8 "
                                                         "groups in order; fma(l, s, sum)"),
        "normalise": RCP_NORMALISE,
        "LSE": _LSE,
        "combine": _COMBINE,
    }

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        return request_splits(launch.lengths, self._parts(launch, req.heads))

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        res = flashmla(query_rows(req, launch.s_q)[None], req.arrays["kv"][None], seqlens=[req.length],
                       num_sms=launch.num_sms, splits=[plan], build=DEVICE_CHECK_BUILD)
        return {"out": res.out[0, -1], "lse": res.lse[0, :, -1]}


class FlashMLAEtap(PayloadWalkDecode):
    name = "flashmla-etap"
    summary = "FlashMLA-ETAP (the ETAP paper's kernel), race-free"
    row_tile = 16
    formats = ("bf16", "fp16")
    numerics = {
        "keys": ("bf16", "BF16 (or FP16)"),
        "schedule": _PAYLOAD,
        "scores": ("wgmma-transposed", "transposed: S^T = K Q^T, wgmma m64n16, k in order 0..575, blocks walked last "
                                       "to first"),
        "max": ("raw scores", "running max of the raw scores, scaled after"),
        "exp": ("ex2(fma(S, c, -fl(M c)))", "ex2.approx.ftz of fma(S, c, -fl(M c))"),
        "P": ("bf16", "the input format (BF16 or FP16)"),
        "row sum": ("2 keys a thread, butterfly, 4 warps", "2 keys a thread, a butterfly over 8 lane groups, then 4 "
                                                           "warps in order"),
        "normalise": RCP_NORMALISE,
        "LSE": ("fma(M, scale, fl(lg2 L ln 2))", "fma(M, scale, fl(lg2(L) ln 2)), natural log"),
        "combine": ("flashmla-combine, expf", "expf (exp2 of fl(x log2 e)) weights; 32 lanes and an xor butterfly; "
                                              "lse in natural log"),
    }

    def _parts(self, launch: Launch, heads: int) -> int:
        return etap_num_sm_parts(s_q=launch.s_q, heads_q=heads, num_sms=launch.num_sms)

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        meta, _ = etap_schedule(launch.lengths, self._parts(launch, req.heads))
        return [[(lo * BLOCK_SIZE_N, min(hi * BLOCK_SIZE_N, n)) for lo, hi in blocks]
                for blocks, n in zip(metadata_splits(meta, list(launch.lengths)), launch.lengths)]

    def races(self, req: Request, launch: Launch) -> RaceExposure:
        return etap_race_exposure(launch.lengths, s_q=launch.s_q, heads=req.heads, num_sms=launch.num_sms)

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        res = flashmla_etap(query_rows(req, launch.s_q)[None], req.arrays["kv"][None], seqlens=[req.length],
                            num_sms=launch.num_sms, splits=[plan])
        return {"out": res.out[0, -1], "lse": res.lse[0, :, -1]}


class FlashMLASparseFP8(BatchKernel):
    """FlashMLA's sparse FP8 decode on DeepSeek V3.2's cache: every request attends `topk` slots of its `tokens`
    cached tokens (seeded choice), so the scheduler sees the batch size only."""

    name = "flashmla-sparse-fp8"
    summary = "FlashMLA's sm90 sparse FP8 decode (DeepSeek V3.2's cache)"
    row_tile = 64
    stages = {"out": "bf16", "lse": "fp32"}
    lengths_vary = False
    what_if = _WHAT_IF
    numerics = {
        "keys": ("e4m3 + scales", "E4M3 with per-tile FP32 scales, dequantized to BF16 (RoPE part BF16)"),
        "schedule": _PAYLOAD,
        "scores": ("wgmma-k-in-order", "wgmma, k in order 0..575, one block of 64 slots at a time"),
        "max": ("log2-units", "running max of fl(rowmax(S) c), c = fl(fl(scale) fl(log2 e))"),
        "exp": _EX2_FMA,
        "P": ("bf16", "BF16"),
        "row sum": ("4 lanes: 16 columns each", "4 lanes a row, 16 columns each in order (2t, 2t + 1, 2t + 8, ...); "
                                                "fma(l, s, sum)"),
        "normalise": RCP_NORMALISE,
        "LSE": _LSE,
        "combine": _COMBINE,
    }

    def options(self, **given: Any) -> dict[str, Any]:
        tokens = given.pop("tokens", None)
        super().options(**given)
        return {} if tokens is None else {"tokens": check_int(tokens, "tokens", lo=1)}

    @staticmethod
    def _check_heads(heads: int, what: str = "heads") -> None:
        if heads not in (64, 128):
            raise ValueError(f"{what}: the sparse decode takes 64 or 128 heads, got {heads}")

    def check_request(self, *, length: int, heads: int, s_q: int, options: Mapping[str, Any]) -> int:
        topk = check_int(length, "length", lo=BLOCK_SIZE_N)
        if topk % BLOCK_SIZE_N:
            raise ValueError(f"length: the sparse decode's topk is a multiple of 64, got {topk}")
        self._check_heads(check_int(heads, "heads", lo=1))
        check_int(s_q, "s_q", lo=1)
        tokens = options.get("tokens", 4 * topk)
        if tokens < topk:
            raise ValueError(f"tokens: a request's cache must hold its topk ({topk}) tokens, got {tokens}")
        return tokens

    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        opts = self.options(**options)
        tokens = self.check_request(length=length, heads=heads, s_q=s_q, options=opts)
        arrays = self._draw(dist, seed, heads, s_q, tokens, length)
        return Request(arrays, heads, length, s_q, {"dist": dist, "seed": seed, "heads": heads, "tokens": tokens})

    @staticmethod
    def _draw(dist: str, seed: int, heads: int, s_q: int, tokens: int, topk: int) -> dict[str, np.ndarray]:
        q, kv = make_inputs(dist, batch=1, heads=heads, sq=s_q, context=tokens, seed=seed)
        rng = np.random.default_rng([seed, 7])
        idx = np.stack([rng.choice(tokens, topk, replace=False) for _ in range(s_q)]).astype(np.int32)
        return {"q": q[0], "kv": kv[0], "indices": idx}

    def from_arrays(self, q: np.ndarray, kv: np.ndarray, *, s_q: int, **options: Any) -> Request:
        """Every query attends to all of kv's tokens: topk = the length rounded up to 64, the rest empty slots."""
        self._check_heads(q.shape[1], "inputs")
        if "tokens" in options:
            raise ValueError(f"tokens: the request's cache is the inputs' kv ({kv.shape[0]} tokens); tokens applies "
                             "to a drawn request")
        self.options(**options)
        n = kv.shape[0]
        topk = -(-n // BLOCK_SIZE_N) * BLOCK_SIZE_N
        idx = np.full((q.shape[0], topk), -1, np.int32)
        idx[:, :n] = np.arange(n)
        return Request({"q": q, "kv": kv, "indices": idx}, q.shape[1], topk, q.shape[0],
                       {"dist": "normal:1", "seed": 0, "heads": q.shape[1], "tokens": n, "file": True})

    def adopt(self, req: Request) -> Request:
        """The dense request's q and kv, every token attended."""
        self.adopted_length(length=req.length, heads=req.heads, s_q=req.s_q)
        return self.from_arrays(req.arrays["q"], req.arrays["kv"], s_q=req.s_q)

    def adopted_length(self, *, length: int, heads: int, s_q: int) -> int:
        """topk: the length rounded up to 64."""
        self._check_heads(check_int(heads, "heads", lo=1))
        check_int(s_q, "s_q", lo=1)
        return -(-check_int(length, "length", lo=1) // BLOCK_SIZE_N) * BLOCK_SIZE_N

    def _parts(self, launch: Launch, heads: int) -> int:
        return num_sm_parts(s_q=launch.s_q, heads_q=heads, num_sms=launch.num_sms)

    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        parts = self._parts(launch, heads)
        combine_width(parts, launch.num_sms)  # the model's own bound, naming num_sms
        return min(parts, launch.length // BLOCK_SIZE_N), parts + launch.batch

    def max_splits(self, launch: Launch, *, heads: int) -> int:
        return combine_width(self._parts(launch, heads), launch.num_sms)

    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        return request_splits(launch.lengths, self._parts(launch, req.heads))

    def check_split_tokens(self, split_tokens: int | None) -> None:
        fixed_splits([1], split_tokens)  # the model's own check: a multiple of 64

    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        return fixed_splits(launch.lengths, split_tokens)

    def reason(self, req: Request, launch: Launch) -> str:
        total = launch.batch * (req.length // BLOCK_SIZE_N + FIXED_OVERHEAD_BLOCKS)
        return _payload_reason(self._parts(launch, req.heads), total,
                               f"{launch.batch} request{'s' * (launch.batch > 1)} of {req.length // BLOCK_SIZE_N} "
                               f"blocks, {FIXED_OVERHEAD_BLOCKS} a request")

    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        paged, _ = pages(req.arrays["kv"][None], BLOCK_SIZE_N)
        cache = quantize_kv_cache(paged, "v32")
        res = flashmla_sparse_fp8(query_rows(req, launch.s_q)[None], cache,
                                  req.arrays["indices"][None, -launch.s_q:], num_sms=launch.num_sms,
                                  scale=576**-0.5, splits=[plan], build=DEVICE_CHECK_BUILD)
        return {"out": res.out[0, -1], "lse": res.lse[0, :, -1]}

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        b, tokens = launch.batch, req.recipe["tokens"]
        q = np.zeros((b, launch.s_q, req.heads, 576), req.arrays["q"].dtype)
        kv = np.zeros((b, tokens, 576), req.arrays["kv"].dtype)
        idx = np.zeros((b, launch.s_q, req.length), np.int32)
        for j in range(b):
            if j == launch.position:
                a = {"q": query_rows(req, launch.s_q), "kv": req.arrays["kv"],
                     "indices": req.arrays["indices"][-launch.s_q:]}
            else:
                a = self._draw(req.recipe["dist"], mate_seed(req, j), req.heads, launch.s_q, tokens, req.length)
            q[j], kv[j], idx[j] = a["q"], a["kv"], a["indices"]
        paged, base = pages(kv, BLOCK_SIZE_N)
        return {"q": q, "kv_cache": quantize_kv_cache(paged, "v32"),
                "indices": idx + base[:, None, None].astype(np.int32)}

