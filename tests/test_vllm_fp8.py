"""FP8 MLA as vLLM serves it, bit for bit: vLLM's dense FP8 FlashMLA decode and vLLM's Triton MLA decode (BF16 and
FP8 caches). H100 captures of 10 cases each through `amla-sim crosscheck` (seed 0), replayed; fresh seeds on an H100
(1000) and an H200 (2000) against predictions committed before the runs; vLLM's quantization against the GPU's
bytes for every BF16 value; each modelled choice shown to matter; bad calls refused by name."""

from __future__ import annotations

import functools
import importlib
import json
import math
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import FASTEST

from amla_sim.algorithms import (ALGORITHMS, flashmla_dense_fp8, golden, quantize_cache_fp8, quantize_query_fp8,
                                 vllm_triton_mla)
from amla_sim.algorithms.deployed import splitkv
from amla_sim.algorithms.deployed.fast_math import logf
from amla_sim.algorithms.deployed.vllm.triton_mla import row_extents, vllm_num_kv_splits
from amla_sim.crosscheck import replay
from amla_sim.crosscheck.vllm import DENSE_FP8_CASES, FLASHMLA_DENSE_FP8, TRITON_CASES, VLLM_TRITON_MLA, fp8_inputs
from amla_sim.experiments.inputs import make_inputs
from amla_sim.machines import get_machine
from amla_sim.units import DivUnit, ExpUnit, FMAUnit, LogUnit, MatrixUnit

dense = importlib.import_module("amla_sim.algorithms.deployed.flashmla.dense_fp8")  # the modules, not functions
combine = importlib.import_module("amla_sim.algorithms.deployed.flashmla.combine")
triton = importlib.import_module("amla_sim.algorithms.deployed.vllm.triton_mla")
DATA = Path(__file__).parent / "data"
DENSE, TRITON = DATA / "flashmla_dense_fp8_h100.npz", DATA / "vllm_triton_mla_h100.npz"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
# the NumPy engine replays these (every case on the fastest engine): every cache kind and page size below; dense:
# 16 and 64 heads, s_q 1 and 2, lengths 1 to 8K, unit and non-unit descales
_CHEAP_TRITON = [0, 5, 7]
_CHEAP_DENSE = [2, 4, 9]


def _load(path: Path) -> tuple[dict, dict]:
    with np.load(path) as z:
        return json.loads(str(z["meta"])), {k: z[k] for k in z.files if k != "meta"}


@pytest.fixture(scope="module")
def dense_capture():
    return _load(DENSE)


@pytest.fixture(scope="module")
def triton_capture():
    return _load(TRITON)


def test_dense_fp8_bit_exact(engine):
    cases = None if engine == FASTEST else _CHEAP_DENSE
    report = replay(DENSE, cases=cases)
    assert report.kernel == "flashmla-dense-fp8" and report.version == "46d64a8"
    assert len(report.cases) == (len(DENSE_FP8_CASES) if cases is None else len(cases))
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()
        assert [s.name for s in row.stages] == ["splits", "lse", "out"]


def test_vllm_triton_bit_exact(engine):
    cases = None if engine == FASTEST else _CHEAP_TRITON
    report = replay(TRITON, cases=cases)
    assert report.kernel == "vllm-triton-mla" and report.version == "0.33.0"
    assert len(report.cases) == (len(TRITON_CASES) if cases is None else len(cases))
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()


