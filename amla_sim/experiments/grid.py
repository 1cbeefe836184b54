"""User-defined sweeps: any grid of algorithms (with options), machines, distributions, contexts, heads, s_q and
block sizes, each cell sampled ``samples`` times, on any scheduler, into a result store that resumes.

A task is one sample of one (machine, distribution, context, heads, s_q, block): its inputs, the FP64 reference,
every algorithm of the grid, their errors: one row each in ``DIR/results.csv`` (:mod:`.store`). A sample's
inputs depend only on (seed, grid name, distribution, sample): every machine, block and algorithm sees the same
inputs, and for one head count the queries are the same at every context and a shorter context's keys are the
first rows of a longer one's, so curves of error against context are paired. Results are therefore identical
whatever the scheduler, the number of workers, the engine or interruptions. ``DIR/grid.json`` records the grid;
another grid (anything but ``samples``) is refused rather than mixed into the folder.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from .._seeds import derive_seed
from .._validate import check_int, check_positive_int, dumps_strict
from ..algorithms import golden
from ..engine import use_engine
from ..formats import get_format, round_to
from ..machines import Machine, get_machine
from ..plugins import PluginError, call_algorithm, get_algorithm
from ..resources import ResourceError, available_bytes, run_bytes
from ..schedules import get_schedule
from .inputs import make_inputs, parse_dist
from .layer import LAYER_ALGORITHMS, LAYER_MACHINE, layer_bytes, layer_reference
from .metrics import NONFINITE_FOOTNOTE, all_metrics, nonfinite_note, sample_stats
from .schedulers import check_run, execute, progress_bar
from .specs import parse_algorithm
from .store import ResultStore, StoreCorrupt, atomic_write, claim_folder

__all__ = ["Grid", "GridResult", "run_grid", "load_grid", "parse_algorithm"]

KEYS = ("machine", "distribution", "context", "heads", "sq", "block", "sample", "algorithm")
METRICS = ("rel_frobenius", "rmse", "cos_diff", "max_abs")
GRID_FIELDS = KEYS + METRICS
# FP64 attention of the inputs as drawn, or of their BF16 rounding; or the MLA layer's (:mod:`.layer`)
REFERENCES = ("golden", "golden-bf16", "layer")


@dataclass(frozen=True)
class Grid:
    """A sweep definition. Lists are tuples; every combination of them is a cell."""

    algorithms: tuple[str, ...]
    machines: tuple[str, ...] = ("ieee32-fast",)
    distributions: tuple[str, ...] = ("normal:1",)
    contexts: tuple[int, ...] = (8192,)
    heads: tuple[int, ...] = (128,)
    sq: tuple[int, ...] = (1,)
    blocks: tuple[int, ...] = (64,)
    schedule: str = "reference"  # the kernel schedule of every algorithm that does not name its own
    samples: int = 10
    seed: int = 0
    input_format: str = "bf16"
    sampler: str = "round"  # make_inputs' sampler: "round" or "table" (the exact rounded distribution)
    reference: str = "golden"
    metric: str = "rel_frobenius"  # the one summarised in the Markdown table and the plot
    name: str = "grid"  # part of every sample's seed: named grids (the papers' tables) keep their own draws
    paper: Mapping[str, float] = field(default_factory=dict)  # "distribution/algorithm" -> published value

    def __post_init__(self) -> None:
        for f in ("algorithms", "machines", "distributions", "contexts", "heads", "sq", "blocks"):
            v = getattr(self, f)
            if isinstance(v, (str, int)) or not isinstance(v, Iterable):
                raise TypeError(f"{f}: expected a list, got {v!r}")
            v = tuple(v)
            if not v:
                raise ValueError(f"{f}: expected at least one value")
            if len(set(v)) != len(v):
                raise ValueError(f"{f}: repeated values in {list(v)}")
            object.__setattr__(self, f, v)
        for a in self.algorithms:
            if not isinstance(a, str) or not a.isprintable():  # a label is a field of every row of results.csv
                raise ValueError(f"algorithms: expected specs of printable characters (no line break), got {a!r}")
        labels = [parse_algorithm(a)[0] for a in self.algorithms]
        if len(set(labels)) != len(labels):
            raise ValueError(f"algorithms: two algorithms share a label ({labels}); name them as label=spec")
        for m in self.machines:
            if not isinstance(m, str):
                raise ValueError(f"machines: expected machine names, got {m!r}")
            try:
                get_machine(m)
            except ValueError as e:
                raise ValueError(f"machines: {str(e).removeprefix('machine: ')}") from None
        for d in self.distributions:
            if not isinstance(d, str) or not d.isprintable():
                raise ValueError(f"distributions: expected specs like 'normal:1', got {d!r}")
            try:
                parse_dist(d)
            except ValueError as e:
                raise ValueError(f"distributions: {e}") from None
        for f in ("contexts", "heads", "sq", "blocks"):
            for v in getattr(self, f):
                check_positive_int(v, f)
        if not isinstance(self.schedule, str):
            raise ValueError(f"schedule: expected a schedule name, got {self.schedule!r}")
        get_schedule(self.schedule)
        check_positive_int(self.samples, "samples")
        check_int(self.seed, "seed", lo=0, hi=2**63 - 1)
        get_format(self.input_format, argname="input_format")
        if self.sampler not in ("round", "table"):
            raise ValueError(f"sampler: expected 'round' or 'table', got {self.sampler!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference: expected one of {REFERENCES}, got {self.reference!r}")
        _check_layer(self)
        if self.metric not in METRICS:
            raise ValueError(f"metric: expected one of {METRICS}, got {self.metric!r}")
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"name: expected a non-empty name without '/', got {self.name!r}")
        _check_paper(self.paper)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "grid") -> Grid:
        """A grid from a TOML table or a dict; unknown keys are errors naming them."""
        known = {f.name for f in fields(cls)}
        aliases = {"dists": "distributions", "block": "blocks", "context": "contexts"}
        out: dict[str, Any] = {}
        for key, value in data.items():
            k = aliases.get(key, key)
            if k not in known:
                raise ValueError(f"{where}: unknown field {key!r}; expected some of {sorted(known)}")
            out[k] = tuple(value) if isinstance(value, list) else value
        if "algorithms" not in out:
            raise ValueError(f"{where}: the field 'algorithms' is required")
        return cls(**out)

    def identity(self) -> dict[str, Any]:
        """Everything that decides a row's numbers: not `samples` (how many), `metric` (every metric is stored;
        this one is summarised) or `paper` (what the summary is set beside)."""
        d = asdict(self)
        for presentation in ("samples", "metric", "paper"):
            d.pop(presentation)
        return json.loads(json.dumps(d))  # tuples as lists, as grid.json holds them

    def cells(self) -> list[tuple[str, str, int, int, int, int]]:
        return [(m, d, c, h, s, b) for m in self.machines for d in self.distributions for c in self.contexts
                for h in self.heads for s in self.sq for b in self.blocks]


def _check_layer(grid: Grid) -> None:
    """A layer grid (reference "layer") runs the layer's algorithms only, on their own machine, BF16 inputs, the
    kernels' own tiles; any other grid runs none of them."""
    names = [parse_algorithm(a)[1] for a in grid.algorithms]
    if grid.reference != "layer":
        if any(n in LAYER_ALGORITHMS for n in names):
            raise ValueError(f"algorithms: {sorted(set(names) & set(LAYER_ALGORITHMS))} measure the MLA layer; "
                             "give reference 'layer' (--reference layer)")
        return
    if not set(names) <= set(LAYER_ALGORITHMS):
        raise ValueError(f"algorithms: a layer grid runs the layer's paths ({', '.join(LAYER_ALGORITHMS)}), got "
                         f"{sorted(set(names) - set(LAYER_ALGORITHMS))}")
    for f, want in (("machines", (LAYER_MACHINE,)), ("blocks", (64,))):
        if getattr(grid, f) != want:
            raise ValueError(f"{f}: a layer grid's kernels run on their own machines and tiles; give {list(want)}, "
                             f"got {list(getattr(grid, f))}")
    if grid.input_format != "bf16" or grid.schedule != "reference":
        raise ValueError(f"input_format, schedule: a layer grid's inputs are BF16 and its kernels lay out their own "
                         f"work; got {grid.input_format!r} and {grid.schedule!r}")
    if min(grid.contexts) < max(grid.sq):
        raise ValueError(f"contexts: a layer sample measures the last s_q of its tokens; every context at least the "
                         f"largest sq ({max(grid.sq)}), got {min(grid.contexts)}")


