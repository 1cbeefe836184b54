"""DeepSeek V3.2's sparse kernels in the invariance study (:mod:`amla_sim.invariance.v32`): a query token and its
top-k list is the request, the launch's other tokens its batchmates. FA3's sparse call cuts the token by a split
count from the whole launch, exactly as ``fa3_schedule`` gives it, and its bits change exactly when that cut does;
FlashMLA's sparse prefill kernel has no split, and the token's bits are the same alone and inside any launch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FASTEST

from amla_sim.algorithms.deployed.fa3.scheduler import fa3_schedule
from amla_sim.algorithms.deployed.fa3.sparse import fa3_mla_sparse
from amla_sim.algorithms.deployed.flashmla.sparse_prefill import flashmla_sparse_prefill
from amla_sim.cli import main
from amla_sim.engine import use_engine
from amla_sim.invariance import Launch, get_batch_kernel, invariance, kernel_diff
from amla_sim.invariance.v32 import Fa3MLASparse, FlashMLASparsePrefill

LENGTH, HEADS = 1024, 16  # the token under study: 1024 valid keys of V3.2's topk 2048, 16 heads


def bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.fixture(scope="module", autouse=True)
def _fastest_engine():
    with use_engine(FASTEST):
        yield


# (label, lengths: the token first, its batchmates after, FA3's split count for the token)
LAUNCHES = [
    ("alone", (LENGTH,), 16),
    ("1 batchmate of its length", (LENGTH,) * 2, 16),
    ("8 tokens of its length", (LENGTH,) * 8, 8),
    ("8 tokens, 7 of 64 keys", (LENGTH,) + (64,) * 7, 16),
    ("8 tokens, 7 of 3000 (2048 keys)", (LENGTH,) + (3000,) * 7, 8),
    ("100 tokens of its length", (LENGTH,) * 100, 2),
    ("100 tokens, 99 of 64 keys", (LENGTH,) + (64,) * 99, 16),
    ("100 tokens, 99 of 128 keys", (LENGTH,) + (128,) * 99, 8),
    ("1000 tokens of its length", (LENGTH,) * 1000, 1),
    ("1000 tokens, 999 of 64 keys", (LENGTH,) + (64,) * 999, 1),
]


def _study(kernel: str):
    return invariance(kernel, length=LENGTH, heads=HEADS, seed=3,
                      launches=[Launch(label, lens) for label, lens, _ in LAUNCHES])


@pytest.fixture(scope="module")
def fa3_study():
    return _study("fa3-mla-sparse")


@pytest.fixture(scope="module")
def prefill_study():
    return _study("flashmla-sparse-prefill")


# --- FA3's sparse call: the plan is fa3_schedule's ----------------------------------------------------------------


@pytest.mark.parametrize("lengths, heads, num_sms, num_kv_splits, topk, counts", [
    ((2048,), 128, 132, None, 2048, [16]),
    ((2048,) * 3, 128, 132, None, 2048, [16] * 3),
    ((4096, 2048, 700, 64, 1), 64, 132, None, 2048, [16, 16, 11, 1, 1]),  # past topk: topk keys
    ((2048,) + (64,) * 99, 64, 132, None, 2048, [16] + [1] * 99),
    ((300,) * 8, 16, 114, None, 2048, [5] * 8),
    ((1500, 200, 5000), 128, 132, 4, 2048, [4] * 3),
    ((1500, 200, 5000), 128, 132, 1, 2048, [1] * 3),
    ((640,) * 993, 16, 132, None, 2048, [1] * 993),  # more than 992 tokens: none split
    ((640, 100, 900), 32, 78, None, 512, [4, 2, 4]),
    ((256,), 16, 132, None, 2048, [4]),  # the bound comes from topk: a list of 4 blocks splits ...
    ((256,), 16, 132, None, 256, [1]),  # ... and would not, were max_seqlen_k its own length
])
def test_the_fa3_plan_is_fa3_schedules(lengths, heads, num_sms, num_kv_splits, topk, counts):
    k = Fa3MLASparse()
    req = k.request(dist="normal:1", seed=0, length=lengths[0], heads=heads, s_q=1, topk=topk)
    L = Launch("x", lengths, num_sms=num_sms, num_kv_splits=num_kv_splits)
    valid = [min(n, topk) for n in lengths]
    sched = fa3_schedule(valid, s_q=1, heads=heads, page_size=1, max_seqlen_k=topk, num_splits=num_kv_splits or 0,
                         num_sms=num_sms)
    want = [[(lo * 64, min(hi * 64, v)) for lo, hi in sched.blocks(i, v, 0, s_q=1, heads=heads) if hi > lo]
            for i, v in enumerate(valid)]
    assert k.plans(req, L) == want
    assert [len(p) for p in want] == counts
    assert all(p[-1][1] == v and p[0][0] == 0 for p, v in zip(want, valid))  # every key, once


@pytest.mark.parametrize("lengths, position", [((LENGTH,) * 8, 3), ((64,) * 7 + (LENGTH,), 7)])
def test_the_fa3_token_alone_under_its_plan_is_its_row_of_the_whole_launch(lengths, position):
    """The adapter runs the token alone under the launch's plan; the kernel's model over every token of the
    launch (``fa3_mla_sparse(**batch)``) gives its row the same bits, and the same split count."""
    k = Fa3MLASparse()
    req = k.request(dist="flashmla", seed=3, length=LENGTH, heads=HEADS, s_q=1)
    L = Launch("x", lengths, position=position)
    res = fa3_mla_sparse(**k.batch(req, L), trace=True)
    plan = k.plans(req, L)[position]
    (ranges, _), = res.trace["split_blocks"][position]  # the model's own cut of the token: block ranges
    assert plan == [(lo * 64, min(hi * 64, LENGTH)) for lo, hi in ranges if hi > lo]
    mine = k.run(req, L, plan)
    assert np.array_equal(bits(res.out[position]), bits(mine["out"]))
    assert np.array_equal(bits(res.lse[:, position]), bits(mine["lse"]))


# --- a token alone and in launches of 1, 8, 100 and 1000 tokens ---------------------------------------------------


@pytest.mark.parametrize("i", range(len(LAUNCHES)), ids=[lab for lab, _, _ in LAUNCHES])
def test_fa3_bits_change_exactly_when_the_split_count_does(fa3_study, i):
    label, lengths, count = LAUNCHES[i]
    ref, r = fa3_study.results[0], fa3_study.results[i]
    assert len(r.plan) == count and r.plan[-1][1] == LENGTH
    assert r.same_plan == (count == len(ref.plan))
    assert r.comparison.bit_exact == r.same_plan, (label, r.changed)
    if not r.same_plan:
        assert r.changed["out"] > 0.1 * HEADS * 512 and f"{count} split" in r.reason
    # one cut, one answer: every launch of this cut gives these bits, whoever its batchmates are
    for other in fa3_study.results:
        if other.plan == r.plan:
            assert np.array_equal(bits(other.bits["out"]), bits(r.bits["out"]))


def test_a_different_count_that_cuts_alike_changes_no_bit():
    """A token of 2048 keys and 64 heads: alone FA3 gives it 28 splits, beside 99 tokens of 64 keys 16; both cut
    its 32 blocks into 16 of 2 (the 12 others empty), so its bits agree."""
    k = Fa3MLASparse()
    rep = invariance(k, length=2048, heads=64, seed=1, launches=[Launch("alone", (2048,)),
                                                                 Launch("100", (2048,) + (64,) * 99)])
    alone, mates = rep.results
    assert alone.reason.endswith("28 splits, 16 with keys") and mates.reason.endswith(": 16 splits")
    assert alone.plan == mates.plan == [(128 * i, 128 * i + 128) for i in range(16)]
    assert mates.comparison.bit_exact and rep.invariant


def test_num_splits_1_is_batch_invariant(fa3_study):
    k = Fa3MLASparse()
    rep = invariance(k, length=LENGTH, heads=HEADS, seed=3, batchmates=(7, 99), mixed=None, num_kv_splits=(1,),
                     split_tokens=None)
    assert [len(r.plan) for r in rep.results] == [16, 8, 2, 1]
    assert not rep.invariant and rep.what_if.plan == [(0, LENGTH)]
    assert np.array_equal(bits(rep.results[-1].bits["out"]), bits(fa3_study.results[-1].bits["out"]))  # 1000 tokens
    assert not rep.what_if.against_kernel.bit_exact  # one split is not the 16 of the token alone


# --- FlashMLA's sparse prefill: never -----------------------------------------------------------------------------


@pytest.mark.parametrize("i", range(len(LAUNCHES)), ids=[lab for lab, _, _ in LAUNCHES])
def test_the_prefill_plan_and_bits_never_change(prefill_study, i):
    r = prefill_study.results[i]
    assert r.plan == [(0, LENGTH)] and r.same_plan and r.comparison.bit_exact
    assert prefill_study.invariant


@pytest.mark.parametrize("lengths, position, num_sms, heads, topk", [
    ((512,), 0, 132, HEADS, 2048),
    ((512,) * 8, 5, 132, HEADS, 2048),
    ((64,) * 99 + (512,), 99, 114, HEADS, 2048),
    ((512, 700, 200), 0, 132, 128, 512),  # a batchmate past topk attends topk keys
])
def test_the_prefill_token_alone_is_its_row_of_the_whole_launch(lengths, position, num_sms, heads, topk):
    """The model run of the token alone equals its row of the model run over the whole launch, bit for bit."""
    k = FlashMLASparsePrefill()
    req = k.request(dist="flashmla", seed=4, length=512, heads=heads, s_q=1, topk=topk)
    L = Launch("x", lengths, position=position, num_sms=num_sms)
    assert k.plans(req, L) == [[(0, min(n, topk))] for n in lengths]
    alone = k.run(req, Launch("alone", (512,)), [(0, 512)])
    res = flashmla_sparse_prefill(**k.batch(req, L), build="upstream")  # the build the kernel model predicts
    assert np.array_equal(bits(res.out[position, :heads]), bits(alone["out"]))
    assert np.array_equal(bits(res.lse[position, :heads]), bits(alone["lse"]))


# --- diff: the numerics each states --------------------------------------------------------------------------------


@pytest.mark.parametrize("a, b, differing", [
    ("fa3-mla", "fa3-mla-sparse", ["schedule"]),
    ("flashmla-sparse-prefill", "flashmla", ["schedule", "combine"]),
])
def test_the_diff_explains_by_the_schedule(a, b, differing):
    d = kernel_diff(a, b, length=LENGTH, heads=HEADS)
    assert not d.identical and d.differing_steps == differing
    assert d.aligned is not None and d.aligned.bit_exact
    assert d.explanation.startswith("the schedule")


# --- the command --------------------------------------------------------------------------------------------------


def test_the_command_fa3_sparse(capsys):
    assert main(["invariance", "--kernel", "fa3-mla-sparse", "--length", str(LENGTH), "--heads", str(HEADS),
                 "--seed", "3", "--batchmates", "1,7", "--mixed", "0", "--num-kv-splits", "1",
                 "--split-tokens", "one"]) == 3
    out = capsys.readouterr().out
    assert "with 7 batchmates of its length" in out and "8 splits of 128" in out and "1 split of 1024" in out
    assert "verdict: 2 of 3 launches change the request's bits; each follows a change of its splits" in out
    assert "what-if, num_splits = 1" in out


def test_the_command_sparse_prefill(capsys):
    assert main(["invariance", "--kernel", "flashmla-sparse-prefill", "--length", str(LENGTH), "--heads",
                 str(HEADS), "--batchmates", "1,7", "--mixed", "2", "--num-sms", "132,114", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["invariant"] and len(rep["results"]) == 6 and rep["request"]["valid"] == LENGTH
    assert all(r["plan"] == [[0, LENGTH]] and r["same_plan"] for r in rep["results"])


@pytest.mark.parametrize("kernel", ["fa3-mla-sparse", "flashmla-sparse-prefill"])
@pytest.mark.parametrize("length, valid, topk", [(300, 300, 2048), (2048, 2048, 2048), (4096, 2048, 2048),
                                                  (4096, 512, 512)])
def test_length_is_the_tokens_context_and_its_list_is_topk_wide(kernel, length, valid, topk):
    """--length: the token's context; it attends min(length, topk) rows of it, itself (the last) first."""
    req = get_batch_kernel(kernel).request(dist="normal:1", seed=2, length=length, heads=16, s_q=1, topk=topk)
    idx = req.arrays["indices"]
    assert req.length == length and req.recipe["valid"] == valid and idx.shape == (1, topk)
    assert idx[0, 0] == length - 1 and (idx[0, valid:] == -1).all()
    assert len(set(idx[0, :valid].tolist())) == valid and 0 <= idx[0, :valid].min()
    assert req.arrays["kv"].shape == (length, 576)


