"""FlashMLA as the engines ship it: vLLM 0.33.0's libraries (its FlashMLA compiled without fast math, its ops taking
the scale as a double) and sgl-flash-mla 1.0.0's, captured on an H200 (scripts/capture_builds.py, trimmed by
scripts/trim_capture.py), replayed bit for bit; the CUDA math each build compiles to against an H200's probe
(scripts/probe_math_builds.py); and each build's choices shown to matter."""

import json

import numpy as np
import pytest
from conftest import FASTEST

from amla_sim.algorithms.deployed.flashmla import builds
from amla_sim.algorithms.deployed.flashmla.builds import Build
from amla_sim.arith import elementwise as ew
from amla_sim.arith import logarithm as lg
from amla_sim.crosscheck import replay
from amla_sim.engine import use_engine
from amla_sim.machines import get_machine

DATA = "tests/data/"

#: capture -> (kernel, build, cases): the H200 captures of the shipped libraries
CAPTURES = {
    "flashmla_vllm_h200.npz": ("flashmla", "vllm", 7),
    "flashmla_sglang_h200.npz": ("flashmla", "sglang", 3),
    "flashmla_fp16_vllm_h200.npz": ("flashmla", "vllm", 3),  # FP16 inputs, MTP causal among them
    "scales_flashmla_vllm_h200.npz": ("flashmla", "vllm", 26),
    "scales_flashmla_sglang_h200.npz": ("flashmla", "sglang", 26),
    "flashmla_sparse_fp8_vllm_h200.npz": ("flashmla-sparse-fp8", "vllm", 3),
    "scales_flashmla_sparse_fp8_vllm_h200.npz": ("flashmla-sparse-fp8", "vllm", 6),
    "scales_flashmla_sparse_fp8_sglang_h200.npz": ("flashmla-sparse-fp8", "sglang", 6),
    "flashmla_sparse_prefill_vllm_h200.npz": ("flashmla-sparse-prefill", "vllm", 4),
    "scales_flashmla_sparse_prefill_vllm_h200.npz": ("flashmla-sparse-prefill", "vllm", 6),
    "scales_flashmla_sparse_prefill_sglang_h200.npz": ("flashmla-sparse-prefill", "sglang", 6),
    "flashmla_dense_fp8_vllm_h200.npz": ("flashmla-dense-fp8", "vllm", 4),
    "scales_flashmla_dense_fp8_vllm_h200.npz": ("flashmla-dense-fp8", "vllm", 26),
}
_KEY = {"flashmla": "dense", "flashmla-sparse-fp8": "sparse_fp8", "flashmla-sparse-prefill": "sparse_prefill",
        "flashmla-dense-fp8": "dense_fp8"}


def _replay(capture: str):
    with use_engine(FASTEST):
        return replay(DATA + capture)


def _exact(report) -> bool:
    return all(row.first_difference is None and not row.skipped for row in report.cases)


@pytest.mark.parametrize("capture", sorted(CAPTURES))
def test_shipped_builds_bit_exact(capture):
    kernel, build, n = CAPTURES[capture]
    with np.load(DATA + capture) as z:
        cases = json.loads(str(z["meta"]))["cases"]
    assert len(cases) == n and {c["build"] for c in cases} == {build}
    report = _replay(capture)
    assert report.kernel == kernel and len(report.cases) == n
    assert _exact(report), report.format()


def _with_build(monkeypatch, kernel: str, build: str, machine: str, double: bool) -> None:
    monkeypatch.setitem(builds.BUILDS, _KEY[kernel], {**builds.BUILDS[_KEY[kernel]], build: Build(machine, double)})


# each capture's build with one of its two choices undone: the machine (fast math or not), the scale's type
@pytest.mark.parametrize(("capture", "machine", "double"), [
    ("flashmla_vllm_h200.npz", "sm90-cuda", True),
    ("scales_flashmla_vllm_h200.npz", "sm90-cuda-precise", False),
    ("scales_flashmla_sglang_h200.npz", "sm90-cuda", False),
    ("scales_flashmla_sparse_fp8_vllm_h200.npz", "sm90-cuda", True),
    ("scales_flashmla_sparse_fp8_vllm_h200.npz", "sm90-cuda-precise", False),
    ("scales_flashmla_sparse_fp8_sglang_h200.npz", "sm90-cuda", False),
    ("flashmla_sparse_prefill_vllm_h200.npz", "sm90-cuda", True),
    ("scales_flashmla_sparse_prefill_vllm_h200.npz", "sm90-cuda-precise", False),
    ("scales_flashmla_sparse_prefill_sglang_h200.npz", "sm90-cuda", False),
    ("scales_flashmla_dense_fp8_vllm_h200.npz", "sm90-cuda", False),
])
def test_each_build_choice_matters(capture, machine, double, monkeypatch):
    kernel, build, _ = CAPTURES[capture]
    _with_build(monkeypatch, kernel, build, machine, double)
    assert not _exact(_replay(capture))


