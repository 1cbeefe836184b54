"""Algorithms defined outside the package: import paths and entry points in run, sweep (local and Dask) and
reproduce; broken plugins as one clear error (issue 22)."""

from __future__ import annotations

import importlib
import json
import os
import sys

import numpy as np
import pytest

from amla_sim.cli import main
from amla_sim.experiments.grid import Grid, run_grid
from amla_sim.experiments.specs import parse_algorithm
from amla_sim.experiments.sweep import run_table
from amla_sim.plugins import PluginError, algorithm_names, get_algorithm

PLUGIN = '''
"""A user's algorithm: Base over the KV blocks last to first (ETAP's order), and broken ones."""
import numpy as np
from amla_sim.algorithms import base


def backward(q, kv, *, machine="ieee32", schedule="reference", block=64, scale=None, trace=False, halves=1):
    assert halves in (1, 2)
    return base(q, kv, machine=machine, schedule=schedule, block=block, scale=scale, trace=trace, order="backward")


def takes_anything(q, kv, **options):
    return base(q, kv, **{k: v for k, v in options.items() if k != "colour"})


def wrong_return(q, kv, *, machine="ieee32", schedule="reference", block=64, scale=None, trace=False):
    return np.zeros(3)


def raises(q, kv, *, machine="ieee32", schedule="reference", block=64, scale=None, trace=False):
    raise RuntimeError("boom")


def no_contract(q, kv):
    return base(q, kv)


NOT_CALLABLE = 3
'''
ENTRY_POINTS = """[amla_sim.algorithms]
backward-base = amla_user_plugin:backward
broken = amla_user_plugin_missing:fn
"""
SMALL = {"machines": ("ieee32",), "distributions": ("normal:1",), "contexts": (96,), "heads": (4,), "samples": 2}


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin module and a distribution declaring its entry points, importable here and in workers."""
    (tmp_path / "amla_user_plugin.py").write_text(PLUGIN)
    (tmp_path / "amla_user_broken.py").write_text("raise ImportError('a missing dependency')\n")
    dist = tmp_path / "amla_user_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: amla-user-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    importlib.invalidate_caches()
    yield tmp_path
    for name in ("amla_user_plugin", "amla_user_broken"):
        sys.modules.pop(name, None)


def test_specs_with_import_paths(plugin):
    assert parse_algorithm("amla_user_plugin:backward") == ("backward", "amla_user_plugin:backward", {})
    assert parse_algorithm("mine=amla_user_plugin:backward:halves=2") == ("mine", "amla_user_plugin:backward",
                                                                       {"halves": 2})
    assert parse_algorithm("x=amla_user_plugin:takes_anything:colour=red")[2] == {"colour": "red"}
    assert parse_algorithm("A=snapmla:config=A") == ("A", "snapmla", {"config": "A"})  # built-ins as before
    with pytest.raises(ValueError, match="option 'colour=red' is not key=value with a key of amla_user_plugin"):
        parse_algorithm("mine=amla_user_plugin:backward:colour=red")
    with pytest.raises(ValueError, match="option 'block=3'"):  # the sweep's own keywords are not options
        parse_algorithm("mine=amla_user_plugin:backward:block=3")


def test_entry_points_are_found_by_name(plugin):
    assert algorithm_names()["backward-base"] == "entry point amla_user_plugin:backward"
    assert get_algorithm("backward-base") is get_algorithm("amla_user_plugin:backward")
    assert parse_algorithm("backward-base") == ("backward-base", "backward-base", {})


@pytest.mark.parametrize(("spec", "match"), [
    ("amla_user_broken:fn", "cannot import 'amla_user_broken' .ImportError: a missing dependency.[^;]*$"),
    ("amla_user_nowhere:fn", "cannot import 'amla_user_nowhere' .ModuleNotFoundError.*PYTHONPATH=. amla-sim"),
    ("amla_user_plugin:nothing", "'amla_user_plugin' has no attribute 'nothing'"),
    ("amla_user_plugin:NOT_CALLABLE", "is a int, not a callable"),
    ("amla_user_plugin:no_contract", "takes no keyword 'machine', 'schedule', 'block', 'scale', 'trace'"),
    ("broken", r"algorithm 'broken' \(entry point amla_user_plugin_missing:fn\): cannot import"),
    ("nonesuch", "unknown algorithm 'nonesuch'; expected one of .*'backward-base'"),
])
def test_a_plugin_that_cannot_load_is_one_error_naming_it(plugin, spec, match):
    with pytest.raises(PluginError, match=match):
        parse_algorithm(spec)


@pytest.mark.parametrize(("spec", "match"), [
    ("amla_user_plugin:wrong_return", "'amla_user_plugin:wrong_return' returned a ndarray, not an AttentionResult"),
    ("amla_user_plugin:raises", "'amla_user_plugin:raises' raised RuntimeError: boom"),
])
def test_a_plugin_that_fails_on_the_tiny_problem_stops_the_sweep_before_any_work(plugin, tmp_path, capsys, spec,
                                                                                 match):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--algorithms", f"base,{spec}", "--machines", "ieee32", "--contexts", "64", "--heads", "4",
              "--samples", "1", "--quiet", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "a tiny problem" in err and "Traceback" not in err
    assert __import__("re").search(match, err)
    assert not (tmp_path / "out" / "results.csv").exists()


def _by_label(summary):
    return {c["algorithm"]: c["rel_frobenius"]["mean"] for c in summary["cells"]}


@pytest.mark.parametrize(("scheduler", "jobs"), [("local", 1), ("local", 2),
                                                 pytest.param("dask", 2, marks=pytest.mark.skipif(
                                                     importlib.util.find_spec("distributed") is None,
                                                     reason="Dask is not installed"))])
def test_sweep_runs_a_plugin_like_the_built_in_it_equals(plugin, tmp_path, scheduler, jobs):
    """The plugin is Base run backward: its numbers are the built-in spec base:order=backward's, on any scheduler
    (workers import it from PYTHONPATH)."""
    grid = Grid(algorithms=("ref=base:order=backward", "mine=amla_user_plugin:backward", "backward-base", "base"), **SMALL)
    res = run_grid(grid, out_dir=tmp_path / scheduler, progress=False, scheduler=scheduler, jobs=jobs,
                   log=lambda s: None)
    got = _by_label(res.summary)
    assert got["mine"] == got["ref"] == got["backward-base"] != got["base"]


def test_reproduce_adds_plugin_columns_on_the_papers_draws(plugin, tmp_path, capsys):
    res = run_table("amla-table3", out_dir=tmp_path, samples=2, context=384, heads=4, progress=False,
                    algorithms=("ref=base:order=backward", "mine=amla_user_plugin:backward"))
    rows = {(r["distribution"], r["algorithm"]): r for r in res.summary["rows"]}
    assert {a for _, a in rows} == {"base", "amla", "ref", "mine"}
    for d in {d for d, _ in rows}:
        assert rows[(d, "mine")]["ours"] == rows[(d, "ref")]["ours"] != rows[(d, "base")]["ours"]
    plain = run_table("amla-table3", out_dir=tmp_path / "plain", samples=2, context=384, heads=4, progress=False)
    assert all(rows[(r["distribution"], r["algorithm"])]["ours"] == r["ours"] for r in plain.summary["rows"])
    with pytest.raises(ValueError, match="labelled 'amla', a column the table has"):
        run_table("amla-table3", out_dir=tmp_path, samples=1, algorithms=("amla=amla_user_plugin:backward",))
    with pytest.raises(PluginError, match="raised RuntimeError: boom"):
        run_table("amla-table3", out_dir=tmp_path / "x", samples=1, algorithms=("amla_user_plugin:raises",))
    assert not (tmp_path / "x").exists()
    assert main(["reproduce", "amla-table3", "--samples", "1", "--context", "128", "--heads", "4", "--quiet",
                 "--algorithms", "mine=amla_user_plugin:backward", "--out", str(tmp_path / "cli")]) == 0
    assert "| N(0, 1) | mine |" in capsys.readouterr().out


def test_run_takes_a_plugin_with_options(plugin, capsys):
    args = ["run", "--machine", "ieee32", "--heads", "4", "--context", "96", "--json"]
    assert main(args + ["--algorithm", "amla_user_plugin:backward:halves=2"]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert main(args + ["--algorithm", "base:order=backward"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert mine["rmse"] == ref["rmse"] and mine["options"] == {"halves": 2}
    with pytest.raises(SystemExit) as e:
        main(args + ["--algorithm", "amla_user_plugin:wrong_return"])
    assert e.value.code == 2 and "returned a ndarray, not an AttentionResult" in capsys.readouterr().err


def test_a_plugin_returning_the_wrong_shape_is_named(plugin):
    from amla_sim.plugins import call_algorithm
    from amla_sim.algorithms import AttentionResult

    q = np.zeros((1, 1, 4, 576), np.float32)
    kv = np.zeros((1, 8, 576), np.float32)
    bad = lambda q, kv, **kw: AttentionResult(out=np.zeros((1, 4, 512)), lse=np.zeros(1))  # noqa: E731
    with pytest.raises(PluginError, match=r"'mine' returned out of dtype float64 and shape \(1, 4, 512\)"):
        call_algorithm("mine", bad, q, kv)


def test_plugin_docs_example_is_this_contract():
    """The contract the plugins module documents is the keywords every built-in takes."""
    import inspect

    from amla_sim.algorithms import ALGORITHMS
    from amla_sim.plugins import CONTRACT

    for name, fn in ALGORITHMS.items():
        params = inspect.signature(fn).parameters
        assert all(k in params for k in CONTRACT), name
