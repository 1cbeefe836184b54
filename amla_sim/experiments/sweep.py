"""Resumable sweeps: one task per (distribution, sample), results kept in a checked store, final files rebuilt.

DIR/results.csv (:mod:`amla_sim.experiments.store`) gets one line per (distribution, sample, algorithm), each with
its own CRC, written task by task with one checked append and an fsync, so an interrupted run loses at most the
tasks in flight and a torn line is never read as a number. A re-run computes only what is missing (a column added to
a table: that column alone, on each task's own draw) and never deletes rows. Every task draws its inputs from a seed
derived from (seed, table, distribution, sample), so the numbers do not depend on the order, the number of jobs, or
interruptions; the final files are rebuilt from the sorted store and are identical either way.
"""

from __future__ import annotations

import math
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .. import _blas_clock
from .._validate import check_int, check_positive_int, dumps_strict
from ..engine import use_engine
from ..machines import get_machine
from ..schedules import get_schedule
from .grid import check_runs, check_sweep_memory
from .metrics import NONFINITE_FOOTNOTE, nonfinite_note, sample_stats
from .schedulers import check_run, execute, progress_bar
from .store import ResultStore, StoreCorrupt, atomic_write, claim_folder
from .tables import TABLE_METRICS, TABLES, Table, run_sample, table_specs, with_algorithms

TABLE_FIELDS = ("distribution", "sample", "algorithm", *TABLE_METRICS)


@dataclass
class SweepResult:
    table: Table
    out_dir: Path
    summary: dict
    computed: int  # tasks computed in this run (the rest were already on disk)
    seconds: float
    blas_seconds: float


def _task(args: tuple) -> tuple[list[dict], float]:
    table_name, extra, dist, sample, machine, schedule, context, heads, seed, engine, only = args
    t0 = _blas_clock.elapsed()
    table = with_algorithms(TABLES[table_name], extra)
    if only is not None:  # the columns a resumed task still lacks (the same draw: its seed is the task's)
        table = replace(table, algorithms=only)
    with use_engine(engine):
        rows = run_sample(table, dist, sample, machine=get_machine(machine), schedule=schedule, context=context,
                          heads=heads, seed=seed)
    return rows, _blas_clock.elapsed() - t0


def _fields(r: dict) -> tuple[str, ...]:
    return (r["distribution"], str(r["sample"]), r["algorithm"], *(repr(float(r[k])) for k in TABLE_FIELDS[3:]))


def _row(values: tuple[str, ...]) -> dict:
    try:
        return {"distribution": values[0], "sample": int(values[1]), "algorithm": values[2],
                **{k: float(v) for k, v in zip(TABLE_FIELDS[3:], values[3:], strict=True)}}
    except ValueError:
        raise StoreCorrupt(f"results.csv: a row with a valid checksum does not parse: {values}") from None


def _tasks(store: ResultStore, table: Table) -> dict[tuple[str, int], list[dict]]:
    """The store's rows of the table's columns by task; a task is complete when every column has its row (a
    column added to a table since is computed alone, on the task's own draw)."""
    tasks: dict[tuple[str, int], list[dict]] = {}
    algs = set(table.algorithms)
    for values in store.rows.values():
        row = _row(values)
        if row["algorithm"] in algs:
            tasks.setdefault((row["distribution"], row["sample"]), []).append(row)
    return tasks


def _missing(table: Table, rows: list[dict]) -> tuple[str, ...]:
    """The table's columns a task has no row of, in the table's order."""
    have = {r["algorithm"] for r in rows}
    return tuple(a for a in table.algorithms if a not in have)


def _order(store: ResultStore, table: Table) -> list[tuple[str, ...]]:
    """Keys in the table's order: distribution, then sample, then algorithm."""
    dists = {d: i for i, (d, _) in enumerate(table.distributions)}
    algs = {a: i for i, a in enumerate(table.algorithms)}
    return sorted(store.rows, key=lambda k: (dists.get(k[0], len(dists)), k[0], int(k[1]) if k[1].isdigit() else -1,
                                             algs.get(k[2], len(algs)), k[2]))


