"""Nothing a capture holds goes uncompared unsaid: every reader refuses, by file, case and member, an array that
belongs to no case or to no stage, a capture of no case, and a damaged file; the CLI says so in one line, never a
traceback and never a pass. Each table row is a damage found by fuzzing the readers."""

from __future__ import annotations

import io
import json
import zipfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest

from amla_sim import compare
from amla_sim.cli import main
from amla_sim.crosscheck import CaptureError, ReplayReport, replay
from amla_sim.crosscheck.deployed import KERNELS, replay_deployed
from amla_sim.crosscheck.own import compare_stages
from amla_sim.testing import assert_bitwise_equal

DATA = Path(__file__).parent / "data"

#: One committed capture of every deployed kernel, and an array its cases hold.
CAPTURES = {"sglang-triton": ("sglang_decode.npz", "o"), "flashmla": ("flashmla_decode.npz", "out"),
            "flashmla-etap": ("flashmla_etap_decode.npz", "out"),
            "flashmla-sparse-fp8": ("flashmla_sparse_fp8_decode.npz", "out"), "fa3-mla": ("fa3_mla_h100.npz", "out"),
            "flashmla-dense-fp8": ("flashmla_dense_fp8_h100.npz", "out"),
            "vllm-triton-mla": ("vllm_triton_mla_h100.npz", "out")}