def test_the_captures_cover_the_issue(dense_capture, triton_capture):
    """Dense FP8: 16, 64 and 128 heads; s_q 1 and 2; 1 to 8K tokens; unit and non-unit descales; FlashMLA's inputs
    and N(0, 1). Triton: BF16 and FP8 caches, pages 1, 16 and 64, the batch-invariant single split, s_q 1 and 2.
    Every call repeatable; the GPU's quantized bytes are the project's."""
    (dm, _), (tm, _) = dense_capture, triton_capture
    for meta in (dm, tm):
        assert meta["device"] == H100 and all(c["repeat_identical"] for c in meta["cases"])
        assert {c["heads"] for c in meta["cases"]} == {16, 64, 128} and {c["sq"] for c in meta["cases"]} == {1, 2}
        assert {c["dist"] for c in meta["cases"]} == {"flashmla", "normal:1"}
    d = dm["cases"]
    assert all(c["quant_identical"] for c in d) and len(d) >= 8
    assert min(min(c["seqlens"]) for c in d) == 1 and max(max(c["seqlens"]) for c in d) == 8192
    assert {c["q_scale"] == c["k_scale"] == 1 for c in d} == {True, False}
    assert any(math.log2(c["k_scale"]) % 1 for c in d)  # a descale that is not a power of two
    t = tm["cases"]
    assert {c["kv_cache"] for c in t} == {"bf16", "fp8"} and {c["page_size"] for c in t} == {1, 16, 64}
    assert all(c["quant_identical"] for c in t if c["kv_cache"] == "fp8")
    assert {c["num_kv_splits"] for c in t if c["batch_invariant"]} == {1} and sum(c["batch_invariant"] for c in t) >= 2
    assert any(c["kv_cache"] == "fp8" and c["sq"] == 2 for c in t) and any(c["k_scale"] != 1 for c in t)


@pytest.mark.parametrize("name", ["flashmla_dense_fp8", "vllm_triton_mla"])
def test_fresh_seeds_as_predicted(name):
    """Predictions (CRC-32 of the bits) written before the runs: every case of seed 1000 on an H100 and seed 2000
    on an H200 as predicted, repeatable, the GPU's quantization the project's."""
    predicted = json.loads((DATA / f"{name}_predicted.json").read_text())
    record = json.loads((DATA / f"{name}_record.json").read_text())
    runs = {(r["seed"], r["device"]): r["cases"] for k, r in record.items() if k != "kernel"}
    assert set(runs) == {(1000, H100), (2000, H200)}
    for (seed, _), rows in runs.items():
        assert len(rows) == len(predicted[str(seed)]) == 10
        assert all(r["as_predicted"] and r["repeat_identical"] and r["quant_identical"] is not False for r in rows)
        assert [r["out_crc"] for r in rows] == [p["out_crc"] for p in predicted[str(seed)]]


@pytest.mark.parametrize("spec, case", [(FLASHMLA_DENSE_FP8, 9), (VLLM_TRITON_MLA, 5)])
def test_the_predictions_are_the_models(spec, case, fastest_engine):
    """The committed predictions are what the models give today (a cheap case of each)."""
    name = spec.name.replace("-", "_")
    want = json.loads((DATA / f"{name}_predicted.json").read_text())["1000"][case]
    r = spec.recipes(1000)[case]
    arrays = {f"c{case}_{k}": np.zeros(s, d) for k, (s, d, _) in spec.outputs(r).items()}
    got = {n: sim for n, _, sim in spec.stages(r, case, arrays)}
    assert zlib.crc32(np.ascontiguousarray(got["out"]).tobytes()) == want["out_crc"]
    assert zlib.crc32(np.ascontiguousarray(got["lse"]).tobytes()) == want["lse_crc"]


# --- vLLM's quantization ---------------------------------------------------------------------------------------


def test_quantization_is_the_gpus_for_every_bf16_value():
    """``QuantFP8``'s query and ``concat_and_cache_mla``'s cache quantization, as torch runs them on an H100: every
    one of the 65,536 BF16 values under eight scales (scripts/vllm_fp8_quant.py), byte for byte, NaN included."""
    with np.load(DATA / "vllm_fp8_quant.npz") as z:
        x = np.arange(-32768, 32768).astype(np.int16).view(ml_dtypes.bfloat16)
        for i, s in enumerate(z["scales"]):
            assert np.array_equal(quantize_query_fp8(x, float(s)).view(np.uint8), z[f"q{i}"]), s
            assert np.array_equal(quantize_cache_fp8(x, float(s)).view(np.uint8), z[f"c{i}"]), s


def test_quantization_rounds_saturates_and_divides_as_vllm():
    x = np.array([1.0, 500, -1e6, 0.3, 3 * 2.0**-10, 1.0625], np.float32)
    assert quantize_cache_fp8(x).astype(np.float32).tolist() == [1, 448, -448, 0.3125, 2.0**-9 * 2, 1.0]
    # the query multiplies by the reciprocal (rounded once), the cache divides: on the GPU, 0.0542 / 3.7 rounds to
    # byte 8 and 0.0542 * fl(1 / 3.7) to byte 7 (tests/data/vllm_fp8_quant.npz holds both); either formula in the
    # other's place fails the test above
    x = np.array([0.05419921875], ml_dtypes.bfloat16)
    assert quantize_query_fp8(x, 3.7).view(np.uint8)[0] == 7 and quantize_cache_fp8(x, 3.7).view(np.uint8)[0] == 8


