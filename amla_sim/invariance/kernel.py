"""What a kernel of the invariance study is: a :class:`BatchKernel` gives the request's inputs, its split plan in
a launch (the kernel's scheduler, run on the host over every request's length), its bits under a plan (the
kernel's model, the request alone: rows of different requests never meet), a batch-invariant plan to compare
with, and the whole batch as a device would run it. :class:`DenseDecode` holds what every decode whose inputs are
q and a cache of the request's tokens shares.

A model run covers the request only, because the scheduler is the one place its batchmates enter: the plan comes
from every length in the launch, the arithmetic from the request's own rows.

A kernel family lives in a module of this package that lists its kernels' classes in its ``__all__``
(:mod:`.registry` finds them); each kernel checks its own bounds (:meth:`BatchKernel.bounds`) before any plan is
built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._validate import check_int
from ..algorithms._common import check_kernel_inputs
from ..experiments.inputs import make_inputs
from ..formats import get_format
from .launches import Launch
from .races import RaceExposure

__all__ = ["Request", "Plan", "BatchKernel", "DenseDecode", "describe_plan", "query_rows", "mate_seed",
           "checked_inputs", "RCP_NORMALISE"]

Plan = list[tuple[int, int]]  # a request's splits: token (or slot) ranges [start, end), in order

#: A step several kernels state alike (:attr:`BatchKernel.numerics`): the output times MUFU.RCP of the row sum.
RCP_NORMALISE = ("rcp", "O times MUFU.RCP of L (div.approx)")


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
    if isinstance(plan, (str, bytes)) or not isinstance(plan, Sequence) or not plan or not all(
            isinstance(r, Sequence) and len(r) == 2 and all(isinstance(v, (int, np.integer)) for v in r)
            and r[1] >= r[0] for r in plan):
        raise ValueError(f"plan: expected one or more (start, end) ranges of ints, got {plan!r:.80}")
    runs: list[list[int]] = []
    for a, b in plan:
        if runs and runs[-1][1] == b - a:
            runs[-1][0] += 1
        else:
            runs.append([1, b - a])
    text = ", ".join(f"{n} of {size}" for n, size in runs)
    return text.replace(" of ", " splits of " if runs[0][0] > 1 else " split of ", 1)


def query_rows(req: Request, s_q: int) -> np.ndarray:
    """The request's last `s_q` query rows (a launch with fewer rows than the request was drawn with)."""
    if s_q > req.s_q:
        raise ValueError(f"s_q: the request was drawn with {req.s_q} query rows, a launch asks for {s_q}")
    return req.arrays["q"][-s_q:]


def mate_seed(req: Request, j: int) -> int:
    """The seed batchmate `j` of a device run is drawn from."""
    return int(req.recipe.get("seed", 0)) * 1000 + 17 + j


