"""The LSE merges of chunked prefill, vLLM's ``merge_attn_states`` and SGLang's ``merge_state_v2``, against an H200's
bits (``scripts/capture_merges.py``, ``tests/data/merges_h200.npz``): one merge and each engine's chain, every output
and LSE bit, the rows both kernels treat apart included; each modelled choice shown to matter; and both engines'
Triton fallbacks (``--triton``, ``tests/data/merges_triton_h200.npz``)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from amla_sim import compare
from amla_sim.algorithms.deployed.merge import (sglang_merge_state_triton, sglang_merge_state_v2, sglang_new_then_chunks,
                                                vllm_context_then_new, vllm_merge_attn_states,
                                                vllm_merge_attn_states_triton)
from amla_sim.crosscheck.merge import MERGE_CASES, TRITON_MERGE_CASES, merge_inputs

DATA = Path(__file__).parent / "data" / "merges_h200.npz"


@pytest.fixture(scope="module")
def capture():
    with np.load(DATA) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    assert meta["cases"] == [list(c) for c in MERGE_CASES] and meta["repeat_identical"] is True
    return arrays


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else np.ascontiguousarray(a).view(np.uint32)


def _run(i: int, vllm_machine: str = "sm90-cuda-precise", sglang_machine: str = "sm90-cuda") -> dict[str, np.ndarray]:
    outs, lses = merge_inputs(*MERGE_CASES[i])
    vo, vl = vllm_merge_attn_states(outs[0], lses[0].T.copy(), outs[1], lses[1].T.copy(), machine=vllm_machine)
    so, sl = sglang_merge_state_v2(outs[0], lses[0], outs[1], lses[1], machine=sglang_machine)
    chain, _, _ = vllm_context_then_new(outs, [x.T.copy() for x in lses], machine=vllm_machine)
    co, cl = sglang_new_then_chunks(outs[0], lses[0], outs[1:], lses[1:], machine=sglang_machine)
    return {"vllm_out": vo, "vllm_lse": vl, "sglang_out": so, "sglang_lse": sl, "vllm_chain_out": chain,
            "sglang_chain_out": co, "sglang_chain_lse": cl}


@pytest.mark.parametrize("case", range(len(MERGE_CASES)))
def test_every_merge_bit_is_the_devices(capture, case):
    """Every bit, NaN against NaN whatever the payload (the rule of :func:`amla_sim.compare`: SGLang's NaN rows are
    0x7FFF in BF16 on the device, the model's quiet NaN 0x7FC0); every other element bit for bit."""
    got = _run(case)
    for name, a in got.items():
        report = compare({name: capture[f"c{case}_{name}"]}, {name: a})
        assert report.bit_exact and report[name].nan_mismatch == 0, (case, name, report.format())
        number = ~np.isnan(a.astype(np.float32))
        assert np.array_equal(_bits(a)[number], capture[f"c{case}_{name}"][number]), (case, name)


@pytest.mark.parametrize("what, machines, stage", [
    ("vLLM's build is precise: fast math changes its bits", ("sm90-cuda", "sm90-cuda"), "vllm_lse"),
    ("SGLang's build is fast: precise math changes its bits", ("sm90-cuda-precise", "sm90-cuda-precise"),
     "sglang_lse"),
])
def test_each_builds_arithmetic_matters(capture, what, machines, stage):
    differ = sum(int((_bits(_run(c, *machines)[stage]) != capture[f"c{c}_{stage}"]).sum())
                 for c in range(len(MERGE_CASES)))
    assert differ > 0, what


def test_the_rows_both_kernels_treat_apart(capture):
    """Both LSEs infinite (tokens 3, 11, ...): vLLM copies the prefix's output and writes -inf, SGLang writes NaN;
    a +inf LSE (FA2's empty row) is read as -inf by both. The captured chains fold the partials in one tree (SGLang's
    started from the first partial, vLLM's ends with the last), so they part on those rows and on two other
    elements, the builds' arithmetic."""
    outs, lses = merge_inputs(*MERGE_CASES[0])
    vo = capture["c0_vllm_out"].view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(vo[3::8].view(np.uint16), outs[0][3::8].view(np.uint16))
    assert np.isneginf(capture["c0_vllm_lse"].view(np.float32)[:, 3::8]).all()
    assert np.isnan(capture["c0_sglang_out"].view(ml_dtypes.bfloat16)[3::8].astype(np.float32)).all()
    np.testing.assert_array_equal(capture["c0_vllm_out"][4::8], _bits(outs[1][4::8]))  # only the suffix counts
    a, b = capture["c1_vllm_chain_out"], capture["c1_sglang_chain_out"]
    kind = np.arange(len(a)) % 8
    assert (a[kind == 3] != b[kind == 3]).all()
    assert int((a[kind != 3] != b[kind != 3]).sum()) == 2  # of 43,008: the two builds' arithmetic, one tree


@pytest.mark.parametrize("case, share", [(0, 0.0), (1, 0.2), (2, 0.05)])
def test_the_engines_orders_part_from_three_partials(case, share):
    """On one request (the new tokens' partial last in vLLM's fold, first in SGLang's), the two folds are other
    trees: from three partials on they give other bits, on the same build too (the models, each bit for bit the
    device's on the single merges and chains above)."""
    outs, lses = merge_inputs(*MERGE_CASES[case])
    v, _, _ = vllm_context_then_new(outs, [x.T.copy() for x in lses])
    s, _ = sglang_new_then_chunks(outs[-1], lses[-1], outs[:-1], lses[:-1], machine="sm90-cuda-precise")
    number = np.isfinite(v.astype(np.float32)) & np.isfinite(s.astype(np.float32))
    differ = ((v.view(np.uint16) != s.view(np.uint16)) & number).mean()
    assert differ > share if share else differ == 0


@pytest.mark.parametrize("call, match", [
    (lambda o, l: vllm_merge_attn_states(o[0], l[0], o[1], l[1]), "^prefix_lse: expected float32 \\(8, 64\\)"),
    (lambda o, l: sglang_merge_state_v2(o[0][..., :100], l[0], o[1], l[1]), "^prefix_output: .*multiple of 8"),
    (lambda o, l: sglang_merge_state_v2(o[0], l[0], o[1].astype(np.float32), l[1]), "^suffix_output: "),
    (lambda o, l: vllm_merge_attn_states(o[0], l[0].T, o[1], l[1].T, prefill_tokens_with_context=65),
     "^prefill_tokens_with_context"),
    (lambda o, l: vllm_context_then_new(o[:1], l[:1]), "^outputs, lses"),
])
def test_bad_input_names_the_argument(call, match):
    outs, lses = merge_inputs(*MERGE_CASES[0])
    with pytest.raises(ValueError, match=match):
        call(outs, lses)


@pytest.mark.parametrize("bad", [np.zeros((4, 2, 8), np.int32), np.zeros((4, 2, 8), np.dtype("V2"))])
def test_outputs_that_are_not_floats_are_refused_by_name(bad):
    lse = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="^prefix_output: expected BF16, FP16 or FP32"):
        sglang_merge_state_v2(bad, lse, bad, lse)