@pytest.fixture
def no_work(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a plan was built or a request drawn before the flags were checked")

    for cls in (Fa3MLASparse, FlashMLASparsePrefill):
        monkeypatch.setattr(cls, "plans", boom)
        monkeypatch.setattr(cls, "request", boom)


@pytest.mark.parametrize("kernel, argv, message", [
    ("fa3-mla-sparse", ["--sq", "1,2"], "--sq: fa3-mla-sparse takes one query a request"),
    ("fa3-mla-sparse", ["--num-kv-splits", "257"], "--num-kv-splits: expected an int in [1, 256]"),
    ("fa3-mla-sparse", ["--split-tokens", "256"], "--split-tokens: FA3 takes a split count"),
    ("fa3-mla-sparse", ["--tokens", "8192"], "--tokens: not an option of fa3-mla-sparse"),
    ("fa3-mla-sparse", ["--format", "fp16"], "--format: not an option of fa3-mla-sparse"),
    ("flashmla-sparse-prefill", ["--heads", "200"], "--heads: flashmla-sparse-prefill takes 1 to 128 heads"),
    ("flashmla-sparse-prefill", ["--num-kv-splits", "2"], "--num-kv-splits: flashmla-sparse-prefill's API takes no"),
    ("flashmla-sparse-prefill", ["--split-tokens", "256"], "--split-tokens: FlashMLA's sparse prefill never splits"),
    ("flashmla-sparse-prefill", ["--max-context-len", "9"], "--max-context-len: not an option of flashmla-sparse"),
    ("flashmla-sparse-prefill", ["--sq", "2"], "--sq: flashmla-sparse-prefill takes one query a request"),
])
def test_bad_flags_are_refused_by_name_before_any_work(no_work, capsys, kernel, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["invariance", "--kernel", kernel, "--length", "256", "--heads", "16", "--mixed", "0", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and message in err, err


@pytest.mark.parametrize("kwargs, match", [
    ({"topk": 200}, "^topk: flashmla-sparse-prefill takes a list of a multiple of 128"),
    ({"topk": 0}, r"^topk: expected an int in \[128, "),
])
def test_a_bad_topk_is_refused_by_name(no_work, kwargs, match):
    with pytest.raises(ValueError, match=match):
        invariance("flashmla-sparse-prefill", length=256, heads=16, mixed=None, **kwargs)
