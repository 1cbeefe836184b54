"""Odd values given to sweep, reproduce, run, pipeline, roofline and compare: each is one line of error naming the
flag (exit 2), before any work, never a traceback, a hang or memory past the machine's."""

from __future__ import annotations

import socket
import time

import pytest

from amla_sim.cli import main
from amla_sim.experiments import grid as grid_module
from amla_sim.experiments import sweep as sweep_module
from amla_sim.experiments.schedulers import check_run
from amla_sim.pipeline import construct_cycle, simulate

SWEEP = ["sweep", "--algorithms", "base", "--machines", "ieee32", "--dists", "normal:1", "--contexts", "64",
         "--heads", "4", "--samples", "1", "--quiet"]
TABLE = ["reproduce", "amla-table3", "--samples", "1", "--context", "64", "--heads", "4", "--quiet"]
PIPELINE = ["pipeline", "--cube", "3,2,4", "--vector", "1,5,2"]
LAYER = ["sweep", "--reference", "layer", "--algorithms", "vllm-prefill", "--machines", "sm90-cuda", "--contexts", "8",
         "--heads", "1", "--samples", "1", "--quiet"]


@pytest.fixture
def no_work(monkeypatch):
    """1 GiB of memory, and no sample may run: a refusal must come before any work."""
    def refuse(*args, **kwargs):
        raise AssertionError("a sample ran: the input was not refused before any work")

    monkeypatch.setattr(grid_module, "available_bytes", lambda: 1 << 30, raising=False)
    monkeypatch.setattr(grid_module, "execute", refuse)
    monkeypatch.setattr(sweep_module, "execute", refuse)


def _error(argv, capsys, code=2) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (SWEEP + ["--samples", "1000000"], "sweep: 1000000 result rows need about 2.9 GiB of memory and 1.0 GiB is "
                                       "available; lower samples"),
    (SWEEP + ["--contexts", "1000000"], "sweep: 1 sample(s) at once of heads 4, s_q 1, context 1000000 need about"),
    (SWEEP + ["--contexts", "99999999999999999999999"], "lower contexts, heads, sq or jobs"),
    (SWEEP + ["--machines", "nope"], "error: machines: unknown machine 'nope'"),
    (SWEEP + ["--algorithms", "amla:scaling=pre:scaling=post"], "option scaling is given twice"),
    (SWEEP + ["--out", ""], "error: --out: expected a folder, got ''"),
    (["sweep", "--grid", ""], "error: --grid: expected a TOML file or a table name, got ''"),
    (TABLE + ["--samples", "100000"], "table amla-table3: 1200000 result rows need about"),
    (TABLE + ["--context", "1000000"], "lower context, heads or jobs"),
    (TABLE + ["--heads", "99999999999999999999999"], "lower context, heads or jobs"),
    (TABLE + ["--algorithms", "x=amla:scaling=pre:scaling=post"], "option scaling is given twice"),
    (["reproduce", "all,all"], "error: table: 'all' (every table) stands alone, got 'all,all'"),
    (TABLE + ["--out", ""], "error: --out: expected a folder, got ''"),
    (LAYER + ["--contexts", "60000", "--heads", "128"], "sweep: 1 sample(s) at once of heads 128, s_q 1, context "
                                                        "60000 need about"),
    (LAYER + ["--reference", "golden"], "error: algorithms: ['vllm-prefill'] measure the MLA layer"),
    (LAYER + ["--machines", "ieee32"], "error: machines: a layer grid's kernels run on their own machines"),
    (LAYER + ["--algorithms", "sglang-prefill:deterministic=true"], "error: algorithms: "
                                                                    "'sglang-prefill:deterministic=true': "
                                                                    "deterministic: SGLang's deterministic mode"),
], ids=["sweep-samples", "sweep-context", "sweep-context-huge", "sweep-machine", "sweep-option-twice",
        "sweep-out-empty", "sweep-grid-empty", "table-samples", "table-context", "table-heads-huge", "table-option-twice", "table-all-all",
        "table-out-empty", "layer-memory", "layer-golden", "layer-machine", "layer-sglang-deterministic-mha"])
def test_sweep_and_reproduce_refuse_before_any_work(tmp_path, capsys, no_work, argv, message):
    argv = argv if "--out" in argv else [*argv, "--out", str(tmp_path / "out")]
    assert message in _error(argv, capsys)


