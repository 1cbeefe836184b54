"""The absorbed MLA projections (W_UK before the absorbed kernel, W_UV after it) as the engines' deterministic modes
compute them, against an H200 (``scripts/capture_bmm.py``, ``tests/data/bmm_h200.npz``, cut by its ``--trim`` to one
head a call): vLLM 0.33's and SGLang 0.5.23's batch-invariant Triton bmm run from their files with the engines' own
calls, and cuBLAS's ``torch.bmm`` through the same calls (normal mode), 1 to 300 tokens at 16 heads and 4 at 128:
every bit is the model's; each modelled choice shown to matter; bad input refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from amla_sim.algorithms.deployed.projections import bmm_batch_invariant, w_uk, w_uv
from amla_sim.arith.mma import MODEL_TABLE, MMAModel
from amla_sim.crosscheck.projections import BMM_CASES, bmm_inputs, split_kv_b
from amla_sim.machines import get_machine
from amla_sim.units import MatrixUnit

DATA = Path(__file__).parent / "data" / "bmm_h200.npz"
CALLS = [f"{e}_{op}_{impl}" for e in ("vllm", "sglang") for op in ("w_uk", "w_uv") for impl in ("triton", "cublas")]


@pytest.fixture(scope="module")
def capture():
    with np.load(DATA) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    assert meta["repeat_identical"] and meta["device"] == "NVIDIA H200" and meta["keep_heads"] == 1
    assert [tuple(c) for c in meta["cases"]] == [BMM_CASES[i] for i in meta["trimmed_from"]["cases"]]
    return meta, arrays


def _model(case, machine="sm90-triton"):
    q, attn, w = bmm_inputs(*case)
    uk, uv = split_kv_b(w, case[1])
    return (w_uk(q[:, :1], uk[:1], machine=machine).view(np.uint16),
            w_uv(attn[:, :1], uv[:1], machine=machine).view(np.uint16))


@pytest.mark.parametrize("i", range(5))
def test_every_bit_of_both_engines_and_cublas(capture, i):
    meta, arrays = capture
    uk, uv = _model(meta["cases"][i])
    for call in CALLS:
        assert np.array_equal(arrays[f"c{i}_{call}"], uk if "_w_uk_" in call else uv), (meta["cases"][i], call)


def _fp32_add() -> MMAModel:
    row = MODEL_TABLE["sm90"].rows["bf16"]
    return MMAModel("bf16 dots added in FP32", {"bf16": dataclasses.replace(row, chain="fp32-add")}, doc="a what-if")


@pytest.mark.parametrize("matrix", ["exact", "fp32", "fp32-add"],
                         ids=["a correctly rounded dot", "sequential FP32 FMAs", "each tl.dot added in FP32"])
def test_the_fused_chain_over_k_matters(capture, matrix):
    meta, arrays = capture
    mc = get_machine("sm90-triton", matrix=MatrixUnit(_fp32_add() if matrix == "fp32-add" else matrix))
    differ = 0
    for i, case in enumerate(meta["cases"]):
        uk, uv = _model(case, mc)
        differ += int((arrays[f"c{i}_vllm_w_uk_triton"] != uk).sum() + (arrays[f"c{i}_vllm_w_uv_triton"] != uv).sum())
    assert differ > 0


def test_a_tokens_bits_do_not_depend_on_the_batch():
    """Each row of the product is its own chain over K: the token's output is the same in a batch of 1 and of 300."""
    q, _, w = bmm_inputs(300, 2, 9)
    uk, _ = split_kv_b(w, 2)
    assert np.array_equal(w_uk(q, uk)[7:8].view(np.uint16), w_uk(q[7:8], uk).view(np.uint16))


@pytest.mark.parametrize(("a", "b", "match"), [
    (np.zeros((2, 3, 4), np.float32), None, "a: expected a BF16"),
    (None, np.zeros((2, 5, 6)), "b: expected a BF16"),
    (None, "shape", r"b: expected \(2, 4, N\)"),
])
def test_bad_input_is_refused_by_name(a, b, match):
    bf = bmm_inputs(1, 1, 0)[0].dtype
    good_a, good_b = np.zeros((2, 3, 4), bf), np.zeros((2, 4, 5), bf)
    if isinstance(b, str):
        b = np.zeros((2, 5, 6), bf)
    with pytest.raises(ValueError, match=match):
        bmm_batch_invariant(good_a if a is None else a, good_b if b is None else b)


@pytest.mark.parametrize(("call", "match"), [
    (lambda q, uk, uv: w_uk(q[0], uk), r"q_nope, W_UK: expected \(T, h, K\) and \(h, K, N\)"),
    (lambda q, uk, uv: w_uk(q, uv), "q_nope, W_UK: expected"),
    (lambda q, uk, uv: w_uv(q.astype(np.float32), uv), "attn, W_UV: expected"),
    (lambda q, uk, uv: w_uk(q.astype(np.float32), uk), "q_nope: expected a BF16"),
])
def test_the_projections_name_their_arguments(call, match):
    q, _, w = bmm_inputs(2, 2, 0)
    uk, uv = split_kv_b(w, 2)
    with pytest.raises(ValueError, match=match):
        call(q, uk, uv)
