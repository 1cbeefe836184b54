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
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from .._validate import check_int, strict_json
from ..comparison import ComparisonReport, compare
from ..experiments.inputs import parse_dist
from ..resources import split_bytes
from .kernel import BatchKernel, Plan, Request, describe_plan
from .launches import INT32_MAX, Launch
from .preflight import check_launches, check_memory, request_bytes
from .registry import BATCH_KERNELS, ByKernel, get_batch_kernel

__all__ = ["kernel_diff", "DiffReport", "STEPS", "NUMERICS", "SIDE_OPTIONS"]

#: The steps of an MLA decode, in pipeline order.
STEPS = ("keys", "schedule", "scores", "max", "exp", "P", "row sum", "normalise", "LSE", "combine")

#: kernel -> step -> (tag, what the model does), each kernel's :attr:`~.kernel.BatchKernel.numerics`. Two
#: kernels' choices are the same where the tags are; the schedule is compared by the plans themselves.
NUMERICS: Mapping[str, Mapping[str, tuple[str, str]]] = ByKernel("numerics")


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
    def nan(self) -> int:
        """The elements NaN on both sides: the same bits, not the same answer."""
        return sum(s.nan_both for s in self.comparison.stages)

    @property
    def identical(self) -> bool:
        """Every stage of both kernels compared, bit for bit the same and no NaN (a stage one returns alone never
        is)."""
        return self.comparison.bit_exact and not self.nan

    @property
    def differing_steps(self) -> list[str]:
        """The steps whose stated choices differ (a step one side does not state is not counted)."""
        return [s for s, _, _, same in self.steps if same is False]

    @property
    def explanation(self) -> str:
        if self.identical:
            return "the same bits: nothing to explain"
        if self.comparison.bit_exact:
            return f"the same bits, but {self.nan} elements are NaN in both: NaN against NaN is no answer"
        skipped = self.comparison.not_compared
        if self.comparison.first_difference is None:
            return (f"no compared bit differs ({', '.join(s.name for s in self.comparison.stages)}), but "
                    + "; ".join(f"{k} was not compared ({v})" for k, v in skipped.items()) + ": not shown identical")
        steps = self.differing_steps
        if self.aligned is not None and self.aligned.first_difference is None:
            return ("the schedule: run on one split plan, the two give the same bits"
                    + (f" in {', '.join(s.name for s in self.aligned.stages)} (the stages both return)"
                       if skipped else ""))
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
            nan = "".join(f", {n} {what}" for n, what in ((s.nan_mismatch, "NaN against a number"),
                                                           (s.nan_both, "NaN in both"),
                                                           (s.inf_mismatch, "infinity against another value")) if n)
            lines.append(f"  {s.name:4s} {s.size - s.identical} of {s.size} elements differ, max {s.max_ulp} ulp "
                         f"between numbers ({s.max_row_ulp:.3g} ulp of the row's largest |value|){nan}  {hist}")
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
    """A built-in algorithm or plugin as the diff runs it (``name`` or ``name:key=value``, as ``amla-sim run``
    takes it): the request's whole kv, its numerics if stated."""

    def __init__(self, spec: str):
        from ..experiments.specs import parse_algorithm
        from ..plugins import PluginError

        try:
            _, self.name, self.options = parse_algorithm(spec)
        except (PluginError, ValueError, TypeError) as e:
            raise ValueError(f"kernel: {str(e).removeprefix('algorithms: ')}") from None
        from ..plugins import get_algorithm

        self.fn = get_algorithm(self.name)
        stated = getattr(self.fn, "numerics", None) or {}
        if not isinstance(stated, Mapping) or set(stated) - set(STEPS):
            raise ValueError(f"kernel: {spec}'s numerics must map steps of {STEPS} to a tag or (tag, text), got "
                             f"{stated!r:.80}")
        self.numerics = {k: (v, v) if isinstance(v, str) else tuple(v) for k, v in stated.items()}

    def run(self, req: Request, s_q: int) -> dict[str, np.ndarray]:
        from ..plugins import call_algorithm

        q, kv = req.arrays["q"][None, -s_q:], req.arrays["kv"][None]
        res = call_algorithm(self.name, self.fn, q, kv, **self.options)  # a plugin's result checked there
        return {"out": np.asarray(res.out)[0, -1]}


