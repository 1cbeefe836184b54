"""Device against simulator, stage by stage: :func:`compare` and the report it returns.

A *stage* is one named array of a kernel's pipeline (``S``, ``m``, ``P``, ..., ``out``). Each side may give it
as floats of any supported format (FP64, FP32, FP16, BF16, E4M3, E5M2) or as the raw bits of one (unsigned or
signed integers of the format's width, as a kernel's debug dump often holds them); integer stages with no
format (AMLA's ``N``) are compared as integers. Every cross-check of amla-sim reports through this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ._validate import strict_json
from .formats import Format, FormatLike, get_format, is_float_dtype
from .testing import _fmt_elem, row_ulp_distance, ulp_distance

__all__ = ["compare", "ComparisonReport", "StageComparison", "HISTOGRAM_BINS"]

#: The ULP-distance bins of each stage's histogram (and ``"nan"``: NaN on one side only).
HISTOGRAM_BINS = ("0", "1", "2-3", "4-15", "16-255", ">=256")
_EDGES = (0, 1, 2, 4, 16, 256)


@dataclass(frozen=True)
class StageComparison:
    """One stage: how many elements have the device's bits, and how far the others are.

    NaN agrees with NaN whatever the payloads (units write different quiet NaNs); ``nan_payload`` counts those
    agreements whose words differ (a wrong format can make distinct words NaN: the report shows them),
    ``nan_mismatch`` the elements that are NaN on one side only (the histogram's ``"nan"`` bin), ``inf_mismatch``
    those where an infinity meets anything else, ``nan_both`` the elements NaN on both sides (an agreement on the
    bits, not on a number). ULP statistics are over the other elements, NaN against NaN at distance 0 (integer
    stages: exact absolute differences of the values, whatever their widths and signs); the histogram's bins add up
    to ``size``. ``max_row_ulp`` is the largest difference between two finite values in ULPs of their row's largest
    finite magnitude (:func:`~amla_sim.testing.row_ulp_distance`; rows are the last axis), the scale a reader judges
    an output by where ``max_ulp`` counts the values between two outputs near zero. A stage of no element compares
    nothing: it is never bit-exact.
    """

    name: str
    format: str  # "bf16", ... or "int" for an integer stage
    shape: tuple[int, ...]
    size: int
    identical: int  # elements with the same bits (or NaN on both sides)
    max_ulp: int
    median_ulp: float
    histogram: dict[str, int]  # HISTOGRAM_BINS -> count, and "nan" -> nan_mismatch
    nan_mismatch: int
    inf_mismatch: int
    first_mismatch: dict[str, Any] | None = None  # index, device and simulated values of the first differing one
    nan_payload: int = 0  # NaN on both sides in different words (counted identical)
    nan_both: int = 0  # NaN on both sides, whatever the words
    max_row_ulp: float = 0.0  # the largest difference in ULPs of its row's largest |value|

    @property
    def bit_exact(self) -> float:
        """The fraction of elements with the device's bits (0.0 for an empty stage: nothing was compared)."""
        return self.identical / self.size if self.size else 0.0


@dataclass(frozen=True)
class ComparisonReport:
    """Per stage in pipeline order, and the first stage that differs (where a model is wrong, if anywhere).

    skipped: the stages that were not compared, and why (held by one side only, or holding no element). A report
    is bit-exact only when it compared at least one element of every stage and skipped none. not_selected: the
    stages a side holds that the caller's `stages` left out (listed, not counted against the verdict: the caller
    chose what to compare).
    """

    stages: tuple[StageComparison, ...]
    explanations: Mapping[str, str] = field(default_factory=dict)  # stage -> the model responsible for it
    meta: Mapping[str, Any] = field(default_factory=dict)  # what was compared: kernel, device, machine, case...
    skipped: Mapping[str, str] = field(default_factory=dict)  # stage -> why it was not compared
    not_selected: tuple[str, ...] = ()

    @property
    def first_difference(self) -> str | None:
        return next((s.name for s in self.stages if s.identical < s.size), None)

    @property
    def not_compared(self) -> dict[str, str]:
        """Every stage asked for or held that no element of was compared: name -> why."""
        return {**self.skipped, **{s.name: "no element" for s in self.stages if s.size == 0}}

    @property
    def responsible(self) -> str | None:
        """The model that the first differing stage depends on, where the caller said."""
        first = self.first_difference
        return None if first is None else self.explanations.get(first)

    @property
    def bit_exact(self) -> bool:
        """True when at least one stage was compared, every stage is identical and none was left out."""
        return bool(self.stages) and self.first_difference is None and not self.not_compared

    def __getitem__(self, name: str) -> StageComparison:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"stage {name!r} is not in the report ({[s.name for s in self.stages]})")

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {**dict(self.meta),
                "stages": [{**asdict(s), "shape": list(s.shape), "bit_exact": s.bit_exact} for s in self.stages],
                "not_compared": self.not_compared, "not_selected": list(self.not_selected), "bit_exact": self.bit_exact,
                "first_difference": self.first_difference, "responsible": self.responsible}

    def to_json(self, **kwargs: Any) -> str:
        """Strict JSON (RFC 8259: no NaN or Infinity); keyword arguments go to :func:`json.dumps`."""
        return json.dumps(strict_json(self.to_dict()), allow_nan=False, **kwargs)

    def format(self, *, indent: str = "  ") -> str:
        """A table: stage, format, bit-exact %, max ULP (and in ULPs of the row's largest value), median ULP,
        histogram, NaN counts; then the verdict."""
        lines = [f"{indent}{'stage':6s} {'format':6s} {'bit-exact':>10s} {'max ulp':>8s} {'row ulp':>8s} "
                 f"{'median':>7s}  histogram"]
        for s in self.stages:
            hist = " ".join(f"{k}:{v}" for k, v in s.histogram.items() if v)
            extra = "".join(f" {k} {v}" for k, v in (("nan≠", s.nan_mismatch), ("nan=", s.nan_both),
                                                      ("inf≠", s.inf_mismatch), ("nan-payload≠", s.nan_payload)) if v)
            lines.append(f"{indent}{s.name:6s} {s.format:6s} {100 * s.bit_exact:9.3f}% {s.max_ulp:8d} "
                         f"{s.max_row_ulp:8.3g} {s.median_ulp:7g}  {hist}{extra}")
        for name, why in self.not_compared.items():
            lines.append(f"{indent}{name:6s} not compared: {why}")
        if self.not_selected:
            lines.append(f"{indent}not selected, so not compared: {', '.join(self.not_selected)}")
        first = self.first_difference
        nan = sum(s.nan_both for s in self.stages)
        if first is None and self.bit_exact:
            lines.append(f"{indent}every stage bit-identical" + (f", {nan} element{'s' * (nan != 1)} NaN on both sides" if nan else ""))
        elif first is None:
            lines.append(f"{indent}no compared element differs, but not every stage was compared: not bit-exact")
        else:
            m = self[first].first_mismatch
            where = f" (first at {tuple(m['index'])}: device {m['device']}, simulated {m['simulated']})" if m else ""
            lines.append(f"{indent}first difference at {first}{where}")
            if self.responsible:
                lines.append(f"{indent}  depends on: {self.responsible}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


StagesArg = Sequence[str] | Mapping[str, FormatLike | None] | None


def compare(device: npt.ArrayLike | Mapping[str, npt.ArrayLike], simulated: npt.ArrayLike | Mapping[str, npt.ArrayLike],
            *, stages: StagesArg = None, formats: Mapping[str, FormatLike] | None = None,
            explanations: Mapping[str, str] | None = None, meta: Mapping[str, Any] | None = None) -> ComparisonReport:
    """Compare a device's stages with the simulator's, bit for bit.

    device, simulated: one array each (a stage named ``out``) or mappings of stage name -> array.

    stages: the stages to compare, in pipeline order (the first that differs is reported): names, or a mapping
    name -> format (``"bf16"``, a dtype, ...; None: from the arrays) for stages both sides hold as raw bits;
    each must be held by both sides, and at least one named. Default: the stages both hold, in the device's
    order; a stage that only one side holds is reported as not compared, and the report is then not bit-exact.

    formats: name -> format of stages held as raw bits, with `stages` as names or the default.

    explanations: stage -> the model it depends on (shown for the first differing stage).

    meta: anything that says what was compared; kept in the report and its JSON. Where ``meta["device"]`` and
    ``meta["simulated"]`` are both strings (the files compared), errors name the sides by them.

    Each side of a stage may be floats or the raw bits of the stage's format. Floats of two formats are compared
    in the wider where it holds every value of the narrower (a simulated E4M3 P against the FP32 a kernel
    stored it in: the widening is exact); otherwise they are an error (round one side first).
    """
    sides = _side_names(meta)
    try:
        dev, sim = _as_stages(device, "device"), _as_stages(simulated, "simulated")
        for side, held in (("device", dev), ("simulated", sim)):
            if not held:
                raise ValueError(f"{side}: no stage at all (nothing to compare is never bit-exact)")
        order, skipped = _order(dev, sim, stages)
        for name, fmt in (formats or {}).items():
            if name not in order:
                raise ValueError(f"formats: {name!r} is not among the stages compared ({list(order)})")
            if order[name] is not None and order[name] != fmt:
                raise ValueError(f"formats: {name!r} is given two formats ({order[name]!r} and {fmt!r})")
            order[name] = fmt
        rows = tuple(_compare_stage(name, dev[name], sim[name], fmt) for name, fmt in order.items())
    except (ValueError, TypeError) as e:
        if sides is None:
            raise
        raise (TypeError if isinstance(e, TypeError) else ValueError)(f"{sides}: {e}") from None
    unselected = tuple(dict.fromkeys(n for n in (*dev, *sim) if n not in order and n not in skipped))
    return ComparisonReport(rows, dict(explanations or {}), dict(meta or {}), skipped, unselected)


def _side_names(meta: Mapping[str, Any] | None) -> str | None:
    """'device A against simulated B' where the caller's meta names both sides' files; else None."""
    d, s = (meta or {}).get("device"), (meta or {}).get("simulated")
    return f"device {d} against simulated {s}" if isinstance(d, str) and isinstance(s, str) else None


def _order(dev: dict[str, np.ndarray], sim: dict[str, np.ndarray],
           stages: StagesArg) -> tuple[dict[str, FormatLike | None], dict[str, str]]:
    """The stages to compare (name -> format or None) in order, and those skipped as held by one side only."""
    skipped: dict[str, str] = {}
    if stages is None:
        order: dict[str, FormatLike | None] = {k: None for k in dev if k in sim}
        if not order:
            raise ValueError(f"stages: device and simulated share no stage name (device {sorted(dev)}, "
                             f"simulated {sorted(sim)})")
        skipped = {**{k: "device only" for k in dev if k not in sim},
                   **{k: "simulated only" for k in sim if k not in dev}}
    elif isinstance(stages, Mapping):
        order = dict(stages)
    elif isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence):
        raise TypeError(f"stages: expected stage names or a mapping name -> format, got {stages!r}")
    else:
        order = dict.fromkeys(stages)
        if len(order) != len(stages):
            twice = next(n for n in order if list(stages).count(n) > 1)
            raise ValueError(f"stages: {twice!r} is named twice")
    if not order:
        raise ValueError("stages: no stage to compare (an empty selection is never bit-exact)")
    for name in order:
        if not isinstance(name, str):
            raise TypeError(f"stages: stage names must be strings, got {name!r}")
        for side, arrays in (("device", dev), ("simulated", sim)):
            if name not in arrays:
                raise ValueError(f"stages: {side} has no stage {name!r} (it has {sorted(arrays)})")
    return order, skipped