class BatchKernel(ABC):
    """A kernel whose scheduler sees the whole batch.

    row_tile: the query rows one unit of work (a CTA or program) holds. stages: what :meth:`run` returns, stage
    name -> storage format. numerics: the kernel's arithmetic step by step (:data:`amla_sim.invariance.diff.STEPS`
    -> (tag, text); two kernels make the same choice where the tags are equal)."""

    name: str
    summary: str
    row_tile: int
    stages: Mapping[str, str]
    numerics: Mapping[str, tuple[str, str]]
    formats: tuple[str, ...] = ("bf16",)  # the inputs' formats, the first the default
    takes_s_q: bool = True
    lengths_vary: bool = True  # False: every request of a launch is as long as the scheduler counts (sparse V3.2)
    takes_num_kv_splits: bool = False
    what_if: str = ""

    def options(self, **given: Any) -> dict[str, Any]:
        """The kernel's own options (a sparse decode's topk, ...), checked; unknown ones are errors. A kernel of
        several `formats` takes ``format`` (the first by default)."""
        opts = {}
        if len(self.formats) > 1:
            fmt = given.pop("format", self.formats[0])
            if fmt not in self.formats:
                raise ValueError(f"format: {self.name} takes {' or '.join(self.formats)}, got {fmt!r}")
            opts["format"] = fmt
        if given:
            raise ValueError(f"{next(iter(given))}: not an option of {self.name}")
        return opts

    @abstractmethod
    def check_request(self, *, length: int, heads: int, s_q: int, options: Mapping[str, Any]) -> int:
        """Check a request to be drawn (`options` as :meth:`options` returned them), before anything is drawn;
        return the tokens of its cache (what drawing it costs)."""

    @abstractmethod
    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        """The request, drawn from `dist` and `seed`."""

    @abstractmethod
    def from_arrays(self, q: np.ndarray, kv: np.ndarray, *, s_q: int, **options: Any) -> Request:
        """The request from a user's arrays: q (s_q, heads, 576) and kv (length, 576) in a format the kernel
        takes; batchmates for a device run are drawn from N(0, 1)."""

    @abstractmethod
    def bounds(self, launch: Launch, *, heads: int, options: Mapping[str, Any]) -> tuple[int, int]:
        """Check `launch` against the kernel's API and model (its SMs, split counts, heads) before any plan is
        built: a ValueError naming the argument. Returns the most splits one request can get in it and the most
        all its requests can get together (what planning and running cost)."""

    @abstractmethod
    def max_splits(self, launch: Launch, *, heads: int) -> int:
        """The most splits the model runs one request of `launch` in (a plan handed in, such as the what-if's)."""

    def races(self, req: Request, launch: Launch) -> RaceExposure | None:
        """The rows a data race of the published kernel can change from run to run (None: it has none)."""
        return None

    @abstractmethod
    def plans(self, req: Request, launch: Launch) -> list[Plan]:
        """Every request's splits in `launch`, as the kernel's scheduler cuts them."""

    @abstractmethod
    def run(self, req: Request, launch: Launch, plan: Plan) -> dict[str, np.ndarray]:
        """The request's row of interest under `plan`: stage name -> array, in the kernel's storage formats."""

    def request_bytes(self, *, heads: int, s_q: int, tokens: int) -> int:
        """Peak bytes of one model run of a request (`tokens` as :meth:`check_request` returned them): a decode's
        over a cache of `tokens` rows, by default."""
        from .preflight import request_bytes

        return request_bytes(heads=heads, s_q=s_q, tokens=tokens, splits=0)

    def adopt(self, req: Request) -> Request:
        """Another kernel's request (q and kv drawn for a dense decode) as this kernel takes it."""
        self.adopted_length(length=req.length, heads=req.heads, s_q=req.s_q)
        return req

    def adopted_length(self, *, length: int, heads: int, s_q: int) -> int:
        """The length a dense decode's request of `length` tokens has here (:meth:`adopt`), checked before it is
        drawn."""
        return self.check_request(length=length, heads=heads, s_q=s_q, options=self.options())

    def check_split_tokens(self, split_tokens: int | None) -> None:
        """The what-if's split size, checked (None: one split a request)."""
        if split_tokens is not None:
            check_int(split_tokens, "split_tokens", lo=1)

    @abstractmethod
    def invariant_plans(self, req: Request, launch: Launch, split_tokens: int | None) -> list[Plan]:
        """Every request's splits under a plan that looks at the request alone: splits of `split_tokens` (None:
        one split each)."""

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


