"""FlashAttention-3's MHA-form MLA prefill (q/k 192, v 128) and vLLM's chained prefill, bit for bit: an H200's
captures of vLLM 0.33.0's shipped ``_vllm_fa3_C`` through ``scripts/capture_prefill.py`` (the case table at seed 0
and, held out, at seed 1000; vLLM's chain with its ``merge_attn_states``), replayed; the model against exact
attention on the golden machine; a request's split count changed by a batchmate, on the device; each modelled
choice shown to matter; bad input refused by name."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from amla_sim.algorithms.deployed.fa3 import scheduler
from amla_sim.algorithms.deployed.fa3.prefill import cu_seqlens, fa3_prefill, prefill_schedule
from amla_sim.algorithms.deployed.vllm.mla_prefill import plan_context_chunks, vllm_mla_prefill, workspace_rows
from amla_sim.crosscheck import replay
from amla_sim.crosscheck.fa3_prefill import PREFILL_CASES, prefill_inputs
from amla_sim.crosscheck.files import CaptureError
from amla_sim.crosscheck.prefill_chain import chain_inputs

prefill = importlib.import_module("amla_sim.algorithms.deployed.fa3.prefill")
DATA = Path(__file__).parent / "data"
CAPTURE, HELD_OUT, CHAIN = (DATA / f for f in ("fa3_prefill_h200.npz", "fa3_prefill_seed2000_h100.npz",
                                               "vllm_prefill_chain_h200.npz"))


def _load(path: Path) -> tuple[dict, dict]:
    with np.load(path) as z:
        return json.loads(str(z["meta"])), {k: z[k] for k in z.files if k != "meta"}


@pytest.mark.parametrize("path", [CAPTURE, HELD_OUT], ids=["h200-seed0", "h100-seed2000"])
def test_the_capture_is_predicted_in_every_bit(path, fastest_engine):
    report = replay(path)
    assert report.kernel == "fa3-prefill" and len(report.cases) == len(PREFILL_CASES)
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()
    assert sum(len(row.stages) == 3 for row in report.cases) >= 5  # the split counts compared where dynamic


def test_vllms_chain_is_predicted_in_every_bit(fastest_engine):
    report = replay(CHAIN)
    assert report.kernel == "vllm-prefill-chain" and len(report.cases) == 3
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()


def test_the_captures_cover_the_calls():
    """Causal new-token calls and context-chunk calls; 8 to 128 heads and grouped heads; BF16 and FP16; num_splits
    0 (1 to 6 splits a request) and 1; requests of no key and a chunk of none; every launch repeatable. The chain:
    a request of no context, a context cut and continued twice, one chunk for the batch."""
    meta, arrays = _load(CAPTURE)
    cases = meta["cases"]
    assert meta["device"] == "NVIDIA H200" and all(c["repeat_identical"] for c in cases)
    assert {c["causal"] for c in cases} == {True, False} and {c["format"] for c in cases} == {"bf16", "fp16"}
    assert {c["heads"] for c in cases} == {8, 16, 32, 128} and any(c["heads_k"] < c["heads"] for c in cases)
    splits = {int(s) for k, a in arrays.items() if k.endswith("_splits") for s in a}
    assert splits == {1, 3, 5, 6}
    assert any(0 in c["seqlens"] and max(c["seqlens"]) > 0 for c in cases)
    assert any(max(c["seqlens"]) == 0 for c in cases)
    chain, _ = _load(CHAIN)
    plans = [plan_context_chunks(c["context_lens"], c["workspace"], block_size=c["block_size"])
             for c in chain["cases"]]
    assert [len(p) for p in plans] == [4, 1, 2] and sum(ch.is_continuation for p in plans for ch in p) == 3
    assert all(c["repeat_identical"] for c in chain["cases"])


def test_a_batchmate_changes_a_requests_split_count_and_its_bits():
    """Cases 4 and 5 hold the same request (128 queries over a context chunk of 1500 keys, 16 heads): alone it is
    split six ways, beside a request of 3000 keys three ways; the device's bits of its rows differ, and the model
    predicts both (the replay above)."""
    meta, arrays = _load(CAPTURE)
    assert meta["cases"][4]["seed"] == meta["cases"][5]["seed"]
    q4, k4, _ = prefill_inputs(meta["cases"][4])
    q5, k5, _ = prefill_inputs(meta["cases"][5])
    assert np.array_equal(q4.view(np.uint16), q5[:128].view(np.uint16))
    assert np.array_equal(k4.view(np.uint16), k5[:1500].view(np.uint16))
    assert arrays["c4_splits"].tolist() == [6] and arrays["c5_splits"].tolist() == [3, 5]
    alone, beside = arrays["c4_out"], arrays["c5_out"][:128]
    assert 0 < np.mean(alone != beside) < 0.5


@pytest.mark.parametrize("causal", [True, False])
def test_the_model_is_attention_on_golden(causal):
    """On golden: each query's output and LSE are exact attention over its keys (bottom-right causal), with the
    API's FP32 scale; grouped heads share their KV head; a request of no key writes out 0 and LSE -inf."""
    rng = np.random.default_rng(3)
    ql, kl = [5, 130, 1], ([5, 130, 1] if causal else [300, 0, 7])
    q = rng.standard_normal((sum(ql), 4, 192))
    k, v = rng.standard_normal((sum(kl), 2, 192)), rng.standard_normal((sum(kl), 2, 128))
    bf = prefill.get_format("bf16").dtype
    q, k, v = (x.astype(bf) for x in (q, k, v))
    res = fa3_prefill(q, k, v, cu_seqlens(ql), cu_seqlens(kl), causal=causal, machine="golden")
    sc = float(np.float32(192 ** -0.5))
    for i, (a, b) in enumerate(zip(cu_seqlens(ql)[:-1], cu_seqlens(ql)[1:])):
        ka, kb = cu_seqlens(kl)[i], cu_seqlens(kl)[i + 1]
        for h in range(4):
            Q, K, V = (x.astype(float) for x in (q[a:b, h], k[ka:kb, h // 2], v[ka:kb, h // 2]))
            if kb == ka:
                assert (res.out[a:b, h] == 0).all() and np.isneginf(res.lse[h, a:b]).all()
                continue
            S = Q @ K.T * sc
            if causal:
                S = np.where(np.arange(kb - ka)[None, :] <= np.arange(b - a)[:, None] + (kb - ka) - (b - a), S,
                             -np.inf)
            m = S.max(1, keepdims=True)
            P = np.exp(S - m)
            np.testing.assert_allclose(res.out[a:b, h], P @ V / P.sum(1, keepdims=True), rtol=1e-12, atol=1e-13)
            np.testing.assert_allclose(res.lse[h, a:b], (m + np.log(P.sum(1, keepdims=True)))[:, 0], rtol=1e-12)


def test_a_k_of_no_row_writes_out_zero_and_lse_plus_infinity():
    """``mha_fwd`` launches nothing when k has no row (flash_api.cpp:1281-1309); a k with rows but requests of no
    key runs the kernel, whose empty tiles write LSE -inf (captured: case 6)."""
    q = np.ones((3, 2, 192), prefill.get_format("bf16").dtype)
    k, v = np.zeros((0, 2, 192), q.dtype), np.zeros((0, 2, 128), q.dtype)
    res = fa3_prefill(q, k, v, [0, 3], [0, 0])
    assert (res.out == 0).all() and np.isposinf(res.lse).all()


def test_the_split_choice_follows_the_launch():
    """The bound from ``get_num_splits`` as if the batch were its longest request; per request the prepare kernel's
    count over the whole batch's blocks; 128 heads never split; more than 992 requests never split."""
    assert prefill_schedule([128], [1500], heads=16, heads_k=16, d=192, dv=128, num_splits=0, causal=False,
                            max_seqlen_q=128, max_seqlen_k=1500) == (7, [6], True)
    assert prefill_schedule([128, 128], [1500, 3000], heads=16, heads_k=16, d=192, dv=128, num_splits=0,
                            causal=False, max_seqlen_q=128, max_seqlen_k=3000)[1] == [3, 5]
    assert prefill_schedule([128], [60000], heads=128, heads_k=128, d=192, dv=128, num_splits=0, causal=False,
                            max_seqlen_q=128, max_seqlen_k=60000)[0] == 1
    many = prefill_schedule([1] * 993, [4000] * 993, heads=16, heads_k=16, d=192, dv=128, num_splits=8,
                            causal=False, max_seqlen_q=1, max_seqlen_k=4000)
    assert many[0] == 1 and set(many[1]) == {1}
    assert scheduler.varlen_splits([1], [12], num_head=16, bound=7) == [6]


def test_vllms_workspace_and_chunk_plan():
    """``determine_chunked_prefill_workspace_size``; a request cut at a page multiple and continued; a request of no
    context in no chunk; a chunk ends at a request of no context."""
    assert workspace_rows(4096, 256, 16) == 32768 and workspace_rows(163840, 256, 64) == 65536
    plans = plan_context_chunks([100, 5000, 0, 30], 2048, block_size=64)
    assert [(p.request_start, p.request_end, p.starts, p.seq_lens, p.is_continuation) for p in plans] == [
        (0, 2, (0, 0), (100, 1920), False), (1, 2, (1920,), (2048,), True), (1, 2, (3968,), (1032,), True),
        (3, 4, (0,), (30,), False)]
    assert plan_context_chunks([0, 0], 1024) == []


# --- each choice matters ----------------------------------------------------------------------------------


def _lanes_in_order(mc, part, s, P):
    acc = P[..., 0] if part is None else mc.mul_add(part[..., 0], s, P[..., 0])
    for j in range(1, P.shape[-1]):
        acc = mc.f(acc + P[..., j])
    return np.stack([acc, 0 * acc, 0 * acc, 0 * acc], axis=-1)


def _tiles(size: int, tile: tuple[int, int]) -> dict:
    """The tile table with the 192 / 128 tile of `size`-byte inputs replaced, causal or not."""
    return {**prefill.PREFILL_TILES, **{(192, 128, size, causal, False): tile for causal in (False, True)}}


CHOICES = {
    "key blocks of 64, not 128": (1, ("PREFILL_TILES", _tiles(2, (128, 64)))),
    "key blocks of 176": (10, ("PREFILL_TILES", _tiles(2, (128, 176)))),
    "one lane sums a row in order": (0, ("lane_sums", _lanes_in_order)),
}


@pytest.mark.parametrize("change", sorted(CHOICES))
def test_each_choice_matters(change, monkeypatch, fastest_engine):
    """The replay of a case fails when one of the model's choices is replaced by a plausible other."""
    case, swap = CHOICES[change]
    monkeypatch.setattr(prefill, *swap)
    meta, arrays = _load(CAPTURE)
    c = meta["cases"][case]
    keep, qpk = c["keep_heads"], c["heads"] // c["heads_k"]
    q, k, v = prefill_inputs(c)
    res = fa3_prefill(q[:, :keep], k[:, :keep // qpk], v[:, :keep // qpk], cu_seqlens(c["qlens"]), cu_seqlens(c["seqlens"]),
                      scale=c["scale"], causal=c["causal"], num_splits=c["num_splits"], launch_heads=c["heads"])
    same = (np.mean(res.out.view(np.uint16) == arrays[f"c{case}_out"]),
            np.mean(res.lse.astype(np.float32).view(np.uint32) == arrays[f"c{case}_lse"]))
    assert min(same) < 1, same


def test_the_split_count_matters():
    """Case 2's first request split three ways; computed in one split, other bits."""
    meta, arrays = _load(CAPTURE)
    c = meta["cases"][2]
    q, k, v = prefill_inputs(c)
    res = fa3_prefill(q[:, :2], k[:, :2], v[:, :2], cu_seqlens(c["qlens"]), cu_seqlens(c["seqlens"]), scale=c["scale"],
                      splits=[1, 1], launch_heads=16)
    assert np.mean(res.out.view(np.uint16) == arrays["c2_out"]) < 1


@pytest.mark.parametrize("change", ["one chunk a request", "the merges with fast math"])
def test_each_chain_choice_matters(change, monkeypatch):
    """vLLM's chain case 0 (a context cut at the workspace and continued): with the context in one chunk, or the
    merges on a fast-math build, other bits."""
    meta, arrays = _load(CHAIN)
    c = dict(meta["cases"][0])
    inputs, _ = chain_inputs(c)
    q, k, v, kc, vc = (x[:, :4] for x in inputs)
    if change == "one chunk a request":
        c["workspace"] = 65536
    else:
        mp = importlib.import_module("amla_sim.algorithms.deployed.vllm.mla_prefill")
        fast = mp.vllm_merge_attn_states

        def merge(*a, **kw):
            return fast(*a, **kw, machine="sm90-cuda")

        monkeypatch.setattr(mp, "vllm_merge_attn_states", merge)
    res = vllm_mla_prefill(q, k, v, kc, vc, c["qlens"], c["context_lens"], workspace=c["workspace"],
                           block_size=c["block_size"], scale=c["scale"], num_splits=c["num_splits"], launch_heads=16)
    assert np.mean(res.out.view(np.uint16) == arrays["c0_out"]) < 1


# --- bad input --------------------------------------------------------------------------------------------

_BF = prefill.get_format("bf16").dtype
_Q, _K, _V = np.zeros((4, 2, 192), _BF), np.zeros((4, 2, 192), _BF), np.zeros((4, 2, 128), _BF)


@pytest.mark.parametrize(("args", "kw", "match"), [
    ((_Q.astype(np.float32), _K, _V, [0, 4], [0, 4]), {}, "q: FA3 takes BF16, FP16 or FP8 E4M3"),
    ((_Q, _K.astype(np.float16), _V, [0, 4], [0, 4]), {}, "k, v: the same format"),
    ((_Q, _K, _V[..., :64], [0, 4], [0, 4]), {}, "v: head dim 64 with q's 192: FA3 takes another V head dim only"),
    ((_Q[..., :100], _K[..., :100], _V[..., :100], [0, 4], [0, 4]), {}, "q: head_size should be a multiple of 8"),
    ((_Q, _K[:, :1].repeat(3, 1)[:, :3], _V[:, :1].repeat(3, 1), [0, 4], [0, 4]), {}, "k: its heads"),
    ((_Q, _K, _V, [0, 5], [0, 4]), {}, "cu_seqlens_q: offsets must rise"),
    ((_Q, _K, _V, [0, 2, 4], [0, 4]), {}, "cu_seqlens_k: 2 offsets for 2 requests"),
    ((_Q, _K, _V, [0, 4], [0, 4]), {"max_seqlen_k": 3}, "max_seqlen_k"),
    ((_Q, _K, _V, [0, 4], [0, 4]), {"num_splits": 300}, "num_splits"),
    ((_Q, _K, _V, [0, 4], [0, 4]), {"launch_heads": 1}, "launch_heads"),
    ((_Q, _K, _V, [0, 4], [0, 4]), {"splits": [1, 2]}, "splits: one split count a request"),
    ((_Q, _K, _V, [0, 4], [0, 4]), {"causal": None}, "causal: expected True or False"),
    ((_Q, _K, _V, [0, 4], [0, 4]), {"softcap": "fifty"}, "softcap: expected a float32 number"),
    ((_Q, _K, _V, [0, 4], [0, 4]), {"window_size": (1.5, 0)}, r"window_size: expected \(left, right\) ints"),
    ((_Q, _K, _V, [0, 4], [0, 4]), {"window_size": 3}, "window_size: expected"),
])
def test_bad_input_is_refused_by_name(args, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fa3_prefill(*args, **kw)


def test_the_chain_refuses_by_name():
    with pytest.raises(ValueError, match="context_lens: one a request"):
        vllm_mla_prefill(_Q, _K, _V, _K, _V, [4], [2, 2], workspace=1024)
    with pytest.raises(ValueError, match="k_context, v_context: 8 rows"):
        vllm_mla_prefill(_Q, _K, _V, _K, _V, [2, 2], [4, 4], workspace=1024)
    with pytest.raises(ValueError, match="workspace"):
        plan_context_chunks([100], 8, block_size=16)


@pytest.mark.parametrize(("args", "kw", "match"), [
    ((_K, _V, [4], [2, 2]), {}, "prefix_lens: one a request"),
    ((_K, _V, [2, 2], [4, 4]), {}, "k_prefix, v_prefix: 8 rows"),
    ((_K[:, :1], _V, [4], [2]), {}, r"k_prefix: expected \(P, 2, 192\)"),
    ((_K, _V.astype(np.float32), [4], [2]), {}, "v_prefix: expected"),
    ((_K, _V, [4], [2]), {"mode": "two-shot"}, "mode: expected one of"),
    ((_K, _V, [4], [2]), {"capacity": 0}, "capacity"),
    ((_K, _V, [2, 2], [2, 2]), {"mode": "chunked", "capacity": 1}, "capacity: 1 tokens give 2 requests no prefix"),
])
def test_sglangs_chain_refuses_by_name(args, kw, match):
    from amla_sim.algorithms.deployed.sglang.mha_prefill import sglang_mla_prefill

    with pytest.raises(ValueError, match=match):
        sglang_mla_prefill(_Q, _K, _V, *args, **kw)


# --- FP8 E4M3 (vLLM's FP8 prefill) -----------------------------------------------------------------------

FP8 = DATA / "fa3_prefill_e4m3_h200.npz"


def test_the_fp8_capture_is_predicted_in_every_bit(fastest_engine):
    """vLLM's FP8 prefill (q, k, v cast to E4M3, no descale; out BF16): causal and context-chunk calls, split
    dynamically and not, 16 and 64 heads."""
    report = replay(FP8)
    meta, _ = _load(FP8)
    assert {c["format"] for c in meta["cases"]} == {"e4m3"} and len(report.cases) == 4
    assert {c["causal"] for c in meta["cases"]} == {True, False} and all(c["repeat_identical"] for c in meta["cases"])
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()
    assert sum(len(row.stages) == 3 for row in report.cases) == 2  # split counts compared


def _fp8_case(case: int):
    import ml_dtypes

    meta, arrays = _load(FP8)
    c = meta["cases"][case]
    keep = c["keep_heads"]
    q, k, v = (x[:, :keep].astype(ml_dtypes.float8_e4m3fn) for x in prefill_inputs(c))
    res = fa3_prefill(q, k, v, cu_seqlens(c["qlens"]), cu_seqlens(c["seqlens"]), scale=c["scale"], causal=c["causal"],
                      num_splits=c["num_splits"], launch_heads=c["heads"])
    return (np.mean(res.out.view(np.uint16) == arrays[f"c{case}_out"]),
            np.mean(res.lse.astype(np.float32).view(np.uint32) == arrays[f"c{case}_lse"]))


FP8_CHOICES = {
    "key blocks of 160 (the one-level build's)": ("PREFILL_TILES", _tiles(1, (128, 160))),
    "key blocks of 128": ("PREFILL_TILES", _tiles(1, (128, 128))),
    "no offset of 8 before exp2": ("FP8_MAX_OFFSET", 0),
    "O the products' accumulator (one level)": ("_Fp8Units.__init__", "one level"),
}


@pytest.mark.parametrize("change", sorted(FP8_CHOICES))
def test_each_fp8_choice_matters(change, monkeypatch, fastest_engine):
    """Case 2 (200 queries over a 1,500-key chunk, one split) with one FP8 choice replaced: other bits."""
    name, value = FP8_CHOICES[change]
    if value == "one level":  # vLLM's FP8 tiles, O carried through the products' accumulator
        init = prefill._Fp8Units.__init__
        monkeypatch.setattr(prefill._Fp8Units, "__init__", lambda self, *a, **kw: init(self, *a, two_level=False))
    else:
        monkeypatch.setattr(prefill, name, value)
    assert min(_fp8_case(2)) < 1


# --- SGLang's build (sgl-flash-attn cb303cf, SGLang's switches) -------------------------------------------

SGLANG = DATA / "fa3_prefill_sglang_h200.npz"


def test_sglangs_build_is_predicted_in_every_bit(fastest_engine):
    """SGLang's calls (``num_splits`` 1, one KV head a query head) through its own FA3 build: the BF16 table and the
    FP8 calls of an FP8 cache, which it accumulates in one level on 160-key blocks."""
    meta, _ = _load(SGLANG)
    cases = meta["cases"]
    assert {c["build"] for c in cases} == {"sglang"} and {c["num_splits"] for c in cases} == {1}
    assert {c["format"] for c in cases} == {"bf16", "e4m3"} and all(c["repeat_identical"] for c in cases)
    report = replay(SGLANG)
    assert len(report.cases) == 14
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()


@pytest.mark.parametrize(("path", "case", "other"), [(SGLANG, 12, "vllm"), (FP8, 2, "sglang")],
                         ids=["sglang-as-vllm", "vllm-as-sglang"])
def test_the_fp8_build_matters(path, case, other, fastest_engine):
    """The same FP8 call under the other build's arithmetic (two-level on 96-key blocks, or one level on 160): other
    bits, both ways."""
    import ml_dtypes

    meta, arrays = _load(path)
    c = meta["cases"][case]
    keep = c["keep_heads"]
    q, k, v = (x[:, :keep].astype(ml_dtypes.float8_e4m3fn) for x in prefill_inputs(c))
    res = fa3_prefill(q, k, v, cu_seqlens(c["qlens"]), cu_seqlens(c["seqlens"]), scale=c["scale"], causal=c["causal"],
                      num_splits=c["num_splits"], launch_heads=c["heads"], build=other)
    assert np.mean(res.out.view(np.uint16) == arrays[f"c{case}_out"]) < 1


def test_the_builds_agree_on_bf16():
    """The BF16 path is the same arithmetic in both builds: the model gives one answer (SGLang's capture replays
    under either)."""
    meta, arrays = _load(SGLANG)
    c = meta["cases"][3]
    q, k, v = prefill_inputs(c)
    got = [fa3_prefill(q[:, :1], k[:, :1], v[:, :1], cu_seqlens(c["qlens"]), cu_seqlens(c["seqlens"]),
                       scale=c["scale"], num_splits=1, launch_heads=c["heads"], build=b).out.view(np.uint16)
           for b in ("vllm", "sglang")]
    assert np.array_equal(got[0], got[1]) and np.array_equal(got[0], arrays["c3_out"])


# --- head dim 128 (Llama- and Qwen-class models) ----------------------------------------------------------

HD128 = DATA / "fa3_prefill_hd128_h200.npz"


def test_head_dim_128_is_predicted_in_every_bit(fastest_engine):
    """The same library at q, k and v 128 wide: grouped heads (32 over 8), the 64-row tile of one MMA warpgroup
    (causal and not), FP16, FP8 with and without one warpgroup, splits from the heuristic and ``num_splits`` 1."""
    meta, _ = _load(HD128)
    cases = meta["cases"]
    assert {c["head_dim"] for c in cases} == {128} and {c["format"] for c in cases} == {"bf16", "fp16", "e4m3"}
    assert any(c["heads_k"] < c["heads"] for c in cases) and all(c["repeat_identical"] for c in cases)
    assert sum(prefill.use_one_mma_wg(128, max(c["qlens"]), c["heads"] // c["heads_k"]) for c in cases) == 3
    report = replay(HD128)
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()


@pytest.mark.parametrize(("case", "key", "tile"), [
    (6, (128, 128, 2, False, False), (128, 176)),  # the one-warpgroup tile's key blocks on a two-warpgroup launch
    (2, (128, 128, 2, False, True), (64, 160)),  # and the other way
], ids=["two-warpgroups-176", "one-warpgroup-160"])
def test_head_dim_128s_tiles_matter(case, key, tile, monkeypatch):
    meta, arrays = _load(HD128)
    c = meta["cases"][case]
    monkeypatch.setattr(prefill, "PREFILL_TILES", {**prefill.PREFILL_TILES, key: tile})
    keep = c["keep_heads"]
    q, k, v = prefill_inputs(c)
    res = fa3_prefill(q[:, :keep], k[:, :keep], v[:, :keep], cu_seqlens(c["qlens"]), cu_seqlens(c["seqlens"]),
                      scale=c["scale"], causal=c["causal"], num_splits=c["num_splits"], launch_heads=c["heads"])
    assert np.mean(res.out.view(np.uint16) == arrays[f"c{case}_out"]) < 1


HDX = DATA / "fa3_prefill_hdx_h200.npz"


def test_head_dims_64_96_and_256_are_predicted_in_every_bit(fastest_engine):
    """The same library at q, k and v 64, 96 and 256 wide (``scripts/capture_prefill.py --only hdx``): 192-row tiles,
    one warpgroup's 64-row tile, grouped heads, FP16 and FP8, splits of up to 25 from the heuristic and
    ``num_splits`` 1."""
    meta, _ = _load(HDX)
    cases = meta["cases"]
    assert {c["head_dim"] for c in cases} == {64, 96, 256} and {c["format"] for c in cases} == {"bf16", "fp16", "e4m3"}
    assert all(c["repeat_identical"] for c in cases) and any(c["heads_k"] < c["heads"] for c in cases)
    report = replay(HDX)
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()


@pytest.mark.parametrize(("case", "key", "tile"), [
    (0, (64, 64, 2, True, False), (128, 128)),  # 192 rows an m-block (three MMA warpgroups), not 128
    (5, (256, 256, 2, True, False), (128, 128)),  # 80-key blocks, not 128
    (3, (96, 96, 2, True, False), (192, 128)),  # 144-key blocks, not 128
], ids=["hd64-192-rows", "hd256-80-keys", "hd96-144-keys"])
def test_the_other_head_dims_tiles_matter(case, key, tile, monkeypatch):
    monkeypatch.setattr(prefill, "PREFILL_TILES", {**prefill.PREFILL_TILES, key: tile})
    assert _share(HDX, case) < 1


def test_the_invariance_study_gives_the_devices_launches(fastest_engine):
    """``amla-sim invariance --kernel fa3-prefill``: its request (seed 305, 128 queries over 1,500 keys, 16 heads) is
    cases 4 and 5 of the capture; alone it is cut in six splits, beside a request of 3,000 keys in three, and the
    study's bits of its last query are the device's in both launches."""
    from amla_sim.invariance import Launch, get_batch_kernel, invariance

    k = get_batch_kernel("fa3-prefill")
    req = k.request(dist="normal:1", seed=305, length=1500, heads=16, s_q=128)
    meta, arrays = _load(CAPTURE)
    launches = [Launch("alone", (1500,), s_q=128), Launch("beside 3000 keys", (1500, 3000), s_q=128)]
    for case, launch, splits in ((4, launches[0], 6), (5, launches[1], 3)):
        plan = k.plans(req, launch)[0]
        assert len(plan) == splits
        got = k.run(req, launch, plan)
        assert np.array_equal(got["out"][:2].view(np.uint16), arrays[f"c{case}_out"][127])
        assert np.array_equal(got["lse"][:2].astype(np.float32).view(np.uint32), arrays[f"c{case}_lse"][:, 127])
    whole = fa3_prefill(**k.batch(req, launches[1]), trace=True)  # the launch as a device runs it, batchmate drawn
    assert whole.trace["splits"][0] == 3 and np.array_equal(whole.out[127, :2].view(np.uint16), arrays["c5_out"][127])
    report = invariance("fa3-prefill", length=1500, heads=16, dist="normal:1", seed=305, launches=[
        Launch("alone", (1500,), s_q=128), Launch("beside 3000 keys", (1500, 3000), s_q=128)])
    assert not report.invariant and "3 splits" in report.format()


def test_the_study_refuses_a_decodes_request():
    from amla_sim.invariance import kernel_diff

    with pytest.raises(ValueError, match="kernel: fa3-prefill's request is per-head q, k and v"):
        kernel_diff("fa3-mla", "fa3-prefill", length=256, heads=16)


# --- SGLang's chained prefill -----------------------------------------------------------------------------

SGLANG_CHAIN = DATA / "sglang_prefill_chain_h200.npz"


def test_sglangs_chain_is_predicted_in_every_bit(fastest_engine):
    """SGLang's MHA prefill through its FA3 build and its fast-math ``merge_state_v2``: one shot (prefixes and new
    tokens in one causal call) and chunked (five and four prefix chunks merged in as the prefix operand), BF16 and
    E4M3: every output bit and the merged LSE."""
    meta, _ = _load(SGLANG_CHAIN)
    assert meta["kernel"] == "sglang-prefill-chain" and all(c["repeat_identical"] for c in meta["cases"])
    assert {c["mode"] for c in meta["cases"]} == {"one-shot", "chunked"}
    report = replay(SGLANG_CHAIN)
    assert len(report.cases) == 4
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()


@pytest.mark.parametrize("change", ["vLLM's merge order", "the merges without fast math", "chunks of the capacity"])
def test_each_sglang_chain_choice_matters(change, monkeypatch):
    """Case 1 (three requests, five prefix chunks): merged with the accumulator as the prefix operand, on a precise
    build, or in chunks of the whole capacity a request (not capacity // batch), other bits."""
    mp = importlib.import_module("amla_sim.algorithms.deployed.sglang.mha_prefill")
    merge = mp.sglang_merge_state_v2
    if change == "vLLM's merge order":
        monkeypatch.setattr(mp, "sglang_merge_state_v2", lambda a, sa, b, sb: merge(b, sb, a, sa))
    elif change == "the merges without fast math":
        monkeypatch.setattr(mp, "sglang_merge_state_v2", lambda *a: merge(*a, machine="sm90-cuda-precise"))
    else:
        chunks = mp.prefix_chunks
        monkeypatch.setattr(mp, "prefix_chunks", lambda lens, cap: chunks(lens, cap * len(lens)))
    from amla_sim.crosscheck.prefill_chain import _run_sglang, sglang_chain_inputs

    meta, arrays = _load(SGLANG_CHAIN)
    c = meta["cases"][1]
    res = _run_sglang(c, tuple(x[:, :2] for x in sglang_chain_inputs(c)[0]))
    assert np.mean(res.out.view(np.uint16) == arrays["c1_out"]) < 1


def test_sglangs_prefix_chunks():
    """``prepare_chunked_prefix_cache_info``: L = capacity // batch tokens of every prefix a chunk."""
    from amla_sim.algorithms.deployed.sglang.mha_prefill import prefix_chunks

    assert prefix_chunks([1500, 400, 0], 1024) == [([0, 0, 0], [341, 341, 0]), ([341] * 3, [341, 59, 0]),
                                                   ([682] * 3, [341, 0, 0]), ([1023] * 3, [341, 0, 0]),
                                                   ([1364] * 3, [136, 0, 0])]
    assert prefix_chunks([0, 0]) == []


def test_fp8_descales_against_scaled_attention():
    """The descales (not captured: vLLM's FP8 prefill passes none) against an independent oracle on the golden
    machine: ``q_descale * k_descale`` scales the scores and ``v_descale`` the output, per request and KV head."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(0, 1, s).astype(ml_dtypes.float8_e4m3fn) for s in ((50, 4, 192), (300, 2, 192),
                                                                             (300, 2, 128)))
    ql, kl = [20, 30], [100, 200]
    # powers of two for q and k, so that the oracle's scale (the API's FP32) is the product exactly
    qd, kd = (np.exp2(rng.integers(-2, 3, (2, 2))).astype(np.float32) for _ in range(2))
    vd = rng.uniform(0.5, 2, (2, 2)).astype(np.float32)
    assert (qd * kd != 1).any()
    res = fa3_prefill(q, k, v, cu_seqlens(ql), cu_seqlens(kl), scale=0.125, q_descale=qd, k_descale=kd,
                      v_descale=vd, machine="golden")
    for i, (rows, keys) in enumerate(((slice(0, 20), slice(0, 100)), (slice(20, 50), slice(100, 300)))):
        for hk in range(2):
            heads = slice(2 * hk, 2 * hk + 2)
            one = fa3_prefill(q[rows, heads], k[keys, hk:hk + 1], v[keys, hk:hk + 1], cu_seqlens([ql[i]]),
                              cu_seqlens([kl[i]]), scale=0.125 * float(qd[i, hk]) * float(kd[i, hk]), machine="golden")
            assert res.out.dtype == np.float64  # the golden machine rounds nothing
            np.testing.assert_allclose(res.out[rows, heads], one.out * vd[i, hk], rtol=1e-12, atol=1e-300)
            np.testing.assert_allclose(res.lse[heads, rows], one.lse, rtol=1e-12)


@pytest.mark.parametrize(("kw", "match"), [
    ({"q_descale": np.ones((3, 2), np.float32)}, r"q_descale: expected a float array of shape \(batch, h_k\)"),
    ({"v_descale": np.ones((1, 2), np.int32)}, "v_descale: expected a float array"),
    ({"build": "tgi"}, "build: expected one of vllm, sglang"),
])
def test_fp8_arguments_are_refused_by_name(kw, match):
    import ml_dtypes

    z = np.zeros((4, 2, 192), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=match):
        fa3_prefill(z, z, z[..., :128], [0, 4], [0, 4], **kw)


PAD = DATA / "fa3_prefill_pad_h200.npz"


def test_head_dims_between_the_compiled_ones_are_predicted_in_every_bit(fastest_engine):
    """Head dims FA3 runs on the next compiled kernel, their columns past the call's read as zero
    (``scripts/capture_prefill.py --only pad``): 48, 80, 120 and 200, v narrower than q at 64 and 144, the 192 / 192
    kernel at 160, 176 and 192; BF16, FP16 and FP8. The same at fresh seeds (+ 1000) gave every bit too."""
    meta, _ = _load(PAD)
    dims = {(c["head_dim"], c["head_dim_v"]) for c in meta["cases"]}
    assert {(80, 80), (120, 120), (144, 112), (160, 160), (192, 192), (64, 32), (176, 176)} <= dims
    assert {c["format"] for c in meta["cases"]} == {"bf16", "fp16", "e4m3"}
    report = replay(PAD)
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()


@pytest.mark.parametrize(("d", "dv", "size", "kernel"), [
    (48, 48, 2, (64, 64)), (64, 32, 2, (64, 64)), (80, 80, 2, (96, 96)), (120, 120, 2, (128, 128)),
    (136, 104, 2, (192, 128)), (144, 128, 1, (192, 128)), (160, 160, 2, (192, 192)), (176, 176, 1, (192, 192)),
    (200, 200, 2, (256, 256)), (64, 200, 2, (64, 256)), (64, 264, 2, (64, 512)), (48, 96, 1, (64, 64)),
    (64, 256, 1, (64, 64)),
])
def test_a_call_runs_on_the_kernel_fa3_picks(d, dv, size, kernel):
    """flash_api.cpp's dispatch: each head dim up to the next compiled one, v to its own step where it differs."""
    assert prefill.kernel_dims(d, dv, size) == kernel


@pytest.mark.parametrize(("d", "dv", "size", "match"), [
    (100, 100, 2, "q: head_size should be a multiple of 8"), (120, 120, 1, "q: head_size should be a multiple of 16"),
    (264, 264, 2, "q: FlashAttention forward only supports head dimension at most 256"),
    (96, 64, 2, "v: head dim 64 with q's 96"), (192, 96, 2, "v: head dim 96 with q's 192"),
    (64, 520, 2, "v: head dim 520 with q's 64"), (64, 272, 1, "v: head dim 272 over 256 with FP8 inputs"),
])
def test_head_dims_fa3_refuses_are_refused_by_name(d, dv, size, match):
    with pytest.raises(ValueError, match=match):
        prefill.kernel_dims(d, dv, size)


WIDE = DATA / "fa3_prefill_wide_h200.npz"


def test_a_v_wider_than_q_is_predicted_in_every_bit(fastest_engine):
    """FA3's 64 / 256 kernel (128 x 96 tiles) and its 64 / 512 kernel (64 x 64, v's columns over two warpgroups),
    padded calls among them (48 / 200, 64 / 320), splits from the heuristic and ``num_splits`` 1
    (``scripts/capture_prefill.py --only wide``, one head or group a call kept), and six of them at fresh seeds
    (+ 1000; the other two gave every bit there too)."""
    meta, _ = _load(WIDE)
    assert {prefill.kernel_dims(c["head_dim"], c["head_dim_v"]) for c in meta["cases"]} == {(64, 256), (64, 512)}
    assert {c["num_splits"] for c in meta["cases"]} == {0, 1} and any(c["heads_k"] < c["heads"] for c in meta["cases"])
    for path in (WIDE, DATA / "fa3_prefill_wide_seed1000_h200.npz"):
        report = replay(path)
        for row in report.cases:
            assert row.first_difference is None and not row.skipped, report.format()


@pytest.mark.parametrize(("case", "key", "tile"), [
    (0, (64, 256, 2, False, False), (128, 128)),  # 96-key blocks, not 128
    (2, (64, 512, 2, False, False), (128, 64)),  # 64 rows an m-block, not 128
], ids=["64-256-96-keys", "64-512-64-rows"])
def test_the_wide_kernels_tiles_matter(case, key, tile, monkeypatch):
    monkeypatch.setattr(prefill, "PREFILL_TILES", {**prefill.PREFILL_TILES, key: tile})
    assert _share(WIDE, case) < 1


def _share(path: Path, case: int, **kw) -> float:
    """The share of case `case`'s output bits in the capture at `path` that the model gives."""
    meta, arrays = _load(path)
    c = meta["cases"][case]
    keep, qpk = c["keep_heads"], c["heads"] // c["heads_k"]
    q, k, v = prefill_inputs(c)
    res = fa3_prefill(q[:, :keep], k[:, :keep // qpk], v[:, :keep // qpk], cu_seqlens(c["qlens"]),
                      cu_seqlens(c["seqlens"]), scale=c["scale"], causal=c["causal"], num_splits=c["num_splits"],
                      launch_heads=c["heads"], **kw)
    return float(np.mean(res.out.view(np.uint16) == arrays[f"c{case}_out"]))


def test_the_padded_kernels_choices_matter(monkeypatch):
    """One warpgroup's tile is FA3's choice for the call's head dim, not the kernel's: at d = 120 and 20 query rows
    the 128 kernel's one-warpgroup tile gives other bits; the 192 / 192 kernel's 96-key blocks, not 192 / 128's
    128."""
    one_wg = prefill.use_one_mma_wg
    monkeypatch.setattr(prefill, "use_one_mma_wg",
                        lambda d, mq, qpk, local=False, build="vllm": one_wg(prefill.kernel_dims(d, d)[0], mq, qpk,
                                                                             local, build))
    assert _share(PAD, 1) < 1
    monkeypatch.setattr(prefill, "use_one_mma_wg", one_wg)
    tiles = {k: prefill.PREFILL_TILES[(192, 128) + k[2:]] if k[:2] == (192, 192) else t
             for k, t in prefill.PREFILL_TILES.items()}
    monkeypatch.setattr(prefill, "PREFILL_TILES", tiles)
    assert _share(PAD, 3) < 1


@pytest.mark.parametrize(("edit", "match"), [
    ({"q_descale": 0.5}, "q_descale: only an E4M3 call takes descales"),
    ({"format": "e4m3", "v_descale": "one"}, "v_descale: expected a float32 number"),
    ({"format": "e4m3", "k_descale": True}, "k_descale: expected a float32 number"),
    ({"head_dim": 100}, "head_dim: head_size should be a multiple of 8"),
    ({"head_dim": 96, "head_dim_v": 64}, "v: head dim 64 with q's 96"),
    ({"softcap": "fifty"}, "softcap: expected a float32 number"),
    ({"softcap": float("inf")}, "softcap: expected a finite number"),
    ({"window": [128]}, r"window: expected \[left, right\]"),
    ({"window": [-2, 0]}, "window: expected an int >= -1"),
])
def test_a_recipe_the_prefill_does_not_take_is_refused_by_name(edit, match):
    """A capture's recipe with descales on a 16-bit call, a descale that is no number, or head dims FA3 refuses."""
    from amla_sim.crosscheck.fa3_prefill import FA3_PREFILL

    with pytest.raises(ValueError, match=f"^{match}"):
        FA3_PREFILL.check({**FA3_PREFILL.scale_template(), **edit})


WINDOW = DATA / "fa3_prefill_window_h200.npz"


def test_local_windows_are_predicted_in_every_bit(fastest_engine):
    """``window_size`` through vLLM's library (``scripts/capture_prefill.py --only window``): causal and
    context-chunk calls, windows of one key to 4,000, grouped heads, splits of up to 21, FP16, FP8 at 256, the MLA
    prefill's 192 / 128, one query, and (-1, 0) on a non-causal call (causal); the same at fresh seeds (+ 1000)."""
    meta, _ = _load(WINDOW)
    assert {tuple(c["window"]) for c in meta["cases"]} >= {(0, 0), (-1, 0), (4000, 10), (1000, -1)}
    for path in (WINDOW, DATA / "fa3_prefill_window_seed1000_h200.npz"):
        report = replay(path)
        for row in report.cases:
            assert row.first_difference is None and not row.skipped, report.format()


@pytest.mark.parametrize("change", ["no-unmasked-blocks", "block-aligned", "unwindowed-tiles", "full-keys-split"])
def test_each_window_choice_matters(change, monkeypatch):
    """Each part of the local model, in its other form, gives other bits: the mainloop's unmasked blocks (with
    intra-warpgroup overlap its bounds count the request's keys, not the m-block's after its offset: case 4, whose
    rows 384-466 then read keys past their window), key blocks aligned to kBlockN rather than to the m-block's first
    key, the causal tiles, the split heuristic over every key rather than those the window loads."""
    case = {"no-unmasked-blocks": 4, "block-aligned": 5, "unwindowed-tiles": 1, "full-keys-split": 3}[change]
    if change == "no-unmasked-blocks":
        monkeypatch.setattr(prefill, "_request_frame", lambda d, dv, size, build="vllm": False)
    elif change == "block-aligned":
        monkeypatch.setattr(prefill, "_n_offset", lambda *a: 0)
    elif change == "unwindowed-tiles":
        monkeypatch.setattr(prefill, "LOCAL_TILES", {})
    else:
        schedule = prefill.prefill_schedule
        monkeypatch.setattr(prefill, "prefill_schedule", lambda *a, **kw: schedule(
            *a, **{**kw, "local": None if kw.get("local") is None else (kw["max_seqlen_k"], 0)}))
    assert _share(WINDOW, case) < 1


SOFTCAP = DATA / "fa3_prefill_softcap_h200.npz"


def test_softcaps_are_predicted_in_every_bit(fastest_engine):
    """``softcap`` through vLLM's library (``scripts/capture_prefill.py --only caps,caps-seed``): caps of 5 to 50 at
    head dims 96, 128, 192 / 128 and 256, BF16 and FP8, a context chunk that splits, caps with local windows; the
    scores through MUFU.TANH (:mod:`amla_sim.arith.tanh`); the same at fresh seeds (+ 1000)."""
    for path in (SOFTCAP, DATA / "fa3_prefill_softcap_seed1000_h200.npz"):
        meta, _ = _load(path)
        assert all(c["softcap"] > 0 for c in meta["cases"])
        report = replay(path)
        for row in report.cases:
            assert row.first_difference is None and not row.skipped, report.format()


def test_the_softcaps_tanh_matters(monkeypatch):
    """The correctly rounded tanh in place of MUFU.TANH's gives other bits in every softcap call."""
    mla = importlib.import_module("amla_sim.algorithms.deployed.fa3.mla")
    monkeypatch.setattr(mla, "tanh_approx", lambda x: np.tanh(np.asarray(x, np.float64)).astype(np.float32))
    report = replay(SOFTCAP)
    assert all(row.first_difference is not None for row in report.cases), report.format()


@pytest.mark.parametrize("cap", [0.0, -3.0, float("nan")])
def test_a_softcap_of_zero_below_or_nan_is_none(cap):
    """``SOFTCAP_SWITCH(params.softcap > 0.0)``: 0, a negative cap and NaN run the kernel without one."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((40, 2, 64)).astype(ml_dtypes.bfloat16) for _ in range(3))
    plain = fa3_prefill(q, k, v, [0, 40], [0, 40], causal=True)
    capped = fa3_prefill(q, k, v, [0, 40], [0, 40], causal=True, softcap=cap)
    assert np.array_equal(plain.out.view(np.uint16), capped.out.view(np.uint16))
    assert np.array_equal(plain.lse, capped.lse)


SGL128 = DATA / "fa3_prefill_sglang_hd128_h200.npz"


def test_sglangs_build_at_head_dim_128_is_predicted_in_every_bit(fastest_engine):
    """Head dim 128 through SGLang's build as its ``fa3`` backend calls it (``num_splits`` 1, BF16;
    ``scripts/capture_prefill.py --only sglang-hd128``): grouped heads, one warpgroup, context chunks; with vLLM's
    fork's 160-key blocks in place of its 176 the three non-causal calls of two warpgroups part."""
    meta, arrays = _load(SGL128)
    assert {c.get("build") for c in meta["cases"]} == {"sglang"} and {c["head_dim"] for c in meta["cases"]} == {128}
    report = replay(SGL128)
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()


def test_sglangs_tiles_matter(monkeypatch):
    fork = prefill.prefill_tile
    monkeypatch.setattr(prefill, "sgl_tile", lambda d, dv, size, **kw: (*fork(d, dv, size, "vllm", **kw), True))
    report = replay(SGL128, cases=[0, 3])
    assert all(row.first_difference is not None for row in report.cases), report.format()




SGL_MHA = DATA / "fa3_prefill_sglang_mha_h200.npz"


def test_sglangs_build_at_the_mha_head_dims_is_predicted_in_every_bit(fastest_engine):
    """SGLang's build at head dims 64, 96, 128 and 256, BF16 and E4M3, as its ``fa3`` backend calls it
    (``num_splits`` 1; ``scripts/capture_prefill.py --only sglang-mha,sglang-mha-seed``): grouped heads, one
    warpgroup, local windows (one warpgroup in one too), FP8's one-level tiles; the same at fresh seeds (+ 1000)."""
    meta, _ = _load(SGL_MHA)
    cases = meta["cases"]
    assert {c["build"] for c in cases} == {"sglang"} and {c["num_splits"] for c in cases} == {1}
    assert {(c["head_dim"], c["format"]) for c in cases} == {(d, f) for d in (64, 96, 128, 256)
                                                            for f in ("bf16", "e4m3")}
    assert sum(c.get("window", [-1, -1]) != [-1, -1] for c in cases) == 11
    for path in (SGL_MHA, DATA / "fa3_prefill_sglang_mha_seed1000_h200.npz"):
        report = replay(path)
        for row in report.cases:
            assert row.first_difference is None and not row.skipped, report.format()


@pytest.mark.parametrize(("change", "cases"), [
    ("the-forks-tiles", [3, 4, 14, 17, 19]),  # 64's local 192-key blocks; FP8 at 64 and 128 (one level, 160 / 224)
    ("the-forks-bare-blocks", [12, 13]),  # unmasked blocks bounded by the request's keys, not the m-block's
], ids=["the-forks-tiles", "the-forks-bare-blocks"])
def test_sglangs_choices_matter(change, cases, monkeypatch, fastest_engine):
    """SGLang's build in the fork's form gives other bits: its tiles (``sgl_tile``) at 64 in a window and in FP8,
    and its local mainloop's bounds (``seqlen_k - n_offset`` in every kernel)."""
    from amla_sim.algorithms.deployed.fa3 import prefill

    if change == "the-forks-tiles":
        fork = prefill.prefill_tile
        monkeypatch.setattr(prefill, "sgl_tile", lambda d, dv, size, **kw: (*fork(d, dv, size, "vllm", **kw), True))
    else:
        monkeypatch.setattr(prefill, "_request_frame", lambda d, dv, size, build="vllm": True)
    report = replay(SGL_MHA, cases=cases)
    assert all(row.first_difference is not None for row in report.cases), report.format()


WIDE_FP8 = DATA / "fa3_prefill_wide_fp8_h200.npz"


def test_an_fp8_v_wider_than_q_is_the_64_64_kernels(fastest_engine):
    """An FP8 v wider than q at q <= 64 (``scripts/capture_prefill.py --only wide-fp8``; vLLM's library): the
    dispatch's 64 / 64 FP8 kernel reads v's first 64 columns and writes the output's first 64, which the model
    gives in every bit (the LSE and the splits too); the columns past 64 are what the output's buffer held (the
    capture's first call ran twice with other bytes there), NaN in the model and counted, and the replay says it
    compares the written columns only."""
    meta, arrays = _load(WIDE_FP8)
    assert {c["format"] for c in meta["cases"]} == {"e4m3"} and all(c["head_dim_v"] > 64 for c in meta["cases"])
    assert meta["cases"][0]["repeat_identical"] is False
    report = replay(WIDE_FP8)
    assert report.bit_exact, report.format()
    assert all(any(st.name.startswith("out[..., :64] (the kernel leaves columns 64-") for st in row.stages)
               for row in report.cases), report.format()
    c = meta["cases"][2]
    q, k, v = (x.astype(ml_dtypes.float8_e4m3fn) for x in prefill_inputs(c))
    res = fa3_prefill(q[:, :1], k[:, :1], v[:, :1], cu_seqlens(c["qlens"]), cu_seqlens(c["seqlens"]),
                      scale=c["scale"], causal=c["causal"], launch_heads=c["heads"])
    assert np.isnan(res.out[..., 64:].astype(np.float32)).all() and res.hazards["unwritten_columns"] == 40 * 32


def test_an_fp8_v_over_256_at_q_64_is_refused_as_upstream_refuses_it():
    q = np.zeros((4, 2, 64), np.float32).astype(ml_dtypes.float8_e4m3fn)
    v = np.zeros((4, 2, 320), np.float32).astype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match="v: head dim 320 over 256 with FP8 inputs"):
        fa3_prefill(q, q, v, [0, 4], [0, 4])


def test_a_softcap_on_the_golden_machine_is_the_exact_tanh():
    """MUFU.TANH is an FP32 unit: the golden machine takes the exact tanh (close to the H200's bits, not equal)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((40, 2, 64)).astype(ml_dtypes.bfloat16) for _ in range(3))
    gold = fa3_prefill(q, k, v, [0, 40], [0, 40], causal=True, softcap=3.0, machine="golden")
    sm90 = fa3_prefill(q, k, v, [0, 40], [0, 40], causal=True, softcap=3.0)
    a, b = gold.out.astype(np.float64), sm90.out.astype(np.float64)
    assert np.allclose(a, b, rtol=0.02, atol=0.02) and not np.array_equal(a, b)
