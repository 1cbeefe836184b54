"""A dense MLA layer (DeepSeek-V3/R1, Kimi-K2) as vLLM 0.33 and SGLang 0.5.23 chain its kernels on Hopper, against an
H200 (``scripts/capture_layer.py``, ``tests/data/layer_h200.npz``): requests prefilled in the chunks each engine's
scheduler makes (the MHA form through DeepGEMM's kv_b_proj and FA3's 192/128 kernel, or the absorbed form through
the bmm and FA3's MLA kernel) and decoded token by token, every stage's bits the model's; cuBLAS's bmm on 56 shapes
through both engines' calls; each modelled choice shown to matter; the ``prefill-decode --model dense`` answers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from amla_sim.algorithms.deployed.deepgemm import per_token_group_quant_fp8, sglang_per_token_group_quant_fp8
from amla_sim.algorithms.deployed.flashinfer.blockscale_gemm import trtllm_quant_1x128
from amla_sim.algorithms.deployed.fp8_linear import FP8_LINEAR_KERNELS
from amla_sim.algorithms.deployed.mla_layer import LAYER_MODES, LayerInputs, absorbed_chunk, kv_b_proj, mha_chunk
from amla_sim.algorithms.deployed.projections import CUBLAS_CHECKED, w_uk, w_uv
from amla_sim.cli import main
from amla_sim.crosscheck.deepgemm import device_quant_act
from amla_sim.crosscheck.layer import (ACT_QUANT_CASES, CUBLAS_SHAPES, LAYER_CASES, case_request, crc_bits,
                                      layer_request,
                                      act_quant_inputs)
from amla_sim.crosscheck.projections import BMM_CASES, bmm_inputs, split_kv_b
from amla_sim.formats import round_to
from amla_sim.invariance.dense_layer import dense_prefill_vs_decode
from amla_sim.invariance.routing import Prompt, route

DATA = Path(__file__).parent / "data" / "layer_h200.npz"
STAGES = ("out", "attn", "lse", "w_uk", "splits")


@pytest.fixture(scope="module")
def capture():
    with np.load(DATA) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    assert meta["device"] == "NVIDIA H200" and meta["vllm"] == "0.33.0"
    assert [(c["mode"], c["tokens"], c["heads"], c["seed"], c["budget"], tuple(c["keep"]), c["decode_batch"])
            for c in meta["cases"]] == list(LAYER_CASES)
    return meta, arrays


def _bits(stage: str, a: np.ndarray) -> np.ndarray:
    if stage == "lse":
        return np.asarray(a, np.float32).view(np.uint32)
    return np.asarray(a) if stage == "splits" else np.asarray(a).view(np.uint16)


def _sides(i: int, mode=None) -> tuple[dict, list]:
    """The model's prefill (each kept token's step and row) and decodes of case `i`."""
    name, T, h, seed, budget, keep, batch = LAYER_CASES[i]
    md, x = mode or LAYER_MODES[name], case_request(LAYER_CASES[i], hidden=None)
    pre = {}
    for c in route(md.engine, [Prompt(T)], budget=budget, deterministic=md.deterministic):
        mine = [t for t in keep if c.context <= t < c.context + c.tokens]
        if mine:
            step = (mha_chunk(x, c.context, c.tokens, md) if c.path == "mha" else
                    absorbed_chunk(x, np.arange(c.context, c.context + c.tokens), md, causal_step=True))
            pre.update({t: (step, t - c.context) for t in mine})
    return pre, [absorbed_chunk(x, [t] * batch, md, causal_step=False) for t in keep]


def _stage(step, stage: str) -> np.ndarray:
    return getattr(step, stage) if stage in ("out", "splits") else step.stages[stage]


@pytest.mark.parametrize("i", range(len(LAYER_CASES)),
                         ids=[f"{c[0]}-T{c[1]}-B{c[4]}-b{c[6]}-h{c[2]}" for c in LAYER_CASES])
def test_every_stage_of_prefill_and_decode(capture, i):
    meta, arrays = capture
    keep = LAYER_CASES[i][5]
    pre, dec = _sides(i)
    seen = 0
    for stage in STAGES:
        if f"c{i}_prefill_{stage}" in arrays:
            got = np.stack([_stage(pre[t][0], stage)[pre[t][1]] for t in keep])
            assert np.array_equal(_bits(stage, got), arrays[f"c{i}_prefill_{stage}"].reshape(got.shape)), stage
            seen += 1
        got = np.stack([_stage(d, stage)[0] for d in dec])
        assert np.array_equal(_bits(stage, got), arrays[f"c{i}_decode_{stage}"]), stage
    assert seen >= 2  # MHA: out and attn; absorbed: all five


def test_the_prefill_quantizers_are_the_engines_kernels(capture):
    """The device quantized each MHA chunk's latents as the engine's kernel does; the model's bytes are the same."""
    meta, _ = capture
    done = 0
    for case, spec in zip(meta["cases"], LAYER_CASES):
        for lo, hi, crc in case.get("quant_crc", []):
            rows = case_request(spec, hidden=None).c_kv[lo:hi]
            a, s = (per_token_group_quant_fp8(rows, ue8m0=True) if spec[0].startswith("vllm") else
                    sglang_per_token_group_quant_fp8(rows))
            assert crc_bits(a.view(np.uint8)) ^ crc_bits(s) == crc
            done += 1
    assert done == 7  # the new tokens of five MHA chunks (one SGLang's), the context of two


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_cublas_bmm_on_every_captured_shape(capture, heads):
    """cuBLAS's ``torch.bmm`` through vLLM's and SGLang's W_UK and W_UV calls: the first two heads' bits (CRC) are
    the fused chain's at 1 to 512 tokens."""
    _, arrays = capture
    rows = arrays["cublas_crc"]
    rows = rows[rows[:, 1] == heads]
    assert len(rows) == 4 * sum(h == heads for _, h in CUBLAS_SHAPES)
    for m in sorted(set(rows[:, 0].tolist())):
        q, attn, w = bmm_inputs(m, heads, 7)
        uk, uv = split_kv_b(w, heads)
        mine = (crc_bits(w_uk(q[:, :2], uk[:2]).view(np.uint16)), crc_bits(w_uv(attn[:, :2], uv[:2]).view(np.uint16)))
        for *_, is_uv, crc in rows[rows[:, 0] == m].tolist():
            assert crc == mine[is_uv], (m, heads, is_uv)


