"""Inputs near FP32's subnormal range, as an H200 computed them (``scripts/capture_limits.py small``,
``scripts/capture_prefill.py --only small``): q and the caches drawn at about 1e-38 and 1e-36, FlashInfer's E4M3
latents at 2^-125, 2^-120 and 1e-40. A fast-math build (``-ftz=true``) writes every subnormal FP32 product as a zero
and reads a subnormal operand as one; vLLM's FlashMLA library (built without fast math) and the Triton decodes
keep them. Both are modelled by the machines' FP32 multiply (:meth:`amla_sim.machines.Machine.mul`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from amla_sim.algorithms.deployed.flashinfer import mla as fi_mla
from amla_sim.algorithms.deployed.flashinfer.scheduler import flashinfer_mla_plan
from amla_sim.crosscheck.deployed import replay_deployed
from amla_sim.crosscheck.files import read_capture
from amla_sim.crosscheck.flashinfer import flashinfer_inputs
from amla_sim.formats import flush_subnormals
from amla_sim.units import FMAUnit

DATA = Path(__file__).parent / "data"

#: the captures -> (case count, whether the kernel's build flushes); FlashInfer's case 2 (128 heads over 4 x 3,000
#: keys, 28 s to replay) is replayed one request at a time below
SMALL = {"small_fa3_mla_h200.npz": (2, True), "small_fa3_mla_sparse_h200.npz": (2, True),
         "small_fa3_prefill_h200.npz": (3, True), "small_flashinfer_mla_h200.npz": (5, True),
         "small_flashinfer_mla_sparse_h200.npz": (2, True), "small_flashmla_sglang_h200.npz": (2, True),
         "small_flashmla_etap_h200.npz": (2, True), "small_flashmla_h200.npz": (2, False),
         "small_flashmla_sparse_prefill_h200.npz": (2, False), "small_vllm_triton_mla_h200.npz": (4, False),
         "small_sglang_triton_h200.npz": (2, False),
         # no bit of these depends on the flush: NaN outputs from the descales' flushed product, and V3.2's FP8 cache
         "small_flashmla_dense_fp8_h200.npz": (2, None), "small_flashmla_sparse_fp8_h200.npz": (2, None)}
_SLOW = {"small_flashinfer_mla_h200.npz": [2]}


def _replay(name: str, cases: list[int] | None = None):
    meta, arrays = read_capture(DATA / name, what=name)
    assert len(meta["cases"]) == SMALL[name][0]
    cases = [i for i in range(len(meta["cases"])) if i not in _SLOW.get(name, [])] if cases is None else cases
    return replay_deployed(name, meta, arrays, cases=cases)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_small_values_replay_bit_for_bit(name):
    report = _replay(name)
    assert report.bit_exact, report.format()


def _flush_everywhere(self: FMAUnit, x: np.ndarray) -> np.ndarray:
    return flush_subnormals(x, keep_sign=True) if x.dtype == np.float32 else x


@pytest.mark.parametrize("name", sorted(n for n, (_, flushes) in SMALL.items() if flushes is not None))
def test_the_flush_is_the_builds(name, monkeypatch):
    """A fast-math kernel's captures part from the model when its multiplies keep subnormals; the others' (vLLM's
    FlashMLA library, the Triton decodes) when they flush them (each file's first case: every case parts)."""
    flushes = SMALL[name][1]
    monkeypatch.setattr(FMAUnit, "read", (lambda self, x: x) if flushes else _flush_everywhere)
    report = _replay(name, [0])
    assert not any(c.first_difference is None for c in report.cases), report.format()


def _case2_request0() -> tuple[dict, np.ndarray]:
    meta, arrays = read_capture(DATA / "small_flashinfer_mla_h200.npz", what="flashinfer")
    c = meta["cases"][2]
    return c, arrays["c2_out"].reshape(c["batch"], c["heads"], 512)[0]


def _request0(c: dict) -> np.ndarray:
    """Request 0 of case 2 alone, with its batch's chunk length (its bits depend on its batchmates only so)."""
    plan = flashinfer_mla_plan(c["seqlens"], heads=c["heads"], q_lens=1, causal=False, num_sms=132, page_size=1)
    q, kv = flashinfer_inputs(c)
    res = fi_mla.flashinfer_mla(q[:1], kv[:1], seqlens=np.array(c["seqlens"][:1]), scale=c["scale"],
                                kv_len_limit=plan.kv_len_limit)
    return res.out.view(np.uint16).reshape(c["heads"], 512)


def test_flashinfers_rescale_of_a_subnormal_running_output_flushes(monkeypatch):
    """Over work items of four KV tiles (128 heads, 3,000 keys a request) the running O passes through the subnormal
    range and ``O * o_scale`` (``mul.ftz``) flushes it: request 0's 65,536 outputs are the device's, and with that one
    multiply unflushed 128 of them are not. (The whole case, four requests, replays in every bit too: 28 s.)"""
    c, device = _case2_request0()
    assert (_request0(c) == device).all()
    monkeypatch.setattr(fi_mla, "_rescale", lambda mc, O, s: mc.f(O * s[:, None]))  # that multiply unflushed
    assert (_request0(c) != device).sum() == 128
