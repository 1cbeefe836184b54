"""FlashInfer's MLA on Hopper against the device: the H100 captures of SGLang's calls (page 1, BF16, MTP steps) and
FlashInfer's own E4M3 cache and pages replayed bit for bit, the plan's values and work lists included, and each
modelled choice shown to matter (the replay fails without it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_replay_bit_exact, capture_engines
from test_flashinfer_mla import CHOICES

from amla_sim.algorithms.deployed.flashinfer import mla
from amla_sim.crosscheck import replay
from amla_sim.crosscheck.flashinfer import FLASHINFER_CASES
from amla_sim.machines import get_machine

DATA = Path(__file__).parent / "data"
CAPTURE = DATA / "flashinfer_mla_h100.npz"
CAPTURES = [str(CAPTURE)]  # (its scale table is replayed in full by test_scalars.py)


# NumPy: an E4M3 cache whose requests split (the merge, BF16 partials, the dequantisation)
@pytest.mark.parametrize(("capture", "engine", "cases"), capture_engines(CAPTURES, [9]))
def test_the_captures_are_predicted_in_every_bit(capture, engine, cases):
    assert_replay_bit_exact(capture, engine, cases, kernel="flashinfer-mla", total=len(FLASHINFER_CASES),
                            stages=["plan", "work", "lse", "out"])


def test_the_capture_covers_the_calls():
    """SGLang's decode (page 1, causal off) and MTP verify steps (s_q 2 and 4, causal), 16 to 128 heads, 1 to 64
    requests, 1 to 30,000 keys, FlashInfer's pages of 64 and its E4M3 cache with per-tensor scales; one cluster
    of one CTA or of two; every launch repeatable and planned to FlashInfer's fa3 kernel."""
    with np.load(CAPTURE) as z:
        meta = json.loads(str(z["meta"]))
        plans = [z[f"c{i}_plan"] for i in range(len(meta["cases"]))]
    cases = meta["cases"]
    assert meta["device"] == "NVIDIA H100 80GB HBM3" and meta["flashinfer_version"] == "0.7.2"
    assert all(c["repeat_identical"] for c in cases)
    assert {c["page_size"] for c in cases} == {1, 64} and {c["kv_format"] for c in cases} == {"bf16", "e4m3"}
    assert {c["sq"] for c in cases} == {1, 2, 4} and {c["causal"] for c in cases} == {True, False}
    assert {int(p[0]) for p in plans} == {1, 2}  # the cluster size


#: the case a choice's other form is replayed on: an E4M3 cache whose requests split (every choice is on its path)
CHOICE_CASE = 9
BITES = ["fp32-partials", "ieee-exp2", "ieee-log2", "lane-sums-as-fa3", "lse-contracted", "merge-other-product-fused",
         "no-fma", "nope-first", "o-scale-as-fa3", "fp8-scale-not-rounded"]


@pytest.mark.parametrize("change", BITES)
def test_each_choice_matters_on_the_device(change, monkeypatch, fastest_engine):
    """With any one choice in its other form (FP32 split partials, IEEE exp2 or log2, FA3's row sums or o_scale,
    the LSE's add contracted, the merge's other product fused, no FMA, the nope columns first, the FP8 scale not
    rounded to BF16), the replay parts from the device; the model as it is does not (the first test)."""
    if change == "fp8-scale-not-rounded":
        monkeypatch.setattr(mla, "_dequant", lambda mc, kv, c, k, arr: mc.cast(np.concatenate(
            [mc.f(kv)[:, :512] * mc.f(c), mc.f(kv)[:, 512:] * mc.f(k)], axis=1), "bf16"))
    elif isinstance(CHOICES[change], dict):
        units = CHOICES[change]
        monkeypatch.setattr(mla, "get_machine", lambda m: get_machine("sm90-cuda", **units))
    else:
        monkeypatch.setattr(*CHOICES[change])
    report = replay(CAPTURE, cases=[CHOICE_CASE])
    assert report.cases[0].first_difference is not None, report.format()