#: What ``--kernel NAME:key=value`` may set for a modelled kernel: its launch's SM count, and the split count
#: handed to a kernel whose API takes one.
SIDE_OPTIONS = ("num_sms", "num_kv_splits")


@dataclass(frozen=True)
class _Side:
    """One kernel of a diff: a modelled kernel with its launch, or an algorithm."""

    spec: str
    kernel: BatchKernel | _Algorithm
    num_sms: int
    num_kv_splits: int | None = None


def kernel_diff(a: str, b: str, *, length: int = 4096, heads: int = 128, dist: str = "flashmla", seed: int = 0,
                s_q: int = 1, num_sms: int = 132, max_memory: int | None = None) -> DiffReport:
    """Kernels `a` and `b` on one request drawn from `dist` and `seed` (`length` tokens, `heads` heads), alone in
    its launch: where their bits differ and why (see the module docstring). Each is a name of
    :data:`.registry.BATCH_KERNELS`, optionally with its launch's ``:num_sms=N`` (in place of `num_sms`) or
    ``:num_kv_splits=N`` (a kernel whose API takes a split count), or a built-in algorithm or plugin (with its
    options, as ``amla-sim run`` takes them). A sparse FP8 kernel against a dense one sees the same tokens: the
    request attends to every one of its `length` tokens. Every bound and the memory the run needs are checked
    before the request is drawn (`max_memory`: the bytes it may take; None: what this machine has)."""
    for which, v in (("first", a), ("second", b)):
        if not isinstance(v, str) or not v:
            raise TypeError(f"kernel: expected a kernel's name, got {v!r:.60} (the {which} kernel)")
    if a == b:
        raise ValueError(f"kernel: the two kernels are the same ({a!r})")
    check_int(seed, "seed", lo=0)
    check_int(num_sms, "num_sms", lo=1, hi=INT32_MAX)
    if not isinstance(dist, str):
        raise TypeError(f"dist: expected a distribution's name, got {dist!r:.60}")
    parse_dist(dist)
    dense = get_batch_kernel("flashmla")  # the request as FlashMLA's dense decode takes it, adopted by the others
    tokens = dense.check_request(length=length, heads=heads, s_q=s_q, options={})
    sides = [_side(spec, num_sms) for spec in (a, b)]
    launches, most = _launches(sides, length=length, heads=heads, s_q=s_q, num_sms=num_sms)
    check_memory([("length, heads, s_q", request_bytes(heads=heads, s_q=s_q, tokens=tokens, splits=0)),
                  ("heads, s_q, num_sms", split_bytes(rows=s_q * heads, splits=most))],
                 what=f"the diff of {a} and {b} ({length} tokens, {heads} heads)", limit=max_memory)
    req = dense.request(dist=dist, seed=seed, length=length, heads=heads, s_q=s_q)
    reqs = [side.kernel.adopt(req) if isinstance(side.kernel, BatchKernel) else req for side in sides]
    plans: list[Plan | None] = [side.kernel.plans(r, L)[0] if isinstance(side.kernel, BatchKernel) else None
                                for side, r, L in zip(sides, reqs, launches)]
    got = [side.kernel.run(r, L, p) if isinstance(side.kernel, BatchKernel) else side.kernel.run(r, s_q)
           for side, r, L, p in zip(sides, reqs, launches, plans)]
    shared = [s for s in got[0] if s in got[1]]
    alone = {s: f"only {'AB'[i]} ({(a, b)[i]}) returns it" for i in (0, 1) for s in got[i] if s not in got[1 - i]}
    notes = [f"{', '.join(alone)} not compared: only one kernel returns it; compared {', '.join(shared)}"] \
        if alone else []
    rep = replace(compare({s: got[0][s] for s in shared}, {s: got[1][s] for s in shared},
                          meta={"a": a, "b": b, "launch": launches[0].to_dict()}), skipped=alone)
    aligned = None
    if rep.first_difference is not None and None not in plans and plans[0] != plans[1]:
        aligned = _aligned(sides, reqs, launches, plans, got, shared, notes)
    numerics = [dict(NUMERICS[side.kernel.name]) if isinstance(side.kernel, BatchKernel) else side.kernel.numerics
                for side in sides]
    steps = []
    for s in STEPS:
        x, y = numerics[0].get(s), numerics[1].get(s)
        same = None if x is None or y is None else x[0] == y[0]
        if s == "schedule" and None not in plans:
            same = plans[0] == plans[1]  # measured: the plans themselves
        steps.append((s, x and x[1], y and y[1], same))
    info = {"length": length, "heads": heads, "dist": dist, "seed": seed, "s_q": s_q,
            "num_sms": [side.num_sms for side in sides] if sides[0].num_sms != sides[1].num_sms else num_sms}
    return DiffReport(a, b, info, rep, tuple(steps), (plans[0], plans[1]), aligned, tuple(notes))


