"""What the deployed kernels' models refuse, each with a message naming the argument and what to do instead: a
machine without a unit the kernel needs, quantizer inputs that are not float arrays (without a warning for the ones
that are, however large); and what they compute where the kernel does (a causal step longer than its request)."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from amla_sim.algorithms import fa3_mla, flashmla_dense_fp8, flashmla_etap, splitkv_decode, vllm_triton_mla
from amla_sim.algorithms.deployed.flashmla.fp8_cache import quantize_kv_cache
from amla_sim.algorithms.deployed.vllm.fp8 import quantize_cache_fp8, quantize_query_fp8
from amla_sim.algorithms.quantizers import quantize
from amla_sim.experiments.inputs import make_inputs
from amla_sim.machines import get_machine


@pytest.fixture(scope="module")
def inputs():
    return make_inputs("normal:1", batch=2, sq=3, heads=16, context=64, seed=1)


def _fp8(q, kv):
    return quantize_query_fp8(q), quantize_cache_fp8(kv)


@pytest.mark.parametrize("call, match", [
    (lambda q, kv: vllm_triton_mla(q, kv, machine="sm90-cuda"), r"^machine: vllm-triton-mla takes tl\.log .*sm90-triton"),
    (lambda q, kv: splitkv_decode(q[:, :1], kv, machine="sm90-cuda"), r"^machine: sglang-triton .*sm90-triton"),
    (lambda q, kv: flashmla_dense_fp8(*_fp8(q, kv), seqlens=None, machine="ascend910"),
     r"^machine: flashmla-dense-fp8 multiplies E4M3 operands.*ascend910.*sm90-cuda"),
])
def test_a_machine_without_the_kernels_units_is_refused_by_name(inputs, call, match):
    with pytest.raises(ValueError, match=match):
        call(*inputs)


@pytest.mark.parametrize("call, out, lse", [
    # the rows of request 0 (2 keys, a step of 3) that see no key, as each kernel computes them (captured on an
    # H200: tests/data/limits_*_h200.npz): out 0 and LSE -inf (FA3), out 0 and LSE +inf (FlashMLA's first
    # generation), 0 / 0 and log 0 (vLLM's Triton stage 2)
    (lambda q, kv: fa3_mla(q, kv, seqlens=[2, 64]), 0.0, -np.inf),
    (lambda q, kv: flashmla_dense_fp8(*_fp8(q, kv), seqlens=[2, 64]), 0.0, np.inf),
    (lambda q, kv: vllm_triton_mla(q, kv, seqlens=[2, 64]), np.nan, -np.inf),
], ids=["fa3-mla", "flashmla-dense-fp8", "vllm-triton-mla"])
def test_a_causal_step_longer_than_its_request_is_computed(inputs, call, out, lse):
    """Query 0 of a step of 3 over a request of 2 keys sees none; the kernels compute it, and so do the models."""
    res = call(*inputs)
    o = res.out[0, 0].astype(np.float32)
    first = res.lse[0, :, 0] if res.lse.shape[1] == 16 else res.lse[0, 0]  # (b, h, s_q) or (b, s_q, h)
    np.testing.assert_array_equal(o, np.full_like(o, out))
    np.testing.assert_array_equal(first.astype(np.float32), np.full(16, lse, np.float32))
    assert np.isfinite(res.out[1].astype(np.float32)).all()


def test_flashinfer_computes_a_request_shorter_than_its_step(inputs):
    """FlashInfer's plan clamps the rows' KV ends at 0 and the kernel writes out 0 and LSE -inf for a row that sees
    no key (captured: tests/data/edges_flashinfer_mla_h200.npz)."""
    from amla_sim.algorithms import flashinfer_mla

    res = flashinfer_mla(*inputs, seqlens=[2, 64], causal=True)  # out (b, s_q, h, 512), lse (b s_q, h)
    assert (res.out[0, 0].astype(np.float32) == 0).all() and np.isneginf(res.lse[0]).all()
    assert np.isfinite(res.lse[1:]).all() and np.isfinite(res.out[0, 1:].astype(np.float32)).all()


def test_a_causal_step_as_long_as_its_request_runs(inputs):
    """The bound is s_q itself; ETAP's kernel, whose captures hold shorter requests, keeps them."""
    q, kv = inputs
    assert np.isfinite(fa3_mla(q, kv, seqlens=[3, 64]).out.astype(np.float32)).all()
    assert flashmla_etap(q, kv, seqlens=[1, 64]).out.shape == (2, 3, 16, 512)


_NOT_FLOAT = [np.int32, np.uint8, np.bool_, np.complex64, np.str_]


@pytest.mark.parametrize("dtype", _NOT_FLOAT, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("quantizer", [
    lambda x: quantize_query_fp8(x), lambda x: quantize_cache_fp8(x, 0.5),
    lambda x: quantize_kv_cache(x.reshape(1, 64, 1, 576), "v32"),
    lambda x: quantize(x, "per-token", get_machine("sm90-triton")),
], ids=["vllm-query", "vllm-cache", "flashmla-cache", "snapmla"])
def test_the_fp8_quantizers_take_float_arrays_only(quantizer, dtype):
    x = np.ones((64, 576)).astype(dtype)
    with pytest.raises(TypeError, match=r"^(q|kv|x): expected .*float"):
        quantizer(x)


@pytest.mark.parametrize("x", [np.float64(1e300), np.float32(3e38), np.inf, -np.inf, np.nan, np.float32(1e-45)])
@pytest.mark.parametrize("quantizer", [lambda a: quantize_query_fp8(a, 1e-3), lambda a: quantize_cache_fp8(a, 1e-3),
                                       lambda a: quantize(a, "per-block", get_machine("sm90-triton"))],
                         ids=["vllm-query", "vllm-cache", "snapmla"])
def test_the_fp8_quantizers_never_warn(quantizer, x):
    a = np.full((64, 576), x)
    a[0, 0] = 1.0
    with np.errstate(over="ignore"):  # the test's own narrowing of 1e300
        b = a.astype(np.float32).astype(ml_dtypes.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantizer(a)
        quantizer(b)