def _check_paper(paper: Any) -> None:
    """Published values: a mapping of "distribution/algorithm" to a positive finite number."""
    if not isinstance(paper, Mapping):
        raise ValueError(f"paper: expected a table of \"distribution/algorithm\" = value, got {paper!r}")
    for key, value in paper.items():
        if not isinstance(key, str) or "/" not in key:
            raise ValueError(f"paper: expected keys like \"normal:1/amla\", got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"paper: {key!r}: expected a positive finite number, got {value!r}")


@dataclass
class GridResult:
    grid: Grid
    out_dir: Path
    summary: dict
    computed: int  # tasks computed in this run (the rest were already on disk)
    seconds: float


def load_grid(path: str | Path) -> Grid:
    """A grid from a TOML file (the keys of :class:`Grid`; ``dists`` for distributions)."""
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"grid: cannot read {p} ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"grid: {p} is not valid TOML ({e})") from None
    return Grid.from_mapping(data, where=f"grid {p}")


# --- one task ---------------------------------------------------------------------------------------------


def reference(q: np.ndarray, kv: np.ndarray, kind: str) -> np.ndarray:
    """The FP64 attention the errors are measured against: of the inputs, or of their BF16 rounding."""
    if kind == "golden-bf16":
        q, kv = round_to(q, "bf16"), round_to(kv, "bf16")
    return golden(q, kv).out


def sample_errors(specs: Iterable[str], dist: str, *, seed: int, heads: int, sq: int, context: int, block: int,
                  machine: str | Machine, schedule: str = "reference", input_format: str = "bf16",
                  sampler: str = "round", reference_kind: str = "golden") -> list[tuple[str, dict[str, float]]]:
    """One sample: the inputs drawn from `seed`, the FP64 reference, and (label, errors) of every algorithm spec
    (on `schedule` unless the spec names its own)."""
    q, kv = make_inputs(dist, heads=heads, sq=sq, context=context, fmt=input_format, seed=seed, sampler=sampler)
    if reference_kind == "layer":
        ref = layer_reference(q, kv)
        return [(label, all_metrics(LAYER_ALGORITHMS[name](q, kv, **options).out, ref))
                for label, name, options in map(parse_algorithm, specs)]
    ref = reference(q, kv, reference_kind)
    mc = get_machine(machine)
    out = []
    for spec in specs:
        label, name, options = parse_algorithm(spec)
        run = call_algorithm(name, get_algorithm(name), q, kv, machine=mc, block=block,
                             **{"schedule": schedule, **options})
        out.append((label, all_metrics(run.out, ref)))
    return out


def run_task(task: tuple) -> list[tuple[str, ...]]:
    """One sample of one cell on one machine: every algorithm's row, as the store's fields (strings)."""
    grid_json, cell, sample, engine = task
    grid = Grid.from_mapping(json.loads(grid_json))
    machine, dist, context, heads, sq, block = cell
    with use_engine(engine):
        errors = sample_errors(grid.algorithms, dist, seed=derive_seed(grid.seed, grid.name, dist, sample),
                               heads=heads, sq=sq, context=context, block=block, machine=machine,
                               schedule=grid.schedule, input_format=grid.input_format, sampler=grid.sampler,
                               reference_kind=grid.reference)
    return [(*map(str, (*cell, sample)), label, *(repr(float(m[k])) for k in METRICS)) for label, m in errors]


def check_runs(specs: Iterable[str], machines: Iterable[str], blocks: Iterable[int], *, schedule: str = "reference",
               input_format: str = "bf16", heads: int = 64) -> None:
    """Every (algorithm, machine, block) once on a tiny problem of `heads` heads (default 64, FlashMLA's least),
    so that a bad option or a broken plugin fails before any work."""
    q, kv = make_inputs("normal:1", heads=heads, sq=1, context=16, fmt=input_format, seed=0)
    for spec in specs:
        label, name, options = parse_algorithm(spec)
        fn = get_algorithm(name)
        for machine in machines:
            for block in blocks:
                try:
                    call_algorithm(name, fn, q, kv, machine=machine, block=block, **{"schedule": schedule, **options})
                except PluginError as e:
                    raise PluginError(f"algorithms: {spec!r} on machine {machine!r} with block {block}, a tiny "
                                      f"problem (q {q.shape}, kv {kv.shape}): {e}") from None
                except (TypeError, ValueError) as e:
                    raise ValueError(f"algorithms: {spec!r} on machine {machine!r} with block {block}: {e}") from None


def _check_runs(grid: Grid) -> None:
    if grid.reference == "layer":  # each path once on a tiny layer: 2 tokens, 2 heads
        q, kv = make_inputs("normal:1", heads=2, sq=1, context=2, seed=0)
        for spec in grid.algorithms:
            _, name, options = parse_algorithm(spec)
            try:
                LAYER_ALGORITHMS[name](q, kv, **options)
            except (TypeError, ValueError) as e:
                raise ValueError(f"algorithms: {spec!r}: {e}") from None
        return
    check_runs(grid.algorithms, grid.machines, grid.blocks, schedule=grid.schedule, input_format=grid.input_format)


_ROW_BYTES = 3 << 10  # a row while a sweep runs: the store's strings, its task and its parsed copy (2.4 KB measured)


def check_sweep_memory(*, rows: int, shapes: Iterable[tuple[int, int, int]], machines: Iterable[str], jobs: int,
                       what: str, lower_size: str, lower_rows: str,
                       sample_bytes: Callable[[int, int, int], int] | None = None) -> None:
    """Refuse, before any work, a sweep that would not fit in this machine's memory: `jobs` samples at once of its
    largest (heads, s_q, context) on its machines (jobs 0: the samples run elsewhere), or its `rows` (every row
    is held while it runs). lower_size, lower_rows: the arguments that lower each, named in the message."""
    have = available_bytes()
    if jobs:
        sm90 = any(mc.exponential.mode == "sm90" or mc.division.mode == "sm90" for mc in map(get_machine, machines))
        need, (h, sq, c) = max((run_bytes(batch=1, sq=sq, heads=h, context=c, mufu_tables=sm90)
                                + (sample_bytes(h, sq, c) if sample_bytes else 0), (h, sq, c)) for h, sq, c in shapes)
        if need * jobs > have:
            raise ResourceError(f"{what}: {jobs} sample(s) at once of heads {h}, s_q {sq}, context {c} need about "
                                f"{need * jobs / 2**30:.1f} GiB of memory and {have / 2**30:.1f} GiB is available; "
                                f"lower {lower_size}")
    if rows * _ROW_BYTES > have:
        raise ResourceError(f"{what}: {rows} result rows need about {rows * _ROW_BYTES / 2**30:.1f} GiB of memory "
                            f"and {have / 2**30:.1f} GiB is available; lower {lower_rows}")


# --- summary ----------------------------------------------------------------------------------------------


def _parse_row(values: tuple[str, ...]) -> dict[str, Any]:
    try:
        row: dict[str, Any] = dict(zip(KEYS, values[: len(KEYS)], strict=True))
        for k in ("context", "heads", "sq", "block", "sample"):
            row[k] = int(row[k])
        row.update({k: float(v) for k, v in zip(METRICS, values[len(KEYS):], strict=True)})
    except ValueError:
        raise StoreCorrupt(f"results.csv: a row with a valid checksum does not parse: {values}") from None
    return row


def summarize_grid(grid: Grid, rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Per cell and algorithm over samples < grid.samples: n, and of each metric the mean, median and standard
    error over the finite samples, with how many were NaN and how many infinite (:func:`.metrics.sample_stats`)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["sample"] < grid.samples:
            groups.setdefault(tuple(r[k] for k in KEYS if k != "sample"), []).append(r)
    labels = [parse_algorithm(a)[0] for a in grid.algorithms]
    order = {"machine": grid.machines, "distribution": grid.distributions, "context": grid.contexts,
             "heads": grid.heads, "sq": grid.sq, "block": grid.blocks, "algorithm": tuple(labels)}
    cells = []
    for key in sorted(groups, key=lambda k: tuple(order[f].index(v) if v in order[f] else len(order[f])
                                                    for f, v in zip(order, k))):
        rs = groups[key]
        entry: dict[str, Any] = dict(zip(order, key))
        entry["n"] = len(rs)
        for m in METRICS:
            entry[m] = sample_stats(r[m] for r in rs)
        paper = grid.paper.get(f"{entry['distribution']}/{entry['algorithm']}")
        if paper is not None:
            entry["paper"] = paper
        cells.append(entry)
    return {"grid": {**grid.identity(), "samples": grid.samples, "metric": grid.metric, "paper": dict(grid.paper)},
            "cells": cells}


def grid_markdown(summary: dict[str, Any]) -> str:
    """A grid's summary as a Markdown table: a column for each axis the grid varies (an axis of one value is said
    once, above the table), then the algorithm and the metric's statistics; a mean over fewer samples than n
    (some NaN or infinite) says so."""
    g = summary["grid"]
    metric = g["metric"]
    has_paper = any("paper" in c for c in summary["cells"])
    axes = [("machine", "machine"), ("distribution", "distribution"), ("context", "context"), ("heads", "heads"),
            ("sq", "s_q"), ("block", "block")]
    values = {key: list(dict.fromkeys(c[key] for c in summary["cells"])) for key, _ in axes}
    varied = [(key, label) for key, label in axes if len(values[key]) > 1]
    fixed = ", ".join(f"{label} {values[key][0]}" for key, label in axes if len(values[key]) == 1)
    head = [label for _, label in varied] + ["algorithm", "n", "mean", "median", "s.e."]
    head += ["paper", "ours / paper"] if has_paper else []
    lines = [f"### Sweep `{g['name']}`: {metric}", "",
             f"{g['samples']} samples per cell, seed {g['seed']}, inputs {g['input_format']} ({g['sampler']}), "
             f"schedule {g['schedule']}, reference {g['reference']}" + (f"; {fixed}." if fixed else "."), "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for c in summary["cells"]:
        s = c[metric]
        sem = "-" if s["sem"] is None else f"{s['sem']:.2e}"
        cols = [str(c[key]) for key, _ in varied]
        cols += [c["algorithm"], str(c["n"]), f"{s['mean']:.4e}{nonfinite_note(s, c['n'])}", f"{s['median']:.4e}",
                 sem]
        if has_paper:
            p = c.get("paper")
            cols += ["-", "-"] if p is None else [f"{p:.3g}", f"{s['mean'] / p:.3f}"]
        lines.append("| " + " | ".join(cols) + " |")
    if any(c[metric]["nan"] or c[metric]["inf"] for c in summary["cells"]):
        lines += ["", NONFINITE_FOOTNOTE]
    return "\n".join(lines) + "\n"


def plot_grid(summary: dict[str, Any], path: Path) -> bool:
    """A grid's error against context: one panel per (machine, algorithm), one line per distribution (and per
    heads, s_q and block where the grid has several); bars are the standard error; a cell whose mean is not
    finite has no point. False without matplotlib."""
    try:
        from ..plots import _pyplot, error_bar, save_png

        plt = _pyplot()
    except RuntimeError:
        return False
    g, metric = summary["grid"], summary["grid"]["metric"]
    machines, algs = g["machines"], [parse_algorithm(a)[0] for a in g["algorithms"]]
    fig, axes = plt.subplots(len(machines), len(algs), figsize=(3.2 * len(algs) + 1, 2.6 * len(machines) + 0.6),
                             squeeze=False, sharex=True, sharey=True)
    extra = [cell_key for cell_key, grid_key in (("heads", "heads"), ("sq", "sq"), ("block", "blocks"))
             if len(g[grid_key]) > 1]  # named in the legend only where the grid varies them

    def label(c: dict[str, Any]) -> str:
        return " ".join([c["distribution"], *(f"{k}={c[k]}" for k in extra)])

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {lab: cycle[k % len(cycle)] for k, lab in enumerate(dict.fromkeys(map(label, summary["cells"])))}
    for i, mach in enumerate(machines):
        for j, alg in enumerate(algs):
            ax = axes[i][j]
            lines: dict[str, list] = {}
            for c in summary["cells"]:
                if c["machine"] == mach and c["algorithm"] == alg and math.isfinite(c[metric]["mean"]):
                    lines.setdefault(label(c), []).append(c)
            for lab, cs in lines.items():  # a line keeps its colour in every panel, whichever others are empty
                cs.sort(key=lambda c: c["context"])
                ax.errorbar([c["context"] for c in cs], [c[metric]["mean"] for c in cs], color=colour[lab],
                            yerr=[error_bar(c[metric]["sem"]) for c in cs], marker="o", ms=3, capsize=2, label=lab)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{alg} on {mach}", fontsize=8)
            if i == len(machines) - 1:
                ax.set_xlabel("context")
            if j == 0:
                ax.set_ylabel(metric)
    legend = {lab: h for ax in axes.flat for h, lab in zip(*ax.get_legend_handles_labels())}
    if legend:  # every panel's lines (a panel whose cells are all NaN has none), in the grid's order
        order = [lab for lab in colour if lab in legend]
        axes[0][-1].legend([legend[lab] for lab in order], order, fontsize=6)
    fig.tight_layout()
    save_png(fig, path)
    return True


# --- the run ----------------------------------------------------------------------------------------------


def run_grid(grid: Grid, *, out_dir: str | Path, scheduler: str = "local", jobs: int = 1, engine: str = "numpy",
             progress: bool = True, max_tasks: int | None = None, repair: bool = False,
             log: Callable[[str], None] | None = None) -> GridResult:
    """Run (or resume) `grid` into out_dir: results.csv, grid.json, summary.json, summary.md, errors.png.

    scheduler: ``local``, ``dask`` or ``tcp://HOST:PORT`` (:mod:`.schedulers`); jobs: local processes or
    LocalCluster workers. max_tasks: stop after computing this many new tasks (as an interruption would).
    """
    jobs = check_run(scheduler, jobs, engine)
    lists = (grid.machines, grid.distributions, grid.contexts, grid.heads, grid.sq, grid.blocks, grid.algorithms)
    check_sweep_memory(rows=math.prod(map(len, lists)) * grid.samples,
                       shapes=[(h, sq, c) for h in grid.heads for sq in grid.sq for c in grid.contexts],
                       machines=grid.machines, jobs=jobs if scheduler in ("local", "dask") else 0, what="sweep",
                       lower_size="contexts, heads, sq or jobs", lower_rows="samples, or the grid's lists",
                       sample_bytes=layer_bytes if grid.reference == "layer" else None)
    _check_runs(grid)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} is a file, not a folder")
    identity = grid.identity()
    with ResultStore(out, GRID_FIELDS, len(KEYS), repair=repair) as store:
        claim_folder(out, identity, filename="grid.json", what="grid")
        store.compact(sorted(store.rows, key=_sort_key))
        labels = {parse_algorithm(a)[0] for a in grid.algorithms}
        have: dict[tuple, set[str]] = {}
        for values in store.rows:
            have.setdefault(values[:7], set()).add(values[7])
        grid_json = json.dumps(identity)
        todo = [(grid_json, cell, s, engine) for s in range(grid.samples) for cell in grid.cells()
                if have.get((*map(str, cell), str(s))) != labels]
        if max_tasks is not None:
            todo = todo[:max_tasks]
        t0 = time.perf_counter()
        bar = progress_bar(len(todo), grid.name, progress)
        for rows in execute(run_task, todo, scheduler=scheduler, jobs=jobs, log=log):
            store.append(rows)  # a row already there (a retried task) is not written twice
            bar.update(1)
        bar.close()
        seconds = time.perf_counter() - t0
        store.compact(sorted(store.rows, key=_sort_key))
        summary = summarize_grid(grid, (_parse_row(values) for values in store.rows.values()))
        atomic_write(out / "summary.json", dumps_strict(summary, indent=1))
        atomic_write(out / "summary.md", grid_markdown(summary))
        plot_grid(summary, out / "errors.png")
    return GridResult(grid, out, summary, len(todo), seconds)


def _sort_key(key: tuple[str, ...]) -> tuple:
    """Rows in a readable order: numbers as numbers."""
    return tuple((0, int(v), "") if v.isdigit() else (1, 0, v) for v in key)
