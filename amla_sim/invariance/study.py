"""Does a request's output change with its batchmates, and why: :func:`invariance`.

The request runs alone and in each launch of a list (:func:`.launches.variations`); per launch the report gives
the request's split plan under the kernel's scheduler, whether out and LSE change against the request alone (how
many elements, the ULP histogram: :func:`amla_sim.compare`), the cause (the plan and what the scheduler read to
choose it), the argmax of a logits projection where one is given, and the parallelism the launch keeps. A what-if
runs the same launches under a batch-invariant plan: its bits (one answer for every launch) and what it costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .._validate import check_int, strict_json
from ..comparison import ComparisonReport, compare
from ..experiments.inputs import parse_dist
from ..resources import plan_bytes, split_bytes
from .kernel import BatchKernel, Plan, Request, checked_inputs, describe_plan
from .launches import Launch, variations
from .preflight import check_launches, check_memory, check_what_if
from .races import runs
from .registry import get_batch_kernel

__all__ = ["invariance", "InvarianceReport", "LaunchResult", "WhatIf", "project"]


@dataclass(frozen=True)
class LaunchResult:
    """The request in one launch: its plan, its bits against the reference launch's, and why they differ."""

    launch: Launch
    plan: Plan
    same_plan: bool  # the reference's splits: then every bit must be the reference's
    comparison: ComparisonReport  # this launch's stages against the reference's
    reason: str  # what the scheduler read
    units: dict[str, float]  # parallelism: units of work, per SM, longest split
    argmax: int | None = None
    bits: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # the row of interest's stages

    @property
    def changed(self) -> dict[str, int]:
        """Per stage, the elements whose bits differ from the reference's."""
        return {s.name: s.size - s.identical for s in self.comparison.stages}

    @property
    def changed_heads(self) -> list[int]:
        """The heads (rows) of the request whose output bits differ from the reference's."""
        return list(map(int, self.comparison.meta.get("changed_heads", [])))

    @property
    def cause(self) -> str:
        if self.same_plan:
            return "the same splits as the reference: no bit can differ"
        ref = self.comparison.meta["reference_plan"]
        return f"split differently: {describe_plan(self.plan)} (the reference: {ref})"


@dataclass(frozen=True)
class WhatIf:
    """The launches again under a batch-invariant plan (`split_tokens` a split, None: one split)."""

    split_tokens: int | None
    description: str
    plan: Plan
    against_kernel: ComparisonReport  # the invariant plan's bits against the kernel's own, alone
    units: list[dict[str, float]]  # per launch, as LaunchResult.units


