"""FlashInfer's MLA decode (SGLang's flashinfer backend) in the invariance study: which launches change a request's
chunks (the launch's total KV, through the chunk length), that the request run alone under its launch's chunk
length is the whole batch run, the diff against FA3, the refusals, and the device check's capture replayed
(``tests/data/invariance_flashinfer_h100.npz``, written by ``scripts/capture_invariance.py --kernels
flashinfer-mla``; its tests skip while it is absent)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import FASTEST

from amla_sim.algorithms.deployed.flashinfer import flashinfer_mla, flashinfer_mla_plan
from amla_sim.algorithms.deployed.flashinfer.scheduler import MAX_WORKS, cluster_size, kv_len_limit
from amla_sim.cli import main
from amla_sim.crosscheck.files import read_capture
from amla_sim.engine import use_engine
from amla_sim.invariance import Launch, describe_plan, get_batch_kernel, invariance, kernel_diff
from amla_sim.invariance.flashinfer import (
    CAPTURE_PREFIX,
    FLASHINFER_CHECK,
    FlashInferMLA,
    flashinfer_launches,
    natural_lse,
    replay_flashinfer,
)

CAPTURE = Path(__file__).parent / "data" / "invariance_flashinfer_h100.npz"
needs_capture = pytest.mark.skipif(not CAPTURE.is_file(), reason=f"{CAPTURE.name} not captured yet (scripts/"
                                                                 "capture_invariance.py --kernels flashinfer-mla)")

#: The model's predictions for the device check on 132 SMs, written before the device run: per launch the
#: request's chunks (count, length), the out elements that differ from the request alone, and the CRC-32 of the
#: row's out (BF16 bits) and base-2 LSE (FP32 bits) as the capture keeps them.
PREDICTED = [  # (launch, chunks, chunk length, out elements changed, CRC-32 of out, of the base-2 LSE)
    ("alone", 22, 192, 0, 879142482, 3508749490),
    ("with 1 batchmate of 100 tokens", 22, 192, 0, 879142482, 3508749490),
    ("with 7 batchmates of 1 token", 22, 192, 0, 879142482, 3508749490),
    ("with 1 batchmate, 1,610 long", 16, 256, 34750, 2536696033, 2336055171),
    ("with 3 batchmates, 1,610, 107, 4,041 long", 16, 256, 34750, 2536696033, 2336055171),
    ("with 7 batchmates, 1,610, 107, 4,041, 736, 4,412, 2,994, 1,042 long", 8, 512, 35424, 1260632508, 3053596183),
    ("with 15 batchmates, 1,610, 107, 4,041, 736, ... long", 4, 1024, 35778, 3429496127, 3640098594),
    ("last of 16, the same batchmates", 4, 1024, 35778, 3429496127, 3640098594),
    ("with 15 batchmates of 20,000 tokens", 1, 4096, 32758, 2339650560, 1713899274),
    ("alone with s_q = 2", 16, 256, 34750, 2536696033, 2336055171),
]


@pytest.fixture(scope="module", autouse=True)
def _fastest_engine():
    with use_engine(FASTEST):
        yield


def _total(launch: Launch, heads: int) -> int:
    """The launch's KV as MLAPlan sums it (every request's length; causal tile ends for s_q > 1)."""
    p = flashinfer_mla_plan(list(launch.lengths), heads=heads, q_lens=launch.s_q, causal=launch.s_q > 1,
                            num_sms=launch.num_sms)
    return sum(t.remaining_len for t in p.tiles)


# --- the plan: which launches change a request's chunks ---------------------------------------------------------


def test_the_device_checks_launches_cut_the_request_as_predicted():
    k = FlashInferMLA()
    req = k.request(dist="flashmla", seed=8, length=16, heads=128, s_q=2)  # the plans read lengths only
    req.length = FLASHINFER_CHECK["length"]
    launches = flashinfer_launches()
    assert [L.label for L in launches] == [p[0] for p in PREDICTED]
    for L, (_, count, size, *_) in zip(launches, PREDICTED):
        plan = k.plans(req, L)[L.position]
        assert len(plan) == count and plan[0] == (0, size) and plan[-1][1] == 4096, L.label
        assert k.bounds(L, heads=128, options={})[0] == count


@pytest.mark.parametrize("heads, s_q", [(128, 1), (16, 1), (64, 1), (16, 4), (128, 2)])
def test_a_requests_chunks_follow_the_launchs_total_kv_alone(heads, s_q):
    """Every request's chunks are its length cut by kv_len_limit(total KV, clusters): its batchmates' count,
    order and lengths enter only through the total (equal totals give equal chunks, a shuffle changes none)."""
    k = FlashInferMLA()
    rng = np.random.default_rng(heads + s_q)
    cs = cluster_size([s_q], heads)
    req = k.request(dist="normal:1", seed=0, length=16, heads=heads, s_q=s_q)
    for _ in range(40):
        lens = tuple(int(v) for v in rng.integers(s_q, 9000, int(rng.integers(1, 40))))
        L = Launch("x", lens, s_q=s_q)
        limit = kv_len_limit(_total(L, heads), 132 // cs)
        plans = k.plans(req, L)
        assert plans == [[(a, min(a + limit, n)) for a in range(0, n, limit)] for n in lens]
        perm = tuple(int(i) for i in rng.permutation(len(lens)))
        shuffled = k.plans(req, Launch("y", tuple(lens[i] for i in perm), s_q=s_q))
        assert shuffled == [plans[i] for i in perm]
        if s_q == 1 and len(lens) > 2:  # the same total in two requests: the request's chunks do not move
            merged = Launch("z", (lens[0], sum(lens[1:])), s_q=s_q)
            assert k.plans(req, merged)[0] == plans[0]


def test_which_batches_change_the_chunk_length():
    """A 4,096-token request of 128 heads on 132 SMs (66 clusters of 2): chunks of 192 alone, and as long until
    the launch holds more than 66 x 64 = 4,224 keys; then 256, 512, ... as the total grows."""
    k = FlashInferMLA()
    req = k.request(dist="normal:1", seed=0, length=16, heads=128, s_q=1)
    size = {}
    for extra in (0, 1, 128, 129, 66 * 128 - 4096, 66 * 128 - 4095, 66 * 256 - 4096, 66 * 256 - 4095):
        L = Launch("x", (4096, extra) if extra else (4096,))
        size[extra] = k.plans(req, L)[0][0][1]
    assert size == {0: 192, 1: 192, 128: 192, 129: 256, 4352: 256, 4353: 256, 12800: 256, 12801: 512}
    # the request alone and with a second query row: s_q 2 adds its first query's causal end (4,095 keys)
    assert k.plans(req, Launch("x", (4096,), s_q=2))[0][0] == (0, 256)
    # on 16 heads a cluster is one CTA (132 clusters): chunks of 32 up to 8 keys a cluster
    r16 = k.request(dist="normal:1", seed=0, length=16, heads=16, s_q=1)
    assert k.plans(r16, Launch("x", (1056,)))[0][0] == (0, 32)
    assert k.plans(r16, Launch("x", (1056, 1)))[0][0] == (0, 64)


# --- the model: the request alone is the whole batch ------------------------------------------------------------


@pytest.mark.parametrize("heads, s_q, lens, position", [
    (16, 1, (700, 3000, 64, 1500), 0),
    (16, 1, (3000, 64, 1500, 700), 3),
    (128, 1, (1000, 2500, 900), 1),
    (48, 2, (500, 1300, 260), 2),
    (16, 3, (900, 40, 2000), 0),
])
def test_the_request_alone_under_its_launchs_chunk_length_is_the_whole_batch_run(heads, s_q, lens, position):
    """The shortcut the study rests on, checked independently: the model run on the whole launch (every request's
    rows, FlashInfer's own plan of the batch) gives the request's row of interest the bits of the request run alone
    with its launch's chunk length; and under its chunk length alone, other bits."""
    k = FlashInferMLA()
    L = Launch("x", lens, position=position, s_q=s_q)
    req = k.request(dist="flashmla", seed=3, length=lens[position], heads=heads, s_q=s_q)
    bt = k.batch(req, L)
    whole = flashinfer_mla(bt["q"], bt["kv"], seqlens=bt["seqlens"], causal=s_q > 1, return_lse_base_on_e=True)
    row = position * s_q + s_q - 1
    plan = k.plans(req, L)[position]
    got = k.run(req, L, plan)
    np.testing.assert_array_equal(got["out"].view(np.uint16), whole.out[position, -1].view(np.uint16))
    np.testing.assert_array_equal(got["lse"].view(np.uint32), whole.lse[row].view(np.uint32))
    alone = Launch("alone", (lens[position],), s_q=s_q)
    alone_plan = k.plans(req, alone)[0]
    assert alone_plan != plan
    other = k.run(req, alone, alone_plan)
    assert (other["out"].view(np.uint16) != got["out"].view(np.uint16)).any()


def test_run_returns_the_wrappers_natural_lse_and_raw_its_base_2():
    k = FlashInferMLA()
    req = k.request(dist="normal:1", seed=1, length=900, heads=16, s_q=1)
    L = Launch("x", (900, 3000))
    plan = k.plans(req, L)[0]
    raw, run = k.raw(req, L, plan), k.run(req, L, plan)
    res = flashinfer_mla(req.arrays["q"][None], req.arrays["kv"][None], kv_len_limit=plan[0][1])
    np.testing.assert_array_equal(raw["lse"].view(np.uint32), res.lse[0].view(np.uint32))
    base_e = flashinfer_mla(req.arrays["q"][None], req.arrays["kv"][None], kv_len_limit=plan[0][1],
                            return_lse_base_on_e=True)
    np.testing.assert_array_equal(run["lse"].view(np.uint32), base_e.lse[0].view(np.uint32))
    np.testing.assert_array_equal(natural_lse(raw["lse"]).view(np.uint32), run["lse"].view(np.uint32))


def test_kv_len_limit_of_the_plans_own_value_changes_nothing():
    """The hook is bit-identical: handing the plan its own chunk length gives the same plan and bits."""
    rng = np.random.default_rng(5)
    for _ in range(30):
        heads, s_q = int(rng.choice([16, 32, 64, 128])), int(rng.choice([1, 2]))
        lens = [int(v) for v in rng.integers(s_q, 6000, int(rng.integers(1, 20)))]
        causal = s_q > 1
        try:
            p = flashinfer_mla_plan(lens, heads=heads, q_lens=s_q, causal=causal)
        except ValueError:  # a causal tile boundary the wrapper refuses
            continue
        again = flashinfer_mla_plan(lens, heads=heads, q_lens=s_q, causal=causal, kv_len_limit=p.kv_len_limit)
        assert again.tiles == p.tiles and again.info == p.info
        assert all(np.array_equal(a, b) for a, b in zip(again.arrays().values(), p.arrays().values()))
    k = FlashInferMLA()
    req = k.request(dist="normal:1", seed=2, length=3000, heads=16, s_q=1)
    q, kv = req.arrays["q"][None], req.arrays["kv"][None]
    a, b = flashinfer_mla(q, kv), flashinfer_mla(q, kv, kv_len_limit=flashinfer_mla_plan([3000], heads=16).kv_len_limit)
    assert np.array_equal(a.out.view(np.uint16), b.out.view(np.uint16))
    assert np.array_equal(a.lse.view(np.uint32), b.lse.view(np.uint32))


def test_kv_len_limit_is_refused_naming_it_where_the_kernel_could_not_run_it():
    with pytest.raises(ValueError, match="kv_len_limit"):
        flashinfer_mla_plan([100], heads=16, kv_len_limit=0)
    with pytest.raises(ValueError, match="kv_len_limit: chunks of 1 keys need more merge CTAs"):
        flashinfer_mla_plan([1000], heads=128, q_lens=4, causal=True, kv_len_limit=1)
    with pytest.raises(ValueError, match="kv_len_limit: the plan needs"):
        flashinfer_mla_plan([20000], heads=16, kv_len_limit=1)
    with pytest.raises(ValueError, match="seqlens, q_lens, heads: 17000 requests"):  # the kernel's own plan names seqlens
        flashinfer_mla_plan([1] * 17000, heads=128)


def test_max_splits_is_a_plan_the_model_runs():
    """Any cut into at most max_splits chunks is one the model plans (merge CTAs within the SMs, work items within
    16384); the study checks the what-if's size against it before anything runs."""
    k = FlashInferMLA()
    rng = np.random.default_rng(7)
    for _ in range(100):
        heads, s_q = int(rng.choice([16, 48, 64, 128])), int(rng.integers(1, 5))
        sms = int(rng.choice([8, 78, 132]))
        n = int(rng.integers(max(s_q, 64), 40000))
        L = Launch("x", (n,), s_q=s_q, num_sms=sms)
        most = k.max_splits(L, heads=heads)
        for chunks in {1, min(most, n), max(1, min(most, n) // 2)}:
            limit = -(-n // chunks)
            try:
                flashinfer_mla_plan([n], heads=heads, q_lens=s_q, causal=s_q > 1, num_sms=sms, kv_len_limit=limit)
            except ValueError as e:
                assert str(e).startswith("seqlens: request 0"), e  # the causal tile boundary, refused before
    assert k.max_splits(Launch("x", (4096,)), heads=128) == MAX_WORKS


# --- the study and the diff ---------------------------------------------------------------------------------------


def test_the_study_explains_every_change_by_the_chunks():
    rep = invariance("flashinfer-mla", length=1000, heads=16, batchmates=(1, 7), mixed=3, s_q=(1, 2),
                     split_tokens=None, seed=1)
    assert not rep.invariant
    for r in rep.results:
        assert r.same_plan <= r.comparison.bit_exact and (not r.comparison.bit_exact) <= (not r.same_plan)
        assert "kv_len_limit" in r.reason
    assert "each follows a change of its splits" in rep.format()
    w = rep.what_if
    assert w is not None and w.plan == [(0, 1000)] and "none in FlashInfer" in w.description
    k = get_batch_kernel("flashinfer-mla")
    req = k.request(dist="flashmla", seed=1, length=1000, heads=16, s_q=2)
    bits = [k.run(req, r.launch, k.invariant_plans(req, r.launch, 256)[r.launch.position])["out"].view(np.uint16)
            for r in rep.results]
    assert all(np.array_equal(b, bits[0]) for b in bits)  # a fixed chunk length: one answer in every launch
    json.dumps(rep.to_dict())


def test_the_same_total_kv_gives_the_same_bits():
    """Three different batches whose totals give one chunk length: the request's bits are one answer."""
    k = FlashInferMLA()
    launches = [Launch("a", (1200, 900)), Launch("b", (1200, 300, 300, 300), position=0),
                Launch("c", (5, 1200, 1, 894), position=1)]
    rep = invariance(k, launches=launches, length=1200, heads=16, seed=4)
    assert len({describe_plan(r.plan) for r in rep.results}) == 1 and rep.invariant


def test_diff_against_fa3_names_the_arithmetic_after_the_schedule():
    d = kernel_diff("flashinfer-mla", "fa3-mla", length=2048, heads=16)
    assert not d.identical and d.comparison.first_difference == "out"
    assert d.plans[0] != d.plans[1] and d.aligned is not None  # FlashInfer under FA3's plan: the bits still part
    assert d.aligned.first_difference is not None
    assert d.differing_steps == ["schedule", "exp", "row sum", "LSE", "combine"]
    assert "the first modelled difference after the schedule is 'exp'" in d.explanation
    same = kernel_diff("flashinfer-mla", "flashinfer-mla:num_sms=78", length=2048, heads=16)
    assert same.differing_steps == ["schedule"] and same.explanation.startswith("the schedule")


def test_cli_invariance_and_diff(capsys):
    assert main(["invariance", "--kernel", "flashinfer-mla", "--length", "1000", "--heads", "16", "--batchmates",
                 "1", "--mixed", "0"]) == 3
    out = capsys.readouterr().out
    assert "kv_len_limit 64, the request's 1000 keys in 16 chunks" in out
    assert main(["diff", "--kernel", "flashinfer-mla", "--kernel", "fa3-mla", "--length", "512", "--heads",
                 "16"]) == 3
    assert "after the schedule is 'exp'" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--heads", "128", "--num-sms", "132,1"], "--num-sms: 1 SM holds no cluster of 2 CTAs"),
    (["--num-sms", "132,400000"], "--num-sms: 400000 SMs stage .* int workspace"),
    (["--sq", "3", "--heads", "48", "--length", "65"], "--heads, --sq: request 0 .* would drop key 64"),
    (["--length", "64", "--heads", "128", "--batchmates", "20000", "--mixed", "0"],
     "--batchmates, --sq, --heads: 20001 requests of 1 query tile of 128 rows, more work items"),
])
def test_cli_refuses_naming_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["invariance", "--kernel", "flashinfer-mla", *(["--length", "256"] if "--length" not in argv else []),
              *(["--heads", "16"] if "--heads" not in argv else []), *argv])
    assert e.value.code != 0
    import re
    assert re.search(msg, capsys.readouterr().err)


def test_a_plan_flashinfer_cannot_cut_is_refused():
    k = FlashInferMLA()
    req = k.request(dist="normal:1", seed=0, length=500, heads=16, s_q=1)
    for plan in ([(0, 100), (100, 300), (300, 500)], [(0, 200), (200, 400)], [(64, 500)]):
        with pytest.raises(ValueError, match="plan: FlashInfer cuts"):
            k.run(req, Launch("x", (500,)), plan)


# --- the device check ---------------------------------------------------------------------------------------------


def _capture_of_the_model(path: Path, k: FlashInferMLA, *, flip: int | None = None) -> None:
    """A capture as scripts/capture_invariance.py writes it, holding the model's own bits (bit `flip` of launch
    1's out changed)."""
    c = FLASHINFER_CHECK
    launches = flashinfer_launches()
    req = k.request(dist=c["dist"], seed=c["seed"], length=c["length"], heads=c["heads"], s_q=2)
    arrays = {}
    for i, L in enumerate(launches):
        raw = k.raw(req, L, k.plans(req, L)[L.position])
        out = raw["out"].view(np.uint16).copy()
        if flip is not None and i == 1:
            out.reshape(-1)[flip] ^= 1
        p = flashinfer_mla_plan(list(L.lengths), heads=c["heads"], q_lens=L.s_q, causal=L.s_q > 1)
        arrays |= {f"{CAPTURE_PREFIX}_l{i}_out": out, f"{CAPTURE_PREFIX}_l{i}_lse": raw["lse"].view(np.uint32),
                   f"{CAPTURE_PREFIX}_l{i}_plan": np.asarray(p.info, np.int64),
                   f"{CAPTURE_PREFIX}_l{i}_work": np.concatenate(list(p.arrays().values())).astype(np.int32)}
    meta = {"kernel": "flashinfer-mla", "device": "the model", "flashinfer": "0.7.2", "num_sms": 132,
            "seed_offset": 0, "launches": [{**L.to_dict(), "runs_identical": True} for L in launches]}
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), **arrays)


