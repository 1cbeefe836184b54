"""Lemma 3.1 and Appendix A: properties in the domain, pinned behaviour outside it, the compensation analysis."""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from amla_sim.bits import (
    as_float,
    as_int,
    compensation_error,
    exponent_field,
    int_add,
    count_outside_lemma_domain,
    lemma_domain,
    mul_one_plus_eps_via_int_add,
    mul_pow2_via_int_add,
    optimal_compensation_coefficient,
)
from amla_sim.formats import get_format
from amla_sim.testing import assert_bitwise_equal, bits_of, float_arrays

LEMMA_FORMATS = ["fp32", "fp16", "bf16", "fp64"]


@pytest.mark.parametrize("name, itype", [("fp64", np.int64), ("fp32", np.int32), ("fp16", np.int16), ("bf16", np.int16)])
def test_as_int_as_float_round_trip(name, itype):
    f = get_format(name)
    x = np.array([0.5, -0.0, 3.25, np.inf]).astype(f.dtype)
    i = as_int(x)
    assert i.dtype == itype
    assert_bitwise_equal(as_float(i, name), x)


def test_fig3_half_is_126_times_2_pow_23():
    assert int(as_int(np.float32(0.5))) == 126 * 2**23 == 0b00111111000000000000000000000000


@st.composite
def in_domain(draw, name):
    f = get_format(name)
    x = draw(float_arrays(name, (), allow_subnormal=False))
    e = int(exponent_field(x))
    if e == 0:  # zero: nudge to the smallest normal of its sign
        x = np.array(math.copysign(f.min_normal, float(x.astype(np.float64)))).astype(f.dtype)
        e = 1
    top = (1 << f.exponent_bits) - 1
    n = draw(st.integers(1 - e, top - 1 - e))
    return x, n


@pytest.mark.parametrize("name", LEMMA_FORMATS)
@given(data=st.data())
def test_lemma_3_1_in_domain_is_exact_scaling(name, data):
    x, n = data.draw(in_domain(name))
    assert lemma_domain(x, n)
    f = get_format(name)
    want = np.ldexp(x.astype(np.float64), n).astype(f.dtype)  # exact: the result is a normal number of f
    assert_bitwise_equal(mul_pow2_via_int_add(x, n), want, err_msg=f"x={x!r}, n={n}")


@pytest.mark.parametrize("name", LEMMA_FORMATS)
@given(data=st.data())
def test_int_add_is_twos_complement_wraparound(name, data):
    """Everywhere, in or out of the domain: bits + n * 2^m modulo 2^width, computed with Python ints."""
    f = get_format(name)
    x = data.draw(float_arrays(name, (4,), allow_nan=True, allow_infinity=True))
    n = data.draw(st.integers(-(1 << 40), 1 << 40))
    width = 8 * f.dtype.itemsize
    want = [(int(b) + n * (1 << f.mantissa_bits)) % (1 << width) for b in bits_of(x)]
    assert bits_of(mul_pow2_via_int_add(x, n)).tolist() == want


@pytest.mark.parametrize("name", LEMMA_FORMATS)
@given(data=st.data())
def test_lemma_domain_definition(name, data):
    f = get_format(name)
    x = data.draw(float_arrays(name, (8,), allow_nan=True, allow_infinity=True))
    n = data.draw(st.integers(-300, 300))
    top = (1 << f.exponent_bits) - 1
    e = [(int(b) >> f.mantissa_bits) & top for b in bits_of(x)]
    assert lemma_domain(x, n).tolist() == [0 < ei < top and 0 < ei + n < top for ei in e]


@pytest.mark.parametrize("name", LEMMA_FORMATS)
@given(data=st.data())
def test_count_outside_lemma_domain_counts_the_mask(name, data):
    f = get_format(name)
    x = data.draw(float_arrays(name, (3, 5), allow_nan=True, allow_infinity=True))
    n = np.array([[data.draw(st.integers(-40, 40))] for _ in range(3)])
    top = (1 << f.exponent_bits) - 1
    want = sum(not (0 < (int(b) >> f.mantissa_bits) & top < top and 0 < ((int(b) >> f.mantissa_bits) & top) + int(k) < top)
               for row, k in zip(bits_of(x).reshape(3, 5), n[:, 0], strict=True) for b in row)
    assert count_outside_lemma_domain(x, n) == want == int((~lemma_domain(x, n)).sum())


@pytest.mark.parametrize(
    "x_bits, n, want_bits, what",
    [
        (0x00000000, -3, 0xFE800000, "+0 * 2^-3 wraps through the sign bit to -2^126"),
        (0x80000000, -3, 0x7E800000, "-0 * 2^-3 borrows out of the sign bit to +2^126"),
        (0x00000000, 3, 0x01800000, "+0 * 2^3 becomes 2^-124"),
        (0x00000003, 1, 0x00800003, "subnormal 3 * 2^-149 times 2 becomes 2^-126 + 3 * 2^-149, not 6 * 2^-149"),
        (0x03800000, -10, 0xFE800000, "2^-120 * 2^-10: exponent underflow wraps to -2^126"),
        (0x71800000, 28, 0x7F800000, "2^100 * 2^28: E + n = 255 with zero mantissa is +Inf"),
        (0x71A00000, 28, 0x7FA00000, "1.25 * 2^100 * 2^28: E + n = 255 with a mantissa is NaN"),
        (0x71A00000, 40, 0x85A00000, "1.25 * 2^100 * 2^40: exponent overflow carries into the sign: -1.25 * 2^-116"),
        (0x7F800000, -1, 0x7F000000, "+Inf * 2^-1 becomes 2^127"),
    ],
)
def test_out_of_domain_fp32_is_pinned(x_bits, n, want_bits, what):
    x = np.array(x_bits, dtype=np.uint32).view(np.float32)
    assert not lemma_domain(x, n)
    got = mul_pow2_via_int_add(x, n)
    assert int(bits_of(got)) == want_bits, what


