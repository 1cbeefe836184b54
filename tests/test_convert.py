"""Conversions as sm90's ``cvt`` writes them (``amla_sim.arith.convert``): every NaN canonical, E4M3 saturated; the
device captures that show it are the DeepGEMM / FlashInfer and vLLM FP8 quantizer tests'."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from amla_sim.arith.convert import canonical_nan, cvt_e4m3_satfinite
from amla_sim.formats import round_to


def test_e4m3_saturates_and_writes_one_nan():
    x = np.array([500.0, -1e30, np.inf, -np.inf, 1.0625, -0.0, np.nan, -np.nan], np.float32)
    x[7] = np.uint32(0xFFC01234).view(np.float32)  # a NaN of sign and payload
    got = cvt_e4m3_satfinite(x).view(np.uint8)
    assert got.tolist() == [0x7E, 0xFE, 0x7E, 0xFE, round_to(np.float32(1.0625), "e4m3").view(np.uint8), 0x80,
                            0x7F, 0x7F]


@pytest.mark.parametrize(("dtype", "nan"), [(ml_dtypes.bfloat16, 0x7FFF), (ml_dtypes.float8_e4m3fn, 0x7F)])
def test_canonical_nan_keeps_numbers_and_rewrites_nans(dtype, nan):
    x = np.array([1.5, -2.0, np.nan, 0.0], np.float32).astype(dtype)
    bits = x.view(np.uint16 if dtype is ml_dtypes.bfloat16 else np.uint8).copy()
    bits[2] |= 0x80 if dtype is ml_dtypes.float8_e4m3fn else 0x8000  # a negative NaN
    got = canonical_nan(bits.view(dtype)).view(bits.dtype)
    assert got[2] == nan and np.array_equal(np.delete(got, 2), np.delete(bits, 2))
