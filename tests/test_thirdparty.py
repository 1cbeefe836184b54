"""The kernels people deploy (issue 12): SGLang's Triton MLA decode and FlashMLA's dense decode bit for bit, the
units they use (tl.log, lg2.approx), the tensor cores' NaN, against H200 captures that an H100 wrote byte for byte
too, and an H100 capture of inputs no other test uses."""

import hashlib
import json

import ml_dtypes
import numpy as np
import pytest
from conftest import FASTEST, capture_engines

from amla_sim import mma
from amla_sim.algorithms import flashmla, golden
from amla_sim.algorithms.deployed.sglang.decode import split_ranges, splitkv_decode
from amla_sim.arith.logarithm import lg2_approx, log
from amla_sim.crosscheck import CaptureError, replay
from amla_sim.crosscheck.sglang import SGLANG_CASES
from amla_sim.engine import use_engine
from amla_sim.experiments.inputs import make_inputs
from amla_sim.machines import get_machine
from amla_sim.units import DivUnit, ExpUnit, FMAUnit, LogUnit

DATA = "tests/data/"
API_SCALE = float(np.float32(576**-0.5))  # the default scale as a kernel's float parameter holds it


@pytest.fixture(scope="module")
def units():
    with np.load(DATA + "log_units.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("rows", [16, 64])  # mma.sync (SGLang's M = 16) and wgmma
def test_tensor_cores_write_one_nan(rows):
    with np.load(DATA + "nan_dot.npz") as z:
        a, b, c = z[f"a{rows}"].view(ml_dtypes.bfloat16), z[f"b{rows}"].view(ml_dtypes.bfloat16), z[f"c{rows}"]
        assert str(z[f"instr{rows}"]) == ("mma.sync" if rows == 16 else "wgmma")
    got = mma.matmul(a, b, model="sm90").view(np.uint32)
    assert np.isnan(c.view(np.float32)).sum() > rows  # NaN payloads of both signs, and Inf - Inf
    np.testing.assert_array_equal(got, c)


@pytest.mark.parametrize("ftz", [False, True])
def test_lg2_approx_bit_exact(units, ftz):
    x = units["x"].view(np.float32)
    np.testing.assert_array_equal(lg2_approx(x, ftz=ftz).view(np.uint32), units["lg2_ftz" if ftz else "lg2"])
    np.testing.assert_array_equal(lg2_approx(units["xb"].view(np.float32)).view(np.uint32), units["xb_lg2"])


def test_lg2_approx_edges(units):
    x = np.array([1.0, 2.0, 0.5, 0.25, 2.0**-126, 0.0, -0.0, np.inf, -1.0, 2.0**-149], np.float32)
    y = lg2_approx(x)
    assert y[0] == 0 and y[1] == 1 and y[7] == np.inf and np.isneginf(y[5]) and np.isneginf(y[6])
    assert y[2].view(np.uint32) == 0xBF7FFFFE and y[3].view(np.uint32) == 0xBFFFFFFF  # -1 + 2^-23, -2 + 2^-23
    assert y[8].view(np.uint32) == 0x7FFFFFFF and y[9] == -149.0
    assert np.isneginf(lg2_approx(np.float32(2.0**-149), ftz=True))


def test_tl_log_is_libdevice_logf(units):
    np.testing.assert_array_equal(log(units["x"].view(np.float32), mode="sm90").view(np.uint32), units["log"])
    np.testing.assert_array_equal(log(units["xb"].view(np.float32), mode="sm90").view(np.uint32), units["xb_log"])
    one = (np.uint32(0x3F800000) | np.arange(0, 1 << 23, 64, dtype=np.uint32)).view(np.float32)
    np.testing.assert_array_equal(log(one, mode="sm90").view(np.uint32), units["log_one_every64"])
    cr = log(units["x"].view(np.float32))  # correctly rounded: a different function, so the test can fail
    assert np.mean(cr.view(np.uint32) == units["log"]) < 0.95


def test_h100_wrote_the_same_bytes_as_the_h200():
    with open(DATA + "thirdparty_h100_record.json") as f:
        record = json.load(f)["files"]
    checked = 0
    for ours, theirs in (("sglang_decode.npz", "sglang.npz"), ("flashmla_decode.npz", "flashmla.npz"),
                         ("nan_dot.npz", "nan_dot.npz")):
        with np.load(DATA + ours) as z:
            for k in z.files:
                if k != "meta":
                    digest = hashlib.sha256(np.ascontiguousarray(z[k]).tobytes()).hexdigest()[:16]
                    assert record[theirs][k] == digest, (ours, k)
                    checked += 1
    assert checked > 40


# every case on the fastest engine; on NumPy too, the cheapest: 1,000 tokens in 4 splits, with stage 1's partial
# outputs compared
SGLANG_ENGINES = [*((c, FASTEST) for c in range(len(SGLANG_CASES))), (2, "numpy")]


@pytest.mark.parametrize(("case", "engine"), SGLANG_ENGINES, ids=[f"{e}-{c}" for c, e in SGLANG_ENGINES])
def test_sglang_decode_bit_exact(case, engine):
    with use_engine(engine):
        report = replay(DATA + "sglang_decode.npz", cases=[case])
    row = report.cases[0]
    assert report.version == "0.5.23"
    assert row.first_difference is None, report.format()
    assert [s.name for s in row.stages][-2:] == ["lse", "out"]


@pytest.mark.parametrize("change", ["no-fma", "wgmma-layout", "ieee-exp", "correct-log"])
def test_each_modelled_choice_matters(change, fastest_engine):
    """The replay fails when one of the model's measured choices is replaced by a plausible other."""
    mc = get_machine("sm90-triton")
    mc = {"no-fma": get_machine(mc, fma=FMAUnit(contract=False)), "wgmma-layout": mc,
          "ieee-exp": get_machine(mc, exponential=ExpUnit("correctly-rounded")),
          "correct-log": get_machine(mc, logarithm=LogUnit(ln="correctly-rounded", lg2=None))}[change]
    with np.load(DATA + "sglang_decode.npz") as z:
        meta = json.loads(str(z["meta"]))
        out, lse = z["c2_o"], z["c2_lse"]
    c = meta["cases"][2]
    q, kv = make_inputs(c["dist"], batch=1, heads=128, context=c["seqlens"][0], seed=c["seed"])
    res = splitkv_decode(q, kv, num_kv_splits=c["num_kv_splits"][0], max_kv_splits=c["max_kv_splits"],
                         scale=c["scale"], machine=mc, num_warps=1 if change == "wgmma-layout" else 4)
    ran = ~np.isnan(res.lse)
    same = np.mean(res.out[:, 0].view(np.uint16) == out), np.mean(res.lse.view(np.uint32)[ran] == lse[ran])
    assert min(same) < 1, same


def test_split_ranges_follow_the_kernel():
    r = split_ranges([4096, 77, 1000, 64], [8, 2, 4, 1], 8)
    assert r[0, :, 0].tolist() == [512 * i for i in range(8)] and r[0, -1, 1] == 4096
    assert r[1, :3].tolist() == [[0, 64], [64, 77], [128, 77]]  # cdiv(77, 2) = 39 -> 64; the third is empty
    assert r[2, :4, 1].tolist() == [256, 512, 768, 1000]
    assert (r[3, 1:, 0] >= r[3, 1:, 1]).all()


@pytest.mark.parametrize("machine", ["golden", "ieee32", "sm90-triton"])
def test_splitkv_decode_on_other_machines(machine):
    q, kv = make_inputs("flashmla", batch=2, heads=16, context=300, seed=4)
    res = splitkv_decode(q, kv, seqlens=np.array([300, 97]), num_kv_splits=[3, 2], machine=machine)
    ref = np.concatenate([golden(q[i:i + 1], kv[i:i + 1, :n], scale=API_SCALE).out for i, n in enumerate((300, 97))])
    err = np.linalg.norm(res.out.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err < (1e-12 if machine == "golden" else 8e-3), err  # split and merge are exact mathematics


@pytest.mark.parametrize("kwargs, name", [
    ({"seqlens": [-1]}, "seqlens"), ({"seqlens": [10**6]}, "seqlens"), ({"num_kv_splits": 0}, "num_kv_splits"),
    ({"num_kv_splits": 9, "max_kv_splits": 8}, "max_kv_splits"), ({"block_h": 64}, "block_h"),
    ({"block_n": 12}, "block_n"), ({"logit_cap": 30.0}, "logit_cap"), ({"scale": float("nan")}, "scale"),
    ({"machine": "h100"}, "machine"), ({"page_size": 0}, "page_size"), ({"num_kv_splits": True}, "num_kv_splits"),
])
def test_bad_input_names_the_argument(kwargs, name):
    q, kv = make_inputs("normal:1", heads=16, context=64)
    with pytest.raises((ValueError, TypeError), match=name):
        splitkv_decode(q, kv, **kwargs)


@pytest.mark.parametrize("q_shape, kv_shape, name", [((1, 2, 16, 576), (1, 64, 576), "q"),
                                                     ((1, 1, 16, 512), (1, 64, 576), "q"),
                                                     ((1, 1, 16, 576), (2, 64, 576), "kv")])
def test_bad_shapes(q_shape, kv_shape, name):
    with pytest.raises(ValueError, match=name):
        splitkv_decode(np.zeros(q_shape, ml_dtypes.bfloat16), np.zeros(kv_shape, ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="q"):
        splitkv_decode(np.zeros((1, 1, 16, 576), np.int16), np.zeros((1, 64, 576), ml_dtypes.bfloat16))
    for model in (splitkv_decode, lambda q, kv: flashmla(q, kv, seqlens=[64])):
        with pytest.raises(TypeError, match=r"kv: the kernel takes BF16( \(the format of q\))?, got float32"):
            model(np.zeros((1, 1, 16, 576), ml_dtypes.bfloat16), np.zeros((1, 64, 576), np.float32))


# NumPy: s_q 2 with 128 heads, and a batch of one split and 47
@pytest.mark.parametrize(("capture", "engine", "cases"),
                         capture_engines(["flashmla_decode.npz", "flashmla_decode_h100_fresh.npz"], [2, 3]))
def test_flashmla_decode_bit_exact(capture, engine, cases):
    with use_engine(engine):
        report = replay(DATA + capture, cases=cases)
    assert report.version == "9241ae3" and len(report.cases) == len(cases or range(6))
    for row in report.cases:
        assert row.first_difference is None, report.format()


@pytest.mark.parametrize("change", ["no-fma", "ieee-exp2", "ieee-log2", "ieee-div"])
def test_each_flashmla_choice_matters(change, fastest_engine):
    mc = get_machine("sm90-cuda")
    mc = {"no-fma": get_machine(mc, fma=FMAUnit(contract=False)),
          "ieee-exp2": get_machine(mc, exponential=ExpUnit("correctly-rounded")),
          "ieee-log2": get_machine(mc, logarithm=LogUnit(ln=None, lg2="correctly-rounded")),
          "ieee-div": get_machine(mc, division=DivUnit("ieee"))}[change]
    with np.load(DATA + "flashmla_decode.npz") as z:
        c = json.loads(str(z["meta"]))["cases"][1]
        out, lse = z["c1_out"], z["c1_lse"]
    q, kv = make_inputs(c["dist"], batch=1, heads=128, context=4096, seed=c["seed"])
    res = flashmla(q, kv, seqlens=[4096], machine=mc)
    same = np.mean(res.out.view(np.uint16) == out), np.mean(res.lse.view(np.uint32) == lse)
    assert min(same) < 1, same


@pytest.mark.parametrize("machine", ["golden", "ieee32", "sm90-cuda"])
def test_flashmla_on_other_machines(machine):
    q, kv = make_inputs("flashmla", batch=2, heads=64, context=700, seed=9)
    res = flashmla(q, kv, seqlens=[700, 130], machine=machine, build="upstream", trace=True)  # the FP32 scale
    for i, n in enumerate((700, 130)):
        ref = golden(q[i:i + 1], kv[i:i + 1, :n], scale=API_SCALE)  # the scale the kernel receives
        err = np.linalg.norm(res.out[i:i + 1].astype(np.float64) - ref.out) / np.linalg.norm(ref.out)
        assert err < (1e-12 if machine == "golden" else 8e-3), err
        np.testing.assert_allclose(res.lse[i, :, 0], ref.lse[0, 0], rtol=1e-12 if machine == "golden" else 1e-5)
    assert len(res.trace["split_ranges"]) == 2 and res.trace["split_out"][0].shape[1:] == (64, 512)


def test_flashmla_needs_a_log2_model():
    q, kv = make_inputs("normal:1", heads=64, context=64)
    with pytest.raises(ValueError, match="machine: flashmla takes lg2, which sm90-triton does not model"):
        flashmla(q, kv, seqlens=[64], machine="sm90-triton")


@pytest.mark.parametrize("kwargs, name", [({"seqlens": [-1]}, "seqlens"), ({"seqlens": [65]}, "seqlens"),
                                          ({"seqlens": [1, 2]}, "seqlens"),
                                          ({"seqlens": [64], "scale": float("inf")}, "scale"),
                                          ({"seqlens": [64], "num_sms": 0}, "num_sms"),
                                          ({"seqlens": [64], "machine": "b200"}, "machine")])
def test_flashmla_bad_input_names_the_argument(kwargs, name):
    q, kv = make_inputs("normal:1", heads=64, context=64)
    with pytest.raises((ValueError, TypeError), match=name):
        flashmla(q, kv, **kwargs)


def test_cli_replays_sglang(capsys, tmp_path, fastest_engine):
    """The command line (the replay itself is checked on both engines above)."""
    from amla_sim.cli import main

    with np.load(DATA + "sglang_decode.npz") as z:  # one case of the capture, the fastest
        meta = json.loads(str(z["meta"]))
        meta["cases"] = meta["cases"][6:7]
        np.savez(tmp_path / "one.npz", meta=np.array(json.dumps(meta)), c0_o=z["c6_o"], c0_lse=z["c6_lse"])
    assert main(["crosscheck", "--kernel", "sglang-triton", "--replay", str(tmp_path / "one.npz"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cases"][0]["first_difference"] is None and report["cases"][0]["stages"][-1]["bit_exact"] == 1
    with pytest.raises(SystemExit) as e:
        main(["crosscheck", "--kernel", "flashmla", "--replay", str(tmp_path / "one.npz")])
    assert e.value.code == 2 and "--kernel" in capsys.readouterr().err


@pytest.mark.parametrize("case", range(6))
def test_flashmla_scheduler_cuts_where_the_kernel_does(case):
    from amla_sim.algorithms.deployed.flashmla.scheduler import (
        decoding_schedule,
        num_sm_parts,
        request_splits,
    )

    with np.load(DATA + "flashmla_decode.npz") as z:
        c = json.loads(str(z["meta"]))["cases"][case]
        sched, num_splits = z[f"c{case}_sched"], z[f"c{case}_num_splits"]
    parts = num_sm_parts(s_q=c["sq"], heads_q=c["heads"])
    assert parts == sched.shape[0]  # 132 SMs: 66 parts at 128 heads, 33 with s_q = 2, 132 at 64 heads
    ours, ours_splits = decoding_schedule(c["seqlens"], parts)
    np.testing.assert_array_equal(np.array([p.as_ints() for p in ours])[:, :7], sched[:, :7])  # the 8th is padding
    np.testing.assert_array_equal(ours_splits, num_splits)
    for n, splits in zip(c["seqlens"], request_splits(c["seqlens"], parts)):
        assert splits[0][0] == 0 and splits[-1][1] == n and all(a[1] == b[0] for a, b in zip(splits, splits[1:]))


def _edited(tmp_path, source, edit):
    """A copy of a committed capture with `edit(meta, arrays)` applied."""
    with np.load(DATA + source) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    edit(meta, arrays)
    path = tmp_path / "edited.npz"
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


BAD_CAPTURES = {
    "no cases": ("sglang_decode.npz", lambda m, a: m.update(cases=[]), "no list of cases"),
    "no kernel": ("flashmla_decode.npz", lambda m, a: (m.pop("flashmla_commit"), m.pop("kernel", None)),
                  "names no kernel"),
    "missing field": ("flashmla_decode.npz", lambda m, a: m["cases"][0].pop("seed"), "has no 'seed'"),
    "bool batch": ("sglang_decode.npz", lambda m, a: m["cases"][0].update(batch=True), "batch"),
    "seqlens count": ("flashmla_decode.npz", lambda m, a: m["cases"][3].update(seqlens=[64]), "seqlens"),
    "wrong shape": ("sglang_decode.npz", lambda m, a: a.update(c0_o=a["c0_o"][:, :64]), "c0_o should be"),
    "float lse": ("flashmla_decode.npz", lambda m, a: a.update(c1_lse=a["c1_lse"].view(np.float32)),
                  "c1_lse should be uint32"),
    "missing array": ("flashmla_decode.npz", lambda m, a: a.pop("c2_out"), "has no c2_out"),
    "huge": ("flashmla_decode.npz", lambda m, a: m["cases"][0].update(seqlens=[10**8]), "GiB"),
}


@pytest.mark.parametrize("case", sorted(BAD_CAPTURES))
def test_bad_thirdparty_captures_are_refused_before_any_work(case, tmp_path, capsys):
    from amla_sim.cli import main

    source, edit, words = BAD_CAPTURES[case]
    path = _edited(tmp_path, source, edit)
    with pytest.raises(SystemExit) as e:
        main(["crosscheck", "--kernel", "sglang-triton" if source.startswith("sglang") else "flashmla",
              "--replay", str(path)])
    err = capsys.readouterr().err
    assert e.value.code in (1, 2) and words in err and "Traceback" not in err, err


def test_thirdparty_replay_refuses_a_zip_bomb(tmp_path):
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, meta=np.array('{"kernel": "flashmla", "cases": []}'),
                        c0_out=np.zeros((600, 1024, 1024), np.uint16))  # 1.2 GB of zeros, ~1 MB on disk
    with pytest.raises(CaptureError, match="MiB"):
        replay(path)