def test_cublas_checked_is_what_was_captured(capture):
    _, arrays = capture
    captured = {tuple(r[:2]) for r in arrays["cublas_crc"].tolist()} | {c[:2] for c in BMM_CASES}
    assert CUBLAS_CHECKED == captured


def test_vllms_decode_split_bound_under_cuda_graphs_matters(capture):
    """vLLM passes FA3 ``num_splits`` 32 for a decode launch a full CUDA graph replays; FA3's heuristic unbounded
    splits the 300-token request otherwise, and other bits come out."""
    _, arrays = capture
    eager = dataclasses.replace(LAYER_MODES["vllm"], cuda_graph_max=0)
    _, dec = _sides(2, eager)
    got = np.stack([_stage(d, "splits")[0] for d in dec])
    out = np.stack([d.out[0] for d in dec]).view(np.uint16)
    assert not np.array_equal(got, arrays["c2_decode_splits"]) and not np.array_equal(out, arrays["c2_decode_out"])


def test_the_engines_quantizers_give_other_bits():
    """SGLang's quantizer (FP32 scales, an approximate reciprocal) is not vLLM's: kv_b_proj's output parts."""
    x = layer_request(64, heads=2, seed=11)
    a_v, s_v = per_token_group_quant_fp8(x.c_kv, ue8m0=True)
    a_s, s_s = sglang_per_token_group_quant_fp8(x.c_kv)
    assert not np.array_equal(s_v, s_s) and not np.array_equal(a_v.view(np.uint8), a_s.view(np.uint8))
    kv = {k: kv_b_proj(x.c_kv, x.kv_b, x.kv_b_scale, kernel=k)[1].view(np.uint16) for k in FP8_LINEAR_KERNELS}
    assert (kv["deepgemm-ue8m0"] != kv["deepgemm-fp32"]).mean() > 0.1
    assert (kv["deepgemm-ue8m0"] != kv["flashinfer"]).mean() > 0.1
    # FlashInfer's quantizer writes SGLang's bytes (both multiply by 448 MUFU.RCP(amax)) but keeps rcp of that
    # multiplier as the scale, where SGLang keeps amax fl(1 / 448): a few outputs part
    a_f, s_f = trtllm_quant_1x128(x.c_kv)
    assert np.array_equal(a_f.view(np.uint8), a_s.view(np.uint8)) and not np.array_equal(s_f, s_s)
    assert 0 < (kv["flashinfer"] != kv["deepgemm-fp32"]).mean() < 0.01


def test_the_form_matters(capture):
    """vLLM's batch-invariant mode routes a 600-token prompt to the MHA form; its decode (the absorbed form, one
    split, the form the model of an absorbed chunk gives) parts from it on the device in most elements: the route's
    choice of form decides the bits, and the models of both forms give each side's."""
    _, arrays = capture
    assert (arrays["c1_prefill_out"] != arrays["c1_decode_out"]).mean() > 0.5