def _read(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(DATA / name) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(str(arrays.pop("meta"))), arrays


def _write(path: Path, meta: dict | None, arrays: dict[str, np.ndarray]) -> Path:
    np.savez(path, **({} if meta is None else {"meta": np.array(json.dumps(meta))}), **arrays)
    return path


def _exit(argv: list[str], capsys) -> tuple[int, str, str]:
    """main's exit status, stdout and stderr: never a traceback."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture
def no_work(monkeypatch):
    """Every deployed kernel's model replaced by one that fails the test: what is refused is refused before."""
    def boom(self, case, i, arrays):
        raise AssertionError("the model ran")

    for spec in KERNELS.values():
        monkeypatch.setattr(type(spec), "stages", boom)


# --- a deployed kernel's capture: an array of no case, or of no stage, is refused before any work ----------------


def _dropped_last_case(meta: dict, arrays: dict, member: str) -> None:
    """The meta without its last case, whose arrays stay in the file (one bit of `member` flipped)."""
    last = len(meta["cases"]) - 1
    meta["cases"].pop()
    arrays[f"c{last}_{member}"] = arrays[f"c{last}_{member}"] ^ arrays[f"c{last}_{member}"].dtype.type(1)


EXTRA = {  # name -> (edit of (meta, arrays, member), the words of the error)
    "case the meta drops": (_dropped_last_case, "belongs to case {last}, but 'meta' lists cases 0 to {before}"),
    "array of no case": (lambda m, a, k: a.update(notes=np.zeros(3)), "member 'notes' belongs to no case"),
    "leading zero": (lambda m, a, k: a.update(c00_out=a[f"c0_{k}"]), "member 'c00_out' belongs to no case"),
    "no array of its case": (lambda m, a, k: a.update(c0_extra=a[f"c0_{k}"]), "case 0: member 'c0_extra' is no array"),
}


@pytest.mark.parametrize("kernel", sorted(CAPTURES))
@pytest.mark.parametrize("damage", sorted(EXTRA))
def test_an_array_no_case_compares_is_refused_by_name(kernel, damage, tmp_path, no_work):
    name, member = CAPTURES[kernel]
    meta, arrays = _read(name)
    edit, words = EXTRA[damage]
    last = len(meta["cases"]) - 1
    edit(meta, arrays, member)
    path = _write(tmp_path / "c.npz", meta, arrays)
    with pytest.raises(CaptureError) as e:
        replay(path)
    assert str(path) in str(e.value) and words.format(last=last, before=last - 1) in str(e.value), str(e.value)


@pytest.mark.parametrize("cases, words", [([], "non-empty"), ([0, 0], "listed twice"), ([True], "expected an int"),
                                          ("0", "non-empty list")])
def test_a_selection_of_cases_is_checked_before_any_work(cases, words, no_work):
    meta, arrays = _read("sglang_decode.npz")
    with pytest.raises((ValueError, TypeError), match=words):
        replay_deployed(DATA / "sglang_decode.npz", meta, arrays, cases=cases)


RECIPES = {  # an edit of case 0's recipe -> the words of the error
    "scale past any float": ({"scale": 10**400}, "case 0: scale: expected a finite float32 number"),
    "no input CRC": ({"input_crc": None}, "case 0: 'input_crc' should be the CRC-32 of its inputs, got none"),
    "a CRC of 33 bits": ({"input_crc": 2**32}, "case 0: 'input_crc' should be the CRC-32"),
    "repeat_identical not a flag": ({"repeat_identical": "yes"}, "case 0: 'repeat_identical' should be true or false"),
    "repeat_identical 1": ({"repeat_identical": 1}, "case 0: 'repeat_identical' should be true or false, got 1"),
}


@pytest.mark.parametrize("damage", sorted(RECIPES))
def test_what_a_case_records_of_its_run_is_checked(damage, tmp_path, capsys, no_work):
    edit, words = RECIPES[damage]
    meta, arrays = _read("fa3_mla_h100.npz")
    meta["cases"][0].update(edit)
    path = _write(tmp_path / "c.npz", meta, arrays)
    code, _, err = _exit(["crosscheck", "--replay", str(path)], capsys)
    assert code == 1 and words in err and str(path) in err and len(err.strip().splitlines()) == 1, err


def _stages_reading(*names: str):
    """A model whose stages are the device's own arrays `names` (it reads nothing else)."""
    def stages(self, case, i, arrays):
        return [(n, arrays[f"c{i}_{n}"], arrays[f"c{i}_{n}"]) for n in names]

    return stages


def test_a_declared_array_no_stage_read_is_not_compared_and_not_bit_exact(monkeypatch):
    spec = KERNELS["sglang-triton"]
    monkeypatch.setattr(type(spec), "stages", _stages_reading("lse", "o"))
    meta, arrays = _read("sglang_decode.npz")
    report = replay_deployed("c.npz", meta, arrays, cases=[2])  # the case that keeps its partial results, mid
    assert not report.bit_exact
    assert report.cases[0].not_compared == {"c2_mid": "held, but no stage of the model read it"}
    monkeypatch.setattr(type(spec), "stages", _stages_reading("mid", "lse", "o"))
    assert replay_deployed("c.npz", meta, arrays, cases=[2]).bit_exact


def test_the_report_says_what_was_held_and_not_compared(monkeypatch):
    """FlashMLA's captures keep the kernel's schedule, which no stage compares: listed, with the cases left out."""
    spec = KERNELS["flashmla-etap"]
    monkeypatch.setattr(type(spec), "stages", _stages_reading("lse", "out"))
    meta, arrays = _read("flashmla_etap_decode.npz")
    report = replay_deployed("c.npz", meta, arrays, cases=[1])
    assert report.bit_exact and report.not_replayed == (0, *range(2, len(meta["cases"])))
    assert set(report.held_not_compared) == {"c1_sched", "c1_num_splits"}
    text = report.format()
    assert "held, not compared (the kernel's split schedule" in text and "c1_sched, c1_num_splits" in text
    assert "cases not replayed (not asked for): 0, 2" in text
    assert report.to_dict()["held_not_compared"].keys() == {"c1_sched", "c1_num_splits"}


@pytest.mark.parametrize("damage, words", [
    ({"c0_sched": np.zeros((3, 5), np.float32)}, "c0_sched should be int32"),
    ({"c0_splits": np.zeros(1, np.int32)}, "member 'c0_splits' is no array of a flashmla-etap case"),
])
def test_a_held_array_is_checked_too(damage, words, tmp_path, no_work):
    meta, arrays = _read("flashmla_etap_decode.npz")
    with pytest.raises(CaptureError, match=words):
        replay(_write(tmp_path / "c.npz", meta, {**arrays, **damage}))


@pytest.mark.parametrize("error, words", [(ValueError("causal: expected True"), "case 0: causal: expected True"),
                                          (KeyError("dist"), "case 0: its recipe has no 'dist'"),
                                          (CaptureError("replay: the inputs do not rebuild"),
                                           "case 0: the inputs do not rebuild")])
def test_a_recipe_the_model_refuses_names_the_file_and_case(error, words, monkeypatch):
    def stages(self, case, i, arrays):
        raise error

    monkeypatch.setattr(type(KERNELS["fa3-mla"]), "stages", stages)
    meta, arrays = _read("fa3_mla_h100.npz")
    with pytest.raises(CaptureError) as e:
        replay_deployed("c.npz", meta, arrays, cases=[0])
    assert str(e.value) == f"replay: c.npz: {words}"


# --- this project's kernels -------------------------------------------------------------------------------------


def _own(tmp_path: Path, edit) -> Path:
    (tmp_path / "crosscheck_inputs.npz").write_bytes((DATA / "crosscheck_inputs.npz").read_bytes())
    meta, arrays = _read("crosscheck_base_poly.npz")
    edit(meta, arrays)
    return _write(tmp_path / "c.npz", meta, arrays)


OWN = {
    "array of no stage": (lambda m, a: a.update(notes=np.zeros(3)), "member 'notes' is not an array of the capture"),
    "another algorithm's stage written": (lambda m, a: a.update(device_N=a["device_N"] + 1),
                                          "device_N holds data, but base has no stage N"),
    "inputs twice": (lambda m, a: a.update(q=np.zeros((1, 2, 32, 576), np.uint16)), "holds q and names an inputs file"),
    "algorithm a list": (lambda m, a: m.update(algorithm=["base"]), "algorithm ['base'] is not one of"),
    "exp mode a list": (lambda m, a: m.update(exp_mode=["hw"]), "exp_mode ['hw'] is not one of"),
    "scale past float": (lambda m, a: m.update(scale=10**400), "is not a positive FP32 number"),
}


@pytest.mark.parametrize("damage", sorted(OWN))
def test_own_capture_member_of_no_stage_is_refused(damage, tmp_path, capsys):
    edit, words = OWN[damage]
    path = _own(tmp_path, edit)
    code, _, err = _exit(["crosscheck", "--replay", str(path)], capsys)
    assert code == 1 and words in err and str(path) in err and len(err.strip().splitlines()) == 1, err


def test_own_inputs_file_holds_nothing_but_the_inputs(tmp_path):
    path = _own(tmp_path, lambda m, a: None)
    z = dict(np.load(tmp_path / "crosscheck_inputs.npz"))
    np.savez(tmp_path / "crosscheck_inputs.npz", **z, extra=np.zeros(2))
    with pytest.raises(CaptureError, match="member 'extra' is not an input"):
        replay(path)


def test_a_stage_the_device_did_not_dump_is_not_compared():
    a = np.zeros((1, 1, 4), np.float32)
    report = compare_stages("amla", {"m": a, "out": a}, {"m": a, "out": a, "S": a})
    assert not report.bit_exact and report.first_difference is None
    assert report.not_compared == {n: "the device dumped no such stage" for n in ("S", "P", "l", "n", "N", "O")}
    with pytest.raises(ValueError, match="no stage of base"):
        compare_stages("base", {}, {"m": a})


# --- any capture file: one-line errors naming the file and the member --------------------------------------------


def _zip(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members:
            with pytest.warns(UserWarning, match="Duplicate") if name in z.namelist() else nullcontext():
                z.writestr(name, data)
    return path


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(a))
    return buf.getvalue()


META = json.dumps({"kernel": "sglang-triton", "cases": [{"batch": 1}]})
FILES = {  # name -> (members, the words of the error)
    "member twice": ([("meta.npy", _npy(META)), ("c0_o.npy", _npy([1])), ("c0_o.npy", _npy([2]))],
                     "member 'c0_o.npy' is in the file twice"),
    "meta twice": ([("meta.npy", _npy(META)), ("meta.npy", _npy("{}"))], "member 'meta.npy' is in the file twice"),
    "meta NaN": ([("meta.npy", _npy(META.replace('"batch": 1', '"batch": NaN')))],
                 "'meta' holds NaN at cases[0].batch, which is not JSON"),
    "meta Infinity": ([("meta.npy", _npy('{"scale": -Infinity}'))], "'meta' holds -Infinity at scale"),
    "meta key twice": ([("meta.npy", _npy('{"cases": [], "cases": [{"batch": 1}]}'))], "'meta' names 'cases' twice"),
    "meta not a string": ([("meta.npy", _npy(np.arange(3)))], "'meta' should be one JSON string, got int64 (3,)"),
    "meta a list of strings": ([("meta.npy", _npy([META]))], "'meta' should be one JSON string"),
    "meta nested past the stack": ([("meta.npy", _npy("[" * 100000 + "]" * 100000))], "'meta' is not a JSON object"),
    "three-byte words": ([("meta.npy", _npy(META)), ("c0_o.npy", _npy(np.zeros(2, "V3")))],
                         "member 'c0_o.npy' holds |V3 records"),
    "records": ([("meta.npy", _npy(META)), ("c0_o.npy", _npy(np.zeros(2, [("x", "<f4"), ("y", "<i4")])))],
                "member 'c0_o.npy' holds [('x', '<f4'), ('y', '<i4')] records"),
}


@pytest.mark.parametrize("damage", sorted(FILES))
@pytest.mark.parametrize("command", ["crosscheck", "compare"])
def test_a_damaged_file_is_one_line_naming_file_and_member(damage, command, tmp_path, capsys):
    members, words = FILES[damage]
    path = _zip(tmp_path / "c.npz", members)
    argv = ["crosscheck", "--replay", str(path)] if command == "crosscheck" else ["compare", str(path), str(path)]
    code, _, err = _exit(argv, capsys)
    assert code == 1 and words in err and str(path) in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("meta, words", [
    ({"kernel": "sglang-triton"}, "'meta' has no list of cases (got None)"),
    ({"kernel": "sglang-triton", "cases": []}, "'meta' has no list of cases (an empty one: a replay of nothing"),
    ({"kernel": "sglang-triton", "cases": {"0": {}}}, "'meta' has no list of cases (got a JSON object of 1)"),
    ({"kernel": "sglang-triton", "cases": [5]}, "case 0 is not a JSON object (got 5)"),
    ({"kernel": ["sglang-triton"], "cases": [{}]}, "'meta' names no kernel of"),
])
def test_a_capture_of_no_case_is_never_a_pass(meta, words, tmp_path, capsys):
    path = _write(tmp_path / "c.npz", meta, {})
    code, out, err = _exit(["crosscheck", "--replay", str(path)], capsys)
    assert code == 1 and words in err and str(path) in err and not out, err


def test_split_cases_hands_out_arrays_by_case():
    from amla_sim.crosscheck.files import case_arrays, split_cases

    a = np.zeros(2, np.float32)
    meta = {"cases": [{}, {}]}
    assert split_cases("f", meta, {"c0_x": a, "c1_x": a, "c1_y_z": a}) == [{"x": a}, {"x": a, "y_z": a}]
    with pytest.raises(CaptureError, match="case 1 has no member 'c1_y'"):
        case_arrays("f", meta, {"c0_x": a, "c0_y": a, "c1_x": a}, {"x": np.float32, "y": np.float32})
    with pytest.raises(CaptureError, match=r"case 0: member 'c0_x' should have shape \(3,\) for its recipe"):
        case_arrays("f", meta, {"c0_x": a, "c1_x": a}, {"x": np.float32}, shapes=lambda c: {"x": (3,)})
    with pytest.raises(CaptureError, match="case 0: its recipe has no 'n'"):
        case_arrays("f", meta, {"c0_x": a, "c1_x": a}, {"x": np.float32}, shapes=lambda c: {"x": (c["n"],)})


# --- compare: what was compared, what was not ---------------------------------------------------------------------


def test_compare_of_an_empty_side_is_an_error_naming_both_files(tmp_path, capsys):
    dev, sim = tmp_path / "d.npz", tmp_path / "s.npz"
    np.savez(dev)
    np.savez(sim, out=np.ones(4, np.float32))
    code, _, err = _exit(["compare", str(dev), str(sim)], capsys)
    assert code == 2 and f"device {dev} against simulated {sim}: device: no stage at all" in err
    np.savez(dev, out=np.ones(5, np.float32))
    code, _, err = _exit(["compare", str(dev), str(sim)], capsys)
    assert code == 2 and f"device {dev} against simulated {sim}: stage 'out': device has shape (5,)" in err
    with pytest.raises(ValueError, match="^device: no stage at all"):
        compare({}, {"out": np.ones(1)})


def test_compare_lists_the_stages_left_out_of_a_selection(tmp_path, capsys):
    a = np.ones(4, np.float32)
    r = compare({"S": a, "out": a}, {"S": a, "out": a, "P": a}, stages=["out"])
    assert r.bit_exact and r.not_selected == ("S", "P") and "not selected, so not compared: S, P" in r.format()
    assert r.to_dict()["not_selected"] == ["S", "P"]


def test_a_replay_report_of_no_case_says_so():
    report = ReplayReport(kernel="k", version=None, device=None, cases=[], title="t")
    assert not report.bit_exact and "no case replayed: not bit-exact" in report.format()


# --- testing helpers: comparing nothing is not a pass ----------------------------------------------------------


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0, 2)])
def test_assert_bitwise_equal_of_no_element_compares_nothing(shape):
    empty = np.zeros(shape, np.float32)
    with pytest.raises(AssertionError, match="nothing compared"):
        assert_bitwise_equal(empty, empty)
    assert_bitwise_equal(empty, empty, allow_empty=True)


