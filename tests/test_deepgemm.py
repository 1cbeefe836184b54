"""kv_b_proj of an FP8 checkpoint as vLLM 0.33 runs it on Hopper: DeepGEMM's ``fp8_gemm_nt`` (vLLM's vendored
DeepGEMM 2.8.1, JIT-compiled on an H200 by ``scripts/capture_deepgemm.py``, ``tests/data/deepgemm_h200.npz``) on
activations quantized per token group and weights in 128 x 128 blocks, UE8M0 and FP32 scales, 40 to 2,048 tokens, 16
and 128 heads: every kept output bit is the model's, the quantized inputs rebuild to the device's bytes, and each
modelled choice matters; vLLM's quantizer against its rendering in torch; bad input refused by name."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from amla_sim.algorithms.deployed.deepgemm import fp8_gemm_nt, per_token_group_quant_fp8, sglang_per_token_group_quant_fp8
from amla_sim.crosscheck.deepgemm import (DEEPGEMM_CASES, KEEP_COLUMNS, deepgemm_inputs, device_quant_act,
                                          quantize_weight_blocks)
from amla_sim.machines import get_machine
from amla_sim.units import MatrixUnit

DATA = Path(__file__).parent / "data" / "deepgemm_h200.npz"


@pytest.fixture(scope="module")
def capture():
    with np.load(DATA) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    cases = meta["cases"]
    assert [(c["tokens"], c["n"], c["ue8m0"], c["weight_scales"], c["seed"]) for c in cases] == list(DEEPGEMM_CASES)
    assert meta["device"] == "NVIDIA H200" and all(c["repeat_identical"] for c in cases)
    return cases, arrays


def _crc(*arrays) -> int:
    c = 0
    for a in arrays:
        c = zlib.crc32(np.ascontiguousarray(a).tobytes(), c)
    return c


def _inputs(case):
    x, w = deepgemm_inputs(case["tokens"], case["n"], case["seed"])
    a, sa = device_quant_act(x, case["ue8m0"])
    q, sw = quantize_weight_blocks(w, case["weight_scales"])
    return a, sa, q[:KEEP_COLUMNS], sw[:KEEP_COLUMNS // 128]


@pytest.mark.parametrize("i", range(len(DEEPGEMM_CASES)))
def test_every_kept_bit_is_the_devices(capture, i):
    cases, arrays = capture
    a, sa, q, sw = _inputs(cases[i])
    x, w = deepgemm_inputs(cases[i]["tokens"], cases[i]["n"], cases[i]["seed"])
    assert _crc(a.view(np.uint8), sa) == cases[i]["a_crc"]  # the device's quantized inputs, byte for byte
    assert _crc(quantize_weight_blocks(w, cases[i]["weight_scales"])[0].view(np.uint8),
                quantize_weight_blocks(w, cases[i]["weight_scales"])[1]) == cases[i]["w_crc"]
    assert np.array_equal(fp8_gemm_nt(a, sa, q, sw).view(np.uint16), arrays[f"c{i}_out"])


def _mul_then_add(a, sa, b, sb, machine="sm90-cuda"):
    """The promotion as a multiply, then an add (no FMA)."""
    mc = get_machine(machine)
    cb = np.arange(b.shape[0]) // 128
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for j in range(a.shape[1] // 128):
        k = slice(j * 128, (j + 1) * 128)
        part = mc.matmul(mc.operand(a[:, k]), mc.operand(np.ascontiguousarray(b[:, k].T)))
        acc = mc.f(acc + mc.f(mc.f(sa[:, j][:, None] * sb[cb, j][None, :]) * part))
    return mc.cast(acc, "bf16")


@pytest.mark.parametrize("change", ["an exact FP32 accumulator in place of the FP8 tensor cores'",
                                    "the promotion as a multiply and an add"])
def test_each_choice_matters(capture, change):
    cases, arrays = capture
    differ = 0
    for i, case in enumerate(cases):
        args = _inputs(case)
        if change.startswith("an exact"):
            got = fp8_gemm_nt(*args, machine=get_machine("sm90-cuda", matrix=MatrixUnit("exact")))
        else:
            got = _mul_then_add(*args)
        differ += int((got.view(np.uint16) != arrays[f"c{i}_out"]).sum())
    assert differ > 0


def test_vllms_quantizer_and_its_torch_rendering():
    """vLLM's kernel divides the group's max by 448, the torch rendering multiplies by fl(1 / 448): the same bytes
    with UE8M0 scales on the capture's inputs, other scales with FP32 ones."""
    x, _ = deepgemm_inputs(300, 4096, 1)
    for ue8m0, same in ((True, True), (False, False)):
        a, sa = per_token_group_quant_fp8(x, ue8m0=ue8m0)
        b, sb = device_quant_act(x, ue8m0)
        assert (np.array_equal(a.view(np.uint8), b.view(np.uint8)) and np.array_equal(sa, sb)) == same
    _, s = per_token_group_quant_fp8(x)
    assert np.array_equal(s, np.exp2(np.round(np.log2(s))))  # UE8M0: powers of two


@pytest.mark.parametrize(("call", "match"), [
    (lambda: per_token_group_quant_fp8(np.zeros((2, 100), np.float32)), "x: expected"),
    (lambda: sglang_per_token_group_quant_fp8(np.zeros((2, 128), np.float32)), "x: expected"),
    (lambda: sglang_per_token_group_quant_fp8(np.zeros((2, 100), ml_dtypes.bfloat16)), "x: expected"),
    (lambda: fp8_gemm_nt(np.zeros((2, 128), np.float32), np.ones((2, 1), np.float32),
                         np.zeros((128, 128), np.float32), np.ones((1, 1), np.float32)), "a: expected"),
    (lambda: fp8_gemm_nt(*per_token_group_quant_fp8(np.zeros((2, 128), np.float32)),
                         *quantize_weight_blocks(np.zeros((128, 256), np.float32), "ue8m0")), "b: expected"),
])
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()