def _as_stages(x: npt.ArrayLike | Mapping[str, npt.ArrayLike], argname: str) -> dict[str, np.ndarray]:
    items = x.items() if isinstance(x, Mapping) else (("out", x),)
    out = {}
    for k, v in items:
        if not isinstance(k, str):
            raise TypeError(f"{argname}: stage names must be strings, got {k!r}")
        a = np.asarray(v)
        if not a.dtype.isnative:  # big-endian words (a dump from another machine): read as the values they are
            a = a.astype(a.dtype.newbyteorder("="))
        out[k] = a
    return out


def _stage_format(name: str, d: np.ndarray, s: np.ndarray, fmt: FormatLike | None) -> Format | None:
    """The format both sides are read in; None for an integer stage."""
    floats = {a.dtype for a in (d, s) if is_float_dtype(a.dtype)}
    for side, a in (("device", d), ("simulated", s)):
        if not (is_float_dtype(a.dtype) or a.dtype.kind in "iu"):
            raise TypeError(f"{side}: stage {name!r} has dtype {a.dtype}, neither floats nor raw bits")
    if fmt is not None:
        f = get_format(fmt, argname=f"stages[{name!r}]")
        if f.name == "tf32":
            raise ValueError(f"stages[{name!r}]: tf32 has no storage format of its own; compare its fp32 container")
        if any(not _widens(get_format(t), f) for t in floats):
            raise ValueError(f"stage {name!r}: given as {f.name}, but a side holds {sorted(map(str, floats))}")
        return f
    if len(floats) > 1:
        a, b = (get_format(t) for t in (d.dtype, s.dtype))
        if not (_widens(a, b) or _widens(b, a)):
            raise ValueError(f"stage {name!r}: device {d.dtype} and simulated {s.dtype} are different formats, "
                             "neither holding the other; round one side to the other's format first")
        return b if _widens(a, b) else a
    return get_format(floats.pop()) if floats else None