def _aligned(sides: list[_Side], reqs: list[Request], launches: list[Launch], plans: list[Plan | None],
             got: list[dict[str, np.ndarray]], shared: list[str], notes: list[str]) -> ComparisonReport | None:
    """A under B's split plan against B (or B under A's): whether the schedule alone explains the difference."""
    for me, other, how in ((0, 1, "A under B's plan"), (1, 0, "B under A's plan")):
        k, plan = cast(BatchKernel, sides[me].kernel), cast(Plan, plans[other])  # both modelled: both planned
        if len(plan) > k.max_splits(launches[me], heads=reqs[me].heads):
            notes.append(f"{'AB'[me]} cannot run {'AB'[other]}'s split plan: {len(plan)} splits, more than "
                         f"{k.name} runs a request in")
            continue
        try:
            mine = k.run(reqs[me], launches[me], plan)
        except ValueError as e:
            notes.append(f"{'AB'[me]} cannot run {'AB'[other]}'s split plan: {str(e)[:120]}")
            continue
        pair = ({s: mine[s] for s in shared}, {s: got[other][s] for s in shared})
        return compare(*(pair if me == 0 else pair[::-1]), meta={"how": how})
    return None


def _side(spec: str, num_sms: int) -> _Side:
    """``name``, ``name:num_sms=N``, ``name:num_kv_splits=N`` for a modelled kernel; else an algorithm."""
    head, _, rest = spec.partition(":")
    if head not in BATCH_KERNELS:
        return _Side(spec, _Algorithm(spec), num_sms)
    k = get_batch_kernel(head)
    given: dict[str, int] = {}
    for opt in rest.split(":") if rest else ():
        key, eq, raw = opt.partition("=")
        allowed = [o for o in SIDE_OPTIONS if o != "num_kv_splits" or k.takes_num_kv_splits]
        if not eq or key not in allowed:
            raise ValueError(f"kernel: {spec!r}: {opt!r} is not an option of {head} here; a modelled kernel takes "
                             f"{', '.join(o + '=N' for o in allowed)}")
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"kernel: {spec!r}: {key} takes an int, got {raw!r}") from None
        try:
            given[key] = check_int(value, key, lo=1, hi=INT32_MAX)
        except ValueError as e:
            raise ValueError(f"kernel: {spec!r}: {e}") from None
    return _Side(spec, k, given.get("num_sms", num_sms), given.get("num_kv_splits"))


def _launches(sides: list[_Side], *, length: int, heads: int, s_q: int,
              num_sms: int) -> tuple[list[Launch], int]:
    """Each side's launch, the request alone, checked against its kernel's bounds; the most splits of a run."""
    launches, most = [], 0
    for side in sides:
        k = side.kernel
        if not isinstance(k, BatchKernel):
            launches.append(Launch("alone", (length,), s_q=s_q, num_sms=side.num_sms))
            continue
        n = k.adopted_length(length=length, heads=heads, s_q=s_q)
        L = Launch("alone", (n,), s_q=s_q, num_sms=side.num_sms, num_kv_splits=side.num_kv_splits)
        try:
            one, _ = check_launches(k, [L], length=n, heads=heads, options=k.options())
        except ValueError as e:
            named = [a.strip() for a in str(e).partition(":")[0].split(",")]
            if side.spec != k.name and ("num_kv_splits" in named or (
                    "num_sms" in named and side.num_sms != num_sms)):  # set by the side's own options
                raise ValueError(f"kernel: {side.spec!r}: {e}") from None
            raise ValueError(f"{e} ({side.spec})") from None
        launches.append(L)
        most = max(most, one)  # the other side's plan, where this one runs it, is no longer than that side's
    return launches, most