def summarize_table(table: Table, tasks: dict[tuple[str, int], list[dict]], *, samples: int, context: int,
                    heads: int, machine: str, seed: int, schedule: str = "reference") -> dict:
    """A paper table's public summary: per (distribution, algorithm) the mean of the table's metric beside the
    paper's, over the finite samples, with how many were NaN and how many infinite."""
    rows = []
    for dist, label in table.distributions:
        for alg in table.algorithms:
            vals = [r for (d, _), rs in tasks.items() if d == dist for r in rs if r["algorithm"] == alg]
            if vals:
                rows.append(_table_row(table, label, alg, vals))
    return {"table": table.name, "title": table.title, "metric": table.metric, "machine": machine, "schedule": schedule,
            "samples": samples, "context": context, "heads": heads, "seed": seed, "source": table.source,
            "rows": rows}


def _table_row(table: Table, label: str, alg: str, vals: list[dict]) -> dict:
    """One (distribution, algorithm) of a table's summary, from its samples' rows."""
    stats = sample_stats(r[table.metric] for r in vals)
    worst = max(vals, key=lambda r: _badness(r[table.metric]))
    entry = {"distribution": label, "algorithm": alg,
             "ours": stats["mean"],
             # the standard error of that mean (None below two samples): how far the paper may be by chance
             "sem": stats["sem"],
             "paper": table.paper.get((label, alg)), "samples": len(vals),
             "median": stats["median"], "nan": stats["nan"], "inf": stats["inf"],
             "worst_sample": worst["sample"]}
    for k in TABLE_FIELDS[3:]:
        each = sample_stats(r[k] for r in vals)
        entry.update({f"mean_{k}": each["mean"], f"nan_{k}": each["nan"], f"inf_{k}": each["inf"]})
    return entry


def _badness(v: float) -> tuple[bool, float]:
    """A sample's metric as an order of how bad it is: NaN worst, then the largest."""
    return (math.isnan(v), 0.0 if math.isnan(v) else v)


def table_markdown(summary: dict) -> str:
    """A paper table's summary as Markdown: ours beside the paper's (or, where nothing is published, every
    metric side by side); a mean over fewer samples than were run (some NaN or infinite) says so."""
    lines = [f"### {summary['title']}", "",
             f"{summary['samples']} samples, G = {summary['heads']}, context {summary['context']}, "
             f"machine `{summary['machine']}`, schedule `{summary.get('schedule', 'reference')}`, "
             f"metric: {summary['metric']} (means over samples).", "",
             "| distribution | algorithm | ours | s.e. | paper | ours / paper |", "|---|---|---|---|---|---|"]
    if all(r["paper"] is None for r in summary["rows"]):  # nothing published: every metric, side by side
        lines[-2:] = ["| distribution | algorithm | rel. Frobenius | RMSE | cos diff |", "|---|---|---|---|---|"]
        lines += [f"| {r['distribution']} | {r['algorithm']} | "
                  + " | ".join(f"{r[f'mean_{k}']:.3e}{_note(r, k)}" for k in TABLE_METRICS) + " |"
                  for r in summary["rows"]]
    else:
        lines += [_paper_line(r) for r in summary["rows"]]
    if any(_note(r, k) for r in summary["rows"] for k in TABLE_METRICS):
        lines += ["", NONFINITE_FOOTNOTE]
    return "\n".join(lines) + "\n"


def _note(row: dict, metric: str) -> str:
    return nonfinite_note({"nan": row.get(f"nan_{metric}", 0), "inf": row.get(f"inf_{metric}", 0)}, row["samples"])


def _paper_line(r: dict) -> str:
    """A table row of ours beside the paper's."""
    paper = "-" if r["paper"] is None else f"{r['paper']:.3g}"
    ratio = "-" if r["paper"] is None else f"{r['ours'] / r['paper']:.3f}"
    if r["paper"] is not None and r.get("sem") is not None:
        ratio += f" ± {r['sem'] / r['paper']:.3f}"
    sem = "-" if r.get("sem") is None else f"{r['sem']:.1e}"
    ours = f"{r['ours']:.3e}{nonfinite_note({'nan': r.get('nan', 0), 'inf': r.get('inf', 0)}, r['samples'])}"
    return f"| {r['distribution']} | {r['algorithm']} | {ours} | {sem} | {paper} | {ratio} |"


