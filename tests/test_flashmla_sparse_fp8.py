"""FlashMLA's sm90 sparse FP8 decode (issue 21), bit for bit: captures of an H100 and an H200 (seed 0 through
scripts/capture_thirdparty.py --steps sparse; fresh seeds through `amla-sim crosscheck --kernel
flashmla-sparse-fp8`), its scheduler's metadata int for int, and FlashMLA's own cache quantizer (tests/quant.py,
run on the GPU) byte for byte."""

import importlib
import json
import math

import numpy as np
import pytest
from conftest import capture_engines

from amla_sim.algorithms import golden
from amla_sim.algorithms.deployed.flashmla.fp8_cache import (
    LAYOUTS,
    dequantize_kv_cache,
    layout_of,
    pages,
    quantize_kv_cache,
)
from amla_sim.algorithms.deployed.flashmla.sparse_fp8 import (
    flashmla_sparse_fp8,
    sparse_schedule,
)
from amla_sim.crosscheck import CaptureError, replay
from amla_sim.crosscheck.files import read_capture
from amla_sim.crosscheck.flashmla import quant_inputs, sparse_inputs
from amla_sim.engine import use_engine
from amla_sim.experiments.inputs import make_inputs
from amla_sim.formats import round_to
from amla_sim.machines import get_machine
from amla_sim.units import DivUnit, ExpUnit, FMAUnit, LogUnit

sparse_module = importlib.import_module("amla_sim.algorithms.deployed.flashmla.sparse_fp8")  # the module, not the function
DATA = "tests/data/"
CAPTURES = ["flashmla_sparse_fp8_decode.npz", "flashmla_sparse_fp8_h100_fresh.npz",
            "flashmla_sparse_fp8_h200_fresh.npz"]


def _load(name):
    return read_capture(DATA + name)


# NumPy: both cache layouts, an edge and a normal sink, topk_length, s_q 2, one split and four
@pytest.mark.parametrize(("capture", "engine", "cases"), capture_engines(CAPTURES, [3, 5]))
def test_flashmla_sparse_fp8_bit_exact(capture, engine, cases):
    with use_engine(engine):
        report = replay(DATA + capture, cases=cases)
    assert report.kernel == "flashmla-sparse-fp8" and report.version == "9241ae3"
    assert len(report.cases) == len(cases or range(8))
    for row in report.cases:
        assert row.first_difference is None, report.format()


