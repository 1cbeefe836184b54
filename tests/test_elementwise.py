"""Elementwise ops: exact paths against Fractions and Decimal, hardware models against H200 captures."""

import decimal
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _oracles import round_fraction, to_fp32
from amla_sim.arith import elementwise as ew
from amla_sim.engine import numba_available, use_engine
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


@pytest.mark.parametrize("engine_name", ["numpy", pytest.param("numba", marks=pytest.mark.skipif(
    not numba_available(), reason="numba is not installed (the [fast] extra)"))])
@given(data=st.data())
def test_fma_and_ieee_division_against_fractions(engine_name, data):
    a, b, c = (data.draw(float_arrays("fp32", (), min_value=-1e30, max_value=1e30)) for _ in range(3))
    with use_engine(engine_name):
        assert ew.fma(a, b, c) == np.float32(to_fp32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))))
    if b != 0:
        assert ew.div(a, b) == np.float32(to_fp32(Fraction(float(a)) / Fraction(float(b))))


@given(data=st.data())
def test_bf16_fma_against_fractions(data):
    """``fma.rn.bf16``: the exact a b + c of BF16 values rounded once to BF16 (an independent Fraction rounding)."""
    a, b, c = (data.draw(float_arrays("bf16", (), min_value=-1e30, max_value=1e30)) for _ in range(3))
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    want = round_fraction(exact, 7, -126, 127)
    got = ew.fma_bf16(a, b, c)
    assert got.dtype == ml_dtypes.bfloat16 and np.float32(got).tobytes() == np.float32(want).tobytes()


def test_bf16_fma_round_to_odd_case():
    """(17/16)^2 + 2^-80 = 1 + 33/256 + 2^-80: float64 drops the 2^-80 and leaves the BF16 midpoint 1 + 33/256,
    which would round to even (1 + 32/256); the exact sum rounds up."""
    a, c = np.float32(17 / 16), np.float32(2.0**-80)
    assert round_to(np.float64(a) * np.float64(a) + np.float64(c), "bf16") == np.float32(1 + 32 / 256)
    assert ew.fma_bf16(a, a, c) == np.float32(1 + 34 / 256)


def test_fma_round_to_odd_case(engine):
    """(1 - 2^-24)(1 + 2^-23) + (2^-47 + 2^-60) = 1 + 2^-24 + 2^-60: a float64 sum would round onto the FP32
    midpoint 1 + 2^-24 and then to even (1.0); the exact FMA rounds up."""
    a, b, c = np.float32(1 - 2.0**-24), np.float32(1 + 2.0**-23), np.float32(2.0**-47 + 2.0**-60)
    assert np.float32(float(a) * float(b) + float(c)) == np.float32(1.0)  # the double rounding
    assert ew.fma(a, b, c) == np.float32(1 + 2.0**-23)


# --- hardware paths against the H200 captures -------------------------------------------------------------


def test_triton_div_rn_is_ieee(cap):
    assert_bitwise_equal(ew.div(cap["div_a"], cap["div_b"]), cap["div_rn_y"])


def test_triton_mul_add_is_fused(cap, engine):
    assert_bitwise_equal(ew.fma(cap["div_a"], cap["div_b"], cap["fma_c"]), cap["mul_add_y"])


def _agreement(model, device):
    ok = model.view(np.uint32) == device.view(np.uint32)
    return float(ok.mean()), int(np.abs(ulp_distance(model, device)).max())


def _unit(pattern: int) -> np.ndarray:
    return (np.arange(1 << 23, dtype=np.uint32) | np.uint32(pattern)).view(np.float32)


def test_div_full_is_bit_exact_on_random_inputs(cap):
    assert_bitwise_equal(ew.div(cap["div_a"], cap["div_b"], mode="sm90"), cap["div_full_y"])
    ieee, _ = _agreement(ew.div(cap["div_a"], cap["div_b"]), cap["div_full_y"])
    assert ieee == pytest.approx(0.714, abs=0.005)  # what IEEE division would reach


def test_div_full_and_rcp_are_bit_exact_at_the_edges():
    """Zeros, subnormals, both ends of the range, infinities and NaN, as dividend, divisor and reciprocal."""
    z = np.load(DATA / "div_edges.npz")
    assert_bitwise_equal(ew.div(z["a"], z["b"], mode="sm90"), z["div"])
    assert_bitwise_equal(ew.rcp_approx(z["rcp_x"]), z["rcp"])
    huge, tiny = np.abs(z["b"]) > 2.0**126, (np.abs(z["b"]) < 2.0**-126) & (z["b"] != 0)
    assert huge.sum() > 1000 and tiny.sum() > 1000  # both scaled ranges are exercised


