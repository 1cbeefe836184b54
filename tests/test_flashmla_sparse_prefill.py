"""FlashMLA's sm90 sparse prefill (``flash_mla_sparse_fwd``): the model against FP64 attention over the attended
rows written here (golden within 1e-12, sm90-cuda within BF16), what is masked (-1, >= s_kv, past topk_length,
nothing at all), the attention sink's edges, one token's bits alone and in a batch, refusals by name before any
work, the case table and its inputs, the build's refusal of a folder that is not a checkout; and, once a device
capture is committed, bit for bit with each modelled choice shown to matter."""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amla_sim.algorithms.deployed.flashmla import sparse_prefill as sp
from amla_sim.algorithms.deployed.flashmla.sparse_prefill import flashmla_sparse_prefill
from amla_sim.crosscheck import CaptureError
from amla_sim.crosscheck.flashmla import FLASHMLA_SPARSE_PREFILL, SPARSE_PREFILL_CASES, sparse_prefill_inputs
from amla_sim.crosscheck.kernel import check_recipe

CAPTURE = Path(__file__).parent / "data" / "flashmla_sparse_prefill_h100.npz"

#: token 0: every slot, some -1 and some >= s_kv; token 1: topk_length 0; token 2: its first 64 slots (one pair)
BASE = {"batch": 1, "sq": 3, "heads": 64, "d_qk": 576, "seqlens": [700], "topk": 256, "topk_length": [256, 0, 64],
        "invalid": 0.2, "out_of_range": 0.1, "tail": False, "sink": "edge", "dist": "normal:1", "seed": 3,
        "scale": None}


def _recipe(**change):
    return {**BASE, **change}


def _oracle(q, kv, indices, topk_length, attn_sink, scale):
    """FP64 out, max_logits and lse (natural log) as FlashMLA's tests/ref.py defines them: softmax over the rows
    whose index is in 0..s_kv-1 and whose slot is before topk_length; the sink scales out by exp(lse) / (exp(lse)
    + exp(sink)); a row with nothing: out 0, max_logits -inf, lse +inf."""
    K = kv[:, 0].astype(np.float64)
    idx = indices[:, 0].astype(np.int64)
    ok = (idx >= 0) & (idx < K.shape[0])
    if topk_length is not None:
        ok &= np.arange(idx.shape[1]) < np.asarray(topk_length)[:, None]
    s_q, H, _ = q.shape
    out, ml, lse = np.zeros((s_q, H, 512)), np.full((s_q, H), -np.inf), np.full((s_q, H), np.inf)
    for i in range(s_q):
        rows = K[idx[i, ok[i]]]
        if not len(rows):
            continue
        s = q[i].astype(np.float64) @ rows.T * scale
        ml[i] = s.max(1)
        p = np.exp(s - ml[i][:, None])
        lse[i] = ml[i] + np.log(p.sum(1))
        w = 1.0 if attn_sink is None else 1 / (1 + np.exp(attn_sink.astype(np.float64) - lse[i]))
        out[i] = p @ rows[:, :512] / p.sum(1)[:, None] * np.broadcast_to(w, (H,))[:, None]
    return out, ml, lse


def _bits(res):
    return res.out.view(np.uint16), res.lse.view(np.uint32), res.max_logits.view(np.uint32)


@pytest.fixture(scope="module")
def base():
    inputs = sparse_prefill_inputs(BASE)
    return inputs, flashmla_sparse_prefill(**inputs)


def _scale(d_qk):
    return float(np.float32(d_qk ** -0.5))  # the API's float sm_scale


@pytest.mark.parametrize("d_qk", [576, 512])
def test_golden_is_attention_over_the_attended_rows(d_qk):
    inputs = sparse_prefill_inputs(_recipe(d_qk=d_qk))
    res = flashmla_sparse_prefill(**inputs, machine="golden", build="upstream")  # the FP32 scale, as _scale's
    out, ml, lse = _oracle(**inputs, scale=_scale(d_qk))
    assert res.out.shape == (3, 64, 512) and res.lse.shape == res.max_logits.shape == (3, 64)
    np.testing.assert_allclose(res.out, out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res.max_logits, ml, rtol=1e-12)
    np.testing.assert_allclose(res.lse, lse, rtol=1e-12)


