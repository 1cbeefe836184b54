"""`amla-sim sweep`: grids from flags and TOML, named grids, resumption, refusals, and the schedulers (#14)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from amla_sim.cli import main
from amla_sim.experiments import schedulers
from amla_sim.experiments.grid import METRICS, Grid, grid_markdown, load_grid, plot_grid, run_grid, summarize_grid
from amla_sim.experiments.metrics import sample_stats
from amla_sim.experiments.sweep import run_table
from amla_sim.experiments.tables import TABLES, table_grid

SMALL = {"algorithms": ("base", "amla"), "machines": ("ieee32", "ieee32-fast"),
         "distributions": ("normal:1", "uniform:60"), "contexts": (64, 192), "heads": (4,), "blocks": (64,),
         "samples": 3}
FLAGS = ["--algorithms", "base,amla", "--machines", "ieee32,ieee32-fast", "--dists", "normal:1,uniform:60",
         "--contexts", "64,192", "--heads", "4", "--blocks", "64", "--samples", "3", "--quiet"]
TOML = """
algorithms = ["base", "amla"]
machines = ["ieee32", "ieee32-fast"]
dists = ["normal:1", "uniform:60"]
contexts = [64, 192]
heads = [4]
blocks = [64]
samples = 3
"""

needs_dask = pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                reason="Dask is not installed (the [distributed] extra)")


def _files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ("results.csv", "summary.json", "summary.md")}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("clean")
    run_grid(Grid(**SMALL), out_dir=out, progress=False)
    return _files(out)


def test_flags_and_toml_give_the_same_files(tmp_path, clean, capsys):
    assert main(["sweep", *FLAGS, "--out", str(tmp_path / "a")]) == 0
    (tmp_path / "g.toml").write_text(TOML)
    assert main(["sweep", "--grid", str(tmp_path / "g.toml"), "--quiet", "--out", str(tmp_path / "b")]) == 0
    assert _files(tmp_path / "a") == clean
    assert _files(tmp_path / "b") == clean
    summary = json.loads(clean["summary.json"])
    assert len(summary["cells"]) == 2 * 2 * 2 * 2  # machines x dists x contexts x algorithms
    cell = summary["cells"][0]
    assert cell["n"] == 3 and set(cell["rel_frobenius"]) == {"mean", "median", "sem", "nan", "inf"}
    assert len(clean["results.csv"].splitlines()) == 1 + 8 * 3 * 2


def test_interrupted_and_resumed_run_is_identical(tmp_path, clean):
    out = tmp_path / "cut"
    first = run_grid(Grid(**SMALL), out_dir=out, progress=False, max_tasks=5)
    assert first.computed == 5
    rest = run_grid(Grid(**SMALL), out_dir=out, progress=False)
    assert rest.computed == 24 - 5
    assert _files(out) == clean


def test_more_samples_extend_and_fewer_summarise_a_subset(tmp_path):
    out = tmp_path / "grow"
    run_grid(Grid(**{**SMALL, "samples": 2}), out_dir=out, progress=False)
    more = run_grid(Grid(**{**SMALL, "samples": 3}), out_dir=out, progress=False)
    assert more.computed == 8
    fewer = run_grid(Grid(**{**SMALL, "samples": 1}), out_dir=out, progress=False)
    assert fewer.computed == 0 and all(c["n"] == 1 for c in fewer.summary["cells"])
    assert len((out / "results.csv").read_text().splitlines()) == 1 + 8 * 3 * 2  # nothing deleted


def test_named_table_grid_gives_reproduce_numbers(tmp_path):
    kw = {"samples": 2, "context": 128, "heads": 4}
    table = run_table("amla-table3", out_dir=tmp_path / "t", progress=False, **kw)
    grid = run_grid(table_grid("amla-table3", **kw), out_dir=tmp_path / "g", progress=False)
    ours = {(r["distribution"], r["algorithm"]): r["ours"] for r in table.summary["rows"]}
    labels = dict(TABLES["amla-table3"].distributions)
    got = {(labels[c["distribution"]], c["algorithm"]): c["rel_frobenius"]["mean"] for c in grid.summary["cells"]}
    assert got == ours
    assert all("paper" in c for c in grid.summary["cells"])


def test_another_grid_in_the_folder_is_refused(tmp_path, capsys):
    run_grid(Grid(**{**SMALL, "samples": 1}), out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="another grid.*contexts"):
        run_grid(Grid(**{**SMALL, "contexts": (64,), "samples": 1}), out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="another grid.*schedule"):
        run_grid(Grid(**{**SMALL, "schedule": "amla-sim-gpu", "samples": 1}), out_dir=tmp_path, progress=False)


def test_the_table_has_a_column_for_each_axis_the_grid_varies(clean):
    """Two machines, two distributions, two contexts: a column each; one heads value and one block: said once."""
    lines = clean["summary.md"].decode().splitlines()
    assert "; heads 4, s_q 1, block 64." in lines[2]
    assert lines[4] == "| machine | distribution | context | algorithm | n | mean | median | s.e. |"
    assert len(lines) == 6 + 2 * 2 * 2 * 2 and lines[6].startswith("| ieee32 | normal:1 | 64 | base | 3 |")


def test_another_metric_resummarises_the_same_rows(tmp_path, capsys):
    """Every metric is stored: --metric changes the table and the plot, not the folder's identity."""
    flags = ["sweep", *FLAGS, "--samples", "1", "--out", str(tmp_path)]
    assert main(flags) == 0
    rows = (tmp_path / "results.csv").read_bytes()
    assert main([*flags, "--metric", "rmse"]) == 0
    assert "0 new tasks" in capsys.readouterr().out
    assert (tmp_path / "results.csv").read_bytes() == rows
    assert "rmse" in (tmp_path / "summary.md").read_text().splitlines()[0]
    assert json.loads((tmp_path / "summary.json").read_text())["grid"]["metric"] == "rmse"


