"""The simulator against the H200's Triton kernels, replayed from committed captures (no GPU needed)."""

import json
from pathlib import Path

import numpy as np
import pytest

from amla_sim import compare
from amla_sim.cli import main
from amla_sim.crosscheck import CaptureError, replay
from amla_sim.crosscheck.own import load_capture, save_capture, save_inputs, simulate_stages
from amla_sim.experiments.inputs import make_inputs
from amla_sim.gpu import GPUUnavailable, gpu_status, require_gpu

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("mode", ["poly", "hw"])
@pytest.mark.parametrize("algorithm", ["base", "amla", "snapmla", "etap"])
def test_every_stage_bit_identical(algorithm, mode, engine):
    """poly: the kernels' software exp; hw: their tl.exp / tl.exp2 (MUFU.EX2) and '/' (div.full, MUFU.RCP)
    against the simulator's bit-exact models of those units. Nothing differs, stage by stage."""
    replayed = replay(DATA / f"crosscheck_{algorithm}_{mode}.npz")
    assert replayed.kernel == "amla-sim" and replayed.version == algorithm and len(replayed.cases) == 1
    report = replayed.cases[0]
    assert report.first_difference is None and report.bit_exact and replayed.bit_exact
    assert all(s.bit_exact == 1.0 for s in report.stages)
    names = {s.name for s in report.stages}
    assert {"S", "m", "P", "O", "out"} <= names and (algorithm != "amla" or {"n", "N"} <= names)
    unwritten = {"device_n", "device_N"} if algorithm == "base" else set()  # Base's kernel shares AMLA's buffers
    assert set(replayed.held_not_compared) == unwritten and all(f"{k}" in replayed.format() for k in unwritten)


@pytest.fixture(scope="module")
def fidelity():
    z = np.load(DATA / "fidelity_ci.npz")
    rows = {f"{r['algorithm']}/{r['exp_mode']}/sq{r['sq']}/L{r['context']}": r for r in json.loads(str(z["rows"]))}
    return z, rows


def test_fidelity_record_at_g128(fidelity):
    """72 device runs (4 kernels x 2 exp modes x 9 shapes, G = 128, contexts 1K-8K and 3000): every output bit."""
    _, rows = fidelity
    assert len(rows) == 72 and {r["exp_mode"] for r in rows.values()} == {"poly", "hw"}
    assert all(r["output_bit_exact"] == 1.0 for r in rows.values())


@pytest.mark.parametrize("key", ["base/poly/sq1/L1024", "amla/poly/sq1/L1024", "snapmla/poly/sq1/L1024",
                                 "etap/poly/sq1/L1024", "base/hw/sq1/L1024", "amla/hw/sq1/L1024",
                                 "snapmla/hw/sq1/L1024", "etap/hw/sq1/L1024"])
def test_fidelity_replay_g128(fidelity, key, fastest_engine):
    """On the fastest engine: each kernel's stages are replayed on both engines above."""
    z, rows = fidelity
    r = rows[key]
    q, kv = make_inputs("normal:1", heads=128, sq=r["sq"], context=r["context"], seed=r["seed"])
    sim = simulate_stages(r["algorithm"], q, kv, scale=None, exp_mode=r["exp_mode"])["out"]
    frac = compare(z[key].reshape(sim.shape), sim)["out"].bit_exact
    assert frac == r["output_bit_exact"] == 1.0  # the simulator is deterministic: the device run's number


