"""FlashInfer's sm90 FP8 block-scale GEMM as vLLM 0.33 runs a block linear of fewer than 32 rows, against an H200
(``scripts/capture_fi_gemm.py``, ``tests/data/fi_gemm_h200.npz``): every quantized byte, scale and output bit; each
modelled choice shown to matter; which kernel each engine's launch takes; and ``o_proj`` after the layer as vLLM
runs it on the layer's device capture (``scripts/capture_o_proj.py``, ``tests/data/o_proj_h200.npz``)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from amla_sim.algorithms.deployed.deepgemm import fp8_gemm_nt, per_token_group_quant_fp8
from amla_sim.algorithms.deployed.flashinfer.blockscale_gemm import fp8_blockscale_gemm_sm90, trtllm_quant_1x128
from amla_sim.algorithms.deployed.fp8_linear import fp8_block_linear, fp8_linear_kernel, vllm_graph_tokens
from amla_sim.algorithms.deployed.mla_layer import LAYER_MODES, LayerInputs, o_proj
from amla_sim.arith.elementwise import rcp_approx
from amla_sim.crosscheck.deepgemm import FI_GEMM_CASES, fi_gemm_inputs, quantize_weight_blocks
from amla_sim.crosscheck.layer import HIDDEN, LAYER_CASES, case_request, layer_request
from amla_sim.invariance.dense_layer import o_proj_verdict
from amla_sim.invariance.routing import Prompt, route

DATA = Path(__file__).parent / "data"


def _load(name: str) -> tuple[dict, dict]:
    with np.load(DATA / name) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(str(arrays.pop("meta"))), arrays


@pytest.fixture(scope="module")
def capture():
    meta, arrays = _load("fi_gemm_h200.npz")
    assert meta["device"] == "NVIDIA H200" and meta["flashinfer"] == "0.7.2.post1"
    assert [(c["M"], c["N"], c["K"], c["seed"], c["kind"]) for c in meta["cases"]] == list(FI_GEMM_CASES)
    return meta, arrays


def _case(i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, w = fi_gemm_inputs(*FI_GEMM_CASES[i])
    return (x, *quantize_weight_blocks(w, "ue8m0"))


@pytest.mark.parametrize("i", range(len(FI_GEMM_CASES)), ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-{c[4]}" for c in FI_GEMM_CASES])
def test_every_byte_scale_and_output_bit_is_the_devices(capture, i):
    """kv_b_proj, o_proj, q_b_proj and the fused q_a / kv_a projection at DeepSeek-V3's TP8 shapes (a last weight
    block of 64 rows among them), and groups at the quantizer's edges (zero, a lone value, amaxes of 2^127, subnormal
    groups, a tiny amax over subnormals, an infinity): the quantizer's bytes and scales, read back from the call's
    workspace, and every output bit, NaN payloads included."""
    meta, arrays = capture
    x, w, ws = _case(i)
    q, s = trtllm_quant_1x128(x)
    assert np.array_equal(q.view(np.uint8), arrays[f"c{i}_q"])
    assert np.array_equal(s.view(np.uint32), arrays[f"c{i}_s"].view(np.uint32))
    assert np.array_equal(fp8_blockscale_gemm_sm90(x, w, ws).view(np.uint16), arrays[f"c{i}_out"])
    c = meta["cases"][i]
    assert c["rerun_equal"] and c["runner_equal"]
    # vLLM's DeepGEMM on FlashInfer's bytes and scales gave FlashInfer's bits: one chain, whichever operand is A
    assert c["same_as_deepgemm"]
    assert np.array_equal(fp8_gemm_nt(q, s, w, ws).view(np.uint16), arrays[f"c{i}_out"])


def _ieee(x):
    """The quantizer with an IEEE division 448 / amax and 1 / s."""
    xg = x.astype(np.float32).reshape(x.shape[0], -1, 128)
    amax = np.abs(xg).max(-1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.where(amax != 0, np.float32(448) / amax, np.float32(1)).astype(np.float32)
        q = np.clip(xg * s[..., None], -448, 448).astype(np.float32).reshape(x.shape)
        return q.astype(ml_dtypes.float8_e4m3fn), (np.float32(1) / s).astype(np.float32)


def _sglang_scale(x):
    """The same bytes, SGLang's kept scale amax fl(1 / 448)."""
    q, _ = trtllm_quant_1x128(x)
    amax = np.abs(x.astype(np.float32).reshape(x.shape[0], -1, 128)).max(-1)
    return q, (amax * (np.float32(1) / np.float32(448))).astype(np.float32)


