"""MUFU.TANH (``tanh.approx.f32``) against what an H200 gave in a probe of its own (``scripts/probe_tanh.py``, an
earlier run than the dump the table was built from): per binade, the range of its distance from the correctly
rounded tanh and whether it is constant over blocks of 16 inputs, on every FP32 of the binade; oddness; and the
edges the probe's dump measured."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from amla_sim.arith.tanh import tanh_approx

SUMMARY = json.loads((Path(__file__).parent / "data" / "mufu_tanh_h200.json").read_text())
FRAC = np.arange(1 << 23, dtype=np.uint32)


def _binade(e: int) -> np.ndarray:
    return (FRAC | np.uint32((127 + e) << 23)).view(np.float32)


@pytest.mark.parametrize("e", [-13, -9, -8, -6, -3, -1, 0, 1, 2, 3, 4])
def test_each_binade_is_the_devices(e):
    """The model's distance in ULPs from the correctly rounded tanh spans exactly the device's range over every FP32
    of binade 2^e, and is constant over blocks of 16 exactly where the device's is."""
    x = _binade(e)
    y = tanh_approx(x)
    exact = np.tanh(x.astype(np.float64)).astype(np.float32).view(np.int32).astype(np.int64)
    ulps = y.view(np.int32).astype(np.int64) - exact
    want = SUMMARY[str(e)]
    assert [int(ulps.min()), int(ulps.max())] == want["ulps"]
    blocks = y.view(np.uint32).reshape(-1, 16)
    assert bool((blocks == blocks[:, :1]).all()) == want["constant_over_16"]


@pytest.mark.parametrize("e", [-12, -5, 0, 2])
def test_it_is_odd(e):
    x = _binade(e)[::97]
    assert np.array_equal(tanh_approx(-x).view(np.uint32), tanh_approx(x).view(np.uint32) ^ np.uint32(1 << 31))


@pytest.mark.parametrize(("x", "y"), [
    (0x00000000, 0x00000000), (0x80000000, 0x80000000), (0x00000001, 0x00000001), (0x007FFFFF, 0x007FFFFF),
    (0x00800000, 0x00800000), (0x3B7FFFFF, 0x3B7FFFFF), (0x3B800000, 0x3B800000), (0x7F800000, 0x3F800000),
    (0xFF800000, 0xBF800000), (0x7F7FFFFF, 0x3F800000), (0x41000000, 0x3F800000), (0x7FC00000, 0x7FFFFFFF),
    (0x7FC00001, 0x7FFFFFFF), (0x7F800001, 0x7FFFFFFF), (0xFFC00000, 0x7FFFFFFF),
], ids=lambda v: f"{v:#010x}")
def test_the_edges_are_the_devices(x, y):
    """Zeros, subnormals and everything under 2^-8 come back as they are; from 8 up (infinities too) +-1; a NaN
    the canonical 0x7FFFFFFF (the probe's dump)."""
    got = tanh_approx(np.array([x], np.uint32).view(np.float32)).view(np.uint32)[0]
    assert got == y, f"{got:#x}"


def test_shapes_and_scalars():
    x = np.linspace(-10, 10, 24, dtype=np.float32).reshape(2, 3, 4)
    assert tanh_approx(x).shape == (2, 3, 4) and tanh_approx(x).dtype == np.float32
    assert tanh_approx(np.float32(0.5)).shape == ()


@pytest.mark.parametrize(("x", "err"), [
    (np.array([1.0 + 2.0**-30]), ValueError), (np.array(["a"]), TypeError), (np.array([1, 2]), TypeError),
], ids=["not-fp32", "strings", "ints"])
def test_inputs_that_are_not_fp32_values_are_refused_by_name(x, err):
    with pytest.raises(err, match="^x: "):
        tanh_approx(x)