def plot_table(summary: dict, path: Path) -> bool:
    """A paper table's plot, ours against the paper: the ratio ours / paper per distribution and algorithm, on a
    linear axis around 1 (bars on a log axis from an arbitrary floor would make a 5% gap look like 3x), with the
    standard error of each mean as an error bar (ours / paper +- s.e. / paper: is the gap within noise?); a table
    with no published numbers gets its metric as points on a log axis, with the same error bars. A mean that is
    not finite has no point. False when matplotlib is missing."""
    try:
        from ..plots import _pyplot, error_bar, save_png

        plt = _pyplot()
    except RuntimeError:
        return False
    dists = list(dict.fromkeys(r["distribution"] for r in summary["rows"]))
    algs = list(dict.fromkeys(r["algorithm"] for r in summary["rows"]))
    ratios = any(r["paper"] is not None for r in summary["rows"])
    width = 1.3 * len(dists) + 3
    step = min(0.12, 0.8 / len(algs))  # a distribution's points within 0.8 of its tick, however many columns
    fig, ax = plt.subplots(figsize=(width, 3.4))
    for j, alg in enumerate(algs):
        xs, ys, errs = [], [], []
        for i, d in enumerate(dists):
            r = next((r for r in summary["rows"] if r["distribution"] == d and r["algorithm"] == alg), None)
            if r is not None and (r["paper"] is not None or not ratios) and math.isfinite(r["ours"]):
                unit = r["paper"] if ratios else 1.0
                xs.append(i + (j - (len(algs) - 1) / 2) * step)
                ys.append(r["ours"] / unit)
                errs.append(error_bar(r.get("sem")) / unit)
        if xs:  # a column with no published or finite number has no point, and no legend entry
            # a marker a round of the 10 default colours, so no two columns look alike
            ax.errorbar(xs, ys, yerr=errs, fmt="osD^v"[j // 10 % 5], capsize=3, ms=4, label=alg)
    if ratios:
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel(f"{summary['metric']}: ours / paper (± s.e.)", fontsize=8)
    else:
        ax.set_yscale("log")
        ax.set_ylabel(f"{summary['metric']} (± s.e.)", fontsize=8)
    ax.set_xticks(range(len(dists)), dists, fontsize=7)
    ax.set_title(textwrap.fill(summary["title"], int(14 * width)), fontsize=8)  # wrapped to the figure, not clipped
    if ax.get_legend_handles_labels()[0]:  # many columns: the legend beside the axes, off the points
        ax.legend(fontsize=7, **({"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if len(algs) > 6 else {}))
    fig.tight_layout()
    save_png(fig, path)
    return True


def run_table(
    name: str,
    *,
    out_dir: str | Path,
    samples: int | None = None,
    context: int | None = None,
    heads: int | None = None,
    machine: str | None = None,
    schedule: str = "reference",
    seed: int = 0,
    jobs: int = 1,
    progress: bool = True,
    max_tasks: int | None = None,
    repair: bool = False,
    scheduler: str = "local",
    engine: str = "numpy",
    algorithms: tuple[str, ...] = (),
) -> SweepResult:
    """Reproduce one table into out_dir (results.csv, summary.json, table.md, table.png), resuming if there.

    Rows already in the folder are kept, whatever `samples` asks for now: a smaller request summarises a subset.
    repair: keep every valid row of a damaged results.csv and set the other lines aside (``results.rejected``).
    max_tasks: stop after computing this many new tasks (as an interruption would; for tests).
    scheduler, engine: where the samples run (:mod:`.schedulers`) and on which engine; neither changes a bit.
    schedule: the kernel schedule every algorithm runs on (:mod:`amla_sim.schedules`).
    algorithms: more columns, as sweep specs (a plugin's ``label=module:function`` too), run on the same draws.
    """
    jobs = check_run(scheduler, jobs, engine)
    table, machine, context, heads = check_table(name, context=context, heads=heads, machine=machine,
                                                 schedule=schedule, algorithms=algorithms, samples=samples,
                                                 jobs=jobs if scheduler in ("local", "dask") else 0)
    algorithms = tuple(algorithms)
    samples = 100 if samples is None else samples
    check_int(seed, "seed", lo=0, hi=2**63 - 1)
    out = Path(out_dir) / name
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} is a file, not a folder")
    meta = {"table": name, "context": context, "heads": heads, "machine": machine, "schedule": schedule, "seed": seed}
    if algorithms:  # (absent otherwise: folders of the paper's columns alone resume as before)
        meta["algorithms"] = list(algorithms)
    with ResultStore(out, TABLE_FIELDS, 3, repair=repair) as store:
        claim_folder(out, meta, filename="run.json", what="run")
        store.compact(_order(store, table))  # set a torn last line aside before appending
        done = _tasks(store, table)
        todo = []
        for d, _ in table.distributions:
            for s in range(samples):
                missing = _missing(table, done.get((d, s), []))
                if missing:
                    todo.append((name, algorithms, d, s, machine, schedule, context, heads, seed, engine,
                                 None if len(missing) == len(table.algorithms) else missing))
        if max_tasks is not None:
            todo = todo[:max_tasks]
        t0 = time.perf_counter()
        blas = 0.0
        bar = progress_bar(len(todo), name, progress)
        for rows, blas_s in execute(_task, todo, scheduler=scheduler, jobs=jobs):
            store.append(_fields(r) for r in rows)
            key = (rows[0]["distribution"], rows[0]["sample"])
            done[key] = done.get(key, []) + rows
            blas += blas_s
            bar.update(1)
        bar.close()
        seconds = time.perf_counter() - t0
        store.compact(_order(store, table))
        complete = {k: v for k, v in done.items() if k[1] < samples and not _missing(table, v)}
        summary = _write_summary(out, table, complete, samples, meta)
    return SweepResult(table, out, summary, len(todo), seconds, blas)


def check_table(name: str, *, context: int | None = None, heads: int | None = None, machine: str | None = None,
                schedule: str = "reference", algorithms: tuple[str, ...] = (), samples: int | None = None,
                jobs: int = 1) -> tuple[Table, str, int, int]:
    """Everything :func:`run_table` would refuse, before any work: the names, the sizes, the memory of `jobs`
    samples at once and of the results, and every column (the paper's and the added ones) once on a tiny problem
    with these heads. (table, machine, context, heads)."""
    if name not in TABLES:
        raise ValueError(f"table: expected one of {sorted(TABLES)}, got {name!r}")
    table = with_algorithms(TABLES[name], tuple(algorithms))
    machine = table.machine if machine is None else machine
    get_machine(machine)
    get_schedule(schedule)
    context = table.context if context is None else context
    heads = table.heads if heads is None else heads
    samples = 100 if samples is None else samples
    for arg, v in (("context", context), ("heads", heads), ("samples", samples)):
        check_positive_int(v, arg)
    check_sweep_memory(rows=len(table.distributions) * len(table.algorithms) * samples,
                       shapes=[(heads, table.sq, context)], machines=[machine], jobs=jobs, what=f"table {name}",
                       lower_size="context, heads or jobs", lower_rows="samples")
    try:
        check_runs(table_specs(table), (machine,), (table.block,), schedule=schedule,
                   input_format=table.input_format, heads=heads)
    except ValueError as e:
        raise type(e)(f"table {name}: {e}") from None
    return table, machine, context, heads


def _write_summary(out: Path, table: Table, tasks: dict, samples: int, meta: dict) -> dict:
    """summary.json, table.md and table.png of the tasks (rebuilt whole each run: the store is the record)."""
    keep = {k: v for k, v in meta.items() if k not in ("table", "algorithms")}
    summary = summarize_table(table, tasks, samples=samples, **keep)
    atomic_write(out / "summary.json", dumps_strict(summary, indent=1))
    atomic_write(out / "table.md", table_markdown(summary))
    plot_table(summary, out / "table.png")
    return summary
