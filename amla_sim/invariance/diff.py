"""Two kernels on the same request: where their bits differ, and the first modelled step that explains it.

Each modelled kernel states its numerics step by step, in pipeline order (:data:`NUMERICS`, read off its model's
docstring and upstream file). :func:`kernel_diff` runs both models on one request, compares the row of
interest bit for bit, then looks for the cause two ways: the steps where the two statements differ (the first is
the first modelled difference), and a measurement where the models allow one: kernel A re-run under kernel B's
split plan. If that alone makes A's bits B's, the schedule is the whole explanation; if not, the arithmetic
differs too, at the first differing step after the schedule. A plugin or a built-in algorithm can take part (it
runs as a black box on the request; an attribute ``numerics`` on the function, mapping steps to a tag or a pair
(tag, text), states its choices: a step is the same where the tags are).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._validate import strict_json
from ..comparison import ComparisonReport, compare
from .kernels import BATCH_KERNELS, BatchKernel, Plan, Request, describe_plan, get_batch_kernel
from .launches import Launch

__all__ = ["kernel_diff", "DiffReport", "STEPS", "NUMERICS"]

#: The steps of an MLA decode, in pipeline order.
STEPS = ("keys", "schedule", "scores", "max", "exp", "P", "row sum", "normalise", "LSE", "combine")

_FLASHMLA_COMBINE = ("flashmla-combine", "splits' LSEs in log2 units; 32 lanes sum exp2(lse_s - M) over splits j, "
                     "j + 32, ..., then an xor butterfly; out = sum fma(exp2(lse_s - g), O_s, .)")
_RCP = ("rcp", "O times MUFU.RCP of L (div.approx)")
_EX2_FMA = ("ex2(fma(S, c, -m))", "ex2.approx.ftz of fma(S, c, -m), c = scale log2 e, m in log2 units")
_PAYLOAD = ("flashmla-payload-walk", "FlashMLA's payload walk over the batch's blocks of 64 (get_decoding_sched_meta, "
                                     "or get_mla_metadata in FlashMLA's forks)")
#: kernel -> step -> (tag, what the model does). Two kernels' choices are the same where the tags are; the
#: schedule is compared by the plans themselves.
NUMERICS: dict[str, dict[str, tuple[str, str]]] = {
    "flashmla": {
        "keys": ("bf16", "BF16"),
        "schedule": _PAYLOAD,
        "scores": ("wgmma-seesaw-k", "wgmma, k 0..575 (warpgroup 0) or 256..575 then 0..255 (warpgroup 1), blocks of "
                                     "64 keys in pairs"),
        "max": ("log2-units", "running max of fl(S c), c = fl(scale log2 e)"),
        "exp": _EX2_FMA,
        "P": ("bf16, P0 rescaled and rounded again", "BF16; warpgroup 1 gets P0 rescaled by s1 and rounded again"),
        "row sum": ("4 lanes: adjacent pairs, 8 groups", "4 lanes a row: pairs of adjacent columns, then the 8 "
                                                         "groups in order; fma(l, s, sum)"),
        "normalise": _RCP,
        "LSE": ("fma(lg2 L, ln 2, fl(m ln 2))", "fma(lg2(L), ln 2, fl(m ln 2)) for one split, log2 L + m per split"),
        "combine": _FLASHMLA_COMBINE,
    },
    "flashmla-sparse-fp8": {
        "keys": ("e4m3 + scales", "E4M3 with per-tile FP32 scales, dequantized to BF16 (RoPE part BF16)"),
        "schedule": _PAYLOAD,
        "scores": ("wgmma-k-in-order", "wgmma, k in order 0..575, one block of 64 slots at a time"),
        "max": ("log2-units", "running max of fl(rowmax(S) c), c = fl(fl(scale) fl(log2 e))"),
        "exp": _EX2_FMA,
        "P": ("bf16", "BF16"),
        "row sum": ("4 lanes: 16 columns each", "4 lanes a row, 16 columns each in order (2t, 2t + 1, 2t + 8, ...); "
                                                "fma(l, s, sum)"),
        "normalise": _RCP,
        "LSE": ("fma(lg2 L, ln 2, fl(m ln 2))", "fma(lg2(L), ln 2, fl(m ln 2)) for one split, log2 L + m per split"),
        "combine": _FLASHMLA_COMBINE,
    },
    "flashmla-etap": {
        "keys": ("bf16", "BF16 (or FP16)"),
        "schedule": _PAYLOAD,
        "scores": ("wgmma-transposed", "transposed: S^T = K Q^T, wgmma m64n16, k in order 0..575, blocks walked last "
                                       "to first"),
        "max": ("raw scores", "running max of the raw scores, scaled after"),
        "exp": ("ex2(fma(S, c, -fl(M c)))", "ex2.approx.ftz of fma(S, c, -fl(M c))"),
        "P": ("bf16", "the input format (BF16 or FP16)"),
        "row sum": ("2 keys a thread, butterfly, 4 warps", "2 keys a thread, a butterfly over 8 lane groups, then 4 "
                                                           "warps in order"),
        "normalise": _RCP,
        "LSE": ("fma(M, scale, fl(lg2 L ln 2))", "fma(M, scale, fl(lg2(L) ln 2)), natural log"),
        "combine": ("flashmla-combine, expf", "expf (exp2 of fl(x log2 e)) weights; 32 lanes and an xor butterfly; "
                                              "lse in natural log"),
    },
    "fa3-mla": {
        "keys": ("bf16", "BF16 (or FP16)"),
        "schedule": ("fa3-prepare-scheduler", "the launch's split bound (num_splits, or FA3's heuristic), each "
                                              "request cdiv(n_blocks, ceilf(total_blocks 1.1 / SMs)) splits over "
                                              "the whole batch, cdiv(n_block_max, splits) blocks a split"),
        "scores": ("wgmma rope + nope", "wgmma: Q_rope K_rope^T (k 512..575), then += Q_nope V^T (k 0..511) in one "
                                       "accumulator, blocks walked last to first"),
        "max": ("raw scores", "running max of the raw scores, scaled after"),
        "exp": ("ex2(fma(S, c, -fl(M c)))", "ex2.approx.ftz of fma(S, c, -fl(M c)), c = fl32(double(scale) log2 e)"),
        "P": ("bf16", "the input format (BF16 or FP16), rounded once for both warpgroups"),
        "row sum": ("4 lanes: 16 columns each", "4 lanes a row, 16 columns each in order (2t, 2t + 1, 2t + 8, ...); "
                                                "fma(l, s, .); the lanes met xor 2, then xor 1"),
        "normalise": _RCP,
        "LSE": ("fma(M, fl(c ln 2), __logf L)", "fma(M, fl(c ln 2), fl(lg2(L) ln 2)), natural log"),
        "combine": ("fa3-combine", "a warp a row: 32 lanes sum expf(lse_s - M), xor butterfly; lse = logf(sum) + M; "
                                   "out = sum fma(expf(lse_s - M) rcp(sum), O_s, .)"),
    },
    "sglang-triton": {
        "keys": ("bf16", "BF16"),
        "schedule": ("sglang-num-kv-splits", "SGLang's get_num_kv_splits over the batch; equal splits of a multiple "
                                             "of 32 tokens"),
        "scores": ("mma.sync 512 + 64", "mma.sync m16n8k16: q[:512] K^T then q[512:] K_rope^T chained in one FP32 "
                                        "accumulator, then times sm_scale"),
        "max": ("natural units", "running max of the scaled scores (natural units)"),
        "exp": ("ex2(fl(x log2 e))", "tl.exp: ex2.approx of fl(x log2 e)"),
        "P": ("bf16", "BF16"),
        "row sum": ("mma.sync layout", "mma.sync accumulator layout: 2 adjacent columns a thread, 4 threads, then the "
                                       "warps"),
        "normalise": ("div.full", "div.full (acc / l)"),
        "LSE": ("m + logf(l)", "m + logf(l) (libdevice), per split"),
        "combine": ("online merge", "stage 2: an online merge over the splits in order, natural-log weights, acc / l "
                                    "at the end"),
    },
}
NUMERICS["vllm-triton-mla"] = {
    **NUMERICS["sglang-triton"],
    "schedule": ("vllm-num-kv-splits", "vLLM's _compute_num_kv_splits: one count for the launch, next_pow2(longest "
                                       "// 512) up to 2 x SMs; splits of cdiv(length, n) tokens"),
    "LSE": ("m + logf(l), bf16", "m + logf(l) (libdevice) per split; the final LSE stored in BF16"),
}


@dataclass(frozen=True)
class DiffReport:
    """Kernel A against kernel B on one request."""

    a: str
    b: str
    request: dict[str, Any]
    comparison: ComparisonReport  # A's stages (as "device") against B's (as "simulated")
    steps: tuple[tuple[str, str | None, str | None, bool | None], ...]  # (step, A's, B's, same), pipeline order
    plans: tuple[Plan | None, Plan | None] = (None, None)
    aligned: ComparisonReport | None = None  # A under B's split plan, against B
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def identical(self) -> bool:
        return self.comparison.bit_exact

    @property
    def differing_steps(self) -> list[str]:
        """The steps whose stated choices differ (a step one side does not state is not counted)."""
        return [s for s, _, _, same in self.steps if same is False]

    @property
    def explanation(self) -> str:
        if self.identical:
            return "the same bits: nothing to explain"
        steps = self.differing_steps
        if self.aligned is not None and self.aligned.bit_exact:
            return "the schedule: run on one split plan, the two give the same bits"
        after = [s for s in steps if s != "schedule"]
        if self.aligned is not None and after:
            return (f"the arithmetic: run on one split plan the bits still differ; the first modelled difference "
                    f"after the schedule is '{after[0]}'")
        if steps:
            return f"the first modelled difference is '{steps[0]}'"
        return "no stated step differs: an unmodelled difference (state the plugin's numerics to locate it)"

    def to_dict(self) -> dict[str, Any]:
        return strict_json({
            "a": self.a, "b": self.b, "request": self.request, "identical": self.identical,
            "comparison": self.comparison.to_dict(), "differing_steps": self.differing_steps,
            "explanation": self.explanation,
            "steps": [{"step": s, "a": x, "b": y, "same": same} for s, x, y, same in self.steps],
            "plans": [None if p is None else [list(r) for r in p] for p in self.plans],
            "aligned": None if self.aligned is None else self.aligned.to_dict(), "notes": list(self.notes)})

    def format(self) -> str:
        lines = [f"{self.a} against {self.b}: request {self.request['length']} long, {self.request['heads']} heads "
                 f"({self.request.get('dist')}, seed {self.request.get('seed')})", ""]
        for s in self.comparison.stages:
            hist = " ".join(f"{k}:{v}" for k, v in s.histogram.items() if v)
            lines.append(f"  {s.name:4s} {s.size - s.identical} of {s.size} elements differ, max {s.max_ulp} ulp  "
                         f"{hist}")
        for name, why in self.comparison.not_compared.items():
            lines.append(f"  {name:4s} not compared: {why}")
        pa, pb = self.plans
        if pa is not None or pb is not None:
            lines.append(f"  splits: A {describe_plan(pa) if pa else '-'}; B {describe_plan(pb) if pb else '-'}")
        if self.aligned is not None:
            diff = {s.name: s.size - s.identical for s in self.aligned.stages}
            lines.append(f"  on one split plan ({self.aligned.meta.get('how')}): "
                         + ", ".join(f"{k} {v} differ" for k, v in diff.items()))
        lines += ["", "  step        same  A / B"]
        for s, x, y, same in self.steps:
            mark = {None: "?", True: "yes", False: "NO"}[same]
            lines.append(f"  {s:10s} {mark:>5s}  {x or '(not stated)'}")
            if not same:
                lines.append(f"  {'':10s} {'':5s}  {y or '(not stated)'}")
        lines += [""] + [f"  note: {n}" for n in self.notes] + [f"explanation: {self.explanation}"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


class _Algorithm:
    """A built-in algorithm or plugin as the diff runs it: the request's whole kv, its numerics if stated."""

    def __init__(self, name: str):
        from ..plugins import get_algorithm

        self.name = name
        self.fn = get_algorithm(name)
        stated = getattr(self.fn, "numerics", None) or {}
        if not isinstance(stated, Mapping) or set(stated) - set(STEPS):
            raise ValueError(f"kernel: {name}'s numerics must map steps of {STEPS} to a tag or (tag, text), got "
                             f"{stated!r:.80}")
        self.numerics = {k: (v, v) if isinstance(v, str) else tuple(v) for k, v in stated.items()}

    def run(self, req: Request, s_q: int) -> dict[str, np.ndarray]:
        from ..plugins import call_algorithm

        q, kv = req.arrays["q"][None, -s_q:], req.arrays["kv"][None]
        res = call_algorithm(self.name, self.fn, q, kv)  # a plugin's result checked there
        return {"out": np.asarray(res.out)[0, -1]}