def test_sm90_cuda_is_attention_within_bf16(base):
    inputs, res = base
    out, ml, lse = _oracle(**inputs, scale=_scale(576))
    assert res.out.dtype == ml_dtypes.bfloat16 and res.lse.dtype == res.max_logits.dtype == np.float32
    got = res.out.astype(np.float64)
    for i in (0, 2):
        assert np.linalg.norm(got[i] - out[i]) / np.linalg.norm(out[i]) < 4e-3
        np.testing.assert_allclose(res.lse[i], lse[i], rtol=0, atol=1e-5)
        np.testing.assert_allclose(res.max_logits[i], ml[i], rtol=2e-6, atol=1e-6)
    assert not res.hazards


def test_a_token_with_nothing_to_attend(base):
    """topk_length 0, or every slot -1 or past the cache (a sink of +inf or 0 changes nothing): out 0 (+0 bits),
    max_logits -inf, lse +inf."""
    _, res = base
    assert not res.out[1].view(np.uint16).any()
    assert np.isneginf(res.max_logits[1]).all() and np.isposinf(res.lse[1]).all()
    inputs = sparse_prefill_inputs(_recipe(sq=1, topk=128, topk_length=None))
    inputs["indices"][0, 0, ::2] = -1
    inputs["indices"][0, 0, 1::2] = np.array([700, 2**31 - 1] * 32)
    res = flashmla_sparse_prefill(**inputs)
    assert not res.out.view(np.uint16).any()
    assert np.isneginf(res.max_logits).all() and np.isposinf(res.lse).all()


def test_slots_past_topk_length_are_masked_as_empty_ones():
    """A token attending to its first 100 slots of 256 (two blocks: one pair) has the bits of the same token with
    those slots -1 or past the cache and no topk_length (four blocks: its second pair all empty)."""
    inputs = sparse_prefill_inputs(_recipe(sq=1, topk_length=[100], invalid=0.0, out_of_range=0.0, sink=None))
    short = flashmla_sparse_prefill(**inputs)
    idx = inputs["indices"].copy()
    idx[0, 0, 100::2] = -1
    idx[0, 0, 101::2] = 700 + np.arange(78)
    masked = flashmla_sparse_prefill(inputs["q"], inputs["kv"], idx)
    for a, b in zip(_bits(short), _bits(masked)):
        np.testing.assert_array_equal(a, b)


def test_the_sink_scales_the_output_only():
    """Sinks -inf, +inf and 0 (heads 0-2) and N(6, 4): max_logits and lse bit for bit those without a sink; out
    the same bits at -inf, zeros at +inf, and exp(lse) / (exp(lse) + exp(sink)) of it elsewhere."""
    inputs = sparse_prefill_inputs(_recipe(sq=1, topk=128, topk_length=None))
    sink = inputs["attn_sink"]
    assert np.isneginf(sink[0]) and np.isposinf(sink[1]) and sink[2] == 0
    with_sink = flashmla_sparse_prefill(**inputs)
    without = flashmla_sparse_prefill(**{**inputs, "attn_sink": None})
    np.testing.assert_array_equal(with_sink.lse.view(np.uint32), without.lse.view(np.uint32))
    np.testing.assert_array_equal(with_sink.max_logits.view(np.uint32), without.max_logits.view(np.uint32))
    np.testing.assert_array_equal(with_sink.out[:, 0].view(np.uint16), without.out[:, 0].view(np.uint16))
    assert (with_sink.out[:, 1] == 0).all()  # rO * 0: -0 where O < 0, as the kernel's FP32 multiply gives
    w = 1 / (1 + np.exp(sink[2:].astype(np.float64) - without.lse[0, 2:].astype(np.float64)))
    ref = without.out[0, 2:].astype(np.float64) * w[:, None]
    got = with_sink.out[0, 2:].astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 4e-3
    assert (w < 0.99).any() and (w > 0.01).any()  # the normal sinks do weigh


def test_a_tokens_bits_are_its_own_and_repeatable(base):
    """One CTA per token and no split: each token alone (s_q = 1) gives the bits it has in the batch."""
    inputs, res = base
    for i in range(3):
        alone = flashmla_sparse_prefill(inputs["q"][i:i + 1], inputs["kv"], inputs["indices"][i:i + 1],
                                        topk_length=inputs["topk_length"][i:i + 1], attn_sink=inputs["attn_sink"])
        for a, b in zip(_bits(alone), _bits(res)):
            np.testing.assert_array_equal(a[0], b[i])