@dataclass(frozen=True)
class InvarianceReport:
    """Every launch's result; the first is the reference (the request alone, unless the caller said)."""

    kernel: str
    summary: str
    request: dict[str, Any]
    results: tuple[LaunchResult, ...]
    what_if: WhatIf | None = None
    projection: dict[str, Any] = field(default_factory=dict)
    races: dict[str, Any] = field(default_factory=dict)  # run to run: the row's heads a published race can change

    @property
    def nan(self) -> dict[str, int]:
        """Per stage, the request's elements that are NaN in some launch (the models' ``nan_outputs`` hazard):
        NaN against NaN is the same bits, not an answer."""
        with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens a NaN
            return {s: max(int(np.isnan(r.bits[s].astype(np.float64)).sum()) for r in self.results if s in r.bits)
                    for s in self.results[0].changed}

    @property
    def invariant(self) -> bool:
        """True when no launch changed a bit of the request and no element of it is NaN."""
        return all(r.comparison.bit_exact for r in self.results) and not any(self.nan.values())

    def to_dict(self) -> dict[str, Any]:
        def one(r: LaunchResult) -> dict[str, Any]:
            return {"launch": r.launch.to_dict(), "plan": [list(p) for p in r.plan], "same_plan": r.same_plan,
                    "changed": r.changed, "changed_heads": r.changed_heads, "cause": r.cause, "reason": r.reason,
                    "units": r.units, "argmax": r.argmax, "comparison": r.comparison.to_dict()}

        w = self.what_if
        return strict_json({
            "kernel": self.kernel, "request": self.request, "invariant": self.invariant, "hazards": {
                f"nan_{s}": n for s, n in self.nan.items()},
            "results": [one(r) for r in self.results], "projection": self.projection,
            "what_if": None if w is None else {
                "split_tokens": w.split_tokens, "description": w.description, "plan": [list(p) for p in w.plan],
                "against_kernel": w.against_kernel.to_dict(), "units": w.units},
            "races": self.races})

    def format(self) -> str:
        ref = self.results[0]
        lines = [f"{self.summary}: request {self.request['length']} long, {self.request['heads']} heads "
                 f"({self.request.get('dist', 'from a file')}, seed {self.request.get('seed', '-')})",
                 f"reference: {ref.launch.label}, {describe_plan(ref.plan)}; {ref.reason}", ""]
        stages = [s.name for s in ref.comparison.stages]
        head = f"  {'launch':46s} {'splits':30s} " + " ".join(f"{s + ' changed':>13s}" for s in stages)
        lines += [head + "  max ulp  row ulp  heads  units/SM"]
        for r in self.results:
            ch = " ".join(f"{r.changed[s]:13d}" for s in stages)
            flip = "" if r.argmax is None else f"  argmax {r.argmax}" + ("" if r.argmax == ref.argmax else " FLIPS")
            lines.append(f"  {r.launch.label[:46]:46s} {describe_plan(r.plan)[:30]:30s} {ch} "
                         f"{max(s.max_ulp for s in r.comparison.stages):8d} "
                         f"{max(s.max_row_ulp for s in r.comparison.stages):8.3g} {len(r.changed_heads):6d} "
                         f"{r.units['per_sm']:9.2f}{flip}")
        lines.append("")
        for r in self.results[1:]:
            if not r.same_plan:
                lines.append(f"  {r.launch.label}: {r.reason}")
        moved = [r for r in self.results[1:] if not r.comparison.bit_exact]
        odd = [r.launch.label for r in moved if r.same_plan]
        nan = {s: n for s, n in self.nan.items() if n}
        if nan:
            lines.append("verdict: not answered: the request's " + ", ".join(
                f"{s} holds {n} NaN of {ref.bits[s].size}" for s, n in nan.items()) + "; NaN against NaN is the same "
                "bits, not the same answer" + (
                f"; {len(moved)} of {len(self.results) - 1} launches change other bits" if moved else ""))
        elif not moved:
            lines.append("verdict: batch-invariant over these launches: every one gave the reference's bits")
        else:
            lines.append(f"verdict: {len(moved)} of {len(self.results) - 1} launches change the request's bits; "
                         + (f"NOT explained by the splits: {', '.join(odd)}" if odd else
                            "each follows a change of its splits"))
        if self.projection:
            p = self.projection
            lines.append(f"projection: argmax {p['argmax']} alone, margin to the runner-up {p['margin']:.3g}; "
                         f"{p['flips']} of {len(self.results) - 1} launches flip it")
        if self.races:
            r = self.races
            lines.append(f"run to run: the published kernel (this model is its race-free build) can change "
                         f"{len(r['exposed_heads'])} of the row's {self.request['heads']} heads "
                         f"({r['exposed_text']}), d_v 0-63 first, through its races: {', '.join(r['races'])}; "
                         f"the reference runs them in {r['tiles']} tiles")
        if self.what_if is not None:
            w = self.what_if
            c = w.against_kernel
            diff = {s.name: s.size - s.identical for s in c.stages}
            lines += ["", f"what-if, {w.description}: {describe_plan(w.plan)} in every launch, so the same bits in "
                          f"each; against the kernel's own alone: " + ", ".join(f"{k} {v} changed" for k, v in
                                                                                 diff.items())]
            for r, u in zip(self.results, w.units):
                lines.append(f"  {r.launch.label[:46]:46s} units/SM {r.units['per_sm']:7.2f} -> {u['per_sm']:7.2f}, "
                             f"longest split {r.units['longest']} -> {u['longest']} tokens")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def project(out: npt.ArrayLike, projection: npt.ArrayLike) -> np.ndarray:
    """Logits of a row of interest: its (heads, 512) output flattened, times `projection` (heads * 512, vocab),
    in float64."""
    o, p = np.asarray(out), np.asarray(projection)
    if p.ndim != 2 or p.shape[0] != o.size:
        raise ValueError(f"projection: expected ({o.size}, vocab) for an output of shape {o.shape}, got {p.shape}")
    return np.asarray(o, np.float64).reshape(-1) @ p


def _projection_shape(projection: npt.ArrayLike | None, heads: int) -> np.ndarray | None:
    """The projection, its shape and dtype checked (its values once memory is known to suffice)."""
    if projection is None:
        return None
    p = np.asarray(projection)
    if p.ndim != 2 or p.shape[0] != heads * 512 or p.shape[1] < 2 or p.dtype.kind != "f":
        raise ValueError(f"projection: expected finite floats of shape ({heads * 512}, vocab >= 2) (the row's heads x "
                         f"512 outputs to logits), got {p.dtype} {p.shape}")
    return p


def _finite_projection(p: np.ndarray | None) -> np.ndarray | None:
    if p is None:
        return None
    if not np.isfinite(p).all():
        raise ValueError(f"projection: expected finite floats, {int(np.size(p) - np.isfinite(p).sum())} are not")
    return p.astype(np.float64)