class DenseDecode(BatchKernel):
    """A decode whose inputs are q (s_q, heads, 576) and a cache of the request's `length` tokens, in one of
    `formats` (the ``format`` option where there are several); batchmates are drawn alike, from their own seeds."""

    def check_request(self, *, length: int, heads: int, s_q: int, options: Mapping[str, Any]) -> int:
        check_int(heads, "heads", lo=1)
        check_int(s_q, "s_q", lo=1)
        if not self.takes_s_q and s_q != 1:
            raise ValueError(f"s_q: {self.name} takes one query a request, got {s_q}")
        return check_int(length, "length", lo=1)

    def request(self, *, dist: str, seed: int, length: int, heads: int, s_q: int, **options: Any) -> Request:
        opts = self.options(**options)
        self.check_request(length=length, heads=heads, s_q=s_q, options=opts)
        q, kv = make_inputs(dist, batch=1, heads=heads, sq=s_q, context=length, seed=seed,
                            fmt=opts.get("format", self.formats[0]))
        return Request({"q": q[0], "kv": kv[0]}, heads, length, s_q,
                       {"dist": dist, "seed": seed, "heads": heads, **opts})

    def from_arrays(self, q: np.ndarray, kv: np.ndarray, *, s_q: int, **options: Any) -> Request:
        fmt = get_format(q.dtype).name
        if fmt not in self.formats:
            raise ValueError(f"inputs: {self.name} takes {' or '.join(f.upper() for f in self.formats)}, the file "
                             f"holds {fmt.upper()}")
        if "format" in options and options["format"] != fmt:
            raise ValueError(f"format: {options['format']} given, but the inputs are {fmt}")
        opts = self.options(**options)
        try:
            self.check_request(length=kv.shape[0], heads=q.shape[1], s_q=s_q, options=opts)
        except ValueError as e:  # the file's request, not an argument, is at fault
            raise ValueError(f"inputs: {e}") from None
        if len(self.formats) > 1:
            opts["format"] = fmt
        return Request({"q": q, "kv": kv}, q.shape[1], kv.shape[0], q.shape[0],
                       {"dist": "normal:1", "seed": 0, "heads": q.shape[1], "file": True, **opts})

    def batch(self, req: Request, launch: Launch) -> dict[str, Any]:
        b, top = launch.batch, max(launch.lengths)
        fmt = req.recipe.get("format", self.formats[0])
        q = np.zeros((b, launch.s_q, req.heads, 576), req.arrays["q"].dtype)
        kv = np.zeros((b, top, 576), req.arrays["kv"].dtype)
        for j, n in enumerate(launch.lengths):
            if j == launch.position:
                q[j], kv[j, :n] = query_rows(req, launch.s_q), req.arrays["kv"]
            else:
                qj, kj = make_inputs(req.recipe["dist"], batch=1, heads=req.heads, sq=launch.s_q, context=n,
                                     seed=mate_seed(req, j), fmt=fmt)
                q[j], kv[j, :n] = qj[0], kj[0]
        return {"q": q, "kv": kv, "seqlens": list(launch.lengths)}


def checked_inputs(k: BatchKernel, inputs: Any, s_q: int) -> tuple[np.ndarray, np.ndarray]:
    """A user's q (s_q, heads, 576) and kv (length, 576), one request, in a format `k` takes."""
    if not isinstance(inputs, Mapping) or "q" not in inputs or "kv" not in inputs:
        raise ValueError("inputs: expected a mapping with q (s_q, heads, 576) and kv (length, 576)")
    if set(inputs) - {"q", "kv"}:
        raise ValueError(f"inputs: unexpected arrays {sorted(set(inputs) - {'q', 'kv'})} (q and kv only)")
    q, kv = np.asarray(inputs["q"]), np.asarray(inputs["kv"])
    if q.ndim != 3 or kv.ndim != 2:
        raise ValueError(f"inputs: one request: q (s_q, heads, 576) and kv (length, 576), got q {q.shape} and kv "
                         f"{kv.shape}")
    try:
        qa, kva, _ = check_kernel_inputs(q[None], kv[None], None, formats=k.formats)
    except (ValueError, TypeError) as e:
        raise ValueError(f"inputs: {e}") from None
    if qa.shape[1] < s_q:
        raise ValueError(f"inputs: q holds {qa.shape[1]} query rows, the launches need {s_q}")
    return qa[0], kva[0]
