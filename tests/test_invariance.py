"""Batch invariance and kernel diffs: the device check replayed (an H200's bits of a request alone and in other
launches, for FlashMLA's dense and sparse FP8 decodes and SGLang's decode), SGLang's split choice against its
own Triton program, and the commands that ask the questions."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import FASTEST

from amla_sim.algorithms.deployed.flashmla.dense import flashmla
from amla_sim.algorithms.deployed.flashmla.etap import flashmla_etap
from amla_sim.algorithms.deployed.flashmla.scheduler import (
    check_splits,
    decoding_schedule,
    fixed_splits,
    num_sm_parts,
    request_splits,
)
from amla_sim.algorithms.deployed.sglang import scheduler as sglang_scheduler
from amla_sim.algorithms.deployed.sglang.scheduler import (
    mla_max_kv_splits,
    num_kv_splits,
)
from amla_sim.cli import main
from amla_sim.engine import use_engine
from amla_sim.experiments.inputs import make_inputs
from amla_sim.invariance import (
    Launch,
    describe_plan,
    get_batch_kernel,
    invariance,
    kernel_diff,
    project,
    variations,
)
from amla_sim.invariance.checks import (
    DEVICE_CHECKS,
    device_launches,
    replay_invariance,
    scheduler_batches,
)
from amla_sim.invariance.kernel import Request

DATA = Path(__file__).parent / "data"
CAPTURE = DATA / "invariance_h200.npz"
PREFIX = {"flashmla": "flashmla", "flashmla-sparse-fp8": "sparse", "sglang-triton": "sglang"}


@pytest.fixture(scope="module", autouse=True)
def _fastest_engine():
    """The study's subject is what the models predict of a launch, not an engine (the engines give the same bits;
    the replays check each engine on every kernel): every test here runs on the fastest engine installed."""
    with use_engine(FASTEST):
        yield


@pytest.fixture(scope="module")
def capture():
    return np.load(CAPTURE)


@pytest.fixture(scope="module", params=sorted(DEVICE_CHECKS))
def replayed(request, tmp_path_factory):
    """Each kernel's device check replayed; SGLang's from its out as ``np.save`` writes BF16 (void words, '|V2'),
    which the replay reads as the bits they are, the others from the committed raw bits."""
    path = CAPTURE
    if request.param == "sglang-triton":
        path = tmp_path_factory.mktemp("v2") / "sglang_v2.npz"
        with np.load(CAPTURE) as z:
            arrays = {k: z[k].view(ml_dtypes.bfloat16) if k.endswith("_out") else z[k] for k in z.files
                      if k.startswith("sglang_")}
        np.savez(path, **arrays)
        with np.load(path) as z:
            assert z["sglang_l0_out"].dtype == np.dtype("V2")
    return request.param, replay_invariance(str(path), request.param)


def test_every_launch_of_the_device_check_is_predicted_bit_for_bit(replayed):
    kernel, rows = replayed
    assert len(rows) == len(device_launches(kernel)) >= 5
    for label, rep in rows:
        assert rep.bit_exact, f"{kernel}, {label}:\n{rep}"
        assert all(s.size >= 128 for s in rep.stages)


def test_the_device_shows_the_batch_dependence_the_models_predict(capture):
    """The captures are not one answer repeated: each kernel's request changes bits in most launches, and the
    predictions written before the run (their CRCs) are the captured bytes."""
    predicted = json.loads((DATA / "invariance_predicted.json").read_text())
    for kernel, rows in predicted.items():
        p = PREFIX[kernel]
        moved = 0
        for i, row in enumerate(rows):
            for stage, crc in row["crc32"].items():
                assert zlib.crc32(np.ascontiguousarray(capture[f"{p}_l{i}_{stage}"]).tobytes()) == crc, (kernel, i)
            changed = int((capture[f"{p}_l{i}_out"] != capture[f"{p}_l0_out"]).sum())
            assert changed == row["changed"]["out"]
            moved += changed > 0
        assert moved == len(rows) - 1  # every launch but the reference moved some bit


def test_the_device_ran_each_launch_twice_with_the_same_bytes():
    info = json.loads((DATA / "invariance_h200.json").read_text())
    for kernel in DEVICE_CHECKS:
        assert info[kernel] and all(row["runs_identical"] for row in info[kernel])


def test_flashmla_split_counts_on_the_device_are_the_schedulers(capture):
    for kernel, p in (("flashmla", "flashmla"), ("flashmla-sparse-fp8", "sparse")):
        heads = DEVICE_CHECKS[kernel]["heads"]
        for i, L in enumerate(device_launches(kernel)):
            _, cum = decoding_schedule(L.lengths, num_sm_parts(s_q=L.s_q, heads_q=heads, num_sms=L.num_sms))
            np.testing.assert_array_equal(capture[f"{p}_l{i}_num_splits"], cum)


def test_the_plan_is_the_cause_a_batched_launch_under_the_alone_plan_misses_the_device(capture):
    """Each modelled choice matters: the request in a batch of 8 simulated under its split plan when alone does
    not give the device's bits; under the batch's plan it does (above)."""
    for kernel, p in (("flashmla", "flashmla"), ("flashmla-sparse-fp8", "sparse"), ("sglang-triton", "sglang")):
        c = DEVICE_CHECKS[kernel]
        k = get_batch_kernel(kernel)
        launches = device_launches(kernel)
        req = k.request(dist=c["dist"], seed=c["seed"], length=c["length"], heads=c["heads"],
                        s_q=max(L.s_q for L in launches), **c["options"])
        i = next(j for j, L in enumerate(launches) if L.batch == 8)
        alone_plan = k.plans(req, launches[0])[0]
        got = k.run(req, launches[i], alone_plan)
        assert (got["out"].view(np.uint16) != capture[f"{p}_l{i}_out"]).sum() > 1000, kernel


def test_sglang_split_choice_is_its_backends_on_2000_random_batches(capture):
    got = capture["sglang_sched_splits"]
    at = 0
    for lens, heads, top in scheduler_batches():
        mine = num_kv_splits(lens, heads=heads, max_kv_splits=top, sms=132)
        np.testing.assert_array_equal(mine, got[at:at + len(lens)])
        at += len(lens)
    assert at == got.size


def test_sglang_split_choice_on_near_equal_batches_of_an_h100():
    got = np.load(DATA / "invariance_h100_sched_near.npz")["sglang_sched_near_splits"]
    at = 0
    for lens, heads, top in scheduler_batches(near=True):
        np.testing.assert_array_equal(num_kv_splits(lens, heads=heads, max_kv_splits=top, sms=132),
                                      got[at:at + len(lens)])
        at += len(lens)
    assert at == got.size


@pytest.mark.parametrize("rule, without, near", [
    ("_spread_floor", lambda longest, shortest: shortest, True),
    ("_core_budget", lambda longest, sms: sms, False),
    ("_head_tiles", lambda heads, heads_kv: 1, False),
])
def test_each_rule_of_sglangs_split_choice_matters(capture, monkeypatch, rule, without, near):
    """Without any one of its rules, the model misses SGLang's own choice on some of the random batches (lengths
    within 25% of each other: the near-equal batches)."""
    monkeypatch.setattr(sglang_scheduler, rule, without)
    got = np.load(DATA / "invariance_h100_sched_near.npz")["sglang_sched_near_splits"] if near \
        else capture["sglang_sched_splits"]
    at, missed = 0, 0
    for lens, h, top in scheduler_batches(300, near=near):
        missed += not np.array_equal(num_kv_splits(lens, heads=h, max_kv_splits=top), got[at:at + len(lens)])
        at += len(lens)
    assert missed > 0


def test_a_fresh_seed_on_an_h100_was_as_predicted_before_its_run():
    """The record of the second device check (every seed + 1000, an H100): each launch's CRC and changed count
    against the predictions committed before it ran."""
    pred = json.loads((DATA / "invariance_predicted_seed1000.json").read_text())
    got = json.loads((DATA / "invariance_h100_seed1000.json").read_text())
    assert "H100" in got["device"] and all(got["runs_identical"].values())
    for kernel, rows in pred.items():
        assert len(rows) == len(got["launches"][kernel])
        for p, g in zip(rows, got["launches"][kernel]):
            assert p["crc32"] == g["crc32"] and p["changed"]["out"] == g["changed_out"], (kernel, p["label"])


def test_sglang_max_kv_splits_for_deepseek():
    assert mla_max_kv_splits(163840, sms=132) == 256
    assert mla_max_kv_splits(100, sms=132) == 8
    assert list(num_kv_splits(np.array([4096]), heads=128, max_kv_splits=256)) == [98]


# --- the models' split plans -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    return make_inputs("flashmla", batch=2, heads=16, context=700, seed=3)


@pytest.mark.parametrize("kernel, model", [("flashmla", flashmla), ("flashmla-etap", flashmla_etap)])
def test_the_schedulers_own_plan_handed_in_gives_the_same_bits(small, kernel, model):
    q, kv = small
    lens = [700, 300]
    own = model(q, kv, seqlens=lens)
    plan = get_batch_kernel(kernel).plans(Request({}, 16, 700, 1), Launch("both", tuple(lens)))
    assert plan == request_splits(lens, num_sm_parts(s_q=1, heads_q=16))
    given = model(q, kv, seqlens=lens, splits=plan)
    assert np.array_equal(own.out.view(np.uint16), given.out.view(np.uint16))
    other = model(q, kv, seqlens=lens, splits=fixed_splits(lens, None))
    assert not np.array_equal(own.out.view(np.uint16), other.out.view(np.uint16))


@pytest.mark.parametrize("plan, msg", [
    ([[(0, 700)]], "one list"),
    ([[(0, 700)], [(0, 100), (100, 300)]], "multiple of 64"),
    ([[(0, 640)], [(0, 300)]], "tile the request's 700"),
    ([[(0, 64), (0, 700)], [(0, 300)]], "tile"),
    ([["ab"], [(0, 300)]], "pairs of ints"),
    ([[(64 * i, min(64 * i + 64, 700)) for i in range(11)], [(0, 300)]], None),
])
def test_a_plan_is_checked(plan, msg):
    if msg is None:
        assert check_splits(plan, [700, 300], 32)[0][-1] == (640, 700)
        with pytest.raises(ValueError, match="more than the combine kernel holds"):
            check_splits(plan, [700, 300], 8)
        return
    with pytest.raises(ValueError, match=msg):
        check_splits(plan, [700, 300], 32)


def test_fixed_splits():
    assert fixed_splits([700, 64, 1], 256) == [[(0, 256), (256, 512), (512, 700)], [(0, 64)], [(0, 1)]]
    assert fixed_splits([700, 300], None) == [[(0, 700)], [(0, 300)]]
    with pytest.raises(ValueError, match="split_tokens"):
        fixed_splits([700], 100)


def test_describe_plan():
    assert describe_plan([(0, 128), (128, 256)]) == "2 splits of 128"
    assert describe_plan([(0, 192), (192, 384), (384, 448)]) == "2 splits of 192, 1 of 64"
    assert describe_plan([(0, 4096)]) == "1 split of 4096"


# --- the question, on a CPU ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["flashmla", "flashmla-etap", "flashmla-sparse-fp8", "sglang-triton"])
def test_invariance_report_for_every_modelled_kernel(kernel):
    length = 1024
    rep = invariance(kernel, length=length, heads=64, batchmates=(1, 7), mixed=2, split_tokens=256,
                     s_q=(1,) if kernel == "sglang-triton" else (1, 2))
    assert rep.results[0].launch.label == "alone" and rep.results[0].comparison.bit_exact
    assert not rep.invariant  # with 7 batchmates every one of these kernels splits the request differently
    for r in rep.results:
        assert r.same_plan <= r.comparison.bit_exact  # the same plan never changes a bit
        assert (not r.comparison.bit_exact) <= (not r.same_plan)
        assert r.changed["out"] == len(np.flatnonzero(r.bits["out"].view(np.uint16) !=
                                                      rep.results[0].bits["out"].view(np.uint16)))
    w = rep.what_if
    assert w is not None and all(u["longest"] <= 256 for u in w.units)
    json.dumps(rep.to_dict())
    assert "verdict" in rep.format()


def test_what_if_bits_are_the_same_in_every_launch():
    k = get_batch_kernel("flashmla")
    req = k.request(dist="normal:1", seed=1, length=900, heads=16, s_q=1)
    bits = [k.run(req, L, k.invariant_plans(req, L, 256)[L.position])["out"].view(np.uint16)
            for L in variations(900, batchmates=(3, 7), mixed=2)]
    assert all(np.array_equal(b, bits[0]) for b in bits)


def test_a_near_tie_in_the_projection_flips_with_the_bits():
    rep = invariance("flashmla", length=1024, heads=16, batchmates=(7,), mixed=None, seed=2)
    a, b = (rep.results[i].bits["out"].astype(np.float64).ravel() for i in (0, 1))
    assert not np.array_equal(a, b)
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(a.size)
    u = b - a
    u = u - 0.5 * (u @ (a + b)) / (a @ a) * a  # logit1 - logit0 = u.o: negative alone, positive batched
    W = np.stack([w0, w0 + u], axis=1)
    assert (project(a, W)[1] < project(a, W)[0]) and (project(b, W)[1] > project(b, W)[0])
    rep2 = invariance("flashmla", length=1024, heads=16, batchmates=(7,), mixed=None, seed=2, projection=W)
    assert rep2.results[0].argmax == 0 and rep2.results[1].argmax == 1
    assert rep2.projection["flips"] == 1 and "FLIPS" in rep2.format()


@pytest.mark.parametrize("kwargs, msg", [
    ({"kernel": "nope"}, "kernel: expected one of"),
    ({"kernel": "flashmla", "length": 0}, "length"),
    ({"kernel": "flashmla-sparse-fp8", "length": 100, "heads": 64}, "length: the sparse decode"),
    ({"kernel": "flashmla-sparse-fp8", "heads": 16}, "heads"),
    ({"kernel": "sglang-triton", "s_q": (1, 2)}, "s_q"),
    ({"kernel": "flashmla", "num_kv_splits": (4,)}, "num_kv_splits"),
    ({"kernel": "flashmla", "projection": np.zeros((3, 4))}, "projection"),
    ({"kernel": "flashmla", "launches": []}, "launches"),
    ({"kernel": "flashmla", "bogus": 1}, "bogus: not an option"),
    ({"kernel": "flashmla-etap", "format": "fp8"}, "format"),
    ({"kernel": "flashmla", "inputs": {"q": np.zeros((1, 4, 576))}}, "inputs"),
])
def test_bad_input_is_refused_naming_the_argument(kwargs, msg):
    kwargs = {"length": 256, "heads": 16, **kwargs}
    with pytest.raises(ValueError, match=msg):
        invariance(**kwargs)


def test_launch_checks_its_fields():
    with pytest.raises(ValueError, match="position"):
        Launch("x", (64, 64), position=2)
    with pytest.raises(ValueError, match="lengths"):
        Launch("x", ())


def test_inputs_from_arrays():
    q, kv = make_inputs("normal:1", heads=64, context=300, seed=4)
    rep = invariance("flashmla-sparse-fp8", inputs={"q": q[0], "kv": kv[0]}, batchmates=(7,))
    assert rep.request["length"] == 320 and rep.request["tokens"] == 300
    dense = invariance("flashmla", inputs={"q": q[0], "kv": kv[0]}, batchmates=(7,), mixed=None)
    assert dense.request["length"] == 300


# --- the diff ----------------------------------------------------------------------------------------------


def test_diff_names_the_first_modelled_difference():
    d = kernel_diff("flashmla", "flashmla-etap", length=512, heads=16)
    assert not d.identical and d.plans[0] == d.plans[1]
    assert d.differing_steps[0] == "scores" and "'scores'" in d.explanation
    s = kernel_diff("flashmla", "flashmla-sparse-fp8", length=512, heads=64)
    assert s.differing_steps[0] == "keys"


def test_diff_on_one_plan_tells_schedule_from_arithmetic():
    d = kernel_diff("flashmla", "sglang-triton", length=1024, heads=16)
    assert "schedule" in d.differing_steps and d.aligned is not None
    assert not d.aligned.bit_exact and d.explanation.startswith("the arithmetic")
    assert any("lse" in n for n in d.notes)  # SGLang's decode returns no LSE: out alone is compared


def test_diff_with_a_plugin_that_states_its_numerics(tmp_path, monkeypatch):
    (tmp_path / "myk.py").write_text(
        "from amla_sim.algorithms.deployed.flashmla.dense import flashmla_decode\n"
        "def mine(q, kv, *, machine='sm90-cuda', schedule='reference', block=64, scale=None, trace=False):\n"
        "    return flashmla_decode(q, kv, num_sms=16)\n"
        "mine.numerics = {'keys': ('bf16', 'BF16'), 'schedule': ('fewer SMs', 'FlashMLA on 16 SMs')}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    d = kernel_diff("flashmla", "myk:mine", length=1024, heads=64)
    assert not d.identical
    assert d.differing_steps == ["schedule"] and "'schedule'" in d.explanation


def test_cli_invariance_and_diff(capsys, tmp_path):
    assert main(["invariance", "--kernel", "flashmla", "--length", "2048", "--heads", "16", "--batchmates", "7",
                 "--mixed", "0", "--split-tokens", "one"]) == 3
    text = capsys.readouterr().out
    assert "verdict: 1 of 1 launches" in text and "what-if" in text
    assert main(["invariance", "--kernel", "flashmla", "--length", "512", "--heads", "16", "--batchmates", "1",
                 "--mixed", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["invariant"] is True
    assert main(["invariance", "--kernel", "sglang-triton", "--replay", str(CAPTURE)]) == 0
    assert "every launch's bits as predicted" in capsys.readouterr().out
    assert main(["diff", "--kernel", "flashmla", "--kernel", "flashmla-etap", "--length", "256", "--heads", "16"]) \
        == 3
    assert "explanation: the first modelled difference is 'scores'" in capsys.readouterr().out


@pytest.mark.parametrize("bits", [False, True])
def test_cli_invariance_reads_a_request_from_a_file(tmp_path, capsys, bits):
    """q and kv as np.save writes BF16 (void words) or as their uint16 bits: the same request either way."""
    q, kv = make_inputs("normal:1", heads=16, context=1024, seed=9)
    arrays = {"q": q[0], "kv": kv[0]}
    np.savez(tmp_path / "req.npz", **({k: v.view(np.uint16) for k, v in arrays.items()} if bits else arrays))
    assert main(["invariance", "--kernel", "flashmla", "--inputs", str(tmp_path / "req.npz"), "--batchmates", "7",
                 "--mixed", "0", "--json"]) == 3
    got = json.loads(capsys.readouterr().out)
    want = invariance("flashmla", inputs=arrays, batchmates=(7,), mixed=None).to_dict()
    assert got["request"]["length"] == 1024 and got["results"][1]["changed"] == want["results"][1]["changed"]


@pytest.mark.parametrize("argv, msg", [
    (["invariance", "--kernel", "flashmla", "--projection", "PROJ"], "--projection:"),
    (["invariance", "--kernel", "flashmla", "--split-tokens", "abc"], "--split-tokens"),
    (["invariance", "--kernel", "flashmla", "--inputs", "PROJ"], "--inputs"),
    (["invariance", "--kernel", "sglang-triton", "--sq", "1,2"], "--sq: sglang-triton"),
    (["invariance", "--kernel", "flashmla", "--num-kv-splits", "4"], "--num-kv-splits"),
    (["invariance", "--kernel", "flashmla", "--split-tokens", "100"], "split-tokens"),
    (["invariance", "--kernel", "flashmla-sparse-fp8", "--length", "100"], "--length"),
    (["invariance", "--kernel", "flashmla", "--replay", "nofile.npz"], "nofile"),
    (["diff", "--kernel", "flashmla"], "--kernel: name two"),
    (["diff", "--kernel", "flashmla", "--kernel", "nope"], "nope"),
])
def test_cli_refuses_bad_input_naming_the_flag(argv, msg, capsys, tmp_path):
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    argv = [str(tmp_path / "junk.npy") if a == "PROJ" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code in (1, 2)
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


@pytest.mark.parametrize("argv, says", [
    (["--kernel", "flashmla-sparse-prefill", "--num-sms", "132,114"], "not the SM count (132)"),
    (["--kernel", "flashinfer-mla", "--split-tokens", "10"], "longest split 32 -> 10 tokens"),
    (["--kernel", "flashmla", "--split-tokens", "10"], "--split-tokens: expected a multiple of 64 tokens, got 10"),
])
def test_the_study_says_what_a_flag_means_for_the_kernel(argv, says, capsys):
    """A flag a kernel does not read is said not read; a split size each kernel checks as its what-if takes it
    (FlashInfer's chunk length is any count)."""
    from amla_sim.cli import main

    try:
        main(["invariance", "--length", "300", "--heads", "16", "--batchmates", "1", "--mixed", "0", *argv])
    except SystemExit:
        pass
    out, err = capsys.readouterr()
    assert says in out + err, out + err