def test_cli_replay_json(capsys):
    assert main(["crosscheck", "--replay", str(DATA / "crosscheck_amla_poly.npz"), "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["kernel"] == "amla-sim" and replayed["bit_exact"] is True and len(replayed["cases"]) == 1
    report = replayed["cases"][0]
    assert report["algorithm"] == "amla" and report["bit_exact"] is True and report["first_difference"] is None
    assert [s["name"] for s in report["stages"]] == ["S", "m", "P", "l", "n", "N", "O", "out"]
    assert all(s["bit_exact"] == 1.0 and s["max_ulp"] == 0 and s["nan_mismatch"] == 0 for s in report["stages"])


def _copy_shared(tmp_path, inputs=None):
    """The AMLA capture and its shared inputs file in a fresh folder (the inputs replaced by `inputs`)."""
    for name in ("crosscheck_amla_poly.npz", "crosscheck_inputs.npz"):
        (tmp_path / name).write_bytes((DATA / name).read_bytes())
    if inputs is not None:
        save_inputs(tmp_path / "crosscheck_inputs.npz", *inputs)
    return tmp_path / "crosscheck_amla_poly.npz"


def test_captures_share_their_inputs_by_digest(tmp_path):
    """The committed captures of one draw name one inputs file and its SHA-256; other inputs are refused."""
    meta, q, kv, device = load_capture(_copy_shared(tmp_path))
    assert meta["inputs"]["file"] == "crosscheck_inputs.npz" and q.shape == (1, 2, 32, 576)
    bits = q.view(np.uint16).copy()
    bits[0, 0, 0, 0] ^= 1  # one bit of q
    with pytest.raises(CaptureError, match="SHA-256"):
        load_capture(_copy_shared(tmp_path, (bits, kv.view(np.uint16))))
    (tmp_path / "crosscheck_inputs.npz").unlink()
    with pytest.raises(CaptureError, match="not a file"):
        load_capture(tmp_path / "crosscheck_amla_poly.npz")


def test_save_capture_with_shared_inputs_round_trips(tmp_path):
    meta, q, kv, device = load_capture(DATA / "crosscheck_base_hw.npz")
    save_inputs(tmp_path / "in.npz", q, kv)
    save_capture(tmp_path / "cap.npz", algorithm="base", q=q, kv=kv, scale=None, exp_mode="hw", div_mode="hw",
                 device_name="test", device=device, inputs="in.npz")
    with np.load(tmp_path / "cap.npz") as z:
        assert "q" not in z and "kv" not in z
    again = load_capture(tmp_path / "cap.npz")
    assert np.array_equal(again[1].view(np.uint16), q.view(np.uint16))
    assert all(np.array_equal(again[3][k], device[k]) for k in device)
    with pytest.raises(ValueError, match="inputs"):
        save_capture(tmp_path / "bad.npz", algorithm="base", q=q, kv=kv, scale=None, exp_mode="hw",
                     div_mode="hw", device_name="test", device=device, inputs="../in.npz")


@pytest.mark.skipif(gpu_status() is None, reason="a GPU is present")
def test_missing_gpu_is_a_clear_message(capsys):
    with pytest.raises(GPUUnavailable, match="GPU backend cannot run"):
        require_gpu()
    with pytest.raises(SystemExit) as e:
        main(["crosscheck", "--algorithm", "base"])
    assert e.value.code == 1 and "replay" in capsys.readouterr().err


@pytest.mark.skipif(gpu_status() is not None, reason="needs torch, triton and a CUDA device")
@pytest.mark.parametrize("mode, div", [("poly", "ieee"), ("hw", "hw")])
@pytest.mark.parametrize("algorithm", ["base", "amla", "snapmla", "etap"])
def test_kernel_matches_simulator_on_this_gpu(algorithm, mode, div):  # pragma: no cover - GPU only
    from amla_sim.crosscheck.own import device_run

    q, kv = make_inputs("normal:1", heads=64, sq=1, context=500, seed=9)
    dev = device_run(algorithm, q, kv, exp_mode=mode, div_mode=div)["out"]
    sim = simulate_stages(algorithm, q, kv, scale=None, exp_mode=mode)["out"]
    np.testing.assert_array_equal(dev.view(np.uint16), sim.view(np.uint16))


def test_replay_checks_the_kernel_and_cases_before_any_work():
    """One replay for every capture: a kernel or case the capture does not hold is refused, naming the argument."""
    own = DATA / "crosscheck_base_poly.npz"
    with pytest.raises(ValueError, match="--kernel: the capture holds amla-sim, not flashmla"):
        replay(own, kernel="flashmla")
    with pytest.raises(ValueError, match="cases"):
        replay(own, cases=[1])
    with pytest.raises(ValueError, match="--kernel: the capture holds sglang-triton, not flashmla-etap"):
        replay(DATA / "sglang_decode.npz", kernel="flashmla-etap")


def test_a_report_of_no_case_is_not_bit_exact():
    from amla_sim.crosscheck import ReplayReport

    assert not ReplayReport(kernel="k", version=None, device=None, cases=[], title="t").bit_exact


@pytest.mark.parametrize("kernel, words", [("flashmla", "source: flashmla"), ("flashmla-etap", "--etap-dir"),
                                           ("flashmla-sparse-fp8", "--flashmla-dir"), ("tri-dao", "kernel: expected")])
def test_capture_names_what_is_missing(kernel, words, tmp_path):
    """Before torch or a GPU is needed: an unknown kernel, or a kernel whose build folder is not named."""
    from amla_sim.crosscheck.deployed import capture

    with pytest.raises(ValueError, match=words):
        capture(kernel, tmp_path / "c.npz")
    assert not (tmp_path / "c.npz").exists()
