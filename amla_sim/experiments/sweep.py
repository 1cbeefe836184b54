"""Resumable sweeps: one task per (distribution, sample), results appended atomically, final files rebuilt.

DIR/results.csv gets one line per (distribution, sample, algorithm), written task by task with one append and an
fsync, so an interrupted run loses at most the tasks in flight. A re-run reads the file, drops any incomplete task
(a torn last line), and computes only what is missing. Every task draws its inputs from a seed derived from
(seed, table, distribution, sample), so the numbers do not depend on the order, the number of jobs, or
interruptions; the final files are rebuilt from the sorted CSV and are identical either way.
"""

from __future__ import annotations

import csv
import io
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .. import _blas_clock
from ..machines import get_machine
from .tables import TABLES, Table, run_sample

FIELDS = ("distribution", "sample", "algorithm", "rel_frobenius", "rmse", "cos_diff")


@dataclass
class SweepResult:
    table: Table
    out_dir: Path
    summary: dict
    computed: int  # tasks computed in this run (the rest were already on disk)
    seconds: float
    blas_seconds: float


def _task(args: tuple) -> tuple[list[dict], float]:
    table_name, dist, sample, machine, context, heads, seed = args
    t0 = _blas_clock.elapsed()
    rows = run_sample(TABLES[table_name], dist, sample, machine=get_machine(machine), context=context, heads=heads,
                      seed=seed)
    return rows, _blas_clock.elapsed() - t0


def _format_row(r: dict) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(
        [r["distribution"], r["sample"], r["algorithm"]] + [repr(float(r[k])) for k in FIELDS[3:]])
    return buf.getvalue()


def _append(path: Path, rows: list[dict]) -> None:
    """Append one task's rows in a single write, then fsync: a crash leaves whole tasks or a torn last line."""
    data = "".join(_format_row(r) for r in rows).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str | bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load(path: Path, table: Table) -> dict[tuple[str, int], list[dict]]:
    """Complete tasks already on disk (a task is complete when every algorithm of the table has its row)."""
    tasks: dict[tuple[str, int], list[dict]] = {}
    if not path.exists():
        return tasks
    for line in path.read_text().splitlines()[1:]:
        try:
            vals = next(csv.reader([line]))
            row = {"distribution": vals[0], "sample": int(vals[1]), "algorithm": vals[2],
                   **{k: float(v) for k, v in zip(FIELDS[3:], vals[3:], strict=True)}}
        except (ValueError, StopIteration):
            continue  # a torn line from an interrupted append
        tasks.setdefault((row["distribution"], row["sample"]), []).append(row)
    algs = set(table.algorithms)
    return {k: v for k, v in tasks.items() if {r["algorithm"] for r in v} == algs and len(v) == len(algs)}


def _write_csv(path: Path, tasks: dict[tuple[str, int], list[dict]], table: Table) -> None:
    order = {d: i for i, (d, _) in enumerate(table.distributions)}
    alg_order = {a: i for i, a in enumerate(table.algorithms)}
    rows = sorted((r for rs in tasks.values() for r in rs),
                  key=lambda r: (order.get(r["distribution"], 99), r["sample"], alg_order[r["algorithm"]]))
    _atomic_write(path, ",".join(FIELDS) + "\n" + "".join(_format_row(r) for r in rows))


def summarize(table: Table, tasks: dict[tuple[str, int], list[dict]], *, samples: int, context: int, heads: int,
              machine: str, seed: int) -> dict:
    """The public summary: per (distribution, algorithm) the mean of the table's metric, beside the paper's."""
    rows = []
    for dist, label in table.distributions:
        for alg in table.algorithms:
            vals = [r for (d, _), rs in tasks.items() if d == dist for r in rs if r["algorithm"] == alg]
            if not vals:
                continue
            entry = {"distribution": label, "algorithm": alg,
                     "ours": statistics.fmean(r[table.metric] for r in vals),
                     "paper": table.paper.get((label, alg)), "samples": len(vals),
                     "median": statistics.median(r[table.metric] for r in vals),
                     "worst_sample": max(vals, key=lambda r: r[table.metric])["sample"]}
            for k in FIELDS[3:]:
                entry[f"mean_{k}"] = statistics.fmean(r[k] for r in vals)
            rows.append(entry)
    return {"table": table.name, "title": table.title, "metric": table.metric, "machine": machine,
            "samples": samples, "context": context, "heads": heads, "seed": seed, "source": table.source,
            "rows": rows}