def _widens(narrow: Format, wide: Format) -> bool:
    """Every value of `narrow` is one of `wide` (E4M3 in FP16, BF16 in FP32, ...): the conversion is exact."""
    return (wide.mantissa_bits >= narrow.mantissa_bits and wide.max_finite >= narrow.max_finite
            and wide.min_subnormal <= narrow.min_subnormal and (wide.has_inf or not narrow.has_inf))


def _view(a: np.ndarray, f: Format, side: str, name: str) -> np.ndarray:
    if a.dtype == f.dtype:
        return a
    if is_float_dtype(a.dtype):  # a narrower format: widened exactly
        with np.errstate(invalid="ignore"):
            return a.astype(f.dtype)
    if a.dtype.itemsize != f.dtype.itemsize:
        raise ValueError(f"{side}: stage {name!r} holds {a.dtype} bits, not the {8 * f.dtype.itemsize}-bit words "
                         f"of {f.name}")
    return np.ascontiguousarray(a).view(f.dtype)


def _compare_stage(name: str, d: np.ndarray, s: np.ndarray, fmt: FormatLike | None) -> StageComparison:
    if d.shape != s.shape:
        raise ValueError(f"stage {name!r}: device has shape {d.shape}, simulated {s.shape}")
    f = _stage_format(name, d, s, fmt)
    if f is None:
        dist = _int_distance(d.ravel(), s.ravel())
        same = dist == 0
        nan_d = nan_s = inf_bad = nan_payload = np.zeros(d.size, bool)
        fmt_name, row_ulp = "int", 0.0
    else:
        d, s = _view(d, f, "device", name), _view(s, f, "simulated", name)
        with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens a NaN
            wd, ws = d.astype(np.float64).ravel(), s.astype(np.float64).ravel()
        nan_d, nan_s = np.isnan(wd), np.isnan(ws)
        dist = ulp_distance(d, s).ravel()
        same = (dist == 0) & ~(nan_d | nan_s)
        # ulp_distance puts +0 and -0 at distance 0; bits differ, so they are not identical
        words = np.ascontiguousarray(d).view(f.uint_dtype).ravel() == np.ascontiguousarray(s).view(f.uint_dtype).ravel()
        same &= words
        same |= nan_d & nan_s
        nan_payload = nan_d & nan_s & ~words
        inf_bad = (np.isinf(wd) | np.isinf(ws)) & (wd != ws)
        fmt_name = f.name
        by_row = row_ulp_distance(d, s, f) if d.size else np.zeros(0)
        row_ulp = float(np.nanmax(by_row, initial=0.0))
    one_nan = nan_d ^ nan_s
    num = np.where(nan_d & nan_s, 0, dist)[~one_nan]  # NaN against NaN: distance 0
    hist = {k: int(np.count_nonzero((num >= lo) if hi is None else ((num >= lo) & (num < hi))))
            for k, lo, hi in zip(HISTOGRAM_BINS, _EDGES, (*_EDGES[1:], None))}
    hist["nan"] = int(one_nan.sum())
    first = None
    bad = np.flatnonzero(~same)
    if bad.size:
        i = int(bad[0])
        first = {"index": [int(v) for v in np.unravel_index(i, d.shape)],
                 "device": _show(d.ravel()[i], f), "simulated": _show(s.ravel()[i], f)}
    return StageComparison(
        name=name, format=fmt_name, shape=tuple(d.shape), size=int(d.size), identical=int(same.sum()),
        max_ulp=int(num.max()) if num.size else 0, median_ulp=float(np.median(num)) if num.size else 0.0,
        histogram=hist, nan_mismatch=int(one_nan.sum()), inf_mismatch=int(inf_bad.sum()), first_mismatch=first,
        nan_payload=int(nan_payload.sum()), nan_both=int((nan_d & nan_s).sum()), max_row_ulp=row_ulp)


def _int_distance(d: np.ndarray, s: np.ndarray) -> np.ndarray:
    """|d - s| of integers of any widths and signs, exact (uint64; 2^64 - 1 where it would exceed that)."""

    def sign_magnitude(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if a.dtype.kind == "u":
            return np.zeros(a.shape, bool), a.astype(np.uint64)
        a = a.astype(np.int64)
        neg = a < 0
        return neg, np.where(neg, (-(a + 1)).astype(np.uint64) + np.uint64(1), a.astype(np.uint64))

    (nd, md), (ns, ms) = sign_magnitude(d), sign_magnitude(s)
    with np.errstate(over="ignore"):
        apart = md + ms  # opposite signs: the magnitudes add
    apart = np.where(apart < md, np.uint64(2**64 - 1), apart)  # wrapped: saturate
    return np.where(nd == ns, np.maximum(md, ms) - np.minimum(md, ms), apart)


def _show(v: Any, f: Format | None) -> str:
    if f is None:
        return str(int(v))
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens a NaN
        return _fmt_elem(v, np.asarray(v).reshape(1).view(f.uint_dtype)[0], 2 * f.dtype.itemsize)
