"""The limits table of the cross-check page, row by row: each row's input run through its model, which computes
where the table says it computes and refuses, naming the argument, where it says it refuses; and the captures of
the inputs the kernels compute, replayed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from amla_sim.algorithms import (fa3_mla, flashinfer_mla, flashmla, flashmla_dense_fp8, flashmla_etap,
                                 flashmla_sparse_fp8, flashmla_sparse_prefill, splitkv_decode, vllm_triton_mla)
from amla_sim.algorithms.deployed import scalars
from amla_sim.algorithms.deployed.fa3.prefill import fa3_prefill
from amla_sim.algorithms.deployed.flashinfer.scheduler import flashinfer_mla_plan
from amla_sim.algorithms.deployed.flashmla.fp8_cache import quantize_kv_cache
from amla_sim.algorithms.deployed.vllm.fp8 import quantize_cache_fp8, quantize_query_fp8
from amla_sim.crosscheck.deployed import replay_deployed
from amla_sim.crosscheck.files import read_capture
from amla_sim.experiments.inputs import make_inputs
from amla_sim.units import FMAUnit

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"


def _rows() -> list[tuple[str, str, str, str]]:
    """(kernel, input, upstream, model) of every row of the table under "What each model takes"."""
    text = (ROOT / "docs" / "crosscheck.md").read_text()
    section = text.split("### What each model takes", 1)[1].split("\n### ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| kernel")]
    return [tuple(r) for r in rows]


def _inputs(b=2, sq=3, heads=16, context=64, fmt="bf16"):
    return make_inputs("normal:1", batch=b, sq=sq, heads=heads, context=context, seed=1, fmt=fmt)


def _fp8(b=2, sq=1, heads=16, context=64):
    q, kv = _inputs(b, sq, heads, context)
    return quantize_query_fp8(q), quantize_cache_fp8(kv)


def _sparse_fp8(heads=64, topk=64):
    _, kv = _inputs(1, 1, 1, 128)
    cache = quantize_kv_cache(kv.reshape(2, 64, 1, 576), "v32")
    q = _inputs(1, 1, heads, 1)[0]
    return q, cache, np.arange(topk, dtype=np.int32).reshape(1, 1, topk) % 128


def _sparse_prefill(heads=64, topk=128):
    q, kv = _inputs(1, 4, heads, 256)
    return q[0], kv[0][:, None], np.tile(np.arange(topk, dtype=np.int32) % 256, (4, 1, 1))


def _prefill(klens=(64, 0), d=192, dv=128, rows=None, fmt="bf16"):
    """q, k, v and the offsets of a small MHA-form prefill call (`rows`: k's rows, default the keys')."""
    ql, n = [5, 3], sum(klens) if rows is None else rows
    q = make_inputs("normal:1", heads=4, sq=8, context=1, d_k=d, d_v=min(d, dv), seed=2, fmt=fmt)[0][0]
    k = make_inputs("normal:1", heads=4, sq=max(n, 1), context=1, d_k=d, d_v=min(d, dv), seed=3, fmt=fmt)[0][0][:n]
    v = make_inputs("normal:1", heads=4, sq=max(n, 1), context=1, d_k=dv, d_v=dv, seed=4, fmt=fmt)[0][0][:n]
    return q, k, v, np.cumsum([0, *ql]), np.cumsum([0, *klens])


def _fi8():
    q, kv = _inputs(sq=1)
    return q, kv.astype(ml_dtypes.float8_e4m3fn)


def _small(x: np.ndarray) -> np.ndarray:
    """`x` times 1e-38, in its format (near FP32's subnormal range)."""
    return (x.astype(np.float32) * np.float32(1e-38)).astype(x.dtype)


def _every_computes(scale: float) -> None:
    """Every model on a softmax scale (each kernel's bits for it are captured)."""
    q, kv = _inputs(sq=1)
    for model in (fa3_mla, flashmla_etap, vllm_triton_mla, splitkv_decode, flashinfer_mla):
        model(q, kv, scale=scale)
    flashmla(q, kv, seqlens=[64, 64], scale=scale)
    flashmla_dense_fp8(*_fp8(), scale=scale)
    flashmla_sparse_fp8(*_sparse_fp8(), scale=scale)
    flashmla_sparse_prefill(*_sparse_prefill(), scale=scale)
    fa3_prefill(*_prefill(), scale=scale)


#: (kernel, input) of a row -> (the call, the argument a refusal names)
PROBES = {
    ("fa3-mla", "a causal step longer than its request (`seqlens < s_q`), a request of no key"):
        (lambda: fa3_mla(*_inputs(), seqlens=[0, 2]), None),
    ("fa3-mla", "`num_splits` over 256"): (lambda: fa3_mla(*_inputs(), num_splits=257), "num_splits"),
    ("fa3-mla", "`num_splits` below 0"): (lambda: fa3_mla(*_inputs(), num_splits=-3), None),
    ("fa3-mla", "`softcap` over 0"): (lambda: fa3_mla(*_inputs(), softcap=30.0), None),
    ("fa3-mla", "a local `window_size`"): (lambda: fa3_mla(*_inputs(), window_size=(100, 0)), None),
    ("fa3-mla", "`softcap` of 0 or below"): (lambda: fa3_mla(*_inputs(), softcap=-1.0), None),
    ("fa3-mla", "a NaN or infinite scale"): (lambda: fa3_mla(*_inputs(), scale=float("nan")), "scale"),
    ("fa3-prefill", "a request of no key (k with rows)"): (lambda: fa3_prefill(*_prefill((64, 0))), None),
    ("fa3-prefill", "a k of no row"): (lambda: fa3_prefill(*_prefill((0, 0), rows=0)), None),
    ("fa3-prefill", "`num_splits` over 256"): (lambda: fa3_prefill(*_prefill(), num_splits=257), "num_splits"),
    ("fa3-prefill", "head dims between the compiled ones: any multiple of 8 (16 for FP8) up to 256, v as wide as q, "
                    "narrower at q <= 64, or 104 to 128 at q of 136 to 192"):
        (lambda: (fa3_prefill(*_prefill(d=80, dv=80)), fa3_prefill(*_prefill(d=160, dv=112))), None),
    ("fa3-prefill", "a local `window_size`"):
        (lambda: [fa3_prefill(*_prefill(), causal=c, window_size=w) for c, w in ((True, (2, 0)), (False, (3, 1)))],
         None),
    ("fa3-prefill", "`softcap` over 0"): (lambda: fa3_prefill(*_prefill(), softcap=30.0), None),
    ("fa3-prefill", "`build=\"sglang\"` at head dims 64, 96, 128 and 256, BF16 and FP8, local windows"):
        (lambda: fa3_prefill(*_prefill(d=96, dv=96), build="sglang", window_size=(20, 0)), None),
    ("fa3-prefill", "a v wider than q at q <= 64"):
        (lambda: [fa3_prefill(*_prefill(d=d, dv=dv)) for d, dv in ((64, 256), (48, 200), (64, 512))], None),
    ("fa3-prefill", "a head dim not a multiple of 8 (16 for FP8) or over 256, another v than those"):
        (lambda: fa3_prefill(*_prefill(d=100, dv=100)), "q"),
    ("fa3-prefill", "q, k, v in FP8 E4M3"):
        (lambda: fa3_prefill(*(x.astype(ml_dtypes.float8_e4m3fn) for x in _prefill()[:3]), *_prefill()[3:]), None),
    ("fa3-prefill", "q, k, v in FP8 E5M2"):
        (lambda: fa3_prefill(*(x.astype(ml_dtypes.float8_e5m2) for x in _prefill()[:3]), *_prefill()[3:]), "q"),
    ("every kernel", "a scale of 0 or below"): (lambda: [_every_computes(s) for s in (0.0, -0.1352)], None),
    ("every kernel", "a subnormal scale"): (lambda: [_every_computes(s) for s in (1e-40, -3e-39, 1e-38)], None),
    ("flashmla", "q and kv in FP16"): (lambda: flashmla(*_inputs(fmt="fp16"), seqlens=[64, 64]), None),
    ("flashmla", "a request of no key"): (lambda: flashmla(*_inputs(sq=1), seqlens=[0, 64]), None),
    ("flashmla", "a causal step longer than its request"):
        (lambda: flashmla(*_inputs(), seqlens=[2, 64], causal=True), None),
    ("flashmla", "an SM count that makes more than 160 scheduler parts"):
        (lambda: flashmla(*_inputs(sq=1), seqlens=[64, 64], num_sms=161), "num_sms"),
    ("flashmla-dense-fp8", "a causal step longer than its request"):
        (lambda: flashmla_dense_fp8(*_fp8(sq=3), seqlens=[2, 64]), None),
    ("flashmla-dense-fp8", "a batch of 4,096 requests or more"):
        (lambda: flashmla_dense_fp8(*_fp8(b=4096, heads=1, context=1)), "q"),
    ("flashmla-etap", "a batch of 4,096 requests or more"):
        (lambda: flashmla_etap(*_inputs(b=4096, sq=1, heads=1, context=1)), "q"),
    ("flashmla-sparse-fp8", "heads other than 64 or 128"): (lambda: flashmla_sparse_fp8(*_sparse_fp8(heads=32)), "q"),
    ("flashmla-sparse-fp8", "a top-k width that is not a multiple of 64"):
        (lambda: flashmla_sparse_fp8(*_sparse_fp8(topk=96)), "indices"),
    ("flashmla-sparse-prefill", "heads other than 64 or 128"):
        (lambda: flashmla_sparse_prefill(*_sparse_prefill(heads=32)), "q"),
    ("flashmla-sparse-prefill", "a top-k width that is not a positive multiple of 128"):
        (lambda: flashmla_sparse_prefill(*_sparse_prefill(topk=192)), "indices"),
    ("flashinfer-mla", "a causal step longer than its request"):
        (lambda: flashinfer_mla(*_inputs(), seqlens=[2, 64], causal=True), None),
    ("flashinfer-mla", "a plan of more than 16,384 work items, a causal tile boundary that drops a key"):
        (lambda: flashinfer_mla_plan([65], heads=48, q_lens=3, causal=True), "seqlens"),
    ("flashinfer-mla", "an SM count whose plan overflows the wrapper's 8 MiB int workspace"):
        (lambda: flashinfer_mla(*_inputs(sq=1), num_sms=10**6), "num_sms"),
    ("flashinfer-mla", "a NaN or infinite scale"): (lambda: flashinfer_mla(*_inputs(sq=1), scale=np.inf), "scale"),
    ("vllm-triton-mla", "a causal step longer than its request, a request of no key"):
        (lambda: vllm_triton_mla(*_inputs(), seqlens=[0, 2]), None),
    ("vllm-triton-mla", "one query head"): (lambda: vllm_triton_mla(*_inputs(heads=1)), None),
    ("sglang-triton", "one query head"): (lambda: splitkv_decode(*_inputs(sq=1, heads=1)), None),
    ("sglang-triton", "a request of no key"): (lambda: splitkv_decode(*_inputs(sq=1), seqlens=[0, 64]), None),
    ("sglang-triton", "`logit_cap` of 0 or below"): (lambda: splitkv_decode(*_inputs(sq=1), logit_cap=-1.0), None),
    ("flashmla-dense-fp8, vllm-triton-mla, sglang-triton",
     "a descale, cache scale or `v_scale` of 0, below 0, subnormal, infinite or NaN"):
        (lambda: [(flashmla_dense_fp8(*_fp8(), descale_q=f), vllm_triton_mla(*_inputs(), k_scale=f),
                   splitkv_decode(*_inputs(sq=1), v_scale=f)) for f in (0.0, -0.05, 1e-40, np.inf, np.nan)], None),
    ("flashinfer-mla, flashinfer-mla-sparse", "a cache scale that is not finite and positive (as a double)"):
        (lambda: flashinfer_mla(*_fi8(), ckv_scale=-1.0, kpe_scale=1.0), "ckv_scale"),
    ("flashinfer-mla, flashinfer-mla-sparse", "a latent cache scale under 2^-100 that is not 0 as a float"):
        (lambda: flashinfer_mla(*_fi8(), ckv_scale=2.0 ** -110, kpe_scale=1.0), None),
    ("every kernel", "q and the cache near FP32's subnormal range"):
        (lambda: (flashinfer_mla(*(_small(x) for x in _inputs(sq=1))), fa3_mla(*(_small(x) for x in _inputs())),
                  fa3_prefill(*(_small(x) for x in _prefill()[:3]), *_prefill()[3:])), None),
    ("fa3-prefill", "an FP8 v wider than q at q <= 64"):
        (lambda: fa3_prefill(*(x.astype(ml_dtypes.float8_e4m3fn) for x in _prefill(d=64, dv=128)[:3]),
                             *_prefill()[3:]), None),
    ("fa3-prefill", "an FP8 descale of 0, below 0, subnormal or not finite"):
        (lambda: fa3_prefill(*(x.astype(ml_dtypes.float8_e4m3fn) for x in _prefill()[:3]), *_prefill()[3:],
                             q_descale=np.zeros((2, 4), np.float32), k_descale=np.full((2, 4), np.nan, np.float32)),
         None),
}


def test_every_row_has_its_probe_and_every_probe_its_row():
    rows = {(r[0], r[1]) for r in _rows()}
    assert len(rows) == len(_rows()) > 20
    assert rows == set(PROBES), (rows - set(PROBES), set(PROBES) - rows)


@pytest.mark.parametrize("kernel, what, upstream, model", _rows(), ids=[f"{r[0]}: {r[1][:40]}" for r in _rows()])
def test_the_model_does_what_the_row_says(kernel, what, upstream, model):
    call, arg = PROBES[(kernel, what)]
    assert model.split()[0].rstrip(";,") in ("computes", "refuses"), model
    if model.startswith("computes"):
        assert arg is None
        call()
        return
    named = re.search(r"naming (`\w+`|the argument|the scale)", model)
    assert named and arg is not None, model
    with pytest.raises((ValueError, TypeError)) as e:
        call()
    assert str(e.value).startswith(f"{arg}:"), str(e.value)
    if "not modelled" in model or "not captured" in model:
        assert upstream.startswith("computes"), (upstream, model)  # a refusal of what the kernel runs says so


#: the edges captures -> their case counts: softmax scales of 0, below 0 and subnormal (edges_*), subnormal ones at
#: FP32's normal boundary and negative ones over FlashMLA's odd splits (tiny_*), requests of no key
EDGES = {"edges_fa3_mla_h200.npz": 6, "edges_fa3_mla_sparse_h200.npz": 6, "edges_flashmla_h200.npz": 6,
         "edges_flashmla_dense_fp8_h200.npz": 6, "edges_flashmla_etap_h200.npz": 6,
         "edges_flashmla_sparse_fp8_h200.npz": 6, "edges_flashmla_sparse_prefill_h200.npz": 6,
         "edges_vllm_triton_mla_h200.npz": 6, "edges_sglang_triton_h200.npz": 8, "edges_flashmla_empty_h200.npz": 4,
         "edges_flashinfer_mla_h200.npz": 9, "edges_fa3_prefill_h100.npz": 7,
         "tiny_fa3_mla_h200.npz": 6, "tiny_fa3_mla_sparse_h200.npz": 6, "tiny_fa3_prefill_h200.npz": 6,
         "tiny_flashinfer_mla_h200.npz": 6, "tiny_flashmla_dense_fp8_h200.npz": 6, "tiny_flashmla_etap_h200.npz": 6,
         "tiny_flashmla_h200.npz": 10, "tiny_flashmla_sglang_h200.npz": 10, "tiny_vllm_triton_mla_h200.npz": 6,
         "tiny_sglang_triton_h200.npz": 6, "descale_flashmla_dense_fp8_h200.npz": 10,
         "descale_vllm_triton_mla_h200.npz": 5, "descale_sglang_triton_h200.npz": 5,
         "descale_fa3_prefill_h200.npz": 10}


@pytest.mark.parametrize("name", sorted(EDGES))
def test_the_edges_the_kernels_compute_replay_bit_for_bit(name):
    """Softmax scales of 0, below 0 and subnormal through every kernel, and requests of no key, as an H200 computed
    them: every case replays in every bit."""
    meta, arrays = read_capture(DATA / name, what=name)
    assert len(meta["cases"]) == EDGES[name]
    report = replay_deployed(name, meta, arrays)
    assert report.bit_exact, report.format()


@pytest.mark.parametrize("name", ["softcap_fa3_mla_h200.npz", "softcap_fa3_mla_seed1000_h200.npz"])
def test_fa3s_mla_decode_with_a_softcap_replays_bit_for_bit(name):
    """FA3's MLA decode with a softcap through vLLM 0.33's library (``scripts/capture_limits.py ... softcap``): the
    paged call with the heuristic's splits, an MTP step with a request shorter than it, the CUDA graphs' 32 splits,
    SGLang's unpaged form; the same at fresh seeds."""
    meta, arrays = read_capture(DATA / name, what=name)
    assert all(c["softcap"] > 0 for c in meta["cases"])
    report = replay_deployed(name, meta, arrays)
    assert report.bit_exact, report.format()


@pytest.mark.parametrize("name", ["local_fa3_mla_h200.npz", "local_fa3_mla_seed1000_h200.npz"])
def test_fa3s_mla_decode_in_a_local_window_replays_bit_for_bit(name):
    """FA3's MLA decode with a local ``window_size`` through vLLM 0.33's library (``scripts/capture_limits.py ...
    local``): windows behind the query in MTP steps and decodes, one of a single key, one with keys after the query
    (a non-causal call), the heuristic's splits over the keys a window loads, the CUDA graphs' 32, SGLang's unpaged
    form; the same at fresh seeds."""
    meta, arrays = read_capture(DATA / name, what=name)
    assert all(c["window"] != [-1, -1] for c in meta["cases"])
    report = replay_deployed(name, meta, arrays)
    assert report.bit_exact, report.format()


@pytest.mark.parametrize("change", ["blocks-aligned-to-64", "bound-over-every-key"])
def test_each_local_decode_choice_matters(change, monkeypatch):
    """A local m-block's key blocks start at its first row's first key (``n_offset``), not at a multiple of 64, and
    the launch's split bound weighs the keys the window loads: each in its other form gives other bits (the MTP
    call of 64 heads over 5,000 keys, a window of 1,000)."""
    from amla_sim.algorithms.deployed.fa3 import scheduler

    if change == "blocks-aligned-to-64":
        monkeypatch.setattr(scheduler, "n_offset", lambda *a, **kw: 0)
    else:
        bound = scheduler.launch_splits
        monkeypatch.setattr(scheduler, "launch_splits", lambda *a, local=None, **kw: bound(*a, **kw))
    meta, arrays = read_capture(DATA / "local_fa3_mla_h200.npz", what="local")
    report = replay_deployed("local", {**meta, "cases": meta["cases"][:1]},
                             {k: v for k, v in arrays.items() if k.startswith("c0_")})
    assert not report.bit_exact, report.format()


@pytest.mark.parametrize("name, cases", [("limits_fa3_mla_vllm_h200.npz", 6),
                                         ("limits_flashmla_dense_fp8_vllm_h200.npz", 3),
                                         ("limits_vllm_triton_mla_h200.npz", 4)])
def test_the_captures_of_what_the_kernels_compute_replay_bit_for_bit(name, cases):
    """Requests shorter than their causal step and requests of no key, as vLLM 0.33's shipped libraries and its
    Triton decode computed them on an H200: every stage of every case."""
    meta, arrays = read_capture(DATA / name, what=name)
    assert len(meta["cases"]) == cases
    assert any(min(c["seqlens"]) < c.get("sq", 1) or min(c["seqlens"]) == 0 for c in meta["cases"])
    report = replay_deployed(name, meta, arrays)
    assert report.bit_exact, report.format()


def test_the_rows_without_a_key_are_in_the_captures():
    """The FA3 capture's first case is vLLM's MTP call where row 0 of request 0 sees no key: out 0, LSE -inf."""
    _, arrays = read_capture(DATA / "limits_fa3_mla_vllm_h200.npz", what="fa3")
    out = arrays["c0_out"].view(np.float16).astype(np.float32)  # (b s_q, h, 512), FP16
    lse = arrays["c0_lse"].view(np.float32)  # (h, b s_q)
    assert (out[0] == 0).all() and np.isneginf(lse[:, 0]).all() and np.isfinite(lse[:, 1:]).all()
    _, tri = read_capture(DATA / "limits_vllm_triton_mla_h200.npz", what="triton")
    assert np.isnan(tri["c0_out"].view(ml_dtypes.bfloat16).astype(np.float32)[0]).all()


_FAST_MATH = ["tiny_fa3_mla_h200.npz", "tiny_fa3_mla_sparse_h200.npz", "tiny_fa3_prefill_h200.npz",
              "tiny_flashinfer_mla_h200.npz", "tiny_flashmla_dense_fp8_h200.npz", "tiny_flashmla_etap_h200.npz",
              "tiny_flashmla_sglang_h200.npz"]


@pytest.mark.parametrize("name", _FAST_MATH)
def test_a_fast_math_kernel_reads_a_subnormal_constant_as_zero(name, monkeypatch):
    """At 8.1e-39 and -3e-39 (whose constants are subnormal) a fast-math kernel's bits are those of a flushed
    constant: the same model with the flush off gives others."""
    meta, arrays = read_capture(DATA / name, what=name)
    monkeypatch.setattr(FMAUnit, "read", lambda self, x: x)
    for i in (4, 5):
        assert abs(meta["cases"][i]["scale"]) in (8.1e-39, 3e-39)
        assert not replay_deployed(name, meta, arrays, cases=[i]).bit_exact, i


@pytest.mark.parametrize("name, modules, cases", [
    ("tiny_fa3_mla_h200.npz", ["fa3.mla"], range(4)), ("tiny_fa3_prefill_h200.npz", ["fa3.mla"], (0, 3)),
    ("tiny_flashmla_sglang_h200.npz", ["flashmla.dense"], range(4)),
    ("tiny_flashmla_etap_h200.npz", ["flashmla.etap"], range(4)),
    ("tiny_flashmla_dense_fp8_h200.npz", ["flashmla.dense_fp8"], range(4)),
])
def test_fa3_and_flashmla_form_scale_log2_e_on_the_host(name, modules, cases, monkeypatch):
    """At 1e-38 to 8.2e-39 the scale is subnormal but its double product with log2 e is not: the kernels' bits are
    those of the host's product; formed from the flushed scale (on the device) it would be 0, and other bits."""
    for m in modules:
        module = importlib.import_module(f"amla_sim.algorithms.deployed.{m}")
        monkeypatch.setattr(module, "scale_log2", lambda mc, s: scalars.scale_log2(mc, mc.ftz(s)))
    meta, arrays = read_capture(DATA / name, what=name)
    for i in cases:
        assert not replay_deployed(name, meta, arrays, cases=[i]).bit_exact, i


def test_flashinfer_forms_its_constant_on_the_device(monkeypatch):
    """FlashInfer multiplies ``sm_scale * log2e`` in the kernel, so a subnormal scale is 0 there even where the
    product would be normal (1e-38 to 8.2e-39): formed from the unflushed scale, the model gives other bits."""
    mla = importlib.import_module("amla_sim.algorithms.deployed.flashinfer.mla")
    monkeypatch.setattr(mla, "_scale_log2", lambda mc, s: mc.ftz(scalars.scale_log2_f32(mc, s)))
    name = "tiny_flashinfer_mla_h200.npz"
    meta, arrays = read_capture(DATA / name, what=name)
    for i in range(4):
        assert not replay_deployed(name, meta, arrays, cases=[i]).bit_exact, i


@pytest.mark.parametrize("name, cases", [("edges_flashmla_h200.npz", [4]), ("tiny_flashmla_h200.npz", [1, 6]),
                                         ("tiny_flashmla_sglang_h200.npz", [1, 7])])
def test_flashmla_s_block_of_nothing_moves_the_max_at_a_negative_scale(name, cases):
    """A split of an odd block count runs warpgroup 1 over a block of -1e33 (splitkv_mla.cuh:433); times a negative
    scale it kept (vLLM's precise build, or a product normal at -1e-38) it is the row's largest value and the max
    moves: the captures replay at their scale, and not at -0 (the max left where it was)."""
    meta, arrays = read_capture(DATA / name, what=name)
    assert replay_deployed(name, meta, arrays, cases=cases).bit_exact
    for i in cases:
        zero = {**meta, "cases": [dict(c, scale=-0.0) if j == i else c for j, c in enumerate(meta["cases"])]}
        assert not replay_deployed(name, zero, arrays, cases=[i]).bit_exact, i


@pytest.mark.parametrize("name", ["descale_flashmla_dense_fp8_h200.npz", "descale_vllm_triton_mla_h200.npz"])
def test_vllms_quantizers_at_the_scale_edges_give_the_devices_bytes(name):
    """The query's and the cache's bytes vLLM's quantizers wrote on the device with scales of 0, -0.05, an
    infinity, NaN and 1e-40 are the model's (the recipe's CRC is of the device's bytes; the replay rebuilds them)."""
    meta, arrays = read_capture(DATA / name, what=name)
    assert all(c["quant_identical"] for c in meta["cases"])
    assert {str(c.get("q_scale", 1.0)) for c in meta["cases"]} | {str(c["k_scale"]) for c in meta["cases"]} >= {
        "0.0", "-0.05", "inf", "nan", "1e-40"}


@pytest.mark.parametrize("name, flushed", [("descale_flashinfer_mla_h200.npz", (0, 3)),
                                           ("descale_flashinfer_mla_sparse_h200.npz", (0, 3))])
def test_flashinfers_cache_scales_replay(name, flushed, monkeypatch):
    """FlashInfer's cache scales at the edges its wrapper takes: 1e-300 (0 as a float), 1e39 (an infinity as a
    float), 2^-100, and 1e-40 and 2^-120, whose subnormal partial outputs its fast-math multiplies flush, replay in
    every bit; with the flush off the last two do not."""
    meta, arrays = read_capture(DATA / name, what=name)
    report = replay_deployed(name, meta, arrays)
    assert report.bit_exact, report.format()
    monkeypatch.setattr(FMAUnit, "read", lambda self, x: x)
    for i in flushed:
        assert not replay_deployed(name, meta, arrays, cases=[i]).bit_exact, i


def test_fa3s_final_scale_reads_a_subnormal_v_descale_as_zero(monkeypatch):
    """FA3's FP8 call at v_descale 1e-40: ``finalize``'s FTZ multiply reads it as 0 and every output is +0; unflushed,
    the model's outputs are the underflowed signed zeros of ``O * tiny``."""
    name = "descale_fa3_prefill_h200.npz"
    meta, arrays = read_capture(DATA / name, what=name)
    assert meta["cases"][9]["v_descale"] == 1e-40 and (arrays["c9_out"] == 0).all()
    monkeypatch.setattr(FMAUnit, "read", lambda self, x: x)
    assert not replay_deployed(name, meta, arrays, cases=[9]).bit_exact


@pytest.mark.parametrize(("kernel", "edit", "match"), [
    ("sglang-triton", {"v_scale": "one"}, "v_scale: expected a float32 number"),
    ("flashinfer-mla", {"kv_format": "e4m3", "ckv_scale": -1.0, "kpe_scale": 1.0}, "ckv_scale: must be a finite"),
    ("flashinfer-mla-sparse", {"k_scale": float("nan")}, "k_scale: must be a finite positive value"),
])
def test_a_scale_edge_a_recipe_may_not_hold_is_refused_by_name(kernel, edit, match):
    """The recipe keys the scale captures use: a v_scale that is no number, FlashInfer's refused scales."""
    from amla_sim.crosscheck.deployed import KERNELS

    with pytest.raises(ValueError, match=f"^{match}"):
        KERNELS[kernel].check({**KERNELS[kernel].scale_template(), **edit})