def test_the_captures_cover_the_issue():
    """64 and 128 heads; s_q 1 and 2; topk 128 to 2048 with empty slots and topk_length (0 included); sinks
    (-inf, +inf and 0 among them); batches of mixed lengths; both cache layouts; FlashMLA's and non-power-of-two
    scales; requests in one split and in many; an H100 and an H200; three seeds."""
    seen = {k: set() for k in ("heads", "sq", "topk", "layout", "sink", "power_of_two", "device", "seed", "dist")}
    split_counts, lengths, empty_shares = set(), set(), []
    for capture in CAPTURES:
        meta, arrays = _load(capture)
        seen["device"].add(meta["device"])
        for i, c in enumerate(meta["cases"]):
            for k in ("heads", "sq", "topk", "layout", "sink", "power_of_two", "dist"):
                seen[k].add(c[k])
            seen["seed"].add(c["seed"] // 1000)
            lengths.update(c["topk_length"] or [])
            split_counts.update(np.diff(arrays[f"c{i}_num_splits"]).tolist())
            empty_shares.append(float(np.mean(sparse_inputs(c)["indices"] == -1)))
    assert seen["heads"] == {64, 128} and seen["sq"] == {1, 2} and {128, 2048} <= seen["topk"]
    assert seen["layout"] == {"v32", "model1"} and seen["sink"] == {None, "normal", "edge"}
    assert seen["power_of_two"] == {True, False} and 0 in lengths and len(seen["dist"]) >= 4
    assert 1 in split_counts and max(split_counts) >= 32 and len(seen["seed"]) == 3
    assert seen["device"] == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
    assert min(empty_shares) == 0 and max(empty_shares) > 0.4  # queries with every slot filled, and half empty


@pytest.mark.parametrize("capture", CAPTURES)
def test_the_scheduler_writes_the_kernels_metadata(capture):
    """Where the kernel scheduled for its own GPU (132 SMs), FlashMLA's scheduler here gives its 7 ints a part and
    split counts; where the capture handed it a schedule for fewer SMs, the kernel used that one."""
    meta, arrays = _load(capture)
    for i, c in enumerate(meta["cases"]):
        sched, cum = sparse_schedule(c["topk_length"] or [c["topk"]] * c["batch"], s_q=c["sq"], heads=c["heads"],
                                     num_sms=c["num_sms"])
        got = arrays[f"c{i}_sched"]
        assert got.shape[1] == 7
        np.testing.assert_array_equal(np.array([p.as_ints()[:7] for p in sched]), got[:len(sched)])
        np.testing.assert_array_equal(cum, arrays[f"c{i}_num_splits"])
        assert c["schedule"] == "kernel" or (got[len(sched):, 0] == c["batch"]).all()


# --- the cache quantizer --------------------------------------------------------------------------------


def test_the_quantizer_is_flashmlas_byte_for_byte():
    """FlashMLA's tests/quant.py on the GPU against ours: every byte but MODEL1's pad bytes, which quant.py leaves
    unwritten (torch.empty); zero tokens, tiny, subnormal, huge and exactly-448 amaxes included."""
    meta, arrays = _load("flashmla_fp8_quant.npz")
    assert {c["layout"] for c in meta["cases"]} == {"v32", "model1"} and any(c["edges"] for c in meta["cases"])
    for i, c in enumerate(meta["cases"]):
        theirs = arrays[f"q{i}"]
        ours = quantize_kv_cache(quant_inputs(c), c["layout"])
        assert theirs.shape == ours.shape == (2, 64, 1, LAYOUTS[c["layout"]].bytes_per_token)
        live = np.ones(theirs.shape, bool)
        if c["layout"] == "model1":  # 64 tokens of 576 bytes, then 64 groups of 7 scales and a pad byte
            live.reshape(len(theirs), -1)[:, 64 * 576 + 7::8] = False
        np.testing.assert_array_equal(ours[live], theirs[live], err_msg=str(c))


@pytest.mark.parametrize("layout", ["v32", "model1"])
def test_the_cache_layouts(layout):
    """Bytes where FlashMLA's interface documents them; RoPE kept as BF16; the dequantized nope within the E4M3
    step of each tile's scale; zero pages stay zero."""
    lay = LAYOUTS[layout]
    _, kv = make_inputs("normal:2", batch=1, heads=1, context=128, d_k=lay.d, d_v=lay.d_nope, seed=3)
    pg, base = pages(kv)
    assert pg.shape == (2, 64, 1, lay.d) and base.tolist() == [0]
    cache = quantize_kv_cache(pg, layout)
    assert cache.shape == (2, 64, 1, lay.bytes_per_token) and cache.dtype == np.uint8
    keys = dequantize_kv_cache(cache)
    x = pg.reshape(128, lay.d).astype(np.float32)
    np.testing.assert_array_equal(keys[:, lay.d_nope:], x[:, lay.d_nope:])
    amax = np.abs(x[:, :lay.d_nope]).reshape(128, -1, lay.tile).max(-1, keepdims=True)
    err = np.abs(keys[:, :lay.d_nope] - x[:, :lay.d_nope]).reshape(128, -1, lay.tile)
    assert (err <= amax * 2.0**-3).all()  # E4M3 keeps 3 fraction bits; the scale at most doubles amax / 448
    if layout == "v32":
        t0 = cache[0, 0, 0]
        np.testing.assert_array_equal(t0[528:].view("<u2"), (x[0, 512:].view(np.uint32) >> 16).astype(np.uint16))
        s = t0[512:528].view("<f4")
        assert (np.log2(s) == np.round(np.log2(s))).all()  # powers of two
    else:
        flat = cache.reshape(2, -1)
        assert (flat[:, 64 * 576 + 7::8] == 0).all()
        np.testing.assert_array_equal(flat[0, 448:576].view("<u2"), (x[0, 448:].view(np.uint32) >> 16))
    zero = quantize_kv_cache(np.zeros((1, 64, lay.d), np.float32), layout)
    assert (dequantize_kv_cache(zero) == 0).all()


def test_the_kernels_dequantizer_rounds_where_the_reference_does_not():
    """With a scale that is no power of two (a quantizer other than FlashMLA's), the kernel rounds the scale to
    BF16 and the product to BF16; FlashMLA's reference dequantizer multiplies in FP32, and the two differ."""
    _, kv = make_inputs("normal:1", batch=1, heads=1, context=64, seed=5)
    pg, _ = pages(kv)
    cache = quantize_kv_cache(pg, "v32", power_of_two=False)
    s = cache[0, :, 0, 512:528].copy().view("<f4")
    assert (np.log2(s) != np.round(np.log2(s))).any()
    kernel, ref = dequantize_kv_cache(cache), dequantize_kv_cache(cache, as_kernel=False)
    assert (kernel != ref).mean() > 0.01
    pow2 = quantize_kv_cache(pg, "v32")
    np.testing.assert_array_equal(dequantize_kv_cache(pow2), dequantize_kv_cache(pow2, as_kernel=False))


# --- each choice matters ----------------------------------------------------------------------------------


def _lane_sums_adjacent(mc, P):  # as the dense decode: column pairs first
    q = P.reshape(*P.shape[:-1], 8, 4, 2)
    pair = mc.f(q[..., 0] + q[..., 1])
    s = np.zeros((*P.shape[:-1], 4), mc.dtype)
    for g in range(8):
        s = mc.f(s + pair[..., g, :])
    return s


def _lane_sums_numpy(mc, P):
    q = P.reshape(*P.shape[:-1], 8, 4, 2)
    return mc.f(np.swapaxes(q, -3, -2).reshape(*P.shape[:-1], 4, 16).sum(-1))


CHOICES = {  # name: (case of the seed-0 capture, or (capture, case), where it bites; module function replaced, or
    # machine units swapped)
    "reference-dequantizer": (3, ("_keys", lambda cache: dequantize_kv_cache(cache, as_kernel=False))),
    "lane-sums-pairwise": (1, ("_lane_sums", _lane_sums_adjacent)),
    "lane-sums-numpy": (0, ("_lane_sums", _lane_sums_numpy)),
    "row-total-in-order": (1, ("_row_total", lambda mc, x: mc.f(mc.f(mc.f(x[:, 0] + x[:, 1]) + x[:, 2]) + x[:, 3]))),
    "lse-unfused": (1, ("_lse", lambda mc, L, m, ln2: mc.f(mc.f(mc.log2(L) * ln2) + mc.f(m * ln2)))),
    "sink-fused": ((2, 1), ("_with_sink", lambda mc, L, m, sink: mc.f(L + mc.exp2(mc.mul_add(
        mc.f(sink), mc.f(math.log2(math.e)), -m))))),
    "sink-unfused": (5, ("_combine_sink", lambda mc, g, sink: np.where(
        np.isposinf(g), np.where(np.isneginf(sink), np.inf, mc.f(sink * mc.f(math.log2(math.e)))),
        mc.f(g + mc.log2(mc.f(1.0 + mc.exp2(mc.f(mc.f(sink * mc.f(math.log2(math.e))) - g)))))))),
    "no-fma": (0, {"fma": FMAUnit(contract=False)}),
    "ieee-exp2": (0, {"exponential": ExpUnit("correctly-rounded")}),
    "ieee-log2": (0, {"logarithm": LogUnit(ln=None, lg2="correctly-rounded")}),
    "ieee-reciprocal": (0, {"division": DivUnit("ieee")}),
}


@pytest.mark.parametrize("change", sorted(CHOICES))
def test_each_sparse_fp8_choice_matters(change, monkeypatch, fastest_engine):
    """The replay fails when one of the model's choices is replaced by a plausible other."""
    case, swap = CHOICES[change]
    units = swap if isinstance(swap, dict) else {}
    if not units:
        monkeypatch.setattr(sparse_module, *swap)
    capture, case = case if isinstance(case, tuple) else (0, case)
    meta, arrays = _load(CAPTURES[capture])
    c = meta["cases"][case]
    res = flashmla_sparse_fp8(**sparse_inputs(c), scale=c["scale"], num_sms=c["num_sms"],
                              machine=get_machine("sm90-cuda", **units))
    same = (np.mean(res.out.view(np.uint16) == arrays[f"c{case}_out"]),
            np.mean(res.lse.view(np.uint32) == arrays[f"c{case}_lse"]))
    assert min(same) < 1, same


# --- semantics on other machines --------------------------------------------------------------------------


def _reference(q, keys, idx, ok, scale, d_v=512):
    """FP64 attention of one query's heads over the keys its valid slots name."""
    K = keys[idx[ok]].astype(np.float64)
    s = q.astype(np.float64) @ K.T * scale
    mx = s.max(1, keepdims=True)
    p = np.exp(s - mx)
    return p @ K[:, :d_v] / p.sum(1, keepdims=True), np.log(p.sum(1)) + mx[:, 0]


@pytest.mark.parametrize("layout", ["v32", "model1"])
@pytest.mark.parametrize("machine", ["golden", "ieee32", "sm90-cuda"])
def test_flashmla_sparse_fp8_is_attention_over_the_named_keys(machine, layout):
    """Against FP64 attention over the dequantized keys the valid slots name: empty slots, a topk_length, two
    splits; and an attention sink scales the output by exp(lse) / (exp(lse) + exp(sink)), leaving the LSE."""
    lay = LAYOUTS[layout]
    c = {"batch": 2, "sq": 2, "heads": 64, "layout": layout, "seqlens": [500, 90], "topk": 192,
         "topk_length": [150, 192] if layout == "model1" else None, "invalid": 0.2, "sink": "normal",
         "dist": "normal:1", "seed": 4, "scale": None, "power_of_two": True}
    inputs = sparse_inputs(c)
    res = flashmla_sparse_fp8(**inputs, machine=machine, num_sms=4, build="upstream", trace=True)  # the FP32 scale
    keys = dequantize_kv_cache(inputs["kv_cache"])
    assert res.out.shape == (2, 2, 64, 512) and res.lse.shape == (2, 64, 2)
    tol = 1e-12 if machine == "golden" else 8e-3
    for i in range(2):
        assert len(res.trace["split_blocks"][i]) >= 1
        for j in range(2):
            idx = inputs["indices"][i, j]
            ok = (idx != -1) & (np.arange(192) < (c["topk_length"] or [192, 192])[i])
            ref, lse = _reference(inputs["q"][i, j], keys, idx, ok, float(np.float32(lay.d ** -0.5)))
            w = 1 / (1 + np.exp(inputs["attn_sink"].astype(np.float64) - lse))
            got = res.out[i, j].astype(np.float64)
            assert np.linalg.norm(got - ref * w[:, None]) / np.linalg.norm(ref * w[:, None]) < tol
            np.testing.assert_allclose(res.lse[i, :, j], lse, rtol=1e-12 if machine == "golden" else 1e-5)


def test_a_query_with_no_keys():
    """topk_length 0 (and every slot empty): zero output and an LSE of +inf, in one split and in several."""
    c = {"batch": 2, "sq": 1, "heads": 64, "layout": "model1", "seqlens": [300, 300], "topk": 128,
         "topk_length": [0, 128], "invalid": 0.0, "sink": None, "dist": "normal:1", "seed": 6, "scale": None}
    inputs = sparse_inputs(c)
    inputs["indices"][1] = -1
    for sms in (1, 132):
        res = flashmla_sparse_fp8(**inputs, num_sms=sms)
        assert (res.out == 0).all() and np.isposinf(res.lse).all()


def test_sparse_fp8_matches_golden_on_fp8_keys_within_bf16():
    """The whole pipeline's error against FP64 attention over the same dequantized keys: BF16 rounding only."""
    q, kv = make_inputs("flashmla", batch=1, heads=128, context=1024, seed=8)
    pg, base = pages(kv)
    cache = quantize_kv_cache(pg, "v32")
    idx = np.arange(1024, dtype=np.int32)[None, None]
    res = flashmla_sparse_fp8(q, cache, idx)
    keys = round_to(dequantize_kv_cache(cache), "bf16")
    ref = golden(q, keys[None])
    err = np.sqrt(np.mean((res.out.astype(np.float64) - ref.out) ** 2))
    assert err < 2e-4, err
    np.testing.assert_allclose(res.lse, np.swapaxes(ref.lse, 1, 2), rtol=1e-5)
    # the cache's quantization, not the arithmetic, sets the error against the BF16 keys
    to_bf16 = np.sqrt(np.mean((res.out.astype(np.float64) - golden(q, kv).out) ** 2))
    assert to_bf16 > 5 * err, (to_bf16, err)


def test_the_fp8_table_runs_through_reproduce(tmp_path, fastest_engine):
    """`reproduce fp8-mla` (the low-precision cache table): on sm90-cuda unless told, its columns as data
    (LOW_PRECISION_CACHE), each one's row its error on the same draw computed here directly: FlashMLA's dense
    decode, DeepSeek V3.2's sparse attention with one top-k list (every token of the request) through its FP8
    cache and FlashMLA's sparse decode, and through its BF16 cache and FA3's sparse call and FlashMLA's sparse
    prefill, vLLM's FP8 decodes on inputs quantized here, FlashInfer's decode over the BF16 cache and over
    SGLang's FP4 cache (written and read back here). Every BF16 cache's error is below every FP8 and FP4 cache's."""
    import csv

    from amla_sim._seeds import derive_seed
    from amla_sim.algorithms import (
        fa3_mla_sparse,
        flashinfer_mla,
        flashmla,
        flashmla_dense_fp8,
        flashmla_sparse_prefill,
        quantize_cache_fp8,
        quantize_query_fp8,
        vllm_triton_mla,
    )
    from amla_sim.algorithms.deployed.sglang.fp4_cache import dequantize_mla_kv, quantize_mla_kv
    from amla_sim.cli import main
    from amla_sim.experiments.tables import LOW_PRECISION_CACHE, TABLES

    table = TABLES["fp8-mla"]
    assert table.algorithms == tuple(c.label for c in LOW_PRECISION_CACHE)
    assert main(["reproduce", "fp8-mla", "--samples", "1", "--context", "100", "--heads", "64", "--out",
                 str(tmp_path), "--quiet"]) == 0
    with open(tmp_path / "fp8-mla" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    summary = json.loads((tmp_path / "fp8-mla" / "summary.json").read_text())
    assert summary["machine"] == "sm90-cuda" and len(rows) == 3 * len(LOW_PRECISION_CACHE)
    assert "| rel. Frobenius | RMSE | cos diff |" in (tmp_path / "fp8-mla" / "table.md").read_text()
    q, kv = make_inputs("rope-outliers", heads=64, context=100, seed=derive_seed(0, "fp8-mla", "rope-outliers", 0))
    ref = golden(q, kv).out
    pg, base = pages(kv)
    assert base[0] == 0  # one request: its cache rows are its tokens, paged or flat
    sel = np.full(128, -1, np.int32)  # the one top-k list: every token, -1 after (topk a multiple of 128)
    sel[:100] = np.arange(100)
    fp4 = dequantize_mla_kv(*quantize_mla_kv(kv[0, :, None, :512], kv[0, :, None, 512:]))[None, :, 0]
    cuda = {"machine": "sm90-cuda"}  # the table's machine (each FlashMLA model's default build otherwise)
    for alg, out in (("flashmla", flashmla(q, kv, seqlens=None, **cuda).out),
                     ("flashmla-sparse-fp8", flashmla_sparse_fp8(q, quantize_kv_cache(pg), sel[None, None],
                                                                 **cuda).out),
                     # FA3's list is as long as the context (the call's max_seqlen_k), the same valid rows
                     ("fa3-mla-sparse", fa3_mla_sparse(q[0], kv[0], sel[None, :100]).out[None]),
                     ("flashmla-sparse-prefill", flashmla_sparse_prefill(q[0], kv[0][:, None], sel[None, None],
                                                                         **cuda).out),
                     ("flashmla-dense-fp8", flashmla_dense_fp8(quantize_query_fp8(q), quantize_cache_fp8(kv),
                                                               **cuda).out),
                     ("vllm-triton-fp8", vllm_triton_mla(q, quantize_cache_fp8(kv), machine="sm90-triton").out),
                     ("flashinfer-mla", flashinfer_mla(q, kv).out),
                     ("sglang-fp4", flashinfer_mla(q, fp4).out)):
        want = np.sqrt(np.mean((out.astype(np.float64).reshape(ref.shape) - ref) ** 2))
        got = next(float(r["rmse"]) for r in rows if r["algorithm"] == alg and r["distribution"] == "rope-outliers")
        assert got == pytest.approx(want, rel=1e-12), alg
    for dist, _ in table.distributions:
        rmse = {r["algorithm"]: float(r["rmse"]) for r in rows if r["distribution"] == dist}
        bf16 = [rmse[c.label] for c in LOW_PRECISION_CACHE if c.precision == "bf16"]
        low = [rmse[c.label] for c in LOW_PRECISION_CACHE if c.precision in ("fp8", "fp4")]
        assert len(bf16) == 4 and len(low) == 9 and max(bf16) < min(low), (dist, rmse)


# --- bad input ----------------------------------------------------------------------------------------------


def _ok_inputs():
    return sparse_inputs({"batch": 1, "sq": 1, "heads": 64, "layout": "v32", "seqlens": [100],
                                     "topk": 64, "invalid": 0.0, "dist": "normal:1", "seed": 1})


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(kv_cache=a["kv_cache"][..., :600]), "kv_cache: expected one of"),
    (lambda a: a.update(kv_cache=a["kv_cache"].astype(np.int16)), "kv_cache: expected uint8 pages"),
    (lambda a: a.update(indices=a["indices"] + 10**6), "indices: expected -1 or a token"),
    (lambda a: a["indices"].__setitem__((0, 0, 3), -2), "indices: expected -1 or a token"),
    (lambda a: a.update(indices=a["indices"][..., :32]), "indices: expected ints"),
    (lambda a: a.update(topk_length=np.array([10], np.int32)), "topk_length: the V3.2 kernel takes none"),
    (lambda a: a.update(q=a["q"].astype(np.float32)), "q: the kernel takes BF16"),
    (lambda a: a.update(q=a["q"][..., :512]), r"q: expected \(b, s_q, 64 or 128, 576\)"),
    (lambda a: a.update(q=np.concatenate([a["q"]] * 3, axis=2)), r"q: expected \(b, s_q, 64 or 128, 576\)"),
    (lambda a: a.update(attn_sink=np.zeros(65, np.float32)), "attn_sink: expected float32 \\(64,\\)"),
    (lambda a: a.update(attn_sink=np.zeros(64)), "attn_sink: expected float32"),
    (lambda a: a.update(scale=float("inf")), "scale: expected a finite float32 number"),
    (lambda a: a.update(num_sms=0), "num_sms"),
])
def test_bad_input_names_the_argument(change, match):
    args = _ok_inputs()
    args.pop("topk_length")
    args.pop("attn_sink")
    change(args)
    with pytest.raises((ValueError, TypeError), match=match):
        flashmla_sparse_fp8(**args)


