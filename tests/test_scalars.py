"""Scalars as the kernels' APIs take them: every deployed kernel's scale table captured on an H100 (DeepSeek's
softmax scales and 20 random ones in [0.03, 0.3], random descales and cache scales) is predicted in every bit, and
the two things the models do with a scalar (round it to FP32 first; derive its log2 constant in double or in FP32, as
the kernel does) each change bits on some of those scales."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from amla_sim.algorithms import flashmla
from amla_sim.algorithms.deployed import scalars
from amla_sim.cli import main
from amla_sim.crosscheck import replay
from amla_sim.crosscheck.deployed import KERNELS
from amla_sim.crosscheck.kernel import DEEPSEEK_SCALES, RANDOM_SCALES, scale_table
from amla_sim.experiments.inputs import make_inputs

DATA = Path(__file__).parent / "data"
#: kernels whose scale table is kept as a record of digests, byte for byte another kernel's capture (the
#: equality is tested in test_sgl_fa3.py): SGLang's DSA decode gives vLLM's fork's bits
RECORDED = {"sgl-fa3-mla-sparse": "fa3-mla-sparse"}
CAPTURES = {k: DATA / f"scales_{k.replace('-', '_')}.npz" for k in KERNELS if k not in RECORDED}
#: the model module of each kernel, whose ``softmax_scale`` and log2 constant the tests replace
MODULES = {"flashmla": "flashmla.dense", "flashmla-etap": "flashmla.etap", "flashmla-sparse-fp8": "flashmla.sparse_fp8",
           "fa3-mla": "fa3.mla", "sgl-fa3-mla": "fa3.mla", "flashmla-dense-fp8": "flashmla.dense_fp8", "vllm-triton-mla": "vllm.triton_mla",
           "sglang-triton": "sglang.decode", "flashinfer-mla": "flashinfer.mla",
           "flashinfer-mla-sparse": "flashinfer.mla", "fa3-prefill": "fa3.prefill"}
#: kernel -> the cases that take the scale unrounded (the caller's double) to other bits: 192^-0.5, 0.1352 and three
#: random scales, for every kernel that multiplies the scale by log2 e in double (the Triton kernels and FlashMLA's
#: sparse decode multiply in FP32, which rounds the scale first anyway)
UNROUNDED_BITES = {"flashmla": [1, 2, 9, 11, 20], "flashmla-etap": [1, 2, 9, 11, 20], "fa3-mla": [1, 2, 9, 11, 20],
                   "sgl-fa3-mla": [1, 2, 9, 11, 20], "flashmla-dense-fp8": [1, 2, 9, 11, 20],
                   "fa3-prefill": [1, 2, 9, 11, 20]}
#: kernel -> (the log2 constant it derives, the other form, the cases where the other form changes bits)
DERIVATION_BITES = {"flashmla": ("scale_log2", scalars.scale_log2_f32, [17, 18, 23]),
                    "flashmla-etap": ("scale_log2", scalars.scale_log2_f32, [17, 18, 23]),
                    "fa3-mla": ("scale_log2", scalars.scale_log2_f32, [17, 18, 23]),
                    "sgl-fa3-mla": ("scale_log2", scalars.scale_log2_f32, [17, 18, 23]),
                    "flashmla-dense-fp8": ("scale_log2", scalars.scale_log2_f32, [17, 23]),
                    "flashmla-sparse-fp8": ("scale_log2_f32", scalars.scale_log2, [17, 18, 23]),
                    "flashinfer-mla": ("scale_log2_f32", scalars.scale_log2, [17, 18, 23]),
                    "flashinfer-mla-sparse": ("scale_log2_f32", scalars.scale_log2, [17, 18, 23])}


def _meta(path: Path) -> dict:
    with np.load(path) as z:
        return json.loads(str(z["meta"]))


def _module(kernel: str):
    return importlib.import_module(f"amla_sim.algorithms.deployed.{MODULES[kernel]}")


def _differing(report) -> list[int]:
    return [i for i, row in enumerate(report.cases) if row.first_difference is not None]


@pytest.mark.parametrize("kernel", sorted(CAPTURES))
def test_every_scale_of_the_table_is_predicted(kernel, fastest_engine):
    report = replay(CAPTURES[kernel])
    assert report.kernel == kernel and len(report.cases) == len(DEEPSEEK_SCALES) + 20
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()


@pytest.mark.parametrize("kernel", sorted(CAPTURES))
def test_the_tables_hold_the_scales_they_say(kernel):
    """DeepSeek's scales and 20 random ones, as :func:`scale_table` draws them for seed 0, on an H100; every case
    repeatable; the FP8 kernels' per-tensor scales drawn too (none of them 1)."""
    meta = _meta(CAPTURES[kernel])
    assert meta["device"] == "NVIDIA H100 80GB HBM3" and meta["kernel"] == kernel
    scales = [c["scale"] for c in meta["cases"]]
    assert scales == scale_table(0, 20) and scales[:len(DEEPSEEK_SCALES)] == list(DEEPSEEK_SCALES)
    assert all(RANDOM_SCALES[0] <= s <= RANDOM_SCALES[1] for s in scales[len(DEEPSEEK_SCALES):])
    for key in ("q_scale", "k_scale"):
        drawn = [c[key] for c in meta["cases"] if key in c]
        assert len(set(drawn)) == (len(scales) if drawn else 0) and 1.0 not in drawn
    assert all(c.get("repeat_identical", True) for c in meta["cases"])


