"""vLLM's FLASHINFER_MLA_SPARSE_SM90 (NoPE sparse MLA through FlashInfer's ``<512, 0>`` kernel) against the device:
the H100 captures of vLLM's call (top-k lists with holes, BF16 and E4M3 caches, the plan padded to
``max_num_batched_tokens``, upper-bound plans with the device's kv_end clamp, one 2-CTA cluster) replayed bit for
bit, plan values and staged work lists included; each modelled choice shown to matter; bad calls refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_replay_bit_exact, capture_engines

from amla_sim.algorithms.deployed.flashinfer import mla, sparse
from amla_sim.algorithms.deployed.flashinfer.sparse import flashinfer_mla_sparse, packed_topk
from amla_sim.crosscheck import replay
from amla_sim.crosscheck.flashinfer import FLASHINFER_MLA_SPARSE, FLASHINFER_SPARSE_CASES, flashinfer_sparse_inputs

DATA = Path(__file__).parent / "data"
CAPTURE = DATA / "flashinfer_mla_sparse_h100.npz"
SCALES = DATA / "scales_flashinfer_mla_sparse.npz"  # replayed in full by test_scalars.py
CAPTURES = [str(CAPTURE), str(SCALES)]


def _meta() -> tuple[dict, list[np.ndarray]]:
    with np.load(CAPTURE) as z:
        meta = json.loads(str(z["meta"]))
        return meta, [z[f"c{i}_plan"] for i in range(len(meta["cases"]))]


# NumPy: an E4M3 cache read with a scale BF16 cannot hold, lists with holes, split chunks
@pytest.mark.parametrize(("capture", "engine", "cases"), capture_engines(CAPTURES[:1], [2]))
def test_the_captures_are_predicted_in_every_bit(capture, engine, cases):
    assert_replay_bit_exact(capture, engine, cases, kernel="flashinfer-mla-sparse",
                            total=len(FLASHINFER_SPARSE_CASES), stages=["plan", "work", "lse", "out"])


def test_the_capture_is_vllms_call():
    """The case table as the code writes it, on an H100; every launch repeatable, and the run with the LSE gives
    the output bits of vLLM's run without it. BF16 and E4M3 caches (scales 1, 0.5 and 0.0371, which BF16 rounds),
    holes inside the lists, plans padded to 1 to 8192 rows, exact and upper-bound plans, clusters of one CTA and
    of two, and split rows."""
    meta, plans = _meta()
    cases = meta["cases"]
    assert meta["device"] == "NVIDIA H100 80GB HBM3" and meta["flashinfer_version"] == "0.7.2"
    assert [{k: v for k, v in c.items() if k not in ("input_crc", "repeat_identical", "lse_run_same_out")}
            for c in cases] == FLASHINFER_MLA_SPARSE.recipes(0)
    assert all(c["repeat_identical"] and c["lse_run_same_out"] for c in cases)
    assert {c["kv_format"] for c in cases} == {"bf16", "e4m3"}
    assert {c["k_scale"] for c in cases if "k_scale" in c} == {1.0, 0.5, 0.0371}
    assert float(np.float32(0.0371).astype(ml_dtypes.bfloat16)) != np.float32(0.0371)
    assert {c["upper_bound"] for c in cases} == {0, 32}
    assert {int(p[0]) for p in plans} == {1, 2}  # the cluster size
    with np.load(CAPTURE) as z:  # work_indptr's last entry: the work items, more than the query tiles (splits)
        assert any(int(z[f"c{i}_work"][-1]) > c["batch"] * -(-c["heads"] // 64) for i, c in enumerate(cases))
    _, _, idx = flashinfer_sparse_inputs(cases[0])
    counts = (idx >= 0).sum(axis=1)
    assert any((idx[t, :counts[t]] < 0).any() for t in range(len(idx)))  # holes inside a valid window


def _sorted_packing(indices: np.ndarray):
    """The other order: each token's valid slots sorted, as a cache walk would give them."""
    valid = indices >= 0
    lists = np.where(valid, indices, np.iinfo(np.int64).max)
    out = np.sort(lists, axis=1)
    return np.where(out == np.iinfo(np.int64).max, -1, out), valid.sum(axis=1)


def _bf16_scale_not_rounded(mc, kv, ckv_scale, kpe_scale, arr):
    return mc.cast(mc.f(kv) * mc.f(ckv_scale), "bf16")