def test_the_replay_reads_the_scripts_capture_and_finds_a_flipped_bit(tmp_path, monkeypatch):
    """The replay on a capture of the script's layout holding the model's bits (a small request): every launch
    bit-exact; one bit flipped is found in its launch; a capture of other launches is refused."""
    monkeypatch.setitem(FLASHINFER_CHECK, "length", 600)
    monkeypatch.setitem(FLASHINFER_CHECK, "heads", 16)
    k = FlashInferMLA()
    _capture_of_the_model(tmp_path / "ok.npz", k)
    rows = replay_flashinfer(tmp_path / "ok.npz")
    assert len(rows) == len(flashinfer_launches()) and all(rep.bit_exact for _, rep in rows)
    _capture_of_the_model(tmp_path / "flip.npz", k, flip=100)
    bad = [label for label, rep in replay_flashinfer(tmp_path / "flip.npz") if not rep.bit_exact]
    assert bad == [flashinfer_launches()[1].label]
    from amla_sim.crosscheck.files import CaptureError

    with np.load(tmp_path / "ok.npz") as z:
        arrays = dict(z)
    meta = json.loads(str(arrays.pop("meta")))
    meta["launches"][2]["lengths"] = [600, 2]
    np.savez(tmp_path / "other.npz", meta=np.array(json.dumps(meta)), **arrays)
    with pytest.raises(CaptureError, match="not flashinfer_launches"):
        replay_flashinfer(tmp_path / "other.npz")
    meta["launches"][2]["lengths"] = [600] + [1] * 7
    del arrays[f"{CAPTURE_PREFIX}_l3_lse"]
    np.savez(tmp_path / "short.npz", meta=np.array(json.dumps(meta)), **arrays)
    with pytest.raises(CaptureError, match="holds no flashinfer_l3_lse"):
        replay_flashinfer(tmp_path / "short.npz")



