"""The simulator against the H200's Triton kernels, replayed from committed captures (no GPU needed)."""

import json
from pathlib import Path

import numpy as np
import pytest

from amla_sim.cli import main
from amla_sim.crosscheck import replay, simulate
from amla_sim.experiments.inputs import make_inputs
from amla_sim.gpu import GPUUnavailable, gpu_status, require_gpu

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("algorithm", ["base", "amla", "snapmla", "etap"])
def test_exact_mode_every_stage_bit_identical(algorithm):
    report = replay(DATA / f"crosscheck_{algorithm}_poly.npz")
    assert report["first_difference"] is None
    assert all(r["bit_exact"] == 1.0 for r in report["stages"])
    names = {r["name"] for r in report["stages"]}
    assert {"S", "m", "P", "O", "out"} <= names and (algorithm != "amla" or {"n", "N"} <= names)


@pytest.mark.parametrize("algorithm", ["base", "etap"])
def test_hardware_exp_mode_every_stage_bit_identical(algorithm):
    """The kernels' own tl.exp / tl.exp2 (MUFU.EX2) against the bit-exact ex2.approx model: nothing differs."""
    report = replay(DATA / f"crosscheck_{algorithm}_hw.npz")
    assert report["first_difference"] is None
    assert all(r["bit_exact"] == 1.0 for r in report["stages"])


def test_hardware_exp_mode_amla_differs_only_from_division():
    """AMLA's exponentials are bit-exact; its N (a division by div.full, modelled to 87.7%) is the first stage
    that differs, and the output is bit-identical all the same."""
    report = replay(DATA / "crosscheck_amla_hw.npz")
    stages = {r["name"]: r for r in report["stages"]}
    assert all(stages[k]["bit_exact"] == 1.0 for k in ("S", "m", "P", "l", "n", "out"))
    assert report["first_difference"] == "N" and "division" in report["responsible"]
    assert 0.9 < stages["N"]["bit_exact"] < 1.0


def test_snapmla_hardware_mode_first_difference_is_the_row_sum():
    """S, m and P are bit-exact; l = l alpha + sum P differs (row-sum order in the wgmma layout)."""
    report = replay(DATA / "crosscheck_snapmla_hw.npz")
    stages = {r["name"]: r for r in report["stages"]}
    assert all(stages[k]["bit_exact"] == 1.0 for k in ("S", "m", "P"))
    assert report["first_difference"] == "l" and stages["out"]["bit_exact"] > 0.999


@pytest.fixture(scope="module")
def fidelity():
    z = np.load(DATA / "fidelity_ci.npz")
    rows = {f"{r['algorithm']}/{r['exp_mode']}/sq{r['sq']}/L{r['context']}": r for r in json.loads(str(z["rows"]))}
    return z, rows


def test_fidelity_record_at_g128(fidelity):
    _, rows = fidelity
    exact = [r for r in rows.values() if r["exp_mode"] == "poly"]
    assert len(exact) == 36 and all(r["output_bit_exact"] == 1.0 for r in exact)
    # recorded on the device against the simulator of that day (ex2.approx then modelled as correctly rounded)
    assert all(0.997 < r["output_bit_exact"] < 1.0 for r in rows.values() if r["exp_mode"] == "hw")


@pytest.mark.parametrize(
    "key", ["base/poly/sq1/L1024", "amla/poly/sq1/L1024", "amla/hw/sq1/L1024", "snapmla/poly/sq1/L1024",
            "etap/poly/sq1/L1024"]
)
def test_fidelity_replay_g128(fidelity, key):
    z, rows = fidelity
    r = rows[key]
    q, kv = make_inputs("normal:1", heads=128, sq=r["sq"], context=r["context"], seed=r["seed"])
    sim = simulate(r["algorithm"], q, kv, scale=None, exp_mode=r["exp_mode"])["out"]
    frac = float(np.mean(sim.view(np.uint16) == z[key].reshape(sim.shape)))
    if r["exp_mode"] == "poly":
        assert frac == r["output_bit_exact"] == 1.0  # the simulator is deterministic: the device run's number
    else:  # recorded with ex2.approx modelled as correctly rounded: 3 outputs of 32768 differed, now 2 (div.full)
        assert r["output_bit_exact"] == 1 - 3 / 32768 and frac == 1 - 2 / 32768


def test_cli_replay_json(capsys):
    assert main(["crosscheck", "--replay", str(DATA / "crosscheck_amla_poly.npz"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["algorithm"] == "amla" and report["output_bit_exact"] == 1.0
    assert all({"name", "bit_exact", "max_ulp"} <= set(s) for s in report["stages"])


@pytest.mark.skipif(gpu_status() is None, reason="a GPU is present")
def test_missing_gpu_is_a_clear_message(capsys):
    with pytest.raises(GPUUnavailable, match="GPU backend cannot run"):
        require_gpu()
    with pytest.raises(SystemExit) as e:
        main(["crosscheck", "--algorithm", "base"])
    assert e.value.code == 2 and "replay" in capsys.readouterr().err


@pytest.mark.skipif(gpu_status() is not None, reason="needs torch, triton and a CUDA device")
@pytest.mark.parametrize("algorithm", ["base", "amla", "snapmla", "etap"])
def test_kernel_matches_simulator_on_this_gpu(algorithm):  # pragma: no cover - GPU only
    from amla_sim.gpu.run import run_kernel

    q, kv = make_inputs("normal:1", heads=64, sq=1, context=500, seed=9)
    dev = run_kernel(algorithm, q, kv, exp_mode="poly", div_mode="ieee")["out"]
    sim = simulate(algorithm, q, kv, scale=None, exp_mode="poly")["out"]
    np.testing.assert_array_equal(dev.view(np.uint16), sim.view(np.uint16))