@pytest.mark.parametrize("fn, name", [(quantize_query_fp8, "q_scale"), (quantize_cache_fp8, "k_scale")])
@pytest.mark.parametrize("bad", [True, "1", None])
def test_quantization_refuses_what_is_no_number(fn, name, bad):
    with pytest.raises(ValueError, match=name):
        fn(np.ones(4, np.float32), bad)


# --- vLLM's split count and rows --------------------------------------------------------------------------------


@pytest.mark.parametrize("max_len, sms, inv, want", [
    (1, 132, False, 1), (511, 132, False, 1), (1024, 132, False, 2), (3001, 132, False, 8), (4096, 132, False, 8),
    (20000, 132, False, 64), (65536, 132, False, 128), (163840, 132, False, 264), (10**6, 114, False, 228),
    (10**6, 132, True, 1),
])
def test_vllm_split_count(max_len, sms, inv, want):
    """``_compute_num_kv_splits``: next_pow2(max(1, L // 512)), at most 2 x SMs; 1 when batch-invariant."""
    assert vllm_num_kv_splits(max_len, sms, batch_invariant=inv) == want


def test_a_request_changes_with_its_batchmates_unless_batch_invariant(fastest_engine):
    """The longest request sets every request's split count: a 1000-token request alone (1 split) and beside a
    6000-token one (16 splits, cdiv(1000, 16) = 63 tokens each) gives other bits; batch-invariant mode does not."""
    q, kv = make_inputs("normal:1", batch=2, heads=16, context=6000, seed=5)
    lens = np.array([1000, 6000])
    alone = vllm_triton_mla(q[:1], kv[:1, :1000])
    batched = vllm_triton_mla(q, kv, seqlens=lens)
    assert not np.array_equal(alone.out[0], batched.out[0])
    inv_alone = vllm_triton_mla(q[:1], kv[:1, :1000], batch_invariant=True)
    inv_batched = vllm_triton_mla(q, kv, seqlens=lens, batch_invariant=True)
    assert np.array_equal(inv_alone.out[0].view(np.uint16), inv_batched.out[0].view(np.uint16))


def test_mtp_rows_have_their_own_extents():
    assert row_extents(np.array([5, 1]), 2, True).tolist() == [4, 5, 0, 1]
    assert row_extents(np.array([5, 1]), 2, False).tolist() == [5, 5, 1, 1]
    q, kv = make_inputs("normal:1", batch=1, sq=2, heads=16, context=300, seed=2)
    res = vllm_triton_mla(q, kv, machine="golden")
    for s, n in ((0, 299), (1, 300)):  # row s of the step sees the prefix and the step's tokens up to s
        ref = golden(q[:, s:s + 1], kv[:, :n], scale=float(np.float32(576**-0.5)))  # the API's float
        np.testing.assert_allclose(res.out[0, s], ref.out[0, 0], rtol=1e-12, atol=1e-14)


# --- each choice matters ----------------------------------------------------------------------------------------


def _lane_sum_unfused(mc, part, s, P):
    Pl = P.reshape(P.shape[0], 8, 4, 2)
    terms = [Pl[:, j, :, e] for j in range(8) for e in range(2)]
    acc = terms[0] if part is None else mc.f(mc.f(part * s[:, None]) + terms[0])
    return functools.reduce(lambda a, x: mc.f(a + x), terms[1:], acc)


def _constants_descales_first(mc, scale, dq, dk):
    d = mc.f(mc.f(dq) * mc.f(dk))
    return mc.f(mc.f(scale) * d), mc.f(dense.scale_log2(mc, scale) * d)