def test_rcp_is_bit_exact_on_every_fp32_in_1_2():
    """The capture the table was built from: a check of the table and its indexing, both signs."""
    x = _unit(0x3F800000)
    diff = np.load(DATA / "div_edges.npz")["unit_diff"].astype(np.int32)
    device = ((1.0 / x.astype(np.float64)).astype(np.float32).view(np.int32) + diff).view(np.float32)
    assert_bitwise_equal(ew.rcp_approx(x), device)
    assert_bitwise_equal(ew.rcp_approx(-x), -device)


def test_exp2_is_bit_exact_on_every_fp32_in_1_2_and_in_minus_2_minus_1(engine):
    """[1, 2) is the capture the core table was built from (a check of the table and its indexing); (-2, -1] was
    captured separately and exercises the complemented fraction of negative arguments."""
    for pattern, diff in ((0x3F800000, np.load(DATA / "triton_exp2_unit.npz")["ulp_diff"]),
                          (0xBF800000, np.load(DATA / "ex2_edges.npz")["neg_unit_diff"])):
        x = _unit(pattern)
        device = (ew.exp2(x).view(np.int32) + diff.astype(np.int32)).view(np.float32)
        assert_bitwise_equal(ew.exp2(x, mode="sm90"), device, err_msg=f"x = {x[0]} ... {x[-1]}")


def test_the_device_exp2_is_not_correctly_rounded():
    diff = np.load(DATA / "triton_exp2_unit.npz")["ulp_diff"].astype(np.int64)
    assert np.mean(diff == 0) == pytest.approx(0.611, abs=0.001)
    assert set(np.unique(diff)) == {-1, 0, 1}
    assert np.mean(diff[diff != 0] == 1) > 0.999  # the device errs upward on [1, 2)


def test_exp2_and_exp_are_bit_exact_on_random_inputs(cap, engine):
    assert_bitwise_equal(ew.exp2(cap["exp2_x"], mode="sm90"), cap["exp2_y"])
    assert_bitwise_equal(ew.exp(cap["exp_x"], mode="sm90"), cap["exp_y"])
    cr = ew.exp2(cap["exp2_x"])
    cr_frac, _ = _agreement(np.where(cr < 2.0**-126, np.float32(0), cr), cap["exp2_y"])
    assert cr_frac == pytest.approx(0.510, abs=0.005)  # what a correctly rounded 2^x (flushed) would reach


@pytest.mark.parametrize("op", ["exp2", "exp"])
def test_exp2_and_exp_are_bit_exact_on_edge_inputs(op, engine):
    """Zeros, subnormals, tiny normals (bits below 2^-23), integers, -150 / -126 / 128 neighbourhoods, inf, NaN."""
    z = np.load(DATA / "ex2_edges.npz")
    got = getattr(ew, op)(z["x"], mode="sm90")
    assert_bitwise_equal(got, z[op])
    if op == "exp2":
        tiny_negative = (z["x"] < 0) & (z["x"] > -(2.0**-23))
        assert (got[tiny_negative] == 1).all() and tiny_negative.sum() > 100  # truncated to 0, not complemented


def test_exp2_ftz(cap, engine):
    y = ew.exp2(np.float32([-130.0, -126.0, 1e-40, -1e-40]), mode="sm90")
    assert_bitwise_equal(y, np.float32([0.0, 2.0**-126, 1.0, 1.0]))
    x, dev = cap["exp2_x"], cap["exp2_y"]
    tiny = x < -126
    assert (dev[tiny] == 0).all() and (ew.exp2(x[tiny], mode="sm90") == 0).all()


def test_exp_reaches_subnormal_results_by_squaring_the_half(cap, engine):
    """tl.exp's subnormal results match fl32(EX2(x/2)^2); scaling EX2(x + 24) by 2^-24 instead misses some."""
    t = (cap["exp_x"] * ew.LOG2E_F32).astype(np.float32)
    deep = (t < -126) & (cap["exp_y"] > 0)
    assert deep.sum() > 300
    assert_bitwise_equal(ew.ex2_approx(t[deep]), cap["exp_y"][deep])
    with np.errstate(under="ignore"):
        shifted = (ew.ex2_approx(t[deep] + np.float32(24)).astype(np.float64) * 2.0**-24).astype(np.float32)
    assert (shifted != cap["exp_y"][deep]).sum() >= 8


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
