"""What the comparing commands report: a difference on the scale a reader judges it by (ULPs of the row's largest
|value| beside the count of values between), and NaN never reported as agreement or given a ULP distance."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from amla_sim import compare
from amla_sim.cli import main
from amla_sim.testing import row_ulp_distance

BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("a, b, want", [
    # BF16 keeps 7 fraction bits: an ULP of 1.0 is 2^-7, of 3.0 is 2^-6; the row's largest |value| sets the scale
    ([[1.0, 2 ** -20]], [[1.0 + 2 ** -7, -(2 ** -20)]], [[1.0, 2 ** -19 / 2 ** -7]]),
    ([[3.0, 0.0]], [[3.0, 2 ** -6]], [[0.0, 1.0]]),
    ([[0.0, 0.0]], [[0.0, 2 ** -133]], [[0.0, 1.0]]),  # an all-tiny row: the smallest subnormal is its ULP
    ([[1.0, np.nan, np.inf]], [[1.0, 1.0, 1.0]], [[0.0, np.nan, np.nan]]),  # NaN and infinity have no distance
    ([[2.0], [4.0]], [[2.0 + 2 ** -6], [4.0 + 2 ** -5]], [[1.0], [1.0]]),  # each row its own scale
])
def test_row_ulp_distance_is_in_ulps_of_the_rows_largest_value(a, b, want):
    got = row_ulp_distance(np.array(a, BF16), np.array(b, BF16))
    np.testing.assert_array_equal(got, np.array(want))


def test_compare_reports_the_row_scale_and_nan_in_both():
    a = np.array([[1.0, 2 ** -20, np.nan]], BF16)
    b = np.array([[1.0 + 2 ** -7, -(2 ** -20), np.nan]], BF16)
    s = compare({"out": a}, {"out": b})["out"]
    assert (s.max_row_ulp, s.nan_both, s.identical) == (1.0, 1, 1)
    assert s.max_ulp > 10_000  # the values between 2^-20 and -2^-20: many, and nothing a reader would weigh
    text = compare({"out": a}, {"out": a}).format()
    assert "row ulp" in text and "nan= 1" in text and "1 element NaN on both sides" in text


def _run(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().out


@pytest.mark.parametrize("argv, code, says, never", [
    (["invariance", "--kernel", "flashinfer-mla", "--dist", "normal:1e30", "--length", "300", "--heads", "8",
      "--batchmates", "1", "--mixed", "0"], 4, "verdict: not answered: the request's out holds 4096 NaN of 4096",
     "batch-invariant"),
    (["prefill-decode", "--stack", "vllm-flashmla-sparse", "--dist", "normal:1e30", "--length", "8", "--heads",
      "2", "--topk", "128", "--tokens", "7"], 4, "0 of 1 tokens bit-identical between prefill and decode; 1 more",
     "1 of 1 tokens"),
    (["prefill-decode", "--stack", "sglang-dsa", "--dist", "normal:1e30", "--length", "8", "--heads", "2",
      "--topk", "128", "--tokens", "7"], 3, "NaN against a number", "max 0 ULP),"),
    (["diff", "--kernel", "flashinfer-mla", "--kernel", "flashinfer-mla:num_sms=66", "--dist", "normal:1e30",
      "--length", "300", "--heads", "8"], 4, "NaN against NaN is no answer", "nothing to explain"),
])
def test_nan_is_never_reported_as_agreement(argv, code, says, never, capsys):
    got, out = _run(argv, capsys)
    assert got == code and says in out and never not in out, out


@pytest.mark.parametrize("argv, says", [
    (["prefill-decode", "--stack", "sglang-dsa", "--length", "8", "--heads", "2", "--topk", "128", "--tokens",
      "7"], "ULP of the row's largest |value|"),
    (["diff", "--kernel", "flashinfer-mla", "--kernel", "flashmla", "--length", "300", "--heads", "8"],
     "ulp of the row's largest |value|"),
    (["invariance", "--kernel", "flashinfer-mla", "--length", "300", "--heads", "8", "--batchmates", "1",
      "--mixed", "0"], "row ulp"),
])
def test_every_comparing_command_gives_the_row_scale(argv, says, capsys):
    _, out = _run(argv, capsys)
    assert says in out, out


@pytest.mark.parametrize("a, b", [(np.zeros(3, BF16), np.zeros(3, np.float32)), (np.zeros(3, BF16), np.zeros(4, BF16))])
def test_row_ulp_distance_names_its_arguments(a, b):
    with pytest.raises(TypeError, match="^actual and desired: expected one dtype and shape"):
        row_ulp_distance(a, b)