DENSE_CHOICES = {  # name: (capture case where it bites, (module, attribute, replacement) or machine units)
    "fp8-accumulated-as-triton": (6, {"matrix": MatrixUnit("sm90")}),  # each k32 from 0, then an FP32 add
    "descales-multiplied-first": (6, (dense, "_constants", _constants_descales_first)),
    "row-sum-unfused": (6, (dense, "_lane_sum", _lane_sum_unfused)),
    "row-total-in-order": (6, (dense, "_row_total", lambda mc, p: mc.f(mc.f(mc.f(p[:, 0] + p[:, 1]) + p[:, 2])
                                                                       + p[:, 3]))),
    "lse-other-contraction": (6, (dense, "_split_lse", lambda mc, M, sm, L: mc.mul_add(mc.log2(L), mc.f(math.log(2.0)),
                                                                                     mc.f(M * sm)))),
    "combine-lse-unfused": (9, (combine, "_combine_lse", lambda mc, total, M: mc.f(logf(mc, total) + M))),
    "no-fma": (6, {"fma": FMAUnit(contract=False)}),
    "ieee-exp2": (6, {"exponential": ExpUnit("correctly-rounded")}),
    "ieee-log2": (6, {"logarithm": LogUnit(ln=None, lg2="correctly-rounded")}),
    "ieee-division": (6, {"division": DivUnit("ieee")}),
}


@pytest.mark.parametrize("change", sorted(DENSE_CHOICES))
def test_each_dense_fp8_choice_matters(change, monkeypatch, dense_capture, fastest_engine):
    """The replay fails when one of the dense FP8 model's choices is replaced by a plausible other."""
    case, swap = DENSE_CHOICES[change]
    units = swap if isinstance(swap, dict) else {}
    if not units:
        monkeypatch.setattr(*swap)
    meta, arrays = dense_capture
    c = meta["cases"][case]
    q, kv = fp8_inputs(c)
    res = flashmla_dense_fp8(q, kv, seqlens=np.array(c["seqlens"]), descale_q=c["q_scale"], descale_k=c["k_scale"],
                             scale=c["scale"], machine=get_machine("sm90-cuda", **units))
    same = (np.mean(res.out.view(np.uint16) == arrays[f"c{case}_out"]),
            np.mean(res.lse.astype(np.float32).view(np.uint32) == arrays[f"c{case}_lse"]))
    assert min(same) < 1, same


_IN_ORDER = splitkv._permuted


TRITON_CHOICES = {  # name: (capture case where it bites, (module, attribute, replacement), extra model arguments)
    "fp8-k-in-order": (5, (triton, "FP8_CACHE_K_ORDER", tuple(range(32))), {}),
    "fp8-scores-k-in-order": (5, (splitkv, "_columns", lambda x, cols: x), {}),
    "fp8-pv-k-in-order": (1, (splitkv, "_permuted", lambda n, k: np.arange(n) if n == 32 else _IN_ORDER(n, k)), {}),
    "sglang-split-boundaries": (1, (triton, "split_ranges", lambda r, n, m, min_block_kv: splitkv.split_ranges(
        r, n, m, 32)), {}),
    "mtp-rows-full-length": (5, None, {"causal": False}),
}


@pytest.mark.parametrize("change", sorted(TRITON_CHOICES))
def test_each_vllm_triton_choice_matters(change, monkeypatch, triton_capture, fastest_engine):
    """The replay fails when one of the Triton model's choices is replaced by a plausible other."""
    case, swap, extra = TRITON_CHOICES[change]
    if swap is not None:
        monkeypatch.setattr(*swap)
    meta, arrays = triton_capture
    c = meta["cases"][case]
    q, kv = fp8_inputs(c)
    res = vllm_triton_mla(q, kv, seqlens=np.array(c["seqlens"]), scale=c["scale"], num_kv_splits=c["num_kv_splits"],
                          k_scale=c["k_scale"] if c["kv_cache"] == "fp8" else 1.0, **extra)
    assert np.mean(res.out.reshape(arrays[f"c{case}_out"].shape).view(np.uint16) == arrays[f"c{case}_out"]) < 1


# --- other machines, the sweep entries, bad input ---------------------------------------------------------------


