"""FA3's sparse MLA call (DeepSeek V3.2 with a BF16 cache, vLLM's FLASH_ATTN_MLA_SPARSE and SGLang's DSA fa3 decode):
the H100 capture replayed bit for bit, the split plan it depends on, and what the model refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from amla_sim.algorithms import golden
from amla_sim.algorithms.deployed.fa3 import fa3_mla_sparse, scheduler
from amla_sim.crosscheck import replay
from amla_sim.crosscheck.fa3 import SPARSE_CASES, fa3_sparse_inputs
from amla_sim.experiments.inputs import make_inputs

CAPTURE = Path(__file__).parent / "data" / "fa3_mla_sparse_h100.npz"


def _meta() -> dict:
    with np.load(CAPTURE) as z:
        return json.loads(str(z["meta"]))


def test_the_capture_is_predicted_in_every_bit(fastest_engine):
    report = replay(CAPTURE)
    assert report.kernel == "fa3-mla-sparse" and len(report.cases) == len(SPARSE_CASES)
    for row in report.cases:
        assert row.first_difference is None and not row.skipped, report.format()
        assert [s.name for s in row.stages][-2:] == ["lse", "out"]


def test_the_capture_covers_the_calls():
    """Decode batches that split (1 to 24 splits a token), short lists in a topk-2048 launch (split by topk's
    bound), SGLang's deterministic num_splits = 1, a launch of 1000 tokens that never splits, tokens with no valid
    row, BF16 and FP16, 16 to 128 heads, topk 512 to 2048."""
    meta = _meta()
    cases = meta["cases"]
    assert meta["device"] == "NVIDIA H100 80GB HBM3" and all(c["repeat_identical"] for c in cases)
    with np.load(CAPTURE) as z:  # the metadata holds split counts where the launch may split
        splits = {i: z[f"c{i}_splits"] for i in range(len(cases)) if f"c{i}_splits" in z.files}
    assert {int(s.max()) for s in splits.values()} == {4, 7, 10, 14, 16, 24}
    longest = scheduler.fa3_schedule(cases[7]["seqlens"], s_q=1, heads=128, page_size=1)  # the bound from 600
    assert splits[7].tolist() == [10, 5] and max(longest.splits) < 10  # the device took topk's bound
    assert 4 not in splits and cases[4]["batch"] > scheduler.MAX_SPLIT_BATCH  # never split
    assert any(0 in c["seqlens"] for c in cases) and {c["format"] for c in cases} == {"bf16", "fp16"}
    assert {c["num_splits"] for c in cases} == {0, 1}


def test_a_token_is_attention_over_its_valid_rows():
    """On golden: each token's output and LSE are attention over the rows its list names, in exact arithmetic with
    the API's FP32 scale; a token of no valid row writes out 0 and LSE -inf."""
    case = {"batch": 3, "heads": 16, "rows": 500, "topk": 256, "seqlens": [256, 0, 37], "format": "bf16",
            "dist": "normal:1", "seed": 4}
    q, rows, idx, valid = fa3_sparse_inputs(case)
    res = fa3_mla_sparse(q, rows, idx, machine="golden")
    assert res.out.shape == (3, 16, 512) and res.lse.shape == (16, 3)
    for t in (0, 2):
        ref = golden(q[t][None, None], rows[idx[t, :valid[t]]][None], scale=float(np.float32(576**-0.5)))
        np.testing.assert_allclose(res.out[t], ref.out[0, 0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(res.lse[:, t], ref.lse[0, 0], rtol=1e-12)
    assert (res.out[1] == 0).all() and np.isneginf(res.lse[:, 1]).all()


def test_the_split_bound_is_taken_from_topk_not_the_longest_list():
    """``max_seqlen_k = topk`` sets the launch's bound: short lists in a topk-2048 launch still split, and a bound
    from the longest list (a plausible other reading) gives other counts."""
    lens = [600, 300]
    topk = scheduler.fa3_schedule(lens, s_q=1, heads=128, causal=False, page_size=1, max_seqlen_k=2048)
    longest = scheduler.fa3_schedule(lens, s_q=1, heads=128, causal=False, page_size=1)
    assert topk.bound > longest.bound and topk.splits != longest.splits


def test_a_token_changes_with_its_batchmates_through_its_split_count():
    """The same token and list alone and in a launch of eight such tokens: more splits alone; other bits."""
    case = {"batch": 1, "heads": 16, "rows": 3000, "topk": 2048, "seqlens": [2048], "format": "bf16",
            "dist": "normal:1", "seed": 8}
    q, rows, idx, _ = fa3_sparse_inputs(case)
    alone = fa3_mla_sparse(q, rows, idx, trace=True)
    batch = fa3_mla_sparse(np.repeat(q, 8, axis=0), rows, np.repeat(idx, 8, axis=0), trace=True)
    assert alone.trace["schedule"][0].splits[0] > batch.trace["schedule"][0].splits[0] > 1
    assert (alone.out[0].view(np.uint16) != batch.out[0].view(np.uint16)).any()
    np.testing.assert_array_equal(batch.out[0].view(np.uint16), batch.out[7].view(np.uint16))


@pytest.mark.parametrize("edit, match", [
    (lambda a: a.update(topk_indices=a["topk_indices"].astype(np.float32)), "topk_indices: expected ints"),
    (lambda a: a["topk_indices"].__setitem__((0, 0), 10_000), r"topk_indices: expected cache rows in 0\.\.499"),
    (lambda a: a["topk_indices"].__setitem__((0, 0), -2), "topk_indices: expected cache rows"),
    (lambda a: a["topk_indices"].__setitem__((0, 3), -1), "topk_indices: token 0 has -1 among its first"),
    (lambda a: a.update(valid_counts=np.array([300, 1])), "valid_counts: expected 2 ints in 0..256"),
    (lambda a: a.update(valid_counts=np.array([1.0, 1.0])), "valid_counts"),
    (lambda a: a.update(kv_cache=a["kv_cache"][:, :512]), r"kv_cache: expected shape \(rows, 576\)"),
    (lambda a: a.update(q=a["q"][None]), r"q: expected shape \(T, h, 576\)"),
    (lambda a: a.update(max_seqlen_k=100), "max_seqlen_k"),
    (lambda a: a.update(scale=1e300), "scale"),
    (lambda a: a.update(num_splits=257), "num_splits"),
])
def test_a_call_the_kernel_would_misread_is_refused_by_name(edit, match):
    q, kv = make_inputs("normal:1", batch=2, heads=16, context=500, seed=1)
    idx = np.tile(np.arange(256, dtype=np.int32), (2, 1))
    args = {"q": q[:, 0], "kv_cache": kv[0], "topk_indices": idx}
    edit(args)
    with pytest.raises((ValueError, TypeError), match=match):
        fa3_mla_sparse(**args)


@pytest.mark.parametrize("name", ["fa3-mla-sparse", "flashmla-sparse-prefill"])
def test_the_sweep_entries_are_causal_attention_over_each_request(name):
    """As sweep algorithms the V3.2 kernels list each query's causal prefix of its own request: on golden, the
    golden algorithm with the API's FP32 scale; on sm90-cuda within BF16's error of it."""
    from amla_sim.algorithms import ALGORITHMS

    q, kv = make_inputs("normal:1", batch=2, sq=2, heads=16, context=300, seed=1)
    scale = float(np.float32(576**-0.5))
    ref = golden(q, kv, scale=scale)
    exact = ALGORITHMS[name](q, kv, machine="golden", scale=scale)
    np.testing.assert_allclose(exact.out, ref.out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(exact.lse, ref.lse, rtol=1e-12)
    res = ALGORITHMS[name](q, kv)
    assert res.out.shape == (2, 2, 16, 512) and res.lse.shape == (2, 2, 16)
    assert np.abs(res.out.astype(np.float64) - ref.out).max() < 4e-3


@pytest.mark.parametrize(("idx", "width"), [
    ([[7, 2, 5, -1], [4, -1, -1, -1], [-1, -1, -1, -1]], 3),  # a token of no row among them
    ([[-1, -1], [-1, -1]], 1),  # nothing valid: one column, all zeros
    ([[7, 2, 5, 3], [4, 6, 1, 3], [9, 8, -1, -1]], 4),
])
def test_the_gather_is_as_wide_as_the_longest_list(idx, width):
    """Each token's first valid[t] slots name its rows, zeros after; no wider than the longest count (at least 1):
    the kernels read no slot past a token's count (the captures replay on the narrow gather)."""
    from amla_sim.algorithms.deployed.topk import sparse_rows

    cache = np.arange(10 * 3, dtype=np.float32).reshape(10, 3) + 1
    idx = np.array(idx)
    valid = (idx >= 0).sum(axis=1)
    keys = sparse_rows(cache, idx, valid)
    assert keys.shape == (len(idx), width, 3)
    for t, n in enumerate(valid):
        np.testing.assert_array_equal(keys[t, :n], cache[idx[t, :n]])
        assert not keys[t, n:].any()