def _no_ftz(x):
    """Subnormal inputs kept (no .ftz on the multiply)."""
    xg = x.astype(np.float32).reshape(x.shape[0], -1, 128)
    amax = np.abs(xg).max(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.where(amax != 0, np.float32(448) * rcp_approx(amax), np.float32(1)).astype(np.float32)
        q = (xg * s[..., None]).astype(np.float32)
        q = np.where(np.isnan(q), np.float32(np.nan), np.clip(q, -448, 448)).reshape(x.shape)
    return q.astype(ml_dtypes.float8_e4m3fn), rcp_approx(s)


@pytest.mark.parametrize(("change", "i"), [(_ieee, 2), (_sglang_scale, 3), (_no_ftz, 6),
                                           (lambda x: per_token_group_quant_fp8(x, ue8m0=True), 2)],
                         ids=["ieee-division", "sglang-scale", "no-ftz", "vllm-ue8m0"])
def test_each_choice_matters(capture, change, i):
    """An IEEE division for 448 / amax and 1 / s, SGLang's kept scale (the same bytes), subnormal inputs kept, or
    vLLM's UE8M0 quantizer (the rows of a 32-row launch, whose rows the device saw differ) give other bytes or
    scales, and other outputs."""
    meta, arrays = capture
    x, w, ws = _case(i)
    q, s = change(x)
    assert not np.array_equal(q.view(np.uint8), arrays[f"c{i}_q"]) or not np.array_equal(
        s.view(np.uint32), arrays[f"c{i}_s"].view(np.uint32))
    if change is not _no_ftz:  # the subnormal group's row is NaN either way: its bytes (0x7F, not 448) tell
        assert not np.array_equal(fp8_gemm_nt(q, s, w, ws).view(np.uint16), arrays[f"c{i}_out"])
    assert meta["cases"][i]["rows_differ_at_32"] > 0


def test_the_epilogues_nan_is_canonical(capture):
    """The edges case's NaN rows: every NaN the epilogue writes is 0x7FFF, every NaN byte of the quantizer 0x7F."""
    _, arrays = capture
    out, q = arrays["c6_out"], arrays["c6_q"]
    nan = (out & 0x7FFF) > 0x7F80
    assert nan.any() and (out[nan] == 0x7FFF).all()
    assert ((q & 0x7F) == 0x7F).any() and (q[(q & 0x7F) == 0x7F] == 0x7F).all()


@pytest.mark.parametrize(("tokens", "rows"), [(1, 1), (3, 4), (5, 8), (24, 24), (25, 32), (31, 32), (249, 256),
                                              (257, 272), (512, 512), (513, 513)])
def test_vllms_cuda_graph_sizes(tokens, rows):
    assert vllm_graph_tokens(tokens) == rows


@pytest.mark.parametrize(("mode", "tokens", "graph", "kernel"), [
    ("vllm", 24, True, "flashinfer"), ("vllm", 25, True, "deepgemm-ue8m0"), ("vllm", 25, False, "flashinfer"),
    ("vllm", 32, False, "deepgemm-ue8m0"), ("vllm-batch-invariant", 1, True, "deepgemm-ue8m0"),
    ("sglang", 1, True, "deepgemm-fp32"), ("sglang-deterministic", 600, True, "deepgemm-fp32"),
])
def test_which_kernel_a_launch_takes(mode, tokens, graph, kernel):
    """vLLM: FlashInfer below 32 rows of the launch (a CUDA graph's padded rows for o_proj, the rows themselves in
    the attention op), DeepGEMM from 32 and always when batch-invariant; SGLang: DeepGEMM."""
    assert LAYER_MODES[mode].linear_kernel(tokens, graph=graph) == kernel


@pytest.fixture(scope="module")
def o_capture():
    meta, arrays = _load("o_proj_h200.npz")
    assert meta["device"] == "NVIDIA H200" and meta["vllm"] == "0.33.0"
    assert [c["case"] for c in meta["cases"]] == [i for i, c in enumerate(LAYER_CASES) if c[0].startswith("vllm")]
    return meta, arrays


@pytest.mark.parametrize("i", [i for i, c in enumerate(LAYER_CASES) if c[0].startswith("vllm")])
def test_o_proj_after_the_layer_is_the_devices(o_capture, i):
    """o_proj of each kept token's prefill and decode rows of the layer's device capture, through the kernel
    vLLM's step takes: every bit; and the device's prefill equals its decode after o_proj exactly where
    ``dense_prefill_vs_decode`` says so (the 32-token request at 128 heads: equal before o_proj, not after it: the
    prefill's step of 32 rows runs DeepGEMM, the decode's of 4 FlashInfer's GEMM). Each output column is its own
    chain: one case is compared in all 7,168 columns, the others in their first 1,024."""
    meta, arrays = o_capture
    name, T, h, seed, budget, keep, batch = LAYER_CASES[i]
    cols = None if i == 4 else 1024  # o_proj's first 1,024 weight rows (the recipe's first draws): its first columns
    md, x = LAYER_MODES[name], case_request(LAYER_CASES[i], hidden=cols or HIDDEN)
    arrays = {k: v[..., :cols] for k, v in arrays.items()}
    chunks = route("vllm", [Prompt(T)], budget=budget, deterministic=md.deterministic)
    with np.load(DATA / "layer_h200.npz") as z:
        rows = {side: z[f"c{i}_{side}_out"].view(ml_dtypes.bfloat16) for side in ("prefill", "decode")}
    steps = {"prefill": [next(c.tokens for c in chunks if c.context <= t < c.context + c.tokens) for t in keep],
             "decode": [batch] * len(keep)}
    for side in ("prefill", "decode"):
        got = np.stack([o_proj(rows[side][r:r + 1], x, md.linear_kernel(n))[0] for r, n in enumerate(steps[side])])
        assert np.array_equal(got.view(np.uint16), arrays[f"c{i}_{side}_o"])
    case = next(c for c in meta["cases"] if c["case"] == i)
    assert case["rows_invariant"]
    verdicts = [o_proj_verdict(x, name, n, batch, rows["prefill"][r], rows["decode"][r])
                for r, n in enumerate(steps["prefill"])]
    device_same = [np.array_equal(p, d) for p, d in zip(arrays[f"c{i}_prefill_o"], arrays[f"c{i}_decode_o"])]
    before = [np.array_equal(p, d) for p, d in zip(rows["prefill"], rows["decode"])]
    assert [b and not v.differ for b, v in zip(before, verdicts)] == device_same
    if i == 10:
        assert all(before) and not any(device_same) and all(v.differ for v in verdicts)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: trtllm_quant_1x128(np.zeros((2, 128), np.float32)), "^x:"),
    (lambda: trtllm_quant_1x128(np.zeros((2, 100), ml_dtypes.bfloat16)), "^x:"),
    (lambda: fp8_block_linear(np.zeros((1, 128), ml_dtypes.bfloat16), np.zeros((64, 128), ml_dtypes.float8_e4m3fn),
                              np.ones((1, 1), np.float32), kernel="cutlass"), "^kernel:"),
    (lambda: fp8_linear_kernel("trtllm", False, 4), "^engine:"),
    (lambda: fp8_linear_kernel("vllm", False, 0), "^rows"),
    (lambda: vllm_graph_tokens(0), "^tokens"),
    (lambda: vllm_graph_tokens(5, graph_max=500), "^graph_max:"),
    (lambda: layer_request(4, heads=2, hidden=100), "^hidden:"),
    (lambda: o_proj(np.zeros((1, 2, 128), ml_dtypes.bfloat16), layer_request(4, heads=2, hidden=None), "flashinfer"),
     "^x:"),
])
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_mode_flag_that_is_no_bool_is_refused_by_name():
    with pytest.raises(TypeError, match="^deterministic:"):
        fp8_linear_kernel("vllm", "yes", 4)


def test_o_proj_weights_are_checked_by_name():
    x = layer_request(4, heads=2, seed=0, hidden=128)
    fields = {f: getattr(x, f) for f in ("q_nope", "q_pe", "c_kv", "k_pe", "kv_b", "kv_b_scale", "scale")}
    for bad, name in (({"w_o": x.w_o}, "w_o, w_o_scale"), ({"w_o": x.w_o[:, :128], "w_o_scale": x.w_o_scale}, "w_o"),
                      ({"w_o": x.w_o, "w_o_scale": x.w_o_scale[:, :1]}, "w_o_scale")):
        with pytest.raises(ValueError, match=f"^{name}:"):
            LayerInputs(**fields, **bad)
