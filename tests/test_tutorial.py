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

from amla_sim.crosscheck.files import read_capture
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


def test_the_capture_replays_bit_for_bit(example, engine):
    replay, _ = example
    reports = replay.replay(EXAMPLE / "capture.npz")
    assert len(reports) == 5 and {r.meta["device"] for r in reports} == {"NVIDIA H100 80GB HBM3"}
    for r in reports:
        assert r.bit_exact and [s.name for s in r.stages] == ["m", "l", "O", "out"], str(r)
    assert reports[3].meta["context"] == 64  # one block: the second split had nothing to do
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
    alone and with one bit of its output flipped): exit status 0 when every bit agrees, 3 when one does not."""
    meta, arrays = read_capture(EXAMPLE / "capture.npz")
    one = {f"c0_{k}": arrays[f"c3_{k}"] for k in ("m", "l", "O", "out")}
    for name, flip in (("same", 0), ("flipped", 1)):
        path = tmp_path / f"{name}.npz"
        np.savez(path, meta=np.array(json.dumps({**meta, "cases": [meta["cases"][3]]})),
                 **{**one, "c0_out": one["c0_out"] ^ np.uint16(flip)})
        r = subprocess.run([sys.executable, str(EXAMPLE / "replay.py"), str(path)], capture_output=True, text=True,
                           check=False, timeout=300)
        assert r.returncode == 3 * flip, r.stderr[-2000:]
        assert f"{1 - flip} of 1 cases bit-identical in every stage" in r.stdout


def test_the_plugin_sweeps_beside_base(example, tmp_path):
    """The tutorial's sweep: the plugin through an import path, on the machine its model is written for."""
    grid = Grid(algorithms=("base", "mine=split_fp16:split_fp16"), machines=("sm90-triton",),
                distributions=("normal:1",), contexts=(256,), heads=(64,), schedule="amla-sim-gpu", samples=2)
    res = run_grid(grid, out_dir=tmp_path, progress=False, jobs=2)
    cells = {c["algorithm"]: c for c in res.summary["cells"]}
    assert cells["mine"]["n"] == cells["base"]["n"] == 2
    assert cells["mine"]["rmse"]["mean"] != cells["base"]["rmse"]["mean"]
