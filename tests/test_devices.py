"""The H100 gives the H200's bits: the captures replayed by the other tests stand for both GPUs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def h100():
    return json.loads((DATA / "h100_record.json").read_text())


@pytest.mark.parametrize("capture", ["triton_dot.npz", "fidelity_ci.npz", "ex2_edges.npz", "div_edges.npz"])
def test_h100_capture_is_the_h200_capture_byte_for_byte(h100, capture):
    """The same script on an H100 wrote files identical to the committed H200 ones (sha256 recorded there)."""
    assert json.loads((DATA / "device.json").read_text())["device"] == "NVIDIA H200"
    assert h100["device"]["device"].startswith("NVIDIA H100") and h100["device"]["capability"] == [9, 0]
    assert hashlib.sha256((DATA / capture).read_bytes()).hexdigest() == h100["sha256"][capture]


def test_h100_fidelity_rows(h100):
    """The H100's 72 fidelity runs (4 kernels x 2 exp modes x 9 shapes, G = 128): 100% of output bits, the
    hardware exp and division included (their MUFU tables are the H200's: ex2_edges and div_edges hold both)."""
    rows = h100["fidelity_rows"]
    assert len(rows) == 72 and {r["algorithm"] for r in rows} == {"base", "amla", "snapmla", "etap"}
    assert {r["exp_mode"] for r in rows} == {"poly", "hw"}
    assert all(r["output_bit_exact"] == 1.0 for r in rows)