@pytest.mark.parametrize("name, case, member", [
    ("flashinfer_mla_h100.npz", 0, "work"),  # FlashInfer's staged work lists, read back for every case
    ("flashinfer_mla_sparse_h100.npz", 1, "work"),
    ("fa3_mla_sparse_h100.npz", 0, "splits"),  # FA3's split counts, where the scheduler metadata holds them
    ("fa3_mla_h100.npz", 3, "splits"),
])
def test_a_readback_the_capture_lacks_is_not_compared_exit_4(name, case, member, tmp_path, capsys):
    """A case whose device exposes an array (the plan's work lists, FA3's split counts) but whose file lacks it
    replays as not compared: not bit-exact, exit 4, the member named."""
    meta, arrays = _read(name)
    assert replay_deployed(name, meta, arrays, cases=[case]).bit_exact
    del arrays[f"c{case}_{member}"]
    report = replay_deployed(name, meta, arrays, cases=[case])
    assert not report.bit_exact and report.cases[0].first_difference is None
    assert f"c{case}_{member}" in report.cases[0].not_compared
    one = {f"c0_{k.split('_', 1)[1]}": v for k, v in arrays.items() if k.startswith(f"c{case}_")}  # that case alone
    code, out, _ = _exit(["crosscheck", "--replay", str(_write(tmp_path / name, {**meta, "cases": [
        meta["cases"][case]]}, one))], capsys)
    assert code == 4 and f"c0_{member}" in out and "not in the capture" in out, out


@pytest.mark.parametrize("name, case", [("fa3_mla_h100.npz", 4), ("fa3_mla_h100.npz", 6),
                                        ("fa3_mla_sparse_h100.npz", 3), ("fa3_mla_sparse_h100.npz", 4)])
def test_a_case_whose_device_exposes_no_split_count_replays_whole(name, case):
    """The unpaged call, num_splits = 1 and a launch of more than 992 requests give no split counts to read back:
    their replay is complete without them."""
    meta, arrays = _read(name)
    assert f"c{case}_splits" not in arrays and replay_deployed(name, meta, arrays, cases=[case]).bit_exact