def test_128_heads_and_zero_padded_heads():
    """128 heads of MODEL1's 512 dims; heads are independent rows, so zeroing (padding) heads 64-127 leaves the
    first 64 heads' bits, as vLLM and SGLang rely on when they pad fewer heads."""
    inputs = sparse_prefill_inputs(_recipe(sq=1, heads=128, d_qk=512, topk=128, topk_length=None, sink="normal"))
    full = flashmla_sparse_prefill(**inputs)
    q = inputs["q"].copy()
    q[:, 64:] = 0
    padded = flashmla_sparse_prefill(**{**inputs, "q": q})
    for a, b in zip(_bits(full), _bits(padded)):
        np.testing.assert_array_equal(a[:, :64], b[:, :64])
    assert full.out.shape == (1, 128, 512) and np.isfinite(padded.lse).all()


def test_trace():
    inputs = sparse_prefill_inputs(_recipe(sq=2, topk_length=[0, 0]))
    res = flashmla_sparse_prefill(**inputs, machine="golden", trace=True)
    assert list(res.trace["num_blocks"][0]) == [0, 0] and (res.trace["L"][0] == 0).all()
    assert flashmla_sparse_prefill(**inputs).trace == {}


# --- refusals ---------------------------------------------------------------------------------------------------


def _small():
    return sparse_prefill_inputs(_recipe(sq=2, topk=128, topk_length=[128, 5], sink="normal"))


def _set(key, value):
    return lambda a: a.update({key: value(a) if callable(value) else value})


BAD = [
    (_set("q", lambda a: a["q"].astype(np.float32)), TypeError, "^q: the kernel takes BF16"),
    (_set("q", lambda a: a["q"][..., :320]), ValueError, r"^q: expected \(s_q, h_q, 576 or 512\)"),
    (_set("q", lambda a: a["q"][0]), ValueError, r"^q: expected \(s_q, h_q, 576 or 512\)"),
    (_set("q", lambda a: a["q"][:, :32]), ValueError, "^q: the kernel takes h_q = 64 or 128 heads"),
    (_set("q", lambda a: np.concatenate([a["q"]] * 3, axis=1)), ValueError, "^q: the kernel takes h_q = 64 or 128"),
    (_set("kv", lambda a: a["kv"].astype(np.float32)), TypeError, "^kv: the kernel takes BF16"),
    (_set("kv", lambda a: a["kv"][..., :512]), ValueError, r"^kv: expected \(s_kv, 1, 576\)"),
    (_set("kv", lambda a: a["kv"][:, 0]), ValueError, r"^kv: expected \(s_kv, 1, 576\)"),
    (_set("kv", lambda a: np.concatenate([a["kv"]] * 2, axis=1)), ValueError, "^kv: the kernel takes one KV head"),
    (_set("indices", lambda a: a["indices"].astype(np.float32)), ValueError, "^indices: expected ints"),
    (_set("indices", lambda a: a["indices"] > 0), ValueError, "^indices: expected ints"),
    (_set("indices", lambda a: a["indices"][:, 0]), ValueError, "^indices: expected ints"),
    (_set("indices", lambda a: a["indices"][:1]), ValueError, r"^indices: expected ints \(2, 1, topk\)"),
    (_set("indices", lambda a: np.concatenate([a["indices"]] * 2, axis=1)), ValueError, "^indices: expected ints"),
    (_set("indices", lambda a: a["indices"][..., :64]), ValueError, "^indices: topk must be a positive multiple of"),
    (_set("indices", lambda a: np.concatenate([a["indices"]] * 3, axis=2)[..., :192]), ValueError,
     "^indices: topk must be"),
    (_set("indices", lambda a: a["indices"][..., :0]), ValueError, "^indices: topk must be"),
    (_set("topk_length", np.array([129, 5], np.int32)), ValueError, r"^topk_length: expected 2 ints in 0\.\.128"),
    (_set("topk_length", np.array([-1, 5], np.int32)), ValueError, "^topk_length: expected"),
    (_set("topk_length", np.array([5], np.int32)), ValueError, "^topk_length: expected"),
    (_set("topk_length", np.array([5.0, 5.0])), ValueError, "^topk_length: expected"),
    (_set("attn_sink", lambda a: a["attn_sink"].astype(np.float64)), ValueError, r"^attn_sink: expected float32"),
    (_set("attn_sink", lambda a: a["attn_sink"][:32]), ValueError, r"^attn_sink: expected float32 \(64,\)"),
    (_set("attn_sink", np.full(64, np.nan, np.float32)), ValueError, "^attn_sink: expected .* without NaN"),
    (_set("scale", math.nan), ValueError, "^scale: expected a finite float32 number"),
    (_set("scale", math.inf), ValueError, "^scale: expected a finite"),
    (_set("scale", 1e300), ValueError, "^scale: expected a finite"),  # past FP32 (1e-50 rounds to 0: taken)
    (_set("machine", "sm90-triton"), ValueError, "^machine: flashmla-sparse-prefill takes lg2, which sm90-triton does not model"),
    (_set("machine", "h100"), ValueError, "^machine: unknown machine"),
]