def test_mul_pow2_broadcasts_and_checks():
    x = np.float32([[1.0], [2.0]])
    got = mul_pow2_via_int_add(x, np.array([0, 1, -1]))
    assert_bitwise_equal(got, np.float32([[1, 2, 0.5], [2, 4, 1]]))
    with pytest.raises(TypeError, match="x"):
        mul_pow2_via_int_add(np.arange(3), 1)
    with pytest.raises(TypeError, match="n"):
        mul_pow2_via_int_add(np.float32([1.0]), 1.5)
    with pytest.raises(ValueError, match="x and k"):
        mul_pow2_via_int_add(np.float32([1.0, 2.0]), np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="x and n"):
        lemma_domain(np.float32([1.0, 2.0]), np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="fmt"):
        as_float(np.int16([1]))


def test_int_add_wraps_int32():
    x = np.array(0x7FFFFFFF, dtype=np.uint32).view(np.float32)  # NaN with all fraction bits
    assert int(bits_of(int_add(x, 1))) == 0x80000000  # -0.0


# --- Appendix A ------------------------------------------------------------------------------------------


def test_one_plus_eps_rounds_to_nearest_even():
    one = np.float32(1.0)
    # 1.5 * 2^23 * 1e-6 = 12.58: round gives 13 (truncation would give 12)
    assert int(as_int(mul_one_plus_eps_via_int_add(one, 1e-6))) == 0x3F800000 + 13
    # a tie: 2^23 * 2.5 * 2^-23 = 2.5 -> 2 (ties to even), 3.5 -> 4
    assert int(as_int(mul_one_plus_eps_via_int_add(one, 2.5 * 2.0**-23, coefficient=1.0))) == 0x3F800000 + 2
    assert int(as_int(mul_one_plus_eps_via_int_add(one, 3.5 * 2.0**-23, coefficient=1.0))) == 0x3F800000 + 4
    assert int(as_int(mul_one_plus_eps_via_int_add(np.float32(-1.0), -1e-6))) == int(as_int(np.float32(-1.0))) - 13


@pytest.mark.parametrize("m", [0, 1 << 21, 1 << 22, 3 << 21, (1 << 23) - 1])
@pytest.mark.parametrize("eps", [2.0**-9, -(2.0**-9), 3e-3, -1e-4])
def test_one_plus_eps_against_fractions(m, eps):
    """The exact relative error, from Fractions: coefficient * eps / (1 + f) - eps up to the integer rounding."""
    x = as_float(np.int32((127 << 23) | m))
    got = Fraction(float(mul_one_plus_eps_via_int_add(x, eps)))
    xf = Fraction(float(x))
    delta = round(Fraction(3, 2) * Fraction(eps) * 2**23)  # Python round: ties to even
    if m + delta >= (1 << 23):  # the carry moves into the next binade, where a unit is worth twice as much
        assert got == 2 * (1 + Fraction(m + delta - (1 << 23), 2**23))
        return
    if m + delta < 0:  # the borrow moves into the binade below, where a unit is worth half
        assert got == (1 + Fraction(m + delta + (1 << 23), 2**23)) / 2
        return
    assert got == xf + Fraction(delta, 2**23)
    err = float((got - xf * (1 + Fraction(eps))) / (xf * (1 + Fraction(eps))) / abs(Fraction(eps)))
    f = m / 2**23
    assert err == pytest.approx(math.copysign(1, eps) * (1.5 / (1 + f) - 1), abs=2e-3)


def test_compensation_error_of_the_papers_coefficient():
    r = compensation_error(1.5)
    # error / eps = 1.5 / (1 + f) - 1 for f = M / 2^23 in [0, 1): worst at f = 0
    assert r.worst == pytest.approx(0.5, abs=2e-3)
    assert r.mean == pytest.approx(1.5 * math.log(1.125), rel=1e-2)  # integral of |1.5 / (1 + f) - 1|
    assert r.mean_signed == pytest.approx(1.5 * math.log(2) - 1, abs=2e-3)  # integral of 1.5 / (1 + f) - 1


def test_compensation_error_notices_a_changed_coefficient():
    assert compensation_error(1.4).worst == pytest.approx(0.4, abs=2e-3)
    assert compensation_error(1.4).mean < compensation_error(1.5).mean


@pytest.mark.parametrize(
    "metric, want",
    [
        ("worst", 4 / 3),  # balances c - 1 against 1 - c / 2
        ("mean", math.sqrt(2)),  # the median condition: ln c = ln 2 - ln c
        ("bias", 1 / math.log(2)),  # c * ln 2 = 1
    ],
)
def test_optimal_coefficients(metric, want):
    assert optimal_compensation_coefficient(metric) == pytest.approx(want, abs=3e-3)


def test_compensation_bad_input():
    with pytest.raises(ValueError, match="eps"):
        compensation_error(1.5, eps=[0.0])
    with pytest.raises(ValueError, match="metric"):
        optimal_compensation_coefficient("median")