@pytest.mark.parametrize("machine", ["golden", "ieee32", "sm90-cuda"])
def test_dense_fp8_near_golden_on_its_inputs(machine):
    """Against FP64 attention over the dequantized inputs: exact on golden, within the FP8 P's error elsewhere."""
    q, kv = make_inputs("normal:1", batch=2, sq=2, heads=16, context=700, seed=9)
    q8, kv8 = quantize_query_fp8(q, 0.5), quantize_cache_fp8(kv, 0.25)
    res = flashmla_dense_fp8(q8, kv8, seqlens=[700, 130], descale_q=0.5, descale_k=0.25, machine=machine,
                             build="upstream")  # the API's float scale, as the reference takes it
    for i, n in enumerate((700, 130)):
        qd, kd = q8[i:i + 1].astype(np.float64) * 0.5, kv8[i:i + 1, :n].astype(np.float64) * 0.25
        ref = golden(qd, kd, scale=float(np.float32(576**-0.5)))  # the API's float scale
        err = np.linalg.norm(res.out[i:i + 1].astype(np.float64) - ref.out) / np.linalg.norm(ref.out)
        assert err < (1e-12 if machine == "golden" else 4e-2), err


def test_the_sweep_entries_run_and_quantize_as_vllm():
    q, kv = make_inputs("flashmla", batch=1, heads=16, context=300, seed=4)
    d = ALGORITHMS["flashmla-dense-fp8"](q, kv, machine="sm90-cuda", q_scale=1 / 448, k_scale=1 / 448)
    want = flashmla_dense_fp8(quantize_query_fp8(q, 1 / 448), quantize_cache_fp8(kv, 1 / 448), descale_q=1 / 448,
                              descale_k=1 / 448)
    assert np.array_equal(d.out.view(np.uint16), want.out.view(np.uint16)) and d.lse.shape == (1, 1, 16)
    t = ALGORITHMS["vllm-triton-mla"](q, kv, machine="sm90-cuda", kv_cache="fp8", k_scale=0.01, run_on="sm90-triton")
    want = vllm_triton_mla(q, quantize_cache_fp8(kv, 0.01), k_scale=0.01, machine="sm90-triton")
    assert np.array_equal(t.out.view(np.uint16), want.out.view(np.uint16))


@pytest.mark.parametrize("call, match", [
    (lambda q8, kv8, q, kv: flashmla_dense_fp8(q, kv8), "q: the kernel takes E4M3"),
    (lambda q8, kv8, q, kv: flashmla_dense_fp8(q8, kv), "kv: the kernel takes E4M3"),
    (lambda q8, kv8, q, kv: flashmla_dense_fp8(q8, kv8, descale_q="0"), "descale_q"),
    (lambda q8, kv8, q, kv: flashmla_dense_fp8(q8, kv8, descale_k=None), "descale_k"),
    (lambda q8, kv8, q, kv: flashmla_dense_fp8(q8, kv8, num_sms=0), "num_sms"),
    (lambda q8, kv8, q, kv: flashmla_dense_fp8(q8, kv8, causal="yes"), "causal"),
    (lambda q8, kv8, q, kv: flashmla_dense_fp8(q8, kv8, splits=[[(0, 10)]]), "splits"),
    (lambda q8, kv8, q, kv: vllm_triton_mla(q8, kv8), "q: the kernel takes BF16"),
    (lambda q8, kv8, q, kv: vllm_triton_mla(q, kv.astype(np.float16)), "kv: the kernel takes BF16 or E4M3"),
    (lambda q8, kv8, q, kv: vllm_triton_mla(q, kv8, k_scale=True), "k_scale"),
    (lambda q8, kv8, q, kv: vllm_triton_mla(q, kv, num_kv_splits=0), "num_kv_splits"),
    (lambda q8, kv8, q, kv: vllm_triton_mla(q, kv, page_size=0), "page_size"),
    (lambda q8, kv8, q, kv: vllm_triton_mla(q, kv, causal=None), "causal"),
    (lambda q8, kv8, q, kv: ALGORITHMS["vllm-triton-mla"](q, kv, kv_cache="fp16"), "kv_cache"),
    (lambda q8, kv8, q, kv: ALGORITHMS["flashmla-dense-fp8"](q, kv, block=128), "block"),
])
def test_bad_calls_are_refused_by_name(call, match):
    q, kv = make_inputs("normal:1", batch=1, heads=16, context=100, seed=1)
    with pytest.raises((ValueError, TypeError), match=match):
        call(quantize_query_fp8(q), quantize_cache_fp8(kv), q, kv)


