"""SGLang's own FlashAttention-3 build (sgl-flash-attn) as SGLang calls it: its fa3 MLA backend's bits predicted
from H100 captures, the one host-code difference from vLLM's fork (the split bound from the page table's width)
shown to matter, and its DSA decode shown to give vLLM's fork's bits on the same inputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from amla_sim.algorithms.deployed.fa3 import sgl_fa3_mla
from amla_sim.algorithms.deployed.fa3 import mla as fa3_module
from amla_sim.algorithms.deployed.fa3.scheduler import fa3_schedule
from amla_sim.crosscheck import replay
from amla_sim.crosscheck.deployed import KERNELS
from amla_sim.crosscheck.fa3 import SGL_CASES
from amla_sim.gpu.adapters.fa3 import build_fa3

DATA = Path(__file__).parent / "data"
DENSE = DATA / "sgl_fa3_mla_h100.npz"
#: SGLang's DSA decode captured through its build, kept as a record of digests: its arrays are byte for byte those
#: of vLLM's fork's capture of the same cases (which the suite replays), so they are not stored twice
RECORDS = {DATA / "sgl_fa3_mla_sparse_h100.json": DATA / "fa3_mla_sparse_h100.npz",
           DATA / "scales_sgl_fa3_mla_sparse.json": DATA / "scales_fa3_mla_sparse.npz"}
#: the cases of SGL_CASES whose bits a bound from the longest request (vLLM's max_seqlen_k) changes: a
#: CUDA-graph table of 163,840 keys over a 600-key request, 2,560 pages of 64 over 300 and 900, 40 pages over 2048
BOUND_BITES = [0, 1, 2]


def _digest(a: np.ndarray) -> str:  # as scripts/capture_digest.py writes it
    a = np.ascontiguousarray(a)
    return f"{a.dtype.str}{list(a.shape)}:{hashlib.sha256(a.tobytes()).hexdigest()}"


def _differing(report) -> list[int]:
    return [i for i, row in enumerate(report.cases) if row.first_difference is not None]


def test_sglang_fa3_captures_are_predicted_in_every_bit(fastest_engine):
    """(Its scale table is replayed in full by test_scalars.py.)"""
    report = replay(DENSE)
    assert report.kernel == "sgl-fa3-mla" and len(report.cases) == len(SGL_CASES)
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()
        assert [s.name for s in row.stages] == ["splits", "lse", "out"]


def test_the_dense_capture_covers_sglangs_calls():
    """CUDA-graph tables (163,840 keys in pages of 1, 16 and 64) and eager ones, MTP (s_q 2), deterministic mode
    (num_splits 1), BF16 and FP16, 16 to 128 heads; every launch repeatable; split counts up to 84."""
    with np.load(DENSE) as z:
        meta = json.loads(str(z["meta"]))
        splits = [z[f"c{i}_splits"] for i in range(len(meta["cases"]))]
    cases = meta["cases"]
    assert meta["device"] == "NVIDIA H100 80GB HBM3" and meta["sgl_fa3_commit"] == "cb303cf"
    assert all(c["repeat_identical"] for c in cases)
    assert {c["table_pages"] * c["page_size"] for c in cases} >= {163840, 2560, 4097}
    assert {c["page_size"] for c in cases} == {1, 16, 64} and {c["num_splits"] for c in cases} == {0, 1}
    assert {c["sq"] for c in cases} == {1, 2} and {c["format"] for c in cases} == {"bf16", "fp16"}
    assert max(int(s.max()) for s in splits) == 84 and splits[5].tolist() == [1, 1]


def test_the_bound_from_the_longest_request_gives_other_bits(monkeypatch, fastest_engine):
    """vLLM's fork bounds the splits by ``max_seqlen_k`` (the longest request); SGLang's build by the page table's
    width. Modelled with vLLM's bound, exactly the listed cases change (the split counts, then the bits)."""
    real = fa3_module.fa3_mla

    def vllm_bound(*args, **kwargs):
        return real(*args, **{**kwargs, "max_seqlen_k": None})

    monkeypatch.setattr("amla_sim.algorithms.deployed.fa3.sgl.fa3_mla", vllm_bound)
    report = replay(DENSE)
    assert _differing(report) == BOUND_BITES, report.format()
    for i in BOUND_BITES:  # the split count parts first, and the output with it
        assert report.cases[i].first_difference.startswith("splits"), report.format()
        out = next(s for s in report.cases[i].stages if s.name == "out")
        assert out.identical < out.size


@pytest.mark.parametrize("record", sorted(RECORDS), ids=lambda p: p.stem)
def test_sglangs_dsa_decode_gives_vllms_bits(record):
    """Every array of SGLang's DSA decode capture (34 cases: the sparse cross-check's 8 and the 26 scales) has the
    bytes of vLLM's fork's capture of the same recipe (same input CRCs)."""
    rec = json.loads(record.read_text())
    assert rec["meta"]["kernel"] == "sgl-fa3-mla-sparse" and rec["meta"]["device"] == "NVIDIA H100 80GB HBM3"
    cases = rec["meta"]["cases"]
    with np.load(RECORDS[record]) as z:
        other = json.loads(str(z["meta"]))["cases"]
        assert [c["input_crc"] for c in cases] == [c["input_crc"] for c in other]
        for i in range(len(cases)):
            for name in ("out", "lse"):
                assert rec["sha256"][f"c{i}_{name}"] == _digest(z[f"c{i}_{name}"]), (record.name, i, name)
    assert len(cases) in (8, 26)


def test_the_sparse_split_counts_are_the_models():
    """The split counts SGLang's build wrote for each sparse case (read back in the prepare kernel's sorted order
    and put back in batch order) are the model's schedule for the launch."""
    for record in RECORDS:
        rec = json.loads(record.read_text())
        for i, case in enumerate(rec["meta"]["cases"]):
            sched = fa3_schedule(case["seqlens"], s_q=1, heads=case["heads"], num_splits=case["num_splits"],
                                 causal=False, page_size=1, max_seqlen_k=case["topk"])
            assert rec["sha256"][f"c{i}_splits"] == _digest(np.array(sched.splits, np.int32)), (record.name, i)


def test_sglang_kernels_are_cross_check_kernels():
    assert {"sgl-fa3-mla", "sgl-fa3-mla-sparse"} <= set(KERNELS)
    assert KERNELS["sgl-fa3-mla"].source_flag == KERNELS["sgl-fa3-mla-sparse"].source_flag == "--sgl-fa3-dir"


@pytest.mark.parametrize("kwargs, match", [
    ({"table_pages": 2, "page_size": 64}, "table_pages"),  # 128 keys for a 300-key request
    ({"table_pages": 0}, "table_pages"),
    ({"table_pages": 10, "page_size": 0}, "page_size"),
])
def test_sgl_fa3_refuses_a_table_that_cannot_hold_the_request(kwargs, match):
    q = np.zeros((1, 1, 16, 576), np.float32)
    with pytest.raises(ValueError, match=match):
        sgl_fa3_mla(q, np.zeros((1, 300, 576), np.float32), seqlens=[300], **kwargs)


def test_build_names_the_fork_it_does_not_know(tmp_path):
    with pytest.raises(ValueError, match="fork"):
        build_fa3(tmp_path, fork="tri-dao")
