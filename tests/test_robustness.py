"""Nothing false, nothing silent: careless and hostile inputs get a clear error or the right answer, never a pass
for what was not compared, a hang or a traceback (docs/usage.md, "Robustness")."""

from __future__ import annotations

import json
import shutil
import sys
import warnings
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from amla_sim import compare
from amla_sim.cli import main

DATA = Path(__file__).parent / "data"
SWEEP = ["sweep", "--algorithms", "base", "--machines", "ieee32", "--contexts", "32", "--heads", "4",
         "--samples", "3", "--quiet"]

CARELESS = '''
"""Plugins that do what they should not."""
import numpy as np
from collections import Counter
from amla_sim.algorithms import AttentionResult, base


def doubles_q_in_place(q, kv, *, machine="ieee32", schedule="reference", block=64, scale=None, trace=False):
    q *= 2
    return base(q, kv, machine=machine, schedule=schedule, block=block, scale=scale)


def exits(q, kv, *, machine="ieee32", schedule="reference", block=64, scale=None, trace=False):
    raise SystemExit(0)


def half_d_v(q, kv, *, machine="ieee32", schedule="reference", block=64, scale=None, trace=False):
    res = base(q, kv, machine=machine, schedule=schedule, block=block, scale=scale)
    return AttentionResult(res.out[..., :256], res.lse)


def hazards_as_a_list(q, kv, *, machine="ieee32", schedule="reference", block=64, scale=None, trace=False):
    res = base(q, kv, machine=machine, schedule=schedule, block=block, scale=scale)
    return AttentionResult(res.out, res.lse, hazards=["overflow"])


def talks(q, kv, *, machine="ieee32", schedule="reference", block=64, scale=None, trace=False):
    print("hello from the plugin")
    return base(q, kv, machine=machine, schedule=schedule, block=block, scale=scale)
'''