def kernel_diff(a: str, b: str, *, length: int = 4096, heads: int = 128, dist: str = "flashmla", seed: int = 0,
                s_q: int = 1, num_sms: int = 132) -> DiffReport:
    """Kernels `a` and `b` (names of :data:`.kernels.BATCH_KERNELS`, built-in algorithms or plugins) on one request
    drawn from `dist` and `seed` (`length` tokens, `heads` heads), alone in its launch: where their bits differ
    and why (see the module docstring). A sparse FP8 kernel against a dense one sees the same tokens: the request
    attends to every one of its `length` tokens."""
    if a == b:
        raise ValueError(f"kernel: the two kernels are the same ({a!r})")
    sides = [_side(name) for name in (a, b)]
    req = get_batch_kernel("flashmla").request(dist=dist, seed=seed, length=length, heads=heads, s_q=s_q)
    reqs = [k.adopt(req) if isinstance(k, BatchKernel) else req for k in sides]
    launches = [Launch("alone", (r.length,), s_q=s_q, num_sms=num_sms) for r in reqs]
    plans: list[Plan | None] = [k.plans(r, L)[0] if isinstance(k, BatchKernel) else None
                                for k, r, L in zip(sides, reqs, launches)]
    got = [k.run(r, L, p) if isinstance(k, BatchKernel) else k.run(r, s_q)
           for k, r, L, p in zip(sides, reqs, launches, plans)]
    shared = [s for s in got[0] if s in got[1]]
    notes = []
    one_sided = sorted(set(got[0]) ^ set(got[1]))
    if one_sided:
        notes.append(f"only one kernel returns {', '.join(one_sided)}: compared {', '.join(shared)}")
    rep = compare({s: got[0][s] for s in shared}, {s: got[1][s] for s in shared},
                  meta={"a": a, "b": b, "launch": launches[0].to_dict()})
    aligned = None
    if not rep.bit_exact and None not in plans and plans[0] != plans[1]:
        for me, other, how in ((0, 1, "A under B's plan"), (1, 0, "B under A's plan")):
            try:
                mine = sides[me].run(reqs[me], launches[me], plans[other])
            except ValueError as e:
                notes.append(f"{'AB'[me]} cannot run {'AB'[other]}'s split plan: {str(e)[:120]}")
                continue
            pair = ({s: mine[s] for s in shared}, {s: got[other][s] for s in shared})
            aligned = compare(*(pair if me == 0 else pair[::-1]), meta={"how": how})
            break
    numerics = [dict(NUMERICS[side.name]) if isinstance(side, BatchKernel) else side.numerics for side in sides]
    steps = []
    for s in STEPS:
        x, y = numerics[0].get(s), numerics[1].get(s)
        same = None if x is None or y is None else x[0] == y[0]
        if s == "schedule" and None not in plans:
            same = plans[0] == plans[1]  # measured: the plans themselves
        steps.append((s, x and x[1], y and y[1], same))
    steps = tuple(steps)
    info = {"length": length, "heads": heads, "dist": dist, "seed": seed, "s_q": s_q, "num_sms": num_sms}
    return DiffReport(a, b, info, rep, steps, (plans[0], plans[1]), aligned, tuple(notes))


def _side(name: str) -> BatchKernel | _Algorithm:
    if not isinstance(name, str):
        raise TypeError(f"kernel: expected a name, got {name!r}")
    return get_batch_kernel(name) if name in BATCH_KERNELS else _Algorithm(name)