@pytest.mark.parametrize("change, error, match", BAD, ids=[m.split(":")[0].strip("^") + str(i)
                                                           for i, (_, _, m) in enumerate(BAD)])
def test_bad_input_is_refused_by_name_before_any_work(change, error, match, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(sp, "_token_rows", boom)
    args = _small()
    change(args)
    with pytest.raises(error, match=match):
        flashmla_sparse_prefill(**args)


def test_any_int_width_of_indices():
    """int64, int16 and uint32 indices (the API takes int32; the values are what count) give the same bits."""
    inputs = sparse_prefill_inputs(_recipe(sq=1, topk=128, topk_length=None, out_of_range=0.0, seqlens=[300]))
    ref = flashmla_sparse_prefill(**inputs, machine="golden")
    for dtype in (np.int64, np.int16):
        got = flashmla_sparse_prefill(**{**inputs, "indices": inputs["indices"].astype(dtype)}, machine="golden")
        np.testing.assert_array_equal(got.out, ref.out)
    unsigned = np.where(inputs["indices"] < 0, 2**32 - 1, inputs["indices"]).astype(np.uint32)  # -1 as uint32
    np.testing.assert_array_equal(flashmla_sparse_prefill(**{**inputs, "indices": unsigned}, machine="golden").out,
                                  ref.out)


# --- the cross-check's case table and build --------------------------------------------------------------------


def _arrays(spec, i, case):
    return {f"c{i}_{n}": np.zeros(shape, dtype) for n, (shape, dtype, _) in spec.outputs(case).items()}


def test_the_case_table_covers_the_kernel():
    """64 and 128 heads, d_qk 576 and 512, topk 128 to 2048, -1 and out-of-range slots, topk_length (0 included),
    sinks with -inf, +inf and 0, three distributions; the capture small (under 3 MB of outputs)."""
    spec = FLASHMLA_SPARSE_PREFILL
    recipes = spec.recipes(0)
    assert len(recipes) == len(SPARSE_PREFILL_CASES) == 8 and spec.name == "flashmla-sparse-prefill"
    for i, r in enumerate(recipes + spec.scale_recipes(0, 1)):
        check_recipe(spec, "test", i, r, _arrays(spec, i, r))
    assert {r["heads"] for r in recipes} == {64, 128} and {r["d_qk"] for r in recipes} == {576, 512}
    assert {128, 512, 2048} <= {r["topk"] for r in recipes} and max(r["sq"] for r in recipes) >= 8
    assert any(0 in (r["topk_length"] or []) for r in recipes) and {r["sink"] for r in recipes} == {None, "normal",
                                                                                                   "edge"}
    assert {"normal:1", "flashmla", "rope-outliers"} <= {r["dist"] for r in recipes}
    assert any(r["tail"] for r in recipes) and not all(r["tail"] for r in recipes)
    assert sum(r["sq"] * r["heads"] * 512 * 2 for r in recipes) < 3e6
    empty = far = 0
    for r in recipes[1:4]:
        idx = sparse_prefill_inputs(r)["indices"]
        empty, far = empty + (idx == -1).sum(), far + (idx >= r["seqlens"][0]).sum()
    assert empty and far


def test_the_inputs_rebuild_from_their_crc():
    from amla_sim.crosscheck.files import input_crc

    r = _recipe(sq=1, topk=128, topk_length=None)
    got = sparse_prefill_inputs(r)
    crc = input_crc(*(a for a in got.values() if a is not None))
    for a, b in zip(got.values(), sparse_prefill_inputs({**r, "input_crc": crc}).values()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(CaptureError, match="do not rebuild"):
        sparse_prefill_inputs({**r, "input_crc": crc ^ 1})


@pytest.mark.parametrize("change, match", [
    ({"heads": 32}, "heads: the kernel takes 64 or 128"),
    ({"d_qk": 320}, "d_qk: the kernel takes 576 or 512"),
    ({"topk": 192}, "topk: the kernel takes a multiple of 128"),
    ({"topk": 64}, "topk: expected an int >= 128"),
    ({"batch": 2, "seqlens": [700, 700]}, "batch: a sparse prefill case is one launch"),
    ({"topk_length": [1, 2]}, "topk_length: 2 lengths for s_q 3"),
    ({"topk_length": [1, 2, 300]}, "topk_length: expected an int in"),
    ({"invalid": 2}, "invalid: a share"),
    ({"sink": "big"}, "sink: expected null"),
])
def test_a_bad_recipe_is_refused_by_name(change, match):
    r = _recipe(**change)
    with pytest.raises(CaptureError, match=match):
        check_recipe(FLASHMLA_SPARSE_PREFILL, "test", 0, r, _arrays(FLASHMLA_SPARSE_PREFILL, 0, r))


def test_the_kernel_is_registered():
    from amla_sim.crosscheck.deployed import KERNELS

    assert KERNELS["flashmla-sparse-prefill"] is FLASHMLA_SPARSE_PREFILL
    text = (Path(__file__).parents[1] / "scripts" / "capture_scales.py").read_text()
    assert '"flashmla-sparse-prefill": ("--flashmla-dir", "FlashMLA")' in text
    assert "flashmla-9241ae3-sparse-prefill-src.tar.xz" in text


def test_a_folder_that_is_not_a_checkout_is_refused(tmp_path):
    from amla_sim.gpu import GPUUnavailable
    from amla_sim.gpu.adapters.flashmla import build_sparse_prefill

    repo = "deepseek-ai/FlashMLA"
    with pytest.raises(FileNotFoundError, match=f"^flashmla-sparse-prefill: .* is not a folder; it should be a {repo}"):
        build_sparse_prefill(tmp_path / "nowhere")
    named = []
    for _ in range(10):  # each missing file named once, then the build goes on to the GPU check
        try:
            build_sparse_prefill(tmp_path)
        except FileNotFoundError as e:
            missing = str(e).rsplit("(it has no ", 1)[1].rstrip(")")
            assert missing not in named
            named.append(missing)
            (tmp_path / missing).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / missing).write_text("")
        except (GPUUnavailable, ImportError):
            break
    assert named[0] == "csrc/api/sparse_fwd.h" and len(named) == 6, named
    assert all(f"csrc/sm90/prefill/sparse/instantiations/phase1_k{d}{t}.cu" in named
               for d in (576, 512) for t in ("", "_topklen"))


# --- against the device ------------------------------------------------------------------------------------------


def _lse_unfused(mc, L, m, ln2):
    return mc.f(mc.f(mc.log2(L) * ln2) + sp._max_logits(mc, m, ln2))


def _lse_max_fused(mc, L, m, ln2):
    return mc.mul_add(m, ln2, mc.f(mc.log2(L) * ln2))


def _lane_sums_in_order(mc, P):
    q = P.reshape(*P.shape[:-1], 8, 4, 2)
    s = np.zeros((*P.shape[:-1], 4), mc.dtype)
    for j in range(8):
        for e in range(2):
            s = mc.f(s + q[..., j, :, e])
    return s


#: the modelled choices (module functions, :data:`sparse_prefill.CHOICES`): a plausible other for each, and the
#: smallest case of the H100 capture whose bits it changes (each changes several cases' bits)
ALTERNATIVES = {
    "wg1-k-in-order": (2, ("_second_wg_scores", sp._first_wg_scores)),
    "lane-sums-in-order": (7, ("_lane_sums", _lane_sums_in_order)),
    "row-total-in-order": (7, ("_row_total", lambda mc, x: mc.f(mc.f(mc.f(x[..., 0] + x[..., 1]) + x[..., 2])
                                                                 + x[..., 3]))),
    "p-unfused": (2, ("_probabilities", lambda mc, S, c, m: mc.exp2(mc.f(mc.f(S * c) - m[..., None])))),
    "sink-fused": (7, ("_sink_term", lambda mc, s, m: mc.exp2(mc.mul_add(s, mc.f(math.log2(math.e)), -m)))),
    "ieee-reciprocal": (5, ("_reciprocal", lambda mc, x: mc.f(np.float64(1.0) / x))),
    "lse-unfused": (7, ("_lse", _lse_unfused)),
    "lse-max-fused": (7, ("_lse", _lse_max_fused)),
}


def test_every_choice_has_an_alternative():
    assert {name for _, (name, _) in ALTERNATIVES.values()} == set(sp.CHOICES)
    assert all(callable(getattr(sp, name)) for name in sp.CHOICES)


@pytest.mark.skipif(not CAPTURE.exists(), reason="no device capture of the sparse prefill committed yet")
def test_bit_exact_against_the_device(fastest_engine):
    from amla_sim.crosscheck import replay

    report = replay(CAPTURE)
    assert report.kernel == "flashmla-sparse-prefill" and report.version == "9241ae3"
    assert report.device == "NVIDIA H100 80GB HBM3" and len(report.cases) == len(SPARSE_PREFILL_CASES)
    for row in report.cases:
        assert row.first_difference is None, report.format()


@pytest.mark.skipif(not CAPTURE.exists(), reason="no device capture of the sparse prefill committed yet")
@pytest.mark.parametrize("change", sorted(ALTERNATIVES))
def test_each_choice_matters(change, monkeypatch, fastest_engine):
    """The replay fails when one modelled choice is replaced by its plausible other (on the case named)."""
    from amla_sim.crosscheck import replay

    case, swap = ALTERNATIVES[change]
    monkeypatch.setattr(sp, *swap)
    report = replay(CAPTURE, cases=[case])
    assert report.cases[0].first_difference is not None, change


# --- where the model stops walking ------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(valid=st.lists(st.integers(0, 384), min_size=1, max_size=3), holes=st.booleans(), lengths=st.booleans(),
       sink=st.booleans(), machine=st.sampled_from(["sm90-cuda", "ieee32", "golden"]), seed=st.integers(0, 2**16))