@pytest.mark.parametrize(("i", "identical", "parts"), [
    (2, False, "splits: FA3 cuts"), (3, True, ""), (6, False, "splits: FA3 cuts"), (7, True, ""),
])
def test_prefill_decode_answers_what_the_device_saw(capture, i, identical, parts):
    """The verdicts of ``dense_prefill_vs_decode`` are the device's: its sides' outputs are the capture's, and
    identical exactly where the device's prefill and decode were."""
    _, arrays = capture
    name, T, h, seed, budget, keep, batch = LAYER_CASES[i]
    rep = dense_prefill_vs_decode(case_request(LAYER_CASES[i], hidden=None), name, tokens=list(keep), budget=budget,
                                  decode_batch=batch)
    device_same = [np.array_equal(p, d) for p, d in zip(arrays[f"c{i}_prefill_out"], arrays[f"c{i}_decode_out"])]
    assert [v.identical for v in rep.tokens] == device_same == [identical] * len(keep)
    assert np.array_equal(rep.prefill["out"].view(np.uint16), arrays[f"c{i}_prefill_out"])
    assert np.array_equal(rep.decode["out"].view(np.uint16), arrays[f"c{i}_decode_out"])
    assert all(parts in v.parts for v in rep.tokens) and rep.modelled


def test_an_unchecked_cublas_shape_is_said(capsys):
    """vLLM's default mode at 8 heads, a 20-token prompt (absorbed; o_proj through FlashInfer's GEMM, as the
    decode's) and its last token decoded in a launch of 3: cuBLAS was captured at neither shape, so the models'
    agreement is said with both pieces named, and the command exits 5, not 0."""
    rc = main(["prefill-decode", "--model", "dense", "--stack", "vllm", "--length", "20", "--heads", "8",
               "--tokens", "-1", "--decode-batch", "3"])
    out = capsys.readouterr().out
    assert "token 19: bits identical" in out and "identical after o_proj" in out and rc == 5
    assert "cuBLAS bmm of 20 tokens x 8 heads: not captured" in out and "cuBLAS bmm of 3 tokens x 8 heads" in out


def test_o_proj_parts_a_vllm_prefill_from_its_decode(capsys):
    """A 40-token prompt: equal before o_proj, but its prefill's step of 40 rows runs DeepGEMM and the decode's of 3
    FlashInfer's GEMM, so the layer's output differs (exit 3), and vLLM's batch-invariant mode, tried next, agrees."""
    rc = main(["prefill-decode", "--model", "dense", "--stack", "vllm", "--length", "40", "--heads", "8",
               "--tokens", "-1", "--decode-batch", "3"])
    out = capsys.readouterr().out
    assert rc == 3 and "token 39: bits identical before o_proj; o_proj's kernel: a step of 40 tokens" in out
    assert "Tried the same request in vllm-batch-invariant" in out and "1 of 1 tokens bit-identical" in out


@pytest.mark.parametrize(("argv", "named"), [
    (["--stack", "sglang-dsa"], "--stack"), (["--length", "9000"], "--length"), (["--heads", "129"], "--heads"),
    (["--tokens", "5,5"], "--tokens"), (["--tokens", "400"], "--tokens"),
    (["--length", "8000", "--stack", "sglang-deterministic"], "--length, --heads, --tokens"),
    (["--topk", "256"], "--topk"), (["--dist", "uniform:60"], "--dist"), (["--max-memory", "4"], "--max-memory"),
])
def test_bad_dense_requests_are_refused_by_name(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_:
        main(["prefill-decode", "--model", "dense", "--length", "300", *argv])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_layer_inputs_are_checked_by_name():
    x = layer_request(4, heads=2, seed=0)
    fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}
    for name, bad in (("q_pe", x.q_pe[:, :, :32]), ("c_kv", x.c_kv.astype(np.float32)), ("kv_b", x.kv_b[:256]),
                      ("kv_b_scale", x.kv_b_scale.astype(np.float64)), ("scale", float("nan"))):
        with pytest.raises(ValueError, match=f"^{name}:"):
            LayerInputs(**{**fields, name: bad})
    with pytest.raises(ValueError, match="^mode:"):
        dense_prefill_vs_decode(x, "trtllm")


QUANT = Path(__file__).parent / "data" / "vllm_quant_h200.npz"


@pytest.fixture(scope="module")
def quant_capture():
    with np.load(QUANT) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    assert meta["library"] == "_C_stable_libtorch.abi3.so"
    assert [tuple(c) for c in meta["cases"]] == list(ACT_QUANT_CASES)
    return arrays


