"""The tutorial's own kernel (examples/split_fp16, not part of the package): its model replays the H100 capture
bit for bit on both engines, each of its choices is visible in the bits, and it sweeps through the plugin path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from conftest import FASTEST

from amla_sim.crosscheck.files import read_capture
from amla_sim.engine import use_engine
from amla_sim.experiments.grid import Grid, run_grid

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "split_fp16"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")]))
    import replay
    import split_fp16

    yield replay, split_fp16
    for name in ("replay", "split_fp16"):
        sys.modules.pop(name, None)


# every case on the fastest engine; on NumPy too, the two cheapest (a batch of two in 1,000 tokens, and the case
# whose second split has no block)
@pytest.mark.parametrize(("engine", "cases"), [("numpy", [1, 3]), (FASTEST, None)], ids=["numpy-cases1-3", FASTEST])
def test_the_capture_replays_bit_for_bit(example, engine, cases):
    replay, _ = example
    with use_engine(engine):
        reports = replay.replay(EXAMPLE / "capture.npz", cases=cases)
    cases = cases or list(range(5))
    assert len(reports) == len(cases) and {r.meta["device"] for r in reports} == {"NVIDIA H100 80GB HBM3"}
    for r in reports:
        assert r.bit_exact and [s.name for s in r.stages] == ["m", "l", "O", "out"], str(r)
    assert reports[cases.index(3)].meta["context"] == 64  # one block: the second split had nothing to do
    assert np.isneginf(replay.read_capture(EXAMPLE / "capture.npz")[1]["c3_m"][1]).all()


@pytest.mark.parametrize(("change", "stage"), [
    ({"p_format": "bf16"}, "O"),  # P (and V) rounded to BF16, as Base does: the kernel's FP16 shows in O
    ({"machine": "sm90-triton-exact"}, "l"),  # a correctly rounded exp instead of tl.exp's ex2.approx
    ({"schedule": "reference"}, "l"),  # P summed in NumPy's order, not the wgmma accumulator layout
])
def test_each_choice_of_the_model_matters(example, monkeypatch, change, stage):
    replay, split_fp16 = example
    kwargs = dict(change)
    if kwargs.pop("p_format", None):
        from amla_sim.machines import Machine

        cast = Machine.cast
        monkeypatch.setattr(Machine, "cast", lambda self, x, fmt, **kw: cast(self, x, "bf16" if fmt == "fp16" else fmt,
                                                                            **kw))
    model = partial(split_fp16.split_fp16, **kwargs)
    firsts = [r.first_difference for r in replay.replay(EXAMPLE / "capture.npz", cases=[1, 3], model=model)]
    assert stage in firsts and all(f in (None, stage) for f in firsts), firsts


def test_the_replay_script_says_so_in_its_exit_status(tmp_path):
    """``python examples/split_fp16/replay.py CAPTURE`` as the tutorial runs it (on the capture's smallest case,
    alone and with one bit of its output flipped): exit status 0 when every bit agrees, 3 when one does not, 1
    and one line naming the file for a capture of no case."""
    for name, flip in (("same", 0), ("flipped", 1)):
        path = _one_case(tmp_path / f"{name}.npz", lambda m, a, f=flip: a.update(c0_out=a["c0_out"] ^ np.uint16(f)))
        r = subprocess.run([sys.executable, str(EXAMPLE / "replay.py"), str(path)], capture_output=True, text=True,
                           check=False, timeout=300)
        assert r.returncode == 3 * flip, r.stderr[-2000:]
        assert f"{1 - flip} of 1 cases bit-identical in every stage" in r.stdout
    path = _one_case(tmp_path / "none.npz", lambda m, a: (m.update(cases=[]), a.clear()))
    r = subprocess.run([sys.executable, str(EXAMPLE / "replay.py"), str(path)], capture_output=True, text=True,
                       check=False, timeout=300)
    assert r.returncode == 1 and not r.stdout and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith(f"replay.py: error: replay: {path}: 'meta' has no list of cases")


def _one_case(path, edit=lambda meta, arrays: None):
    """The capture's smallest case as case 0 of a capture of its own, `edit(meta, arrays)` applied."""
    meta, arrays = read_capture(EXAMPLE / "capture.npz")
    meta = {**meta, "cases": [dict(meta["cases"][3])]}
    arrays = {f"c0_{k}": arrays[f"c3_{k}"] for k in ("m", "l", "O", "out")}
    edit(meta, arrays)
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


REFUSED = {  # what a capture holds -> (edit of (meta, arrays), the words of the error)
    "no case": (lambda m, a: m.update(cases=[]), "'meta' has no list of cases (an empty one"),
    "a case the meta lacks": (lambda m, a: a.update(c1_out=a["c0_out"] ^ np.uint16(1)),
                              "member 'c1_out' belongs to case 1, but 'meta' lists"),
    "an array of no case": (lambda m, a: a.update(notes=np.zeros(2)), "member 'notes' belongs to no case"),
    "an array of no stage": (lambda m, a: a.update(c0_P=a["c0_m"]), "case 0: member 'c0_P' is not one of its stages"),
    "a stage missing": (lambda m, a: a.pop("c0_l"), "case 0 has no member 'c0_l'"),
    "a stage in FP64": (lambda m, a: a.update(c0_l=a["c0_l"].astype(np.float64)),
                        "case 0: member 'c0_l' should be float32"),
    "a stage flattened": (lambda m, a: a.update(c0_l=a["c0_l"].ravel()),
                          "case 0: member 'c0_l' should have shape (2, 3, 16)"),
    "a recipe without heads": (lambda m, a: m["cases"][0].pop("heads"), "case 0: its recipe has no 'heads'"),
    "other inputs": (lambda m, a: m["cases"][0].update(seed=99), "case 0: its recipe draws other inputs"),
    "a distribution that is no name": (lambda m, a: m["cases"][0].update(dist=5), "case 0: its recipe draws no inputs"),
    "a context past memory": (lambda m, a: m["cases"][0].update(context=10**12), "case 0: its recipe draws no inputs"),
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_the_replay_script_refuses_what_it_would_not_compare(example, tmp_path, what):
    """Before any work, by file, case and member: a capture of no case, an array of no case or of no stage, a
    stage missing or of another dtype or shape than its recipe says; and inputs its recipe does not rebuild."""
    from amla_sim.crosscheck import CaptureError

    replay, _ = example
    edit, words = REFUSED[what]
    path = _one_case(tmp_path / "c.npz", edit)
    with pytest.raises(CaptureError) as e:
        replay.replay(path)
    assert str(path) in str(e.value) and words in str(e.value), str(e.value)


def test_the_plugin_sweeps_beside_base(example, tmp_path):
    """The tutorial's sweep: the plugin through an import path, on the machine its model is written for."""
    grid = Grid(algorithms=("base", "mine=split_fp16:split_fp16"), machines=("sm90-triton",),
                distributions=("normal:1",), contexts=(256,), heads=(64,), schedule="amla-sim-gpu", samples=2)
    res = run_grid(grid, out_dir=tmp_path, progress=False, jobs=2)
    cells = {c["algorithm"]: c for c in res.summary["cells"]}
    assert cells["mine"]["n"] == cells["base"]["n"] == 2
    assert cells["mine"]["rmse"]["mean"] != cells["base"]["rmse"]["mean"]