def invariance(
    kernel: str | BatchKernel,
    *,
    length: int = 4096,
    heads: int = 128,
    dist: str = "flashmla",
    seed: int = 0,
    inputs: Mapping[str, np.ndarray] | None = None,
    launches: Sequence[Launch] | None = None,
    batchmates: Sequence[int] = (1, 3, 7),
    mixed: int | None = 3,
    num_sms: Sequence[int] = (132,),
    s_q: Sequence[int] = (1,),
    num_kv_splits: Sequence[int] = (),
    projection: npt.ArrayLike | None = None,
    split_tokens: int | None | bool = False,
    max_memory: int | None = None,
    **options: Any,
) -> InvarianceReport:
    """Run a request alone and in other launches through `kernel`'s model and say whether, where and why its
    bits change.

    The request: drawn from `dist` and `seed` (`length` tokens, or topk slots for the sparse decode; `heads`), or
    `inputs` (``q`` (s_q, heads, 576) and ``kv`` (length, 576) of one request, in a format the kernel takes).
    launches: the launches to compare, the first being the reference; default :func:`.launches.variations`
    (`batchmates`, `mixed`, `num_sms`, `s_q`, `num_kv_splits`). projection: (heads * 512, vocab) floats; each
    launch's argmax of the row's logits is reported (a near tie flips where the bits change). split_tokens: also
    run the batch-invariant what-if, splits of that many tokens (None: one split each; False: no what-if).
    max_memory: the bytes the run may take (None: what this machine has). options: the kernel's own (``tokens``
    for the sparse decode's cache, ``format`` for ETAP and FA3, ``max_context_len`` for SGLang).

    Every bound (the kernels' and the study's) and the memory the run needs are checked before the request is
    drawn or a plan built.
    """
    k = get_batch_kernel(kernel) if isinstance(kernel, str) else kernel
    if not isinstance(k, BatchKernel):
        raise TypeError(f"kernel: expected a kernel's name or a BatchKernel, got {kernel!r:.60}")
    opts = k.options(**options)
    req, launches, terms = _prepare(k, opts, options, inputs=inputs, length=length, heads=heads, launches=launches,
                                    batchmates=batchmates, mixed=mixed, num_sms=num_sms, s_q=s_q,
                                    num_kv_splits=num_kv_splits, seed=seed, dist=dist, split_tokens=split_tokens)
    proj = _projection_shape(projection, req["heads"])
    if proj is not None:
        terms.append(("projection", 9 * proj.size))
    check_memory(terms, what=f"the study of {k.name} ({req['length']} tokens, {req['heads']} heads, "
                             f"{len(launches)} launches)", limit=max_memory)
    proj = _finite_projection(proj)
    request = req["request"] or k.request(dist=dist, seed=seed, length=length, heads=heads,
                                          s_q=max(L.s_q for L in launches), **options)
    results, ref = _run_launches(k, request, launches, proj)
    report_proj = {}
    if proj is not None:
        logits = project(ref["out"], proj)
        top2 = np.sort(logits)[-2:]
        report_proj = {"argmax": int(np.argmax(logits)), "margin": float(top2[1] - top2[0]),
                       "flips": sum(r.argmax != results[0].argmax for r in results[1:])}
    what = None
    if split_tokens is not False:
        inv = [k.invariant_plans(request, L, split_tokens) for L in launches]
        plan = inv[0][launches[0].position]
        what = WhatIf(split_tokens, k.what_if, plan, compare(k.run(request, launches[0], plan), ref),
                      [k.units(request, L, p) for L, p in zip(launches, inv)])
    info = {"length": request.length, "heads": request.heads,
            **{key: v for key, v in request.recipe.items() if key != "heads"}}
    return InvarianceReport(k.name, k.summary, info, tuple(results), what, report_proj,
                            _races(k, request, launches[0]))