@pytest.mark.parametrize("rule", ["ue8m0", "fp32"])
@pytest.mark.parametrize("i", range(len(ACT_QUANT_CASES)), ids=[c[0] for c in ACT_QUANT_CASES])
def test_vllms_shipped_quantizer(quant_capture, i, rule):
    """vLLM 0.33's ``per_token_group_fp8_quant`` from its wheel's library (scripts/capture_vllm_quant.py): every
    quantized byte and scale is the model's, latents, magnitudes 2^-30 to 2^30 and groups at the scale's edges."""
    q, s = per_token_group_quant_fp8(act_quant_inputs(ACT_QUANT_CASES[i]), ue8m0=rule == "ue8m0")
    assert np.array_equal(q.view(np.uint8), quant_capture[f"c{i}_{rule}_q"])
    assert np.array_equal(s.view(np.uint32), quant_capture[f"c{i}_{rule}_s"].view(np.uint32))


def test_the_quantizers_division_and_rounding_up_matter(quant_capture):
    """A multiply by fl(1 / 448) (a torch rendering) gives other FP32 scales; UE8M0 scales rounded down rather than
    up give other scales at the edges."""
    x = act_quant_inputs(ACT_QUANT_CASES[2])
    _, s = device_quant_act(x, False)
    assert not np.array_equal(s.view(np.uint32), quant_capture["c2_fp32_s"].view(np.uint32))
    amax = np.maximum(np.float32(1e-10), np.abs(x.astype(np.float32)).reshape(-1, 4, 128).max(-1))
    down = np.exp2(np.floor(np.log2((amax / np.float32(448)).astype(np.float32)))).astype(np.float32)
    assert not np.array_equal(down.view(np.uint32), quant_capture["c2_ue8m0_s"].view(np.uint32))


def test_the_numba_engine_gives_the_same_layer():
    """The layer's models on the numba engine (``AMLA_SIM_ENGINE=numba``, 4x the command's work limit): the same
    bits in both forms."""
    pytest.importorskip("numba")
    from amla_sim.engine import use_engine

    x = layer_request(600, heads=4, seed=3)
    runs = []
    for engine in ("numpy", "numba"):
        with use_engine(engine):
            runs.append([mha_chunk(x, 0, 600, LAYER_MODES["vllm"]).out[-1],
                         absorbed_chunk(x, np.arange(520, 600), LAYER_MODES["vllm"], causal_step=True).out,
                         absorbed_chunk(x, [599] * 3, LAYER_MODES["sglang"], causal_step=False).out])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*runs))


@pytest.mark.parametrize("i", range(len(ACT_QUANT_CASES)), ids=[c[0] for c in ACT_QUANT_CASES])
def test_sglangs_quantizer(i):
    """SGLang 0.5.23's JIT quantizer (its ``per_token_group_quant.cuh`` unchanged, compiled with SGLang's JIT flags
    and launched as its flat launcher launches it; scripts/capture_sglang_quant.py): every byte and FP32 scale is
    the model's; an IEEE division for ``448 / amax`` gives other bytes, and so does vLLM's quantizer."""
    with np.load(Path(__file__).parent / "data" / "sglang_quant_h200.npz") as z:
        dq, ds = z[f"c{i}_q"], z[f"c{i}_s"]
        assert [tuple(c) for c in json.loads(str(z["meta"]))["cases"]] == list(ACT_QUANT_CASES)
    x = act_quant_inputs(ACT_QUANT_CASES[i])
    q, s = sglang_per_token_group_quant_fp8(x)
    assert np.array_equal(q.view(np.uint8), dq) and np.array_equal(s.view(np.uint32), ds.view(np.uint32))
    if i < 2:  # latents and wide magnitudes; the edge groups' multipliers are powers of two over 448
        xg = x.astype(np.float32).reshape(len(x), 4, 128)
        exact = (np.float32(448) / np.maximum(np.float32(1e-10), np.abs(xg).max(-1))).astype(np.float32)
        ieee = np.clip((xg * exact[..., None]).astype(np.float32), -448, 448).reshape(x.shape)
        assert not np.array_equal(round_to(ieee, "e4m3").view(np.uint8), dq)
        vq, _ = per_token_group_quant_fp8(x, ue8m0=False)
        assert not np.array_equal(vq.view(np.uint8), dq)


def test_a_v32_request_refuses_the_dense_budget(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["prefill-decode", "--length", "200", "--budget", "512"])
    assert exit_.value.code == 2 and "--budget" in capsys.readouterr().err