@pytest.mark.parametrize("change, capture, case, stage", [
    ("keys-sorted", 0, 0, "lse"),  # the indexer's order is the kernel's: another order rounds otherwise
    ("fp8-scale-not-rounded", 1, 0, "lse"),  # bf16(k_scale), not the FP32 scale (a random k_scale of the table)
    ("plan-unpadded", 0, 1, "plan"),  # vLLM plans max_num_batched_tokens rows: one CTA a cluster, not two
    ("plan-exact", 0, 3, "work"),  # the upper-bound plan's chunks, not the valid counts': other work lists
])
def test_each_choice_matters_on_the_device(change, capture, case, stage, monkeypatch, fastest_engine):
    """With any one choice in its other form, the replay parts from the device at the stage named (a work list of
    another length is reported as not compared, and the case as not bit-exact); the model as it is does not (the
    first test)."""
    if change == "keys-sorted":
        monkeypatch.setattr(sparse, "packed_topk", _sorted_packing)
    elif change == "fp8-scale-not-rounded":
        monkeypatch.setattr(mla, "_dequant", _bf16_scale_not_rounded)
    else:
        real = sparse.flashinfer_mla

        def other(*args, pad_rows, plan_seqlens, **kw):
            if change == "plan-unpadded":
                pad_rows = 0
            else:
                plan_seqlens = None
            return real(*args, pad_rows=pad_rows, plan_seqlens=plan_seqlens, **kw)

        monkeypatch.setattr(sparse, "flashinfer_mla", other)
    row = replay(CAPTURES[capture], cases=[case]).cases[0]
    if stage == "work":
        assert not row.bit_exact and "their plans differ" in row.not_compared["work"], row.format()
    else:
        assert row.first_difference == stage, row.format()


def test_a_tokens_bits_depend_on_its_batchmates(fastest_engine):
    """The chunk length comes from all the step's keys: the 700-key token of case 0 (4 tokens, 4,797 keys: chunks
    of 192) run alone is cut into chunks of 32 and rounds otherwise."""
    case = FLASHINFER_MLA_SPARSE.recipes(0)[0]
    q, rows, idx = flashinfer_sparse_inputs(case)
    kw = dict(scale=case["scale"], max_num_batched_tokens=case["max_num_batched_tokens"], trace=True)
    batch = flashinfer_mla_sparse(q, rows, idx, **kw)
    alone = flashinfer_mla_sparse(q[2:3], rows, idx[2:3], **kw)
    limits = [r.trace["mla_plan"][0].kv_len_limit for r in (batch, alone)]
    assert limits[0] != limits[1], limits
    assert not np.array_equal(batch.out[2].view(np.uint16), alone.out[0].view(np.uint16))


def test_packing_keeps_the_indexers_order():
    idx = np.array([[5, -1, 3, -1, 9], [-1, -1, -1, -1, -1], [1, 2, 3, 4, 0]])
    packed, counts = packed_topk(idx)
    assert packed.tolist() == [[5, 3, 9, -1, -1], [-1] * 5, [1, 2, 3, 4, 0]] and counts.tolist() == [3, 0, 5]


def _call():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 16, 512)).astype(ml_dtypes.bfloat16)
    rows = rng.standard_normal((300, 512)).astype(ml_dtypes.bfloat16)
    idx = np.array([rng.permutation(300)[:128], np.r_[rng.permutation(300)[:64], np.full(64, -1)]])
    return dict(q=q, kv_cache=rows, topk_indices=idx, scale=0.0625)


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(q=np.concatenate([c["q"], c["q"][..., :64]], axis=-1)), r"^q: expected shape \(T, h, 512\)"),
    (lambda c: c.update(q=c["q"].astype(np.float16)), "^q: the kernel takes BF16"),
    (lambda c: c.update(kv_cache=c["kv_cache"][:, :256]), r"^kv_cache: expected shape \(rows, 512\)"),
    (lambda c: c.update(kv_cache=c["kv_cache"].astype(np.float32)), "^kv_cache: the kernel takes BF16 or E4M3"),
    (lambda c: c.update(topk_indices=c["topk_indices"][:1]), r"^topk_indices: expected ints of shape \(2, topk\)"),
    (lambda c: c.update(topk_indices=c["topk_indices"] + 300), "^topk_indices: expected cache rows in 0..299"),
    (lambda c: c.update(topk_indices=c["topk_indices"] * 1.0), "^topk_indices: expected ints"),
    (lambda c: c.update(k_scale=0.5), "^k_scale: only an E4M3 cache takes a scale"),
    (lambda c: c.update(max_num_batched_tokens=1), "^max_num_batched_tokens: "),
    (lambda c: c.update(plan_seqlens=np.array([1, 1])), "^plan_seqlens: expected 2 ints >= seqlens"),
    (lambda c: c.update(scale=float("inf")), "^scale: "),
    (lambda c: c.update(kv_cache=c["kv_cache"].astype(ml_dtypes.float8_e4m3fn), k_scale=float("nan")), "^k_scale: "),
])
def test_bad_calls_are_refused_by_name(change, match):
    call = _call()
    change(call)
    with pytest.raises((ValueError, TypeError), match=match):
        flashinfer_mla_sparse(**call)


def test_the_kernel_takes_q_and_keys_of_one_width():
    """576 wide (RoPE) or 512 (none), q and kv alike; anything else is refused naming the argument."""
    from amla_sim.algorithms.deployed.flashinfer import flashinfer_mla

    q = np.zeros((1, 1, 16, 512), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=r"^kv: expected shape \(1, S_max, 512\)"):
        flashinfer_mla(q, np.zeros((1, 64, 576), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"^q: expected shape \(b, s_q, h_q, 576 or 512\)"):
        flashinfer_mla(np.zeros((1, 1, 16, 256), ml_dtypes.bfloat16), np.zeros((1, 64, 256), ml_dtypes.bfloat16))