def _prepare(k: BatchKernel, opts: dict[str, Any], options: dict[str, Any], *, inputs: Any, length: int,
             heads: int, launches: Sequence[Launch] | None, split_tokens: int | None | bool,
             **shape: Any) -> tuple[dict[str, Any], list[Launch], list[tuple[str, int]]]:
    """The study's checks, nothing drawn or planned: the request (its length, heads and, from `inputs`, itself),
    the launches, and the memory terms (the arguments that set each, its bytes)."""
    s_q, num_kv_splits = shape["s_q"], shape["num_kv_splits"]
    if launches is None:
        if isinstance(s_q, (str, bytes)) or not isinstance(s_q, (Sequence, np.ndarray)) or not len(s_q):
            raise ValueError(f"s_q: expected one or more query row counts, got {s_q!r:.60}")
        if not k.takes_s_q and tuple(s_q) != (1,):
            raise ValueError(f"s_q: {k.name} takes one query a request")
        if num_kv_splits and not k.takes_num_kv_splits:
            raise ValueError(f"num_kv_splits: {k.name}'s API takes no split count")
        sq_max = max(check_int(n, "s_q", lo=1) for n in s_q)
    else:
        if isinstance(launches, (str, bytes)) or not isinstance(launches, Sequence):
            raise TypeError(f"launches: expected a sequence of Launch objects, got {launches!r:.60}")
        launches = list(launches)
        if not launches or not all(isinstance(L, Launch) for L in launches):
            raise ValueError("launches: at least the reference launch, each a Launch")
        sq_max = max(L.s_q for L in launches)
    if inputs is None:
        if not isinstance(shape["dist"], str):
            raise TypeError(f"dist: expected a distribution's name, got {shape['dist']!r:.60}")
        parse_dist(shape["dist"])
        check_int(shape["seed"], "seed", lo=0)
        tokens = k.check_request(length=length, heads=heads, s_q=sq_max, options=opts)
        req: dict[str, Any] = {"request": None, "length": length, "heads": heads}
        source = "length, heads, s_q" + (", tokens" if "tokens" in opts else "")
    else:
        q, kv = checked_inputs(k, inputs, sq_max)
        r = k.from_arrays(q, kv, s_q=sq_max, **options)
        req, tokens, source = {"request": r, "length": r.length, "heads": r.heads}, kv.shape[0], "inputs"
    if launches is None:
        launches = variations(req["length"], batchmates=shape["batchmates"],
                              mixed=shape["mixed"] if k.lengths_vary else None, num_sms=shape["num_sms"], s_q=s_q,
                              num_kv_splits=num_kv_splits, seed=shape["seed"])
    most, planned = check_launches(k, launches, length=req["length"], heads=req["heads"], options=opts)
    splitter = "num_kv_splits" if any(L.num_kv_splits for L in launches) else "num_sms"
    if split_tokens is not False:
        n, extra = check_what_if(k, launches, length=req["length"], heads=req["heads"], split_tokens=split_tokens)
        splitter = "split_tokens" if n > most else splitter
        most, planned = max(most, n), planned + extra
    terms = [(source, k.request_bytes(heads=req["heads"], s_q=sq_max, tokens=tokens)),
             (f"{'heads' if inputs is None else 'inputs'}, s_q, {splitter}",
              split_bytes(rows=sq_max * req["heads"], splits=most)),
             ("batchmates, mixed" if shape.get("batchmates") is not None else "launches", plan_bytes(planned))]
    return req, launches, terms


def _run_launches(k: BatchKernel, req: Request, launches: Sequence[Launch],
                  proj: np.ndarray | None) -> tuple[list[LaunchResult], dict[str, np.ndarray]]:
    """Every launch's result against the first's, and the first's bits; a plan is run once, whichever launches
    share it."""
    ref_launch = launches[0]
    ref_plan = k.plans(req, ref_launch)[ref_launch.position]
    ref = k.run(req, ref_launch, ref_plan)
    runs: dict[tuple, dict[str, np.ndarray]] = {(tuple(ref_plan), ref_launch.s_q, ref_launch.num_sms): ref}
    results = []
    for L in launches:
        plans = k.plans(req, L)
        plan = plans[L.position]
        key = (tuple(plan), L.s_q, L.num_sms)
        if key not in runs:  # a plan's bits depend on nothing else the launch holds
            runs[key] = k.run(req, L, plan)
        got = runs[key]
        heads_moved = np.flatnonzero(np.any(got["out"].view(np.uint16) != ref["out"].view(np.uint16), axis=-1))
        rep = compare(got, ref,
                      meta={"launch": L.label, "reference": ref_launch.label, "reference_plan": describe_plan(ref_plan),
                            "changed_heads": heads_moved.tolist()})
        arg = None if proj is None else int(np.argmax(project(got["out"], proj)))
        results.append(LaunchResult(L, plan, plan == ref_plan, rep, k.reason(req, L), k.units(req, L, plans), arg,
                                    got))
    return results, ref


def _races(k: BatchKernel, req: Request, launch: Launch) -> dict[str, Any]:
    """The heads of the request's row of interest (its last query row) a race of the published kernel can change."""
    exp = k.races(req, launch)
    if exp is None:
        return {}
    mine = exp.requests[launch.position]
    heads = [h for s, h in mine.rows if s == launch.s_q - 1]
    return {"races": [r.name for r in exp.races], "exposed_heads": heads, "tiles": mine.tiles,
            "exposed_text": runs(heads)}