@pytest.mark.parametrize("argv, word", [
    (["--algorithms", "base,nope"], "algorithms"),
    (["--algorithms", "amla:colour=red"], "algorithms"),
    (["--algorithms", "snapmla:config=Z"], "algorithms"),
    (["--algorithms", "base", "--machines", "h800"], "machine"),
    (["--algorithms", "base", "--dists", "normal:-1"], "dist"),
    (["--algorithms", "base", "--dists", "cauchy"], "dist"),
    (["--algorithms", "base", "--contexts", "0"], "contexts"),
    (["--algorithms", "base", "--contexts", "64,,128"], "contexts"),
    (["--algorithms", "base,base"], "algorithms"),
    (["--algorithms", "base", "--scheduler", "carrier-pigeon"], "scheduler"),
    (["--contexts", "64"], "algorithms"),
])
def test_bad_grids_fail_before_any_work(tmp_path, capsys, argv, word):
    with pytest.raises(SystemExit) as e:
        main(["sweep", *argv, "--out", str(tmp_path / "o"), "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert word in err and "Traceback" not in err
    assert not (tmp_path / "o" / "results.csv").exists()


@pytest.mark.parametrize("text, word", [("algorithms = [\"base\"\n", "not valid TOML"),
                                         ("algorithms = [\"base\"]\ncolour = 3\n", "colour"),
                                         ("machines = [\"ieee32\"]\n", "algorithms"),
                                         ("algorithms = \"base\"\n", "algorithms")])
def test_bad_toml_names_the_problem(tmp_path, text, word):
    (tmp_path / "g.toml").write_text(text)
    with pytest.raises((ValueError, TypeError), match=word):
        load_grid(tmp_path / "g.toml")


# --- NaN and infinite metrics -----------------------------------------------------------------------------

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("values, want", [
    ([NAN, NAN], {"mean": NAN, "median": NAN, "sem": None, "nan": 2, "inf": 0}),
    ([1.0, NAN, 3.0], {"mean": 2.0, "median": 2.0, "sem": 1.0, "nan": 1, "inf": 0}),
    ([INF, 2.0, -INF], {"mean": 2.0, "median": 2.0, "sem": None, "nan": 0, "inf": 2}),
    ([1.5e308, 1.5e308], {"mean": 1.5e308, "median": 1.5e308, "sem": 0.0, "nan": 0, "inf": 0}),
    ([1.5e308, -1.5e308], {"mean": 0.0, "median": 0.0, "sem": INF, "nan": 0, "inf": 0}),
])
def test_sample_stats_are_over_the_finite_samples(values, want):
    assert {k: repr(v) for k, v in sample_stats(values).items()} == {k: repr(v) for k, v in want.items()}


@pytest.mark.parametrize("values, mean", [
    ([NAN, NAN, NAN], "nan (NaN in 3 of 3 samples)"),
    ([1e-3, INF, NAN], "1.0000e-03 (NaN in 1, inf in 1 of 3 samples)"),
    ([INF, INF, INF], "nan (inf in 3 of 3 samples)"),
])
def test_a_cell_with_nonfinite_samples_is_summarised_said_and_not_plotted(tmp_path, values, mean):
    """Such a cell is an entry of the summary and the table (which says so), and no point of the plot."""
    grid = Grid(algorithms=("base",), machines=("ieee32",), contexts=(64, 128), heads=(4,), samples=3)
    rows = [{"machine": "ieee32", "distribution": "normal:1", "context": c, "heads": 4, "sq": 1, "block": 64,
             "sample": s, "algorithm": "base", **dict.fromkeys(METRICS, v if c == 64 else 1e-3)}
            for c in (64, 128) for s, v in enumerate(values)]
    summary = summarize_grid(grid, rows)
    cell = summary["cells"][0]["rel_frobenius"]
    assert (cell["nan"], cell["inf"]) == (sum(map(math.isnan, values)), sum(map(math.isinf, values)))
    md = grid_markdown(summary)
    assert f"| 64 | base | 3 | {mean} |" in md and "| 128 | base | 3 | 1.0000e-03 |" in md
    assert md.rstrip().endswith("(nan where no sample is finite).")
    assert plot_grid(summary, tmp_path / "errors.png") and (tmp_path / "errors.png").stat().st_size > 0


def test_a_plot_of_nan_cells_alone_has_no_legend_and_no_warning(tmp_path):
    grid = Grid(algorithms=("base",), machines=("ieee32",), contexts=(64,), heads=(4,), samples=1)
    rows = [{"machine": "ieee32", "distribution": "normal:1", "context": 64, "heads": 4, "sq": 1, "block": 64,
             "sample": 0, "algorithm": "base", **dict.fromkeys(METRICS, NAN)}]
    assert plot_grid(summarize_grid(grid, rows), tmp_path / "errors.png")  # (a warning is an error here)


def test_a_sweep_with_nan_metrics_writes_its_files_and_resumes(tmp_path, capsys):
    """Naive softmax overflows on U(-60, 60): every sample's metrics are NaN, on the first run and the re-run."""
    argv = ["sweep", "--algorithms", "naive,base", "--machines", "ieee32", "--dists", "uniform:60", "--contexts",
            "64", "--heads", "4", "--samples", "2", "--quiet", "--out", str(tmp_path)]
    for new in (2, 0):
        assert main(argv) == 0
        assert f"{new} new tasks" in capsys.readouterr().out
        md = (tmp_path / "summary.md").read_text()
        assert "| naive | 2 | nan (NaN in 2 of 2 samples) | nan | - |" in md
        cells = {c["algorithm"]: c["rel_frobenius"] for c in json.loads((tmp_path / "summary.json").read_text())["cells"]}
        assert cells["naive"] == {"mean": "nan", "median": "nan", "sem": None, "nan": 2, "inf": 0}
        assert cells["base"]["nan"] == 0 and (tmp_path / "errors.png").exists()


# --- Dask ----------------------------------------------------------------------------------------------------

@needs_dask
def test_unreachable_scheduler_is_one_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(schedulers, "_CONNECT_TIMEOUT", "2s")
    with pytest.raises(SystemExit) as e:
        main(["sweep", *FLAGS, "--scheduler", "tcp://127.0.0.1:9", "--out", str(tmp_path)])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "no Dask scheduler answers at tcp://127.0.0.1:9" in err and "Traceback" not in err


@needs_dask
def test_dask_local_cluster_gives_the_same_files_and_resumes_across_schedulers(tmp_path, clean, capsys):
    out = tmp_path / "d"
    run_grid(Grid(**SMALL), out_dir=out, progress=False, max_tasks=7)  # started on the local scheduler ...
    lines = []
    res = run_grid(Grid(**SMALL), out_dir=out, progress=False, scheduler="dask", jobs=2, log=lines.append)
    assert res.computed == 24 - 7  # ... finished on Dask
    assert _files(out) == clean
    assert any("dashboard http" in line for line in lines)


def _kill_a_worker_once_rows_appear(csv: Path, stop: threading.Event, killed: list) -> None:
    import psutil

    while not stop.is_set():
        if csv.exists() and len(csv.read_bytes().splitlines()) > 1:
            workers = [p for p in psutil.Process().children(recursive=True)
                       if "spawn_main" in " ".join(p.cmdline())]  # not the resource tracker
            if workers:
                workers[0].kill()
                killed.append(workers[0].pid)
                return
        time.sleep(0.02)


@needs_dask
def test_a_killed_worker_loses_nothing(tmp_path):
    """A worker SIGKILLed mid-run: Dask retries its tasks, every row is written once, with the same bits."""
    grid = Grid(algorithms=("base", "amla"), machines=("ieee32",), distributions=("normal:1", "uniform:5"),
                contexts=(2048,), heads=(16,), blocks=(64,), samples=6)
    run_grid(grid, out_dir=tmp_path / "ref", progress=False)
    out = tmp_path / "k"
    stop, killed = threading.Event(), []
    t = threading.Thread(target=_kill_a_worker_once_rows_appear, args=(out / "results.csv", stop, killed))
    t.start()
    try:
        res = run_grid(grid, out_dir=out, progress=False, scheduler="dask", jobs=2, log=lambda s: None)
    finally:
        stop.set()
        t.join()
    assert killed, "no worker was killed: the test did not test anything"
    assert res.computed == 12
    assert _files(out) == _files(tmp_path / "ref")  # every row once, the same bits


@needs_dask
def test_sweep_cli_with_dask_prints_the_dashboard(tmp_path):
    r = subprocess.run([sys.executable, "-m", "amla_sim.cli", "sweep", *FLAGS, "--scheduler", "dask", "--jobs", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "dashboard http" in r.stderr
    assert "| ieee32 | normal:1 | 64 | base | 3 |" in r.stdout