# --- the Triton fallbacks ----------------------------------------------------------------------------------

TRITON = Path(__file__).parent / "data" / "merges_triton_h200.npz"


@pytest.fixture(scope="module")
def triton_capture():
    with np.load(TRITON) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    assert meta["cases"] == [list(c) for c in TRITON_MERGE_CASES] and meta["repeat_identical"] is True
    return arrays


def _run_triton(i: int, machine: str = "sm90-triton") -> dict[str, np.ndarray]:
    outs, lses = merge_inputs(*TRITON_MERGE_CASES[i])
    vo, vl = vllm_merge_attn_states_triton(outs[0], lses[0].T.copy(), outs[1], lses[1].T.copy(), machine=machine)
    so, sl = sglang_merge_state_triton(outs[0], lses[0], outs[1], lses[1], machine=machine)
    return {"vllm_triton_out": vo, "vllm_triton_lse": vl, "sglang_triton_out": so, "sglang_triton_lse": sl}


@pytest.mark.parametrize("case", range(len(TRITON_MERGE_CASES)))
def test_every_triton_merge_bit_is_the_devices(triton_capture, case):
    """vLLM's ``triton_merge_attn_states.py`` and SGLang's ``merge_state_triton``, run from their files on an H200:
    every bit (NaN against NaN whatever the payload), head sizes 128, 512 and 100 (which only the fallbacks take)."""
    for name, a in _run_triton(case).items():
        dev = triton_capture[f"c{case}_{name}"]
        report = compare({name: dev}, {name: a})
        assert report.bit_exact and report[name].nan_mismatch == 0, (case, name, report.format())
        number = ~np.isnan(a.astype(np.float32))
        assert np.array_equal(_bits(a)[number], dev[number]), (case, name)


@pytest.mark.parametrize("machine", ["sm90-cuda", "sm90-cuda-precise"])
def test_the_triton_lowering_matters(triton_capture, machine):
    """``tl.log`` as libdevice's ``logf`` then the add, and ``tl.exp`` as ``ex2.approx``: either CUDA build's
    arithmetic gives other LSE bits."""
    differ = sum(int((_bits(_run_triton(c, machine)["vllm_triton_lse"]) != triton_capture[f"c{c}_vllm_triton_lse"])
                     .sum()) for c in range(len(TRITON_MERGE_CASES)))
    assert differ > 0


def test_vllms_triton_fallback_zeroes_a_row_of_no_key(triton_capture):
    """Where both LSEs are infinite (tokens 3, 11, ...), vLLM's Triton fallback writes out 0 where its CUDA kernel
    copies the prefix's output: on the device and in the models."""
    outs, lses = merge_inputs(*TRITON_MERGE_CASES[0])
    rows = np.arange(outs[0].shape[0]) % 8 == 3
    dev = triton_capture["c0_vllm_triton_out"][rows]
    assert not dev.any() and outs[0][rows].astype(np.float32).any()
    cuda, _ = vllm_merge_attn_states(outs[0], lses[0].T.copy(), outs[1], lses[1].T.copy())
    assert np.array_equal(_bits(cuda)[rows], _bits(outs[0])[rows])