def markdown(summary: dict) -> str:
    lines = [f"### {summary['title']}", "",
             f"{summary['samples']} samples, G = {summary['heads']}, context {summary['context']}, "
             f"machine `{summary['machine']}`, metric: {summary['metric']} (mean over samples).", "",
             "| distribution | algorithm | ours | paper | ours / paper |", "|---|---|---|---|---|"]
    for r in summary["rows"]:
        paper = "-" if r["paper"] is None else f"{r['paper']:.3g}"
        ratio = "-" if r["paper"] is None else f"{r['ours'] / r['paper']:.3f}"
        lines.append(f"| {r['distribution']} | {r['algorithm']} | {r['ours']:.3e} | {paper} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> bool:
    """A grouped bar chart of ours against the paper's values; False when matplotlib is missing."""
    try:
        from ..plots import _pyplot

        plt = _pyplot()
    except RuntimeError:
        return False
    dists = list(dict.fromkeys(r["distribution"] for r in summary["rows"]))
    algs = list(dict.fromkeys(r["algorithm"] for r in summary["rows"]))
    fig, ax = plt.subplots(figsize=(1.6 * len(dists) + 3, 3.6))
    width = 0.8 / (2 * len(algs))
    for j, alg in enumerate(algs):
        for k, (key, hatch) in enumerate((("ours", None), ("paper", "//"))):
            xs, ys = [], []
            for i, d in enumerate(dists):
                r = next((r for r in summary["rows"] if r["distribution"] == d and r["algorithm"] == alg), None)
                if r and r[key] is not None:
                    xs.append(i + (2 * j + k - len(algs) + 0.5) * width)
                    ys.append(r[key])
            if xs:
                ax.bar(xs, ys, width, label=f"{alg} ({key})", hatch=hatch, alpha=0.9 if key == "ours" else 0.5)
    ax.set_xticks(range(len(dists)), dists, fontsize=7)
    ax.set_ylabel(summary["metric"])
    ax.set_yscale("log")
    ax.set_title(summary["title"], fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    _atomic_write(path, buf.getvalue())
    return True


def run_table(
    name: str,
    *,
    out_dir: str | Path,
    samples: int | None = None,
    context: int | None = None,
    heads: int | None = None,
    machine: str = "ieee32-fast",
    seed: int = 0,
    jobs: int = 1,
    progress: bool = True,
    max_tasks: int | None = None,
) -> SweepResult:
    """Reproduce one table into out_dir (results.csv, summary.json, table.md, table.png), resuming if there.

    max_tasks: stop after computing this many new tasks (as an interruption would; for tests).
    """
    if name not in TABLES:
        raise ValueError(f"table: expected one of {sorted(TABLES)}, got {name!r}")
    table = TABLES[name]
    get_machine(machine)  # validate the name before any work
    samples = 100 if samples is None else samples
    context = table.context if context is None else context
    heads = table.heads if heads is None else heads
    for arg, v in (("samples", samples), ("context", context), ("heads", heads), ("jobs", jobs)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg}: expected a positive int, got {v!r}")
    out = Path(out_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    meta = {"table": name, "samples": samples, "context": context, "heads": heads, "machine": machine, "seed": seed}
    meta_path = out / "run.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in meta if k != "samples"} != {k: v for k, v in meta.items() if k != "samples"}:
            raise ValueError(f"out: {out} holds a run with other settings ({old}); choose another --out")
    _atomic_write(meta_path, json.dumps(meta, indent=1))
    csv_path = out / "results.csv"
    done = _load(csv_path, table)
    _write_csv(csv_path, done, table)  # drop torn lines and incomplete tasks before appending
    todo = [(name, d, s, machine, context, heads, seed) for d, _ in table.distributions for s in range(samples)
            if (d, s) not in done]
    if max_tasks is not None:
        todo = todo[:max_tasks]
    t0 = time.perf_counter()
    blas = 0.0
    bar = _progress(len(todo), name, progress)
    for rows, blas_s in _execute(todo, jobs):
        _append(csv_path, rows)
        done[(rows[0]["distribution"], rows[0]["sample"])] = rows
        blas += blas_s
        bar.update(1)
    bar.close()
    seconds = time.perf_counter() - t0
    _write_csv(csv_path, {k: v for k, v in done.items() if k[1] < samples}, table)
    summary = summarize(table, {k: v for k, v in done.items() if k[1] < samples}, samples=samples,
                        context=context, heads=heads, machine=machine, seed=seed)
    _atomic_write(out / "summary.json", json.dumps(summary, indent=1))
    _atomic_write(out / "table.md", markdown(summary))
    plot(summary, out / "table.png")
    return SweepResult(table, out, summary, len(todo), seconds, blas)


def _execute(todo: list[tuple], jobs: int) -> Iterable[tuple[list[dict], float]]:
    if jobs == 1:
        for t in todo:
            yield _task(t)
        return
    # Fresh worker processes with one BLAS thread each: J processes sharing the cores, not J x cores threads.
    saved = {k: os.environ.get(k) for k in _THREAD_VARS}
    os.environ.update({k: "1" for k in _THREAD_VARS})
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            futures = [ex.submit(_task, t) for t in todo]
            for f in as_completed(futures):
                yield f.result()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="sample")
