"""The user-facing testing helpers."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

from amla_sim.formats import FORMATS, get_format
from amla_sim.testing import assert_bitwise_equal, bits_of, float_arrays, ulp_distance


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_ulp_distance_counts_codes(dtype):
    f = get_format(dtype)
    one = np.array(1.0).astype(dtype)
    nxt = (bits_of(one) + 1).view(f.dtype)
    assert int(ulp_distance(one, nxt)) == 1
    assert int(ulp_distance(np.array(-0.0).astype(dtype), np.array(0.0).astype(dtype))) == 0
    tiny = np.array(1, dtype=f.uint_dtype).view(f.dtype)
    neg_tiny = np.array(1 | (1 << (8 * f.dtype.itemsize - 1)), dtype=f.uint_dtype).view(f.dtype)
    assert int(ulp_distance(tiny, neg_tiny)) == 2
    assert int(ulp_distance(one, np.array(np.nan).astype(dtype))) == -1


def test_ulp_distance_requires_same_dtype():
    with pytest.raises(TypeError, match="dtypes"):
        ulp_distance(np.float32(1), np.float64(1))


def test_assert_bitwise_equal_message_has_values_and_hex():
    with pytest.raises(AssertionError) as e:
        assert_bitwise_equal(np.float32([1, 2, 3]), np.float32([1, 2.0000002, 3]), err_msg="ctx")
    msg = str(e.value)
    assert "ctx" in msg and "1 / 3" in msg and "0x40000000" in msg and "0x40000001" in msg and "1 ulp" in msg
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise_equal(np.float32([1]), np.float64([1]))
    with pytest.raises(AssertionError, match="shape"):
        assert_bitwise_equal(np.float32([1]), np.float32([1, 1]))
    with pytest.raises(AssertionError):  # +0 and -0 differ in bits
        assert_bitwise_equal(np.float32(0.0), np.float32(-0.0))
    assert_bitwise_equal(np.float32([np.nan]), np.float32([np.nan]))


@pytest.mark.parametrize("name", sorted(FORMATS))
@given(data=__import__("hypothesis").strategies.data())
@settings(max_examples=30)
def test_float_arrays_respect_classes(name, data):
    f = FORMATS[name]
    x = data.draw(float_arrays(name, (3, 2), allow_subnormal=False))
    assert x.shape == (3, 2) and x.dtype == f.dtype
    xd = x.astype(np.float64)
    assert np.isfinite(xd).all()
    assert ((xd == 0) | (np.abs(xd) >= f.min_normal)).all()
    if name == "tf32":
        assert (bits_of(x) & 0x1FFF == 0).all()
    y = data.draw(float_arrays(name, 4, min_value=-2.0, max_value=3.0))
    assert (y.astype(np.float64) >= -2).all() and (y.astype(np.float64) <= 3).all()


def test_flashmla_check_holds_every_element_and_the_cosine():
    from amla_sim.testing import flashmla_check

    ref = np.linspace(-1, 1, 1001)
    assert flashmla_check(ref + 5e-4, ref)["ok"]
    bad = ref.copy()
    bad[500] += 0.5  # one element far off (ref is 0 there): fails elementwise though the cosine barely moves
    c = flashmla_check(bad, ref)
    assert not c["ok"] and c["elements_passing"] == 1000 / 1001


def test_snapmla_check_bounds():
    from amla_sim.testing import snapmla_check

    ref = np.linspace(1, 2, 100)
    assert snapmla_check(ref * 1.01, ref)["ok"]
    assert not snapmla_check(ref * 1.2, ref)["ok"]