@pytest.mark.parametrize("kernel", sorted(UNROUNDED_BITES))
def test_the_api_rounds_the_scale_to_fp32_first(kernel, monkeypatch, fastest_engine):
    """Taken as the caller's double, the scale gives other bits on exactly the listed cases (192^-0.5 among them:
    FlashMLA's dense model derived its constant so before, one ULP off the device there)."""
    monkeypatch.setattr(_module(kernel), "softmax_scale",
                        lambda scale, default=576**-0.5, double=False: float(default if scale is None else scale))
    cases = UNROUNDED_BITES[kernel]
    report = replay(CAPTURES[kernel], cases=[0, *cases])
    assert _differing(report) == list(range(1, len(cases) + 1)), report.format()


@pytest.mark.parametrize("kernel", sorted(DERIVATION_BITES))
def test_each_kernel_derives_its_log2_constant_as_upstream(kernel, monkeypatch, fastest_engine):
    """``float(scale * M_LOG2E)`` (a double product) and ``sm_scale * LOG_2_E`` (an FP32 one) differ on some
    scales: the other form than the kernel's gives other bits there."""
    name, other, cases = DERIVATION_BITES[kernel]
    monkeypatch.setattr(_module(kernel), name, other)
    report = replay(CAPTURES[kernel], cases=[0, *cases])
    assert _differing(report) == list(range(1, len(cases) + 1)), report.format()


def test_flashmla_dense_192_is_one_ulp_of_the_constant():
    """The scale the device showed it on: FlashMLA's constant from the FP32 scale is one FP32 ULP from the one
    from the double, and the LSE moves with it."""
    s = 192 ** -0.5
    consts = [np.float32(np.float64(np.float32(s)) * math.log2(math.e)), np.float32(s * math.log2(math.e))]
    assert abs(int(consts[0].view(np.int32)) - int(consts[1].view(np.int32))) == 1
    q, kv = make_inputs("normal:1", heads=16, context=300, seed=3)
    a, b = (flashmla(q, kv, seqlens=None, scale=x, build="upstream") for x in (s, float(np.float32(s))))
    np.testing.assert_array_equal(a.lse.view(np.uint32), b.lse.view(np.uint32))  # the API's float is the input
    a, b = (flashmla(q, kv, seqlens=None, scale=x, build="sglang") for x in (s, float(np.float32(s))))
    assert (a.lse.view(np.uint32) != b.lse.view(np.uint32)).any()  # the engines' ops take the double


@pytest.mark.parametrize("value, want", [
    (0.0, 0.0), (-0.1, np.float32(-0.1)), (float("nan"), np.float32("nan")), (float("inf"), np.float32("inf")),
    (1e300, np.float32("inf")), (1e-300, 0.0), (1e-40, np.float32(1e-40)), (10**400, np.float32("inf")),
    (True, "float32 number"), ("0.1", "float32 number"),
])
def test_a_descale_is_taken_whatever_its_value(value, want):
    """No kernel checks its descales and cache scales: each is the caller's number rounded to FP32 once, 0, negative,
    subnormal, infinite and NaN ones included (what each kernel computes with them is captured,
    tests/data/descale_*_h200.npz); only what is no number is refused."""
    if isinstance(want, str):
        with pytest.raises(ValueError, match=f"^scale: expected a {want}"):
            scalars.api_float(value, "scale")
    else:
        got = scalars.api_float(value, "scale")
        assert got.dtype == np.float32 and got.tobytes() == np.float32(want).tobytes()


@pytest.mark.parametrize("value, want", [
    (0.0, 0.0), (-0.1352, np.float32(-0.1352)), (1e-300, 0.0),  # rounds to FP32 0
    (1e-40, np.float32(1e-40)), (-1e-45, np.float32(-1e-45)), (1e-38, np.float32(1e-38)),
    (float("nan"), "finite"), (-float("inf"), "finite"), (1e39, "finite"), ("0.1", "finite"), (True, "finite"),
])
def test_a_softmax_scale_is_taken_as_the_kernels_take_it(value, want):
    """No kernel checks its softmax scale: 0, negative and subnormal ones are taken (their bits captured on an H200,
    tests/data/edges_*_h200.npz and tiny_*_h200.npz); NaN and infinities are not."""
    if isinstance(want, str):
        with pytest.raises(ValueError, match=f"^scale: .*{want}"):
            scalars.api_scale(value)
    else:
        got = scalars.api_scale(value)
        assert got.dtype == np.float32 and got.tobytes() == np.float32(want).tobytes()


@pytest.mark.parametrize("call", [
    lambda q, kv: flashmla(q, kv, seqlens=None, scale=1e300),
    lambda q, kv: importlib.import_module("amla_sim.algorithms").fa3_mla(q, kv, scale=float("nan")),
    lambda q, kv: importlib.import_module("amla_sim.algorithms").splitkv_decode(q, kv, v_scale="1"),
    lambda q, kv: importlib.import_module("amla_sim.algorithms").splitkv_decode(q, kv, scale=float("inf")),
])
def test_every_model_refuses_scalars_outside_float32(call):
    q, kv = make_inputs("normal:1", heads=16, context=64, seed=1)
    with pytest.raises(ValueError, match="scale"):
        call(q, kv)


def test_the_api_float_is_the_fp32_value():
    for s in (*DEEPSEEK_SCALES, 0.03, 0.3):
        got = scalars.api_float(s, "scale")
        assert isinstance(got, np.float32) and got == np.float32(s)


@pytest.mark.parametrize("argv", [
    ["crosscheck", "--kernel", "flashmla", "--replay", "tests/data/scales_flashmla.npz", "--scales", "3"],
    ["crosscheck", "--scales", "3"],
])
def test_crosscheck_scales_only_for_a_deployed_capture(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--scales" in err and "Traceback" not in err