def test_model1_topk_length_above_topk():
    c = {"batch": 1, "sq": 1, "heads": 64, "layout": "model1", "seqlens": [100], "topk": 64, "invalid": 0.0,
         "dist": "normal:1", "seed": 1}
    args = sparse_inputs(c)
    args["topk_length"] = np.array([65], np.int32)
    with pytest.raises(ValueError, match="topk_length: expected 1 ints in 0..64"):
        flashmla_sparse_fp8(**args)


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(layout="v33"), "layout: expected one of"),
    (lambda c: c.update(topk=100), "topk, heads: the kernel takes topk a multiple of 64"),
    (lambda c: c.update(heads=32), "topk, heads: the kernel takes"),
    (lambda c: c.update(topk_length=[64]), "topk_length: only MODEL1 caches take one"),
    (lambda c: c.update(invalid=1.5), "invalid: a share of empty slots"),
    (lambda c: c.update(sink="big"), "sink: expected null"),
    (lambda c: c.update(page_size=32), "page_size: recipes use pages of 64"),
    (lambda c: c.update(layout="model1", power_of_two=False), "power_of_two: true or false"),
    (lambda c: c.update(power_of_two="yes"), "power_of_two: true or false"),
    (lambda c: c.update(seed=c["seed"] + 1), "do not rebuild"),
    (lambda c: c.pop("topk"), "has no 'topk'"),
])
def test_a_capture_that_does_not_match_its_recipe_is_refused(change, match, tmp_path):
    meta, arrays = _load(CAPTURES[0])
    change(meta["cases"][1])
    path = tmp_path / "bad.npz"
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    with pytest.raises(CaptureError, match=match):
        replay(path, cases=[1])