def test_stopping_after_the_last_attended_pair_changes_no_bit(valid, holes, lengths, sink, machine, seed):
    """The model stops at each token's last pair of blocks with an attended slot; the kernel walks all of them.
    Against the model walking them all (the slow reference), every bit of out, lse and max_logits is the same:
    tokens of 0 to 384 attended slots among 512, their -1 slots at the end or scattered, with and without
    topk_length and a sink, on the device's machine and on exact ones."""
    rng = np.random.default_rng(seed)
    s_q, topk, s_kv = len(valid), 512, 600
    q = rng.standard_normal((s_q, 64, 576)).astype(ml_dtypes.bfloat16)
    kv = rng.standard_normal((s_kv, 1, 576)).astype(ml_dtypes.bfloat16)
    idx = np.full((s_q, 1, topk), -1, np.int32)
    for t, n in enumerate(valid):
        at = np.sort(rng.choice(topk, n, replace=False)) if holes else np.arange(n)
        idx[t, 0, at] = rng.choice(s_kv, n, replace=False)
    kw = dict(topk_length=np.array([min(topk, n + 70) for n in valid]) if lengths else None,
              attn_sink=rng.standard_normal(64).astype(np.float32) if sink else None, machine=machine)
    got = flashmla_sparse_prefill(q, kv, idx, **kw)
    real = sp._pairs_walked
    try:
        sp._pairs_walked = lambda ok, pairs: pairs
        ref = flashmla_sparse_prefill(q, kv, idx, **kw)
    finally:
        sp._pairs_walked = real
    for a, b in ((got.out, ref.out), (got.lse, ref.lse), (got.max_logits, ref.max_logits)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
