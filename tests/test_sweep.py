"""Reproduction sweeps: the public summary, resumption after an interruption, and independence from --jobs."""

import json
import math

import pytest

from amla_sim.cli import main
from amla_sim.experiments.sweep import plot_table, run_table, summarize_table, table_markdown
from amla_sim.experiments.tables import TABLE_METRICS, TABLES

SMALL = dict(samples=2, context=256, heads=8, progress=False)


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".csv", ".json", ".md", ".png")}


def test_outputs_and_public_summary(tmp_path):
    res = run_table("amla-table3", out_dir=tmp_path, **SMALL)
    out = tmp_path / "amla-table3"
    assert (out / "results.csv").read_text().count("\n") == 1 + 6 * 2 * 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] and all({"distribution", "algorithm", "ours", "paper"} <= set(r) for r in summary["rows"])
    first = summary["rows"][0]
    assert first["distribution"] == "N(0, 1)" and first["algorithm"] == "base" and first["paper"] == 1.77e-3
    assert "ours / paper" in (out / "table.md").read_text()
    assert res.computed == 12


def test_interrupted_run_resumes_to_identical_files(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_table("amla-table4", out_dir=whole, **SMALL)
    run_table("amla-table4", out_dir=cut, max_tasks=5, **SMALL)  # "killed" after 5 samples
    csv = cut / "amla-table4" / "results.csv"
    with open(csv, "a") as f:
        f.write("uniform:3,1,base,0.0012")  # a torn line from the append in flight
    with pytest.warns(UserWarning, match="last line was torn"):
        res = run_table("amla-table4", out_dir=cut, **SMALL)
    assert (cut / "amla-table4" / "results.rejected").read_text() == "uniform:3,1,base,0.0012\n"
    assert res.computed == 12 - 5
    assert _files(whole / "amla-table4") == _files(cut / "amla-table4")
    again = run_table("amla-table4", out_dir=cut, **SMALL)
    assert again.computed == 0


def test_a_column_added_to_a_table_is_computed_alone(tmp_path, monkeypatch):
    """A table that gains a column resumes by computing that column alone, on each task's own draw: the old rows
    stay as they were and the files equal a whole run of the wider table."""
    from dataclasses import replace

    from amla_sim.experiments import sweep, tables

    run_table("amla-table4", out_dir=tmp_path / "cut", **SMALL)
    before = (tmp_path / "cut" / "amla-table4" / "results.csv").read_text().splitlines()
    wider = replace(TABLES["amla-table4"], algorithms=("base", "amla", "naive"))
    monkeypatch.setitem(sweep.TABLES, "amla-table4", wider)
    monkeypatch.setitem(tables.SPECS, "naive", "naive")
    from amla_sim.algorithms import ALGORITHMS

    runs = []  # the columns run on a task's draw (not the tiny problem each column is tried on first)

    def spy(name):
        def run(q, kv, **kw):
            if kv.shape[1] == SMALL["context"]:
                runs.append(name)
            return real(q, kv, **kw)
        real = ALGORITHMS[name]
        return run

    for name in ("base", "amla", "naive"):
        monkeypatch.setitem(ALGORITHMS, name, spy(name))
    res = run_table("amla-table4", out_dir=tmp_path / "cut", **SMALL)
    assert res.computed == 12 and runs == ["naive"] * 12
    after = (tmp_path / "cut" / "amla-table4" / "results.csv").read_text().splitlines()
    assert set(before) <= set(after) and len(after) == 1 + 6 * 2 * 3
    run_table("amla-table4", out_dir=tmp_path / "whole", **SMALL)
    assert _files(tmp_path / "whole" / "amla-table4") == _files(tmp_path / "cut" / "amla-table4")
    assert run_table("amla-table4", out_dir=tmp_path / "cut", **SMALL).computed == 0


def test_jobs_do_not_change_results(tmp_path):
    run_table("snapmla-configs", out_dir=tmp_path / "one", jobs=1, **SMALL)
    run_table("snapmla-configs", out_dir=tmp_path / "two", jobs=2, **SMALL)
    a, b = _files(tmp_path / "one" / "snapmla-configs"), _files(tmp_path / "two" / "snapmla-configs")
    assert a["results.csv"] == b["results.csv"] and a["summary.json"] == b["summary.json"]


def test_other_settings_in_the_same_folder_are_refused(tmp_path):
    run_table("amla-table3", out_dir=tmp_path, max_tasks=1, **SMALL)
    with pytest.raises(ValueError, match="out"):
        run_table("amla-table3", out_dir=tmp_path, samples=2, context=512, heads=8, progress=False)


def test_another_schedule_in_the_same_folder_is_refused(tmp_path):
    """A folder's rows are of one kernel schedule: resuming it with another is refused, naming the schedule."""
    run_table("amla-table3", out_dir=tmp_path, max_tasks=1, **SMALL)
    with pytest.raises(ValueError, match="differs in schedule"):
        run_table("amla-table3", out_dir=tmp_path, max_tasks=1, schedule="amla-sim-gpu", **SMALL)
    with pytest.raises(ValueError, match="schedule: unknown schedule 'triton'"):
        run_table("amla-table3", out_dir=tmp_path / "new", schedule="triton", **SMALL)
    assert not (tmp_path / "new").exists()


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(ValueError, match="table"):
        run_table("table9", out_dir=tmp_path)
    with pytest.raises(SystemExit):
        main(["reproduce", "amla-table3", "--samples", "0", "--out", str(tmp_path)])
    assert "samples" in capsys.readouterr().err


def test_etap_table_small(tmp_path):
    res = run_table("etap-table1", out_dir=tmp_path, samples=1, context=512, heads=4, progress=False)
    rows = {r["algorithm"]: r for r in res.summary["rows"]}
    assert rows["etap"]["paper"] == 1.25e-5 and rows["fa3-base"]["paper"] == 1.9e-4
    assert 0 < rows["etap"]["ours"] < 1e-2


NAN, INF = math.nan, math.inf


def _summary(name, values):
    """A table's summary of synthetic samples: the first distribution's `values` (each metric), 1e-3 elsewhere."""
    table = TABLES[name]
    first = table.distributions[0][0]
    tasks = {(d, s): [{"distribution": d, "sample": s, "algorithm": a,
                       **dict.fromkeys(TABLE_METRICS, v if d == first else 1e-3)} for a in table.algorithms]
             for d, _ in table.distributions for s, v in enumerate(values)}
    return summarize_table(table, tasks, samples=len(values), context=64, heads=4, machine="ieee32", seed=0)


@pytest.mark.parametrize("name, values, ours, worst", [
    ("amla-table3", [NAN, NAN], "| N(0, 1) | base | nan (NaN in 2 of 2 samples) | - |", 0),
    ("amla-table3", [2e-3, NAN, 1e-3], "| N(0, 1) | base | 1.500e-03 (NaN in 1 of 3 samples) | 5.0e-04 |", 1),
    ("amla-table3", [INF, 1e-3], "| N(0, 1) | base | 1.000e-03 (inf in 1 of 2 samples) | - |", 0),
    ("snapmla-configs", [NAN, INF, 1e-3],
     "| FlashMLA test inputs | snapmla | " + " | ".join(["1.000e-03 (NaN in 1, inf in 1 of 3 samples)"] * 3) + " |", 0),
])
def test_a_table_cell_with_nonfinite_samples_is_summarised_said_and_not_plotted(tmp_path, name, values, ours, worst):
    """The table's metric over the finite samples, the NaN and inf counts, the worst sample (a NaN first), a note
    in the Markdown table, and a plot without that point."""
    summary = _summary(name, values)
    row = summary["rows"][0]
    assert (row["nan"], row["inf"], row["samples"]) == (sum(map(math.isnan, values)), sum(map(math.isinf, values)),
                                                        len(values))
    assert row["worst_sample"] == worst
    md = table_markdown(summary)
    assert ours in md and md.rstrip().endswith("(nan where no sample is finite).")
    assert plot_table(summary, tmp_path / "table.png") and (tmp_path / "table.png").stat().st_size > 0


@pytest.mark.parametrize("name", ["amla-table3", "snapmla-configs"])
def test_a_plot_of_nan_rows_alone_has_no_legend_and_no_warning(tmp_path, name):
    summary = _summary(name, [NAN])
    summary["rows"] = summary["rows"][:1]
    assert plot_table(summary, tmp_path / "table.png")  # (a warning is an error here)


def test_a_plot_of_more_columns_than_colours_tells_each_apart(tmp_path, monkeypatch):
    """The low-precision cache table has more columns than matplotlib's 10 colours: each its own colour and
    marker, every point within 0.4 of its distribution's tick (no overlap with the next one's)."""
    import amla_sim.plots as plots

    figs = []
    monkeypatch.setattr(plots, "save_png", lambda fig, path: figs.append(fig))
    summary = _summary("fp8-mla", [1e-3, 2e-3])
    assert len(TABLES["fp8-mla"].algorithms) > 10 and plot_table(summary, tmp_path / "table.png")
    ax = figs[0].axes[0]
    points = {c.get_label(): c.lines[0] for c in ax.containers}  # each column's errorbar: its points' line
    assert sorted(points) == sorted(TABLES["fp8-mla"].algorithms)
    assert len({(p.get_color(), p.get_marker()) for p in points.values()}) == len(points)
    xs = [x for p in points.values() for x in p.get_xdata()]
    assert max(abs(x - round(x)) for x in xs) <= 0.4


def test_reproduce_with_a_nan_column_writes_its_files_and_resumes(tmp_path, capsys):
    """Naive softmax overflows on U(-60, 60): a column of NaN, on the first run and the re-run."""
    argv = ["reproduce", "amla-table4", "--algorithms", "naive", "--machine", "ieee32", "--samples", "2",
            "--context", "64", "--heads", "4", "--quiet", "--out", str(tmp_path)]
    for _ in range(2):
        assert main(argv) == 0
        assert "| U(-60, 60) | naive | nan (NaN in 2 of 2 samples) |" in capsys.readouterr().out
        rows = {(r["distribution"], r["algorithm"]): r
                for r in json.loads((tmp_path / "amla-table4" / "summary.json").read_text())["rows"]}
        assert rows[("U(-60, 60)", "naive")]["ours"] == "nan" and rows[("U(-60, 60)", "naive")]["nan"] == 2
        assert (tmp_path / "amla-table4" / "table.png").exists()