@pytest.fixture
def careless(tmp_path, monkeypatch):
    (tmp_path / "amla_careless.py").write_text(CARELESS)
    (tmp_path / "amla_exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "amla_parses_argv.py").write_text(
        "import argparse\nargparse.ArgumentParser().parse_args()\ndef f(q, kv, **kw):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["amla-sim", "sweep", "--quiet"])  # what a plugin's own parser would see
    yield
    for m in ("amla_careless", "amla_exits_on_import", "amla_parses_argv"):
        sys.modules.pop(m, None)


def _exit(argv, capsys) -> tuple[int, str, str]:
    """main's exit status, stdout and stderr."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# --- stores: --repair -----------------------------------------------------------------------------------------


def test_repair_flag_repairs_a_damaged_store(tmp_path, capsys):
    out = tmp_path / "r"
    assert _exit([*SWEEP, "--out", str(out)], capsys)[0] == 0
    clean = (out / "results.csv").read_bytes()
    lines = clean.decode().splitlines(keepends=True)
    lines[2] = lines[2].replace("0.00", "0.01", 1)  # a hand edit: the checksum no longer holds
    assert lines[2].encode() not in clean
    (out / "results.csv").write_text("".join(lines))
    code, _, err = _exit([*SWEEP, "--out", str(out)], capsys)
    assert code == 1 and "line 3 fails its checksum" in err and "--repair" in err
    code, _, err = _exit([*SWEEP, "--out", str(out), "--repair"], capsys)
    assert code == 0 and "repaired: 2 valid rows kept, 1 lines set aside" in err
    assert (out / "results.rejected").read_text() == lines[2]
    assert (out / "results.csv").read_bytes() == clean  # the damaged task ran again: the same row


def test_repair_flag_converts_a_store_written_before_checksums(tmp_path, capsys):
    out = tmp_path / "r"
    assert _exit([*SWEEP, "--out", str(out)], capsys)[0] == 0
    clean = (out / "results.csv").read_bytes()
    legacy = b"".join(line.rsplit(b",", 1)[0] + b"\n" for line in clean.splitlines())  # no crc32 column
    (out / "results.csv").write_bytes(legacy)
    code, _, err = _exit([*SWEEP, "--out", str(out)], capsys)
    assert code == 1 and "without row checksums" in err and "--repair" in err
    code, _, err = _exit([*SWEEP, "--out", str(out), "--repair"], capsys)
    assert code == 0 and "3 valid rows kept, 0 lines set aside" in err
    assert (out / "results.csv").read_bytes() == clean


def test_store_with_crlf_line_ends_is_read(tmp_path, capsys):
    out = tmp_path / "r"
    assert _exit([*SWEEP, "--out", str(out)], capsys)[0] == 0
    clean = (out / "results.csv").read_bytes()
    (out / "results.csv").write_bytes(clean.replace(b"\n", b"\r\n"))
    code, out_text, _ = _exit([*SWEEP, "--out", str(out)], capsys)
    assert code == 0 and "0 new tasks" in out_text


def test_grid_label_with_a_line_break_is_refused_before_any_work(tmp_path, capsys):
    grid = tmp_path / "g.toml"
    grid.write_text('algorithms = ["a\\nb=base"]\nmachines = ["ieee32"]\ncontexts = [32]\nheads = [4]\n')
    code, _, err = _exit(["sweep", "--grid", str(grid), "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "no line break" in err and not (tmp_path / "r").exists()


def test_reproduce_all_checks_every_table_before_any_work(tmp_path, capsys):
    code, _, err = _exit(["reproduce", "all", "--heads", "4", "--samples", "1", "--context", "64", "--quiet",
                          "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "table fp8-mla" in err
    assert not (tmp_path / "r").exists()


# --- plugins ------------------------------------------------------------------------------------------------


def test_plugin_writing_into_q_is_refused_and_changes_no_other_row(careless, tmp_path, capsys):
    code, _, err = _exit(["sweep", "--algorithms", "base,amla_careless:doubles_q_in_place", "--machines", "ieee32",
                          "--contexts", "32", "--heads", "4", "--samples", "1", "--quiet", "--out",
                          str(tmp_path / "r")], capsys)
    assert code == 2 and "doubles_q_in_place" in err and "read-only" in err


def test_inputs_reach_every_algorithm_read_only():
    from amla_sim.experiments.inputs import make_inputs
    from amla_sim.plugins import call_algorithm, get_algorithm

    q, kv = make_inputs("normal:1", heads=4, context=32, seed=0)
    before = q.copy()
    seen = {}

    def spy(q, kv, **kw):
        seen["writeable"] = (q.flags.writeable, kv.flags.writeable)
        return get_algorithm("base")(q, kv, **kw)

    call_algorithm("spy", spy, q, kv, machine="ieee32", schedule="reference", block=64, scale=None)
    assert seen["writeable"] == (False, False) and q.flags.writeable
    with pytest.raises(ValueError, match="read-only"):  # a built-in that wrote would fail as loudly
        call_algorithm("base", lambda q, kv, **kw: q.__imul__(2), q, kv)
    assert np.array_equal(q, before)


@pytest.mark.parametrize("spec, says", [
    ("amla_careless:exits", "sys.exit(0)"),
    ("amla_exits_on_import:f", "sys.exit(3)"),
    ("amla_parses_argv:f", "it printed"),
    ("amla_careless:half_d_v", "(1, 1, 64, 512)"),
    ("amla_careless:hazards_as_a_list", "hazards ['overflow']"),
])
def test_plugin_that_exits_or_returns_the_wrong_thing_is_one_clear_error(careless, tmp_path, capsys, spec, says):
    code, out, err = _exit(["sweep", "--algorithms", spec, "--machines", "ieee32", "--contexts", "32", "--heads",
                            "4", "--samples", "1", "--quiet", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and spec.split(":")[0] in err and says in err, err
    assert not (tmp_path / "r" / "results.csv").exists()


def test_plugin_printing_does_not_break_json(careless, capsys):
    code, out, err = _exit(["run", "--algorithm", "amla_careless:talks", "--heads", "4", "--context", "32",
                            "--json"], capsys)
    assert code == 0 and json.loads(out)["algorithm"] == "amla_careless:talks"
    assert "hello from the plugin" in err


@pytest.mark.parametrize("spec, says", [
    ("amla:cleanup=no", "option cleanup: expected true or false, got 'no'"),
    ("amla:compensation=foo", "expected one of ['cann', 'paper', 'none']"),
    ("amla:compensation", "option 'compensation' of amla is not key=value"),
    ("amla:guard=small", "option guard: expected a number"),
])
def test_option_values_are_checked_against_the_algorithm(capsys, spec, says):
    code, _, err = _exit(["run", "--algorithm", spec, "--heads", "4", "--context", "32"], capsys)
    assert code == 2 and says in err


def test_run_takes_a_schedule_from_the_spec(capsys):
    code, out, _ = _exit(["run", "--algorithm", "amla:schedule=reference", "--heads", "4", "--context", "32",
                          "--json"], capsys)
    assert code == 0 and json.loads(out)["options"] == {"schedule": "reference"}


# --- comparisons: never a pass for what was not compared -------------------------------------------------------


@pytest.mark.parametrize("stages", [[], {}, ()])
def test_empty_stage_list_is_an_error_not_bit_exact(stages):
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="no stage to compare"):
        compare(a, a, stages=stages)


def test_stage_held_by_one_side_only_is_not_compared_and_not_bit_exact():
    a = np.ones(4, np.float32)
    r = compare({"S": a, "OUT": a}, {"S": a, "out": a})
    assert r.first_difference is None and not r.bit_exact
    assert r.not_compared == {"OUT": "device only", "out": "simulated only"}
    assert "OUT    not compared: device only" in r.format() and "every stage bit-identical" not in r.format()


def test_empty_stage_is_not_bit_exact():
    r = compare({"out": np.ones(0, np.float32)}, {"out": np.ones(0, np.float32)})
    assert not r.bit_exact and r["out"].bit_exact == 0.0 and r.not_compared == {"out": "no element"}


def test_misnamed_device_stage_is_an_error_in_the_crosscheck():
    from amla_sim.crosscheck.own import compare_stages

    a = np.zeros((1, 1, 4), np.float32)
    with pytest.raises(ValueError, match=r"\['OUT'\] are not stages of base"):
        compare_stages("base", {"m": a, "OUT": a}, {"m": a, "out": a})


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_cli_compare_of_one_sided_stages_exits_4(tmp_path, capsys):
    a, b = np.arange(4, dtype=np.float32), np.arange(4, dtype=np.float32) + 1
    dev, sim = _npz(tmp_path / "d.npz", S=a, OUT=a), _npz(tmp_path / "s.npz", S=a, out=b)
    code, out, _ = _exit(["compare", dev, sim], capsys)
    assert code == 4 and "not compared: device only" in out and "bit-identical" not in out


def test_cli_compare_of_differing_bits_exits_3_and_identical_0(tmp_path, capsys):
    a = np.arange(4, dtype=np.float32)
    dev = _npz(tmp_path / "d.npz", out=a)
    assert _exit(["compare", dev, _npz(tmp_path / "s.npz", out=a + 1)], capsys)[0] == 3
    assert _exit(["compare", dev, _npz(tmp_path / "t.npz", out=a)], capsys)[0] == 0


def test_cli_compare_stage_named_twice_is_an_error(tmp_path, capsys):
    a = ml_dtypes.bfloat16(1.5) * np.ones(4, ml_dtypes.bfloat16)
    f = _npz(tmp_path / "d.npz", out=a.view(np.uint16))
    code, _, err = _exit(["compare", f, f, "--stages", "out,out", "--format", "out=bf16"], capsys)
    assert code == 2 and "--stages: 'out' is named twice" in err


def test_big_endian_raw_bits_are_read_as_their_values():
    b = (np.arange(1, 9, dtype=np.float32) / 3).astype(ml_dtypes.bfloat16)
    r = compare(b.view(np.uint16).astype(">u2"), b)
    assert r.bit_exact and r["out"].identical == 8
    assert compare(np.arange(4, dtype=">f4"), np.arange(4, dtype="<f4")).bit_exact


def test_integer_stages_compare_values_exactly_at_any_width():
    u = np.array([2**64 - 1, 2**63, 5], np.uint64)
    s = np.array([-1, -(2**63), 5], np.int64)
    st = compare({"N": u}, {"N": s})["N"]
    assert st.identical == 1 and st.max_ulp == 2**64 - 1  # 2^64 and 2^64 - 1 apart, saturated at 2^64 - 1
    assert sum(v for k, v in st.histogram.items()) == st.size
    assert compare({"N": np.array([255], np.uint8)}, {"N": np.array([-1], np.int8)})["N"].identical == 0
    assert compare({"N": np.array([7], np.uint64)}, {"N": np.array([7], np.int8)}).bit_exact


def test_distinct_nan_words_are_counted_and_shown():
    d = np.array([0x7C01, 0x3C00], np.uint16)  # BF16 words that read as FP16 NaNs under a wrong format
    s = np.array([0x7C02, 0x3C00], np.uint16)
    r = compare({"out": d}, {"out": s}, stages={"out": "fp16"})
    assert r["out"].nan_payload == 1 and "nan-payload≠ 1" in r.format()


# --- files --------------------------------------------------------------------------------------------------


def test_npz_member_that_is_not_npy_data_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("out.npy", b"x")
    good = _npz(tmp_path / "good.npz", out=np.ones(2, np.float32))
    code, _, err = _exit(["compare", str(bad), good], capsys)
    assert code == 1 and "'out.npy' is not npy data" in err
    code, _, err = _exit(["crosscheck", "--replay", str(bad)], capsys)
    assert code == 1 and "'out.npy' is not npy data" in err


def test_npy_header_claiming_more_than_it_holds_is_refused_before_reading(tmp_path, capsys):
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    header["shape"] = (10**12,)
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    bad = tmp_path / "huge.npz"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("out.npy", buf.getvalue() + b"\0" * 16)
    code, _, err = _exit(["compare", str(bad), str(bad)], capsys)
    assert code == 1 and "claims shape (1000000000000,)" in err and "--context" not in err


def _replay_copy(tmp_path, flip: bool) -> str:
    shutil.copy(DATA / "crosscheck_inputs.npz", tmp_path)
    with np.load(DATA / "crosscheck_base_poly.npz") as z:
        arrays = {k: z[k] for k in z.files}
    if flip:
        arrays["device_out"] = arrays["device_out"].copy()
        arrays["device_out"].flat[7] ^= 1
    return _npz(tmp_path / "capture.npz", **arrays)


@pytest.mark.parametrize("flip, code", [(False, 0), (True, 3)])
def test_crosscheck_exit_status_says_whether_bits_differ(tmp_path, capsys, flip, code):
    got, out, _ = _exit(["crosscheck", "--replay", _replay_copy(tmp_path, flip)], capsys)
    assert got == code, out
    assert ("first difference at out" in out) == flip


# --- sizes and bounds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["run", "--algorithm", "flashmla:num_sms=1000000000", "--machine", "sm90-cuda", "--heads", "64", "--context",
     "64"],
    ["run", "--algorithm", "flashmla:num_sms=21000", "--machine", "sm90-cuda", "--heads", "64", "--context", "64"],
])
def test_num_sms_beyond_the_combine_kernel_is_refused_not_hung(capsys, argv):
    code, _, err = _exit(argv, capsys)
    assert code == 2 and "num_sms" in err and "160" in err


def test_sparse_decode_num_sms_beyond_the_combine_kernel_is_refused():
    from amla_sim.algorithms.deployed.flashmla.sparse_fp8 import sparse_schedule

    with pytest.raises(ValueError, match="num_sms: 1000000000 SMs"):
        sparse_schedule([64], s_q=1, heads=64, num_sms=10**9)


def test_scheduler_walk_is_bounded_by_the_work():
    from amla_sim.algorithms.deployed.flashmla.scheduler import decoding_schedule

    parts, cum = decoding_schedule([100, 5], 10**6)  # two requests: the walk ends at once, the rest idle
    few, few_cum = decoding_schedule([100, 5], 20)  # the same payload per part (cdiv(13, parts) = 1)
    assert len(parts) == 10**6 and parts[:20] == few and cum.tolist() == few_cum.tolist()
    idle = next(i for i, p in enumerate(parts) if p.begin_req == 2)
    assert idle < 20 and parts[-1] == parts[idle]


def test_sglang_max_kv_splits_is_bounded():
    from amla_sim.algorithms import splitkv_decode
    from amla_sim.experiments.inputs import make_inputs

    q, kv = make_inputs("normal:1", heads=16, context=64, seed=0)
    with pytest.raises(ValueError, match="max_kv_splits: at most 65535"):
        splitkv_decode(q, kv, num_kv_splits=2, max_kv_splits=10**9)


def test_quantizing_no_pages_names_kv():
    from amla_sim.algorithms.deployed.flashmla.fp8_cache import quantize_kv_cache

    with pytest.raises(ValueError, match="kv: no tokens"):
        quantize_kv_cache(np.zeros((0, 64, 512), np.float32), "model1")
    with pytest.raises(TypeError, match="power_of_two: expected True or False"):
        quantize_kv_cache(np.zeros((1, 64, 576), np.float32), power_of_two="no")


# --- quiet on any input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_matmul_on_random_bit_patterns_is_quiet(fmt):
    from amla_sim.arith.mma import matmul

    rng = np.random.default_rng(1)
    dt = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[fmt]
    a = rng.integers(0, 2**16, (8, 32), dtype=np.uint16).view(dt)
    b = rng.integers(0, 2**16, (32, 8), dtype=np.uint16).view(dt)
    a.view(np.uint16)[0, :4] = {"bf16": 0x7F81, "fp16": 0x7C01}[fmt]  # signalling NaNs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = matmul(a, b, model="sm90")
    assert np.isnan(out[0]).all()


def test_local_dask_cluster_listens_on_this_machine_only(monkeypatch):
    from amla_sim.experiments import schedulers

    seen = {}

    class Cluster:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def close(self):
            pass

    class Client:
        dashboard_link = "http://127.0.0.1:1/status"

        def __init__(self, cluster):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    fake = type(sys)("distributed")
    fake.LocalCluster, fake.Client = Cluster, Client
    monkeypatch.setattr(schedulers, "_distributed", lambda: fake)
    with schedulers.dask_client("dask", 2, log=lambda line: None):
        pass
    assert seen["host"] == "127.0.0.1" and seen["dashboard_address"].startswith("127.0.0.1:")


def test_replayed_recipe_with_num_sms_past_the_combine_kernel_is_refused(tmp_path, capsys):
    with np.load(DATA / "flashmla_sparse_fp8_decode.npz") as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"]))
    meta["cases"][0]["num_sms"] = 10**9
    arrays["meta"] = np.array(json.dumps(meta))
    code, _, err = _exit(["crosscheck", "--replay", _npz(tmp_path / "c.npz", **arrays)], capsys)
    assert code == 1 and "case 0: num_sms: 1000000000 SMs" in err