def test_invariance_names_the_longest_batchmate():
    """``amla-sim invariance --kernel vllm-triton-mla``: batchmates of the request's length or shorter leave its
    bits alone; a longer one raises every request's split count and changes them, and the report says why."""
    from amla_sim.invariance import invariance
    from amla_sim.invariance.launches import Launch

    launches = [Launch("alone", (1000,)), Launch("beside a shorter one", (1000, 700)),
                Launch("beside a 6000-token one", (1000, 6000))]
    rep = invariance("vllm-triton-mla", length=1000, heads=16, dist="normal:1", launches=launches)
    alone, shorter, longer = rep.results
    assert shorter.comparison.bit_exact and not longer.comparison.bit_exact and not rep.invariant
    assert "longest request (6000 tokens" in longer.reason and "16 splits" in longer.reason
    assert longer.changed["out"] > 0 and alone.plan == [(0, 1000)]


def test_the_fp8_k_order_is_what_the_gpu_showed(triton_capture, fastest_engine):
    """``scripts/vllm_triton_kwidth.py`` on an H100: the kernel on an FP8 cache and on a BF16 cache of the same
    dequantized values differ (so the arithmetic differs, not the values), the FP8 compilation's dots take kWidth 4
    where the BF16 one's take 2, on the same mma.sync; and the model with k in order (the BF16 path's arithmetic)
    misses exactly as many of the FP8 capture's elements as the GPU's own BF16 run did."""
    got = json.loads((DATA / "vllm_triton_kwidth.json").read_text())
    kinds = {(k["fp8_cache"], tuple(k["dot_kwidth"]), tuple(k["mma"])) for k in got["stage1_compilations"]}
    mma = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",)
    assert kinds == {(False, (2,), mma), (True, (4,), mma)}
    meta, arrays = triton_capture
    for case, diff in got["cases"].items():
        c = meta["cases"][int(case)]
        q, kv = fp8_inputs(c)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(triton, "FP8_CACHE_K_ORDER", tuple(range(32)))
            res = vllm_triton_mla(q, kv, seqlens=np.array(c["seqlens"]), scale=c["scale"], k_scale=c["k_scale"],
                                  num_kv_splits=c["num_kv_splits"])
        out = res.out.reshape(arrays[f"c{case}_out"].shape).view(np.uint16)
        assert int((out != arrays[f"c{case}_out"]).sum()) == diff["out"] > 0 and diff["lse"] == 0


@pytest.mark.parametrize("args, match", [
    ((-1, 132), "max_seq_len"), ((4096, 0), "sms"), ((4096.0, 132), "max_seq_len"), ((True, 132), "max_seq_len"),
])
def test_the_split_count_refuses_bad_input(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        vllm_num_kv_splits(*args)


def test_the_invariance_study_takes_one_query_row():
    from amla_sim.invariance import invariance

    with pytest.raises(ValueError, match="s_q"):
        invariance("vllm-triton-mla", length=100, heads=16, s_q=(2,))


@pytest.mark.parametrize("path, edit, match", [
    (TRITON, {"kv_cache": "fp16"}, "kv_cache"), (TRITON, {"k_scale": "zero"}, "k_scale"),
    (TRITON, {"batch_invariant": "yes"}, "batch_invariant"), (TRITON, {"page_size": 0}, "page_size"),
    (DENSE, {"q_scale": [1.0]}, "q_scale"), (DENSE, {"k_scale": None}, "k_scale"),
])
def test_a_corrupted_capture_is_refused_by_name(tmp_path, path, edit, match):
    """A case whose recipe the models do not cover is refused, naming the field, before any work."""
    from amla_sim.crosscheck import CaptureError

    meta, arrays = _load(path)
    meta["cases"][0].update(edit)
    bad = tmp_path / "bad.npz"
    np.savez(bad, meta=np.array(json.dumps(meta)), **arrays)
    with pytest.raises(CaptureError, match=match):
        replay(bad)


def test_run_twice_says_whether_the_gpu_repeated_itself():
    from amla_sim.crosscheck.kernel import run_twice

    runs = iter([{"out": np.arange(3)}, {"out": np.arange(3)}, {"out": np.arange(3)}, {"out": np.ones(3)}])
    assert run_twice(lambda: next(runs))[1] and not run_twice(lambda: next(runs))[1]
