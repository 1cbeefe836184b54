"""The Triton decodes' MHA kernel (one query head a KV head) of vLLM and SGLang against H200 captures: every bit of
stage 1's partial outputs and LSEs, the output and the LSE, and each choice the model makes shown to matter."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from amla_sim.algorithms import splitkv_decode, vllm_triton_mla
from amla_sim.algorithms.deployed import splitkv_mha
from amla_sim.algorithms.deployed.sglang import decode as sglang_decode
from amla_sim.algorithms.deployed.vllm import triton_mla
from amla_sim.crosscheck.deployed import replay_deployed
from amla_sim.crosscheck.files import read_capture
from amla_sim.experiments.inputs import make_inputs

DATA = Path(__file__).parent / "data"
VLLM, SGLANG = "mha_vllm_triton_mla_h200.npz", "mha_sglang_triton_h200.npz"
CAPTURES = [VLLM, SGLANG, "mha_vllm_triton_mla_seed1000_h200.npz", "mha_sglang_triton_seed1000_h200.npz"]


def _replay(name: str, cases: list[int] | None = None):
    meta, arrays = read_capture(DATA / name, what=name)
    return meta, arrays, replay_deployed(name, meta, arrays, cases=cases)


@pytest.mark.parametrize("name", CAPTURES)
def test_the_mha_kernel_replays_bit_for_bit(name):
    """Both engines' calls with one head (vLLM: BF16 and FP8 caches, MTP rows, 1 to 16 splits, the batch-invariant
    count; SGLang: its per-request split counts), the tables and the same at fresh seeds: every stage-1 split's
    output and LSE, every output and LSE bit."""
    meta, arrays, report = _replay(name)
    assert all(c["heads"] == 1 for c in meta["cases"]) and report.bit_exact, report.format()
    mids = [(row.stages[0].name == "mid") for row in report.cases]
    assert mids == [f"c{i}_mid" in arrays for i in range(len(mids))] and sum(mids) >= 3, "stage 1 compared"
    if "vllm" in name:
        assert {c["kv_cache"] for c in meta["cases"]} == {"bf16", "fp8"} and max(c["sq"] for c in meta["cases"]) > 1


def _tile(cache: str, **change):
    return {**splitkv_mha.TILES, cache: dataclasses.replace(splitkv_mha.TILES[cache], **change)}


def _sum_in(bf16_sum: bool, module):
    real = splitkv_mha.stage1_mha

    def call(*args, **kw):
        return real(*args, **{**kw, "bf16_sum": bf16_sum})
    return module, "stage1_mha", call


#: a choice the model makes -> (what to patch, the capture and cases it decides)
CHANGES = {
    "vLLM sums q k in FP32": (lambda: _sum_in(False, triton_mla), VLLM, [0, 2]),
    "SGLang sums q k in BF16": (lambda: _sum_in(True, sglang_decode), SGLANG, [0, 3]),
    "every BF16 product fused": (lambda: (splitkv_mha, "TILES", _tile("bf16", fused=True)), VLLM, [0, 3]),
    "only the FP8 tile's even products fused": (lambda: (splitkv_mha, "TILES", _tile("e4m3", fused=False)), VLLM,
                                                [2, 4]),
    "the FP8 cache on the BF16 tile": (lambda: (splitkv_mha, "TILES", {**splitkv_mha.TILES,
                                                                       "e4m3": splitkv_mha.TILES["bf16"]}), VLLM,
                                       [2, 4]),
    "the FP8 tile's four V rows folded in order": (lambda: (splitkv_mha, "TILES", _tile("e4m3", v_rows=2)), VLLM,
                                                   [2, 4]),
    "no first key fused": (lambda: (splitkv_mha._Tile, "first_key_fused", property(lambda self: False)), SGLANG,
                           [0, 2]),
    "the first key fused on the FP8 tile": (lambda: (splitkv_mha._Tile, "first_key_fused",
                                                     property(lambda self: True)), VLLM, [2, 4]),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_modelled_choice_matters(change, monkeypatch):
    patch, name, cases = CHANGES[change]
    monkeypatch.setattr(*patch())
    _, _, report = _replay(name, cases)
    assert not any(row.bit_exact for row in report.cases), report.format()


@pytest.mark.parametrize("sums", ["p summed in key order", "products chained from the first"])
def test_the_sums_orders_matter(sums, monkeypatch):
    """l's sum as the FP8 key tile holds p (two warp rows), and the P V chain begun with ``fma(p0 v0, fl(p1 v1))``:
    summed otherwise, stage 1's partial outputs differ."""
    if sums == "p summed in key order":
        monkeypatch.setattr(splitkv_mha, "_p_sum", lambda mc, p, rows: _sequential(mc, p))
    else:
        monkeypatch.setattr(splitkv_mha, "_pv", _pv_from_first)
    _, _, report = _replay(VLLM, [2, 4])
    assert not any(row.bit_exact for row in report.cases), report.format()


def _sequential(mc, p):
    acc = p[..., 0]
    for k in range(1, p.shape[-1]):
        acc = mc.f(acc + p[..., k])
    return acc


def _pv_from_first(mc, p, V, rows):
    parts = []
    for w in range(rows):
        pk, vk = p[..., w::rows], V[..., w::rows, :]
        acc = mc.f(pk[..., 0, None] * vk[..., 0, :])
        for i in range(1, pk.shape[-1]):
            acc = mc.mul_add(pk[..., i, None], vk[..., i, :], acc)
        parts.append(acc)
    return splitkv_mha._fold(np.stack(parts, axis=-1), lambda a, b: mc.f(a + b))


def test_one_head_is_its_own_kernel():
    """A head's output through the MHA kernel is not the grouped kernel's for the same numbers: the one-head call is
    not a grouped call of one (their sums are other sums)."""
    q, kv = make_inputs("normal:1", heads=2, context=300, seed=7)
    alone = vllm_triton_mla(q[:, :, :1], kv, num_kv_splits=2)
    grouped = vllm_triton_mla(q, kv, num_kv_splits=2)
    assert not np.array_equal(alone.out.view(np.uint16), grouped.out[:, :, :1].view(np.uint16))
    s_alone = splitkv_decode(q[:, :, :1], kv, num_kv_splits=2)
    s_grouped = splitkv_decode(q, kv, num_kv_splits=2)
    assert not np.array_equal(s_alone.mid[:, :1].view(np.uint32), s_grouped.mid[:, :1].view(np.uint32))