def test_the_causal_mask_matters(monkeypatch):
    """The causal cases of vLLM's MTP call replayed as if not causal."""
    import amla_sim.crosscheck.flashmla as xf

    real = xf.flashmla
    monkeypatch.setattr(xf, "flashmla", lambda *a, **k: real(*a, **{**k, "causal": False}))
    report = _replay("flashmla_sglang_h200.npz")
    assert all(row.first_difference is not None for row in report.cases)


@pytest.fixture(scope="module")
def probe():
    with np.load(DATA + "math_builds.npz") as z:
        return {k: z[k] for k in z.files}


def _same(got: np.ndarray, ref: np.ndarray) -> bool:
    return bool(np.all((got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))))


@pytest.mark.parametrize(("fn", "build"), [("exp2f", "precise"), ("exp2f", "fast"), ("log2f", "precise"),
                                           ("log2f", "fast"), ("logf", "precise"), ("logf", "fast"),
                                           ("expf", "precise"), ("div_log2e", "precise"), ("div", "precise")])
def test_cuda_math_as_each_build_compiles_it(probe, fn, build):
    """The machines' units against an H200's exp2f, log2f, logf, expf and '/' compiled with and without
    --use_fast_math (the fast build's '/' is div.approx.ftz, which the models need for normal divisors only)."""
    mc = get_machine("sm90-cuda-precise" if build == "precise" else "sm90-cuda")
    x, a, b = probe["x"], probe["a"], probe["b"]
    l2e = np.full_like(x, np.float32(np.log2(np.e)))
    got = {"exp2f": lambda: mc.exp2(x), "log2f": lambda: mc.log2(x), "expf": lambda: mc.exp(x),
           "logf": lambda: mc.log(x) if build == "precise" else mc.log_plus(x, np.zeros_like(x)),
           "div_log2e": lambda: mc.div(x, l2e), "div": lambda: mc.div(a, b)}[fn]()
    assert _same(got, probe[f"{fn}_{build}"])


def test_libdevice_log2f_is_not_the_unit(probe):
    """CUDA's log2f without fast math is libdevice's polynomial, not lg2.approx: the unit misses the probe."""
    x = probe["x"]
    assert _same(lg.log2f(x), probe["log2f_precise"])
    assert not _same(lg.lg2_approx(x), probe["log2f_precise"])
    assert not _same(ew.exp(x, mode="sm90"), probe["expf_precise"])


def test_fdividef_stays_approximate():
    """__fdividef is div.approx in either build; '/' is IEEE without fast math."""
    mc = get_machine("sm90-cuda-precise")
    a = np.float32(1.0) + np.arange(1, 4097, dtype=np.float32) * np.float32(2**-12)
    one = np.ones_like(a)
    assert _same(mc.div_approx(one, a), ew.div(one, a, mode="sm90"))
    assert _same(mc.div(one, a), ew.div(one, a, mode="ieee"))
    assert not _same(mc.div_approx(one, a), mc.div(one, a))


@pytest.mark.parametrize("kernel", sorted(builds.BUILDS))
def test_an_unknown_build_is_refused_by_name(kernel):
    with pytest.raises(ValueError, match="build: expected one of"):
        builds.resolve_build(kernel, "trtllm", None)


def test_default_build_is_what_vllm_ships():
    assert builds.DEFAULT_BUILD == "vllm"
    assert builds.resolve_build("dense", "vllm", None)[0].name == "sm90-cuda-precise"
    assert builds.resolve_build("dense_fp8", "vllm", None)[0].name == "sm90-cuda"


def test_fp16_flashmla_is_not_the_bf16_kernel_on_rounded_inputs():
    """vLLM's library on FP16 inputs runs the kernel's FP16 instantiation (P and the output in FP16): the BF16
    kernel on the inputs rounded to BF16 gives other bits."""
    import ml_dtypes

    from amla_sim.algorithms import flashmla
    from amla_sim.crosscheck.kernel import case_inputs

    with np.load(DATA + "flashmla_fp16_vllm_h200.npz") as z:
        case, out = json.loads(str(z["meta"]))["cases"][0], z["c0_out"]
    assert case["format"] == "fp16"
    q, kv = (x.astype(np.float32).astype(ml_dtypes.bfloat16) for x in case_inputs(case))
    with use_engine(FASTEST):
        res = flashmla(q, kv, seqlens=np.array(case["seqlens"]), scale=case["scale"], build="vllm")
    assert np.mean(res.out.astype(np.float16).view(np.uint16) == out) < 1
