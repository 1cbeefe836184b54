"""FlashMLA-ETAP's two data races: which rows of a request they can change, checked against 30 runs of every case
and seed of the published build (H100 and H200), of the build with the epilogue's barrier only (H200: the
P^T race alone) and of the race-free build (the model's bits)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from amla_sim.cli import main
from amla_sim.crosscheck.flashmla import ETAP_CASES
from amla_sim.invariance import invariance
from amla_sim.invariance.races import ETAP_RACES, etap_race_exposure

DATA = Path(__file__).parent / "data"
BUILDS = {"published": DATA / "flashmla_etap_races.npz",
          "epilogue barrier only": DATA / "flashmla_etap_races_epilogue.npz"}


def _outcomes(build: str):
    """Every distinct output a build gave in 30 runs that differs from the race-free bits: (case, where)."""
    with np.load(BUILDS[build]) as z:
        meta = json.loads(str(z["meta"]))
        out = []
        for gpu, runs in meta["gpus"].items():
            for seed in runs["seeds"]:
                for case in meta["cases"]:
                    key = f"{gpu}_s{seed}_c{case}"
                    for j in range(len(z[f"{key}_out_count"])):
                        if z[f"{key}_out{j}_at"].size:
                            out.append((case, z[f"{key}_out{j}_at"]))
    return out


def _masks(case: int):
    _, sq, heads, seqlens, *_ = ETAP_CASES[case]
    exp = etap_race_exposure(seqlens, s_q=sq, heads=heads)
    return exp.mask(), exp.mask(first_read=True)


@pytest.mark.parametrize("s_q, heads, rows", [
    (1, 16, [(0, h) for h in range(8, 16)]),
    (2, 16, [(s, h) for s in (0, 1) for h in range(8, 16)]),
    (2, 24, [(0, h) for h in range(8, 16)] + [(1, h) for h in range(8)] + [(1, h) for h in range(16, 24)]),
    (1, 40, [(0, h) for h in (*range(8, 16), *range(24, 32))]),
    (1, 128, [(0, h) for h in range(128) if h % 16 >= 8]),
])
def test_the_rows_each_thread_stores_last_are_exposed(s_q, heads, rows):
    exp = etap_race_exposure([100, 5000], s_q=s_q, heads=heads)
    assert [e.rows for e in exp.requests] == [tuple(rows)] * 2
    assert len(rows) * 2 <= s_q * heads  # never more than half the rows


def test_tiles_follow_the_scheduler():
    exp = etap_race_exposure([16500, 129], s_q=2, heads=16)  # the capture's case 4: 86 splits, 2 m-blocks
    assert [(e.splits, e.tiles) for e in exp.requests] == [(86, 172), (1, 2)]
    assert [r.name for r in exp.races] == ["p-transpose", "epilogue"] and exp.races == ETAP_RACES


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_race_outcome_lies_in_the_exposed_rows(build):
    """Each distinct wrong output of a build changes only exposed elements, and always some of the columns read
    first (d_v 0-63, 256-319); most change nothing else."""
    outcomes = _outcomes(build)
    assert len(outcomes) >= 20, build  # the races happened, in both builds
    confined = 0
    for case, at in outcomes:
        exposed, first = _masks(case)
        assert exposed.ravel()[at].all(), (build, case)
        assert first.ravel()[at].any(), (build, case)
        confined += first.ravel()[at].all()
    assert confined >= 0.8 * len(outcomes), (build, confined, len(outcomes))


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_the_other_half_of_the_rows_would_be_refuted(build):
    """The choice of half matters: rows r mod 16 in 0..7 (the stores a thread makes first) hold none of the
    changes, so a claim that they are the exposed ones fails on every outcome."""
    for case, at in _outcomes(build):
        exposed, _ = _masks(case)
        assert not (~exposed).ravel()[at].any(), (build, case)


def test_the_p_transpose_race_alone_changes_bits():
    """With the epilogue's barrier in place the outputs still vary (the P^T race); with both synchronisations
    none do (the race-free build, tests of the kernel)."""
    with np.load(BUILDS["epilogue barrier only"]) as z:
        meta = json.loads(str(z["meta"]))
    runs = meta["gpus"]["h200"]
    assert meta["patch"] == "epilogue" and runs["repeats"] == 30
    raced = {(r["seed"], r["case"]) for r in runs["epilogue_fixed"] if len(r["distinct_out"]) > 1}
    assert raced and {c for _, c in raced} <= set(meta["cases"])
    assert all(r["distinct_lse"] == [30] for r in runs["epilogue_fixed"])


def test_invariance_reports_the_races_of_flashmla_etap_only():
    etap = invariance("flashmla-etap", length=512, heads=32, batchmates=(1,), mixed=None)
    assert etap.races["exposed_heads"] == [*range(8, 16), *range(24, 32)]
    assert etap.races["races"] == ["p-transpose", "epilogue"] and "run to run" in etap.format()
    assert etap.to_dict()["races"]["tiles"] == etap.races["tiles"] > 0
    dense = invariance("flashmla", length=512, heads=16, batchmates=(1,), mixed=None)
    assert dense.races == {} and "run to run" not in dense.format()


def test_the_command_prints_the_exposed_heads(capsys):
    code = main(["invariance", "--kernel", "flashmla-etap", "--length", "256", "--heads", "16", "--batchmates", "1",
                 "--mixed", "0"])
    assert code == 0
    assert "can change 8 of the row's 16 heads (8-15)" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, name", [
    ({"seqlens": []}, "seqlens"),
    ({"seqlens": [0, 5]}, "seqlens"),
    ({"seqlens": [5.0]}, "seqlens"),
    ({"seqlens": [5], "s_q": 0}, "s_q"),
    ({"seqlens": [5], "heads": True}, "heads"),
    ({"seqlens": [5], "heads": 128, "num_sms": 1}, "num_sms"),
    ({"seqlens": [5], "num_sms": 10**9}, "num_sms: 1000000000 SMs give 500000000 scheduler parts"),
    ({"seqlens": [5], "num_sms": 2**31}, "num_sms: expected an int in"),
    ({"seqlens": [5] * 65537}, "seqlens: a list of 1 to 65536"),
    ({"seqlens": [2**31]}, "seqlens"),
    ({"seqlens": [5], "heads": 10**10, "num_sms": 156250001}, "heads, s_q: the race exposure of 1 x 10000000000"),
])
def test_bad_input_is_refused_by_name(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=f"^{name}"):
        etap_race_exposure(**kwargs)