@needs_capture
def test_every_launch_of_the_device_check_is_predicted_bit_for_bit():
    rows = replay_flashinfer(CAPTURE)
    assert [label for label, _ in rows] == [L.label for L in flashinfer_launches(
        read_capture(CAPTURE)[0]["seed_offset"], read_capture(CAPTURE)[0]["num_sms"])]
    for label, rep in rows:
        assert rep.bit_exact, f"{label}:\n{rep}"
        assert [s.name for s in rep.stages] == ["out", "lse"] and rep.stages[0].size == 128 * 512


@needs_capture
def test_the_device_ran_each_launch_twice_with_the_same_bytes_and_the_models_plan():
    meta, z = read_capture(CAPTURE)
    assert meta["kernel"] == "flashinfer-mla" and meta["flashinfer"] == "0.7.2"
    assert all(r["runs_identical"] for r in meta["launches"])
    heads = FLASHINFER_CHECK["heads"]
    for i, L in enumerate(flashinfer_launches(meta["seed_offset"], meta["num_sms"])):
        p = flashinfer_mla_plan(list(L.lengths), heads=heads, q_lens=L.s_q, causal=L.s_q > 1, num_sms=L.num_sms)
        np.testing.assert_array_equal(z[f"{CAPTURE_PREFIX}_l{i}_plan"], np.asarray(p.info, np.int64))
        np.testing.assert_array_equal(z[f"{CAPTURE_PREFIX}_l{i}_work"], np.concatenate(list(p.arrays().values())))


@needs_capture
def test_the_device_shows_the_batch_dependence_predicted_before_its_run():
    """The captured bits are the predictions written before the run (this file's PREDICTED: elements changed
    against the request alone on 132 SMs, with the first seed): the controls leave every bit, the other launches
    change about half the row's outputs."""
    meta, z = read_capture(CAPTURE)
    if meta["num_sms"] != 132 or meta["seed_offset"] != 0:
        pytest.skip(f"the predictions are for 132 SMs and the first seed; the capture has {meta['num_sms']} SMs, "
                    f"seed offset {meta['seed_offset']}")
    ref = z[f"{CAPTURE_PREFIX}_l0_out"]
    for i, (label, _, _, changed, *crcs) in enumerate(PREDICTED):
        assert int((z[f"{CAPTURE_PREFIX}_l{i}_out"] != ref).sum()) == changed, label
        for stage, crc in zip(("out", "lse"), crcs):
            assert zlib.crc32(np.ascontiguousarray(z[f"{CAPTURE_PREFIX}_l{i}_{stage}"]).tobytes()) == crc, (label,
                                                                                                            stage)
