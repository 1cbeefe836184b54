"""Elementwise ops: exact paths against Fractions and Decimal, hardware models against H200 captures."""

import decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _oracles import to_fp32
from amla_sim.arith import elementwise as ew
from amla_sim.formats import round_to
from amla_sim.testing import assert_bitwise_equal, float_arrays, ulp_distance

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def cap():
    return np.load(DATA / "triton_exp_div.npz")


def _nearest_fp32_to(exact: decimal.Decimal) -> np.float32:
    """The FP32 nearest to a high-precision Decimal (its neighbours decided in Fractions)."""
    v = Fraction(exact)
    return np.float32(to_fp32(v))


@given(x=float_arrays("fp32", (), min_value=-87.0, max_value=88.0))
def test_exp_correctly_rounded_against_decimal(x):
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        want = _nearest_fp32_to(decimal.Decimal(float(x)).exp())
    assert_bitwise_equal(ew.exp(x), np.float32(want))


@given(x=float_arrays("fp32", (), min_value=-126.0, max_value=127.0))
def test_exp2_correctly_rounded_against_decimal(x):
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        want = _nearest_fp32_to((decimal.Decimal(float(x)) * decimal.Decimal(2).ln()).exp())
    assert_bitwise_equal(ew.exp2(x), np.float32(want))


@given(data=st.data())
def test_fma_and_ieee_division_against_fractions(data):
    a, b, c = (data.draw(float_arrays("fp32", (), min_value=-1e30, max_value=1e30)) for _ in range(3))
    assert ew.fma(a, b, c) == np.float32(to_fp32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))))
    if b != 0:
        assert ew.div(a, b) == np.float32(to_fp32(Fraction(float(a)) / Fraction(float(b))))


def test_fma_round_to_odd_case():
    """(1 - 2^-24)(1 + 2^-23) + (2^-47 + 2^-60) = 1 + 2^-24 + 2^-60: a float64 sum would round onto the FP32
    midpoint 1 + 2^-24 and then to even (1.0); the exact FMA rounds up."""
    a, b, c = np.float32(1 - 2.0**-24), np.float32(1 + 2.0**-23), np.float32(2.0**-47 + 2.0**-60)
    assert np.float32(float(a) * float(b) + float(c)) == np.float32(1.0)  # the double rounding
    assert ew.fma(a, b, c) == np.float32(1 + 2.0**-23)


# --- hardware paths against the H200 captures -------------------------------------------------------------


def test_triton_div_rn_is_ieee(cap):
    assert_bitwise_equal(ew.div(cap["div_a"], cap["div_b"]), cap["div_rn_y"])


def test_triton_mul_add_is_fused(cap):
    assert_bitwise_equal(ew.fma(cap["div_a"], cap["div_b"], cap["fma_c"]), cap["mul_add_y"])


def _agreement(model, device):
    ok = model.view(np.uint32) == device.view(np.uint32)
    return float(ok.mean()), int(np.abs(ulp_distance(model, device)).max())


def test_div_full_model_agreement_as_documented(cap):
    frac, max_ulp = _agreement(ew.div(cap["div_a"], cap["div_b"], mode="sm90"), cap["div_full_y"])
    assert frac == pytest.approx(0.877, abs=0.005) and max_ulp <= 2
    frac_ieee, _ = _agreement(ew.div(cap["div_a"], cap["div_b"]), cap["div_full_y"])
    assert frac > frac_ieee  # the model beats IEEE division


def test_exp2_model_agreement_on_every_fp32_in_1_2():
    diff = np.load(DATA / "triton_exp2_unit.npz")["ulp_diff"].astype(np.int64)
    x = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
    model = ew.exp2(x, mode="sm90")
    cr = ew.exp2(x)
    assert_bitwise_equal(model, cr)  # on [1, 2) the model is the correctly rounded value
    assert np.mean(diff == 0) == pytest.approx(0.611, abs=0.001)
    assert set(np.unique(diff)) == {-1, 0, 1}
    assert np.mean(diff[diff != 0] == 1) > 0.999  # the device errs upward


def test_exp2_and_exp_model_agreement_on_random_inputs(cap):
    frac2, _ = _agreement(ew.exp2(cap["exp2_x"], mode="sm90"), cap["exp2_y"])
    assert frac2 == pytest.approx(0.510, abs=0.005)
    frac, max_ulp = _agreement(ew.exp(cap["exp_x"], mode="sm90"), cap["exp_y"])
    cr_frac, _ = _agreement(ew.exp(cap["exp_x"]), cap["exp_y"])
    assert frac > 2 * cr_frac  # modelling the fl32(x * log2 e) product is what matters for tl.exp
    assert frac == pytest.approx(0.404, abs=0.005) and max_ulp <= 2  # correctly rounded exp: 10.7%, 62 ulp


def test_exp2_ftz(cap):
    y = ew.exp2(np.float32([-130.0, -126.0, 1e-40, -1e-40]), mode="sm90")
    assert_bitwise_equal(y, np.float32([0.0, 2.0**-126, 1.0, 1.0]))
    x, dev = cap["exp2_x"], cap["exp2_y"]
    tiny = x < -126
    assert (dev[tiny] == 0).all() and (ew.exp2(x[tiny], mode="sm90") == 0).all()


def test_recorded_values_substitute_for_the_model():
    diff = np.load(DATA / "triton_exp2_unit.npz")["ulp_diff"].astype(np.int64)
    x = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)[::97]
    dev = (ew.exp2(x).view(np.int32) + diff[::97]).astype(np.int32).view(np.float32)
    rec = ew.Recorded(x, dev)
    q = np.concatenate([x[:1000], np.float32([0.5, 3.0])])
    got = rec(q, lambda v: ew.exp2(v, mode="sm90"))
    assert_bitwise_equal(got[:1000], dev[:1000])
    assert_bitwise_equal(got[1000:], np.float32([2.0**0.5, 8.0]))
    assert rec.coverage(q) == pytest.approx(1000 / 1002)


def test_conversions_match_triton():
    z = np.load(DATA / "triton_cvt.npz")
    x = z["cvt_x"]
    for fmt, overflow in [("e4m3", "satfinite"), ("e5m2", "satfinite"), ("bf16", "ieee"), ("fp16", "ieee")]:
        got = round_to(x, fmt, overflow=overflow)
        dev = z[f"cvt_{fmt}"].view(got.dtype)
        nan = np.isnan(dev.astype(np.float64))
        assert np.array_equal(nan, np.isnan(got.astype(np.float64))), fmt
        assert_bitwise_equal(got[~nan], dev[~nan], err_msg=fmt)


@pytest.mark.parametrize("fn", [ew.exp, ew.exp2])
def test_bad_mode_and_input(fn):
    with pytest.raises(ValueError, match="mode"):
        fn(np.float32([1.0]), mode="fast")
    with pytest.raises(TypeError, match="x"):
        fn(np.arange(3))
    with pytest.raises(ValueError, match="x"):
        fn(np.float64([0.1]))