@pytest.mark.parametrize("call, match", [
    (lambda: pages(np.zeros((64, 576), np.float32)), r"kv: expected a cache \(b, S, d\)"),
    (lambda: pages(np.zeros((1, 64, 576), np.float32), 0), "page"),
    (lambda: quantize_kv_cache(np.zeros((1, 64, 576), np.int32)), "kv: expected BF16 values"),
    (lambda: quantize_kv_cache(np.zeros((1, 64, 2, 576), np.float32)), "kv: one KV head"),
    (lambda: quantize_kv_cache(np.zeros((1, 64, 512), np.float32), "v32"), r"kv: expected pages \(num_blocks, P, 576\)"),
    (lambda: dequantize_kv_cache(np.zeros((1, 64, 1, 656), np.uint8), "model1"), "kv_cache: layout model1 has 584"),
    (lambda: dequantize_kv_cache(np.zeros((1, 64, 656), np.uint8)), "kv_cache: expected uint8 pages"),
])
def test_cache_functions_name_the_bad_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_layout_names_and_sizes():
    assert layout_of(656).name == "v32" and layout_of("model1").bytes_per_token == 584
    with pytest.raises(ValueError, match="layout: expected one of"):
        layout_of(600)
    with pytest.raises(ValueError, match="power_of_two: layout model1 stores E8M0 scales"):
        quantize_kv_cache(np.zeros((1, 64, 512), np.float32), "model1", power_of_two=False)
    with pytest.raises(ValueError, match="kv: the cache quantizer takes BF16 values"):
        quantize_kv_cache(np.full((1, 64, 576), 0.1, np.float32), "v32")


@pytest.mark.parametrize("kwargs, match", [({"block": 128}, "block: the kernel's block is 64 tokens, got 128"),
                                           ({"schedule": "nope"}, "schedule"),
                                           ({"block": 0}, "block")])
@pytest.mark.parametrize("alg", ["flashmla", "flashmla-sparse-fp8"])
def test_the_sweep_entries_refuse_another_layout(alg, kwargs, match):
    from amla_sim.algorithms import ALGORITHMS

    q, kv = make_inputs("normal:1", heads=64, context=70, seed=2)
    with pytest.raises(ValueError, match=match):
        ALGORITHMS[alg](q, kv, **kwargs)
    res = ALGORITHMS[alg](q, kv, machine="ieee32")
    assert res.out.shape == (1, 1, 64, 512)