def test_a_table_name_is_a_table_beside_a_folder_of_that_name(tmp_path, capsys, monkeypatch, no_work):
    """reproduce's folder of a table (``--out .``) does not hide the table from ``sweep --grid``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "amla-table3").mkdir()
    message = "sweep: 1 sample(s) at once of heads 128, s_q 1, context 100000 need about"
    assert message in _error(["sweep", "--grid", "amla-table3", "--contexts", "100000", "--out", "o"], capsys)


@pytest.mark.parametrize("paper, message", [
    ("3", "paper: expected a table of \"distribution/algorithm\" = value, got 3"),
    ('{"a" = 1.0}', "paper: expected keys like \"normal:1/amla\", got 'a'"),
    ('{"normal:1/base" = "x"}', "paper: 'normal:1/base': expected a positive finite number, got 'x'"),
    ('{"normal:1/base" = nan}', "paper: 'normal:1/base': expected a positive finite number, got nan"),
])
def test_a_grid_files_published_values_are_checked(tmp_path, capsys, no_work, paper, message):
    (tmp_path / "g.toml").write_text(f'algorithms = ["base"]\nmachines = ["ieee32"]\ncontexts = [64]\nheads = [4]\n'
                                     f'samples = 1\npaper = {paper}\n')
    assert message in _error(["sweep", "--grid", str(tmp_path / "g.toml"), "--out", str(tmp_path / "o")], capsys)


@pytest.mark.parametrize("argv, message", [
    (["pipeline", "--cube", "1,,2", "--vector", "1,2"], "error: --cube: expected comma-separated numbers such as "
                                                        "3,2,4, got '1,,2'"),
    (["pipeline", "--cube", "3,2,4", "--vector", ""], "error: --vector: expected comma-separated numbers"),
    (["pipeline", "--cube", "1,2", "--vector", "1"], "error: --cube and --vector: one duration per CV pair"),
    (["pipeline", "--cube", "nan", "--vector", "1"], "error: --cube: durations must be finite and non-negative"),
    (["pipeline", "--cube=1e306,1", "--vector=1,1e306", "--cycles", "1000"],
     "error: --cube and --vector: 1000 iterations of these durations overflow a float"),
    (PIPELINE + ["--plot", "."], "error: --plot: . is a folder; name a file in it"),
    (PIPELINE + ["--plot", ""], "error: --plot: expected a file name, got ''"),
    (PIPELINE + ["--plot", "chart.txt"], "error: --plot: expected a file name ending in .png, got 'chart.txt'"),
    (PIPELINE + ["--plot", "chart"], "error: --plot: expected a file name ending in .png, got 'chart'"),
    (PIPELINE + ["--plot", "sock.png"], "error: --plot: sock.png is not a regular file"),
    (PIPELINE + ["--cycles", "1000", "--plot", "g.png"], "error: --plot: a Gantt chart of at most 600 stages"),
    (["roofline", "--peak", "1e308", "--bandwidth", "1e-300"], "error: --peak and --bandwidth: their ratio"),
    (["roofline", "--peak", "1e-300", "--bandwidth", "1e300"], "error: --peak and --bandwidth: their ratio"),
    (["run", "--algorithm", "amla", "--max-memory", "1e308"], "error: --max-memory: expected fewer than"),
    (["run", "--algorithm", "nope"], "error: --algorithm: 'nope': algorithm: unknown algorithm 'nope'"),
    (["run", "--algorithm", "amla:scaling=pre:scaling=post"], "error: --algorithm: 'amla:scaling=pre:scaling=post': "
                                                              "option scaling is given twice"),
    (["compare", "", "b.npz"], "error: device: expected a .npz file, got ''"),
    (["compare", "a.npz", "b.npz", "--format", "out=nope"], "error: argument --format: stage out: unknown format "
                                                            "'nope'"),
], ids=["pipeline-empty-item", "pipeline-empty", "pipeline-lengths", "pipeline-nan", "pipeline-overflow",
        "plot-folder", "plot-empty", "plot-suffix", "plot-no-suffix", "plot-socket", "plot-too-many", "roofline-inf",
        "roofline-zero", "run-max-memory", "run-algorithm", "run-option-twice", "compare-empty", "compare-format"])
def test_other_commands_name_the_flag(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    with socket.socket(socket.AF_UNIX) as s:  # a file that is not a regular one
        s.bind("sock.png")
        assert message in _error(argv, capsys)
    assert not (tmp_path / "chart.txt").exists() and not (tmp_path / "g.png").exists()
    assert not (tmp_path / "chart.png").exists()


@pytest.mark.parametrize("scheduler", ["local", "dask"])
def test_jobs_are_capped_at_the_cpus_here(scheduler):
    """A LocalCluster's workers are processes of this machine, as the local scheduler's are."""
    with pytest.warns(UserWarning, match="CPU"):
        assert check_run(scheduler, 10**9, "numpy") < 10**9


def test_roofline_prints_a_huge_threshold_in_few_digits(capsys):
    assert main(["roofline", "--peak", "1e308"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "h_q s_q >= 1.49e+307" in last and len(last) < 200


def test_the_pipeline_of_many_pairs_is_linear_in_them():
    """Each stage's place in its unit's order is looked up, not searched for (40,000 pairs: 0.5 s, not 25 s)."""
    n = 40_000
    cube, vector = [1.0] * n, [2.0] * n
    t0 = time.process_time()
    tl = simulate(cube, vector, construct_cycle(cube, vector), iterations=1)
    assert time.process_time() - t0 < 8 and len(tl.intervals) == 2 * n
