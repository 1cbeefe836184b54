"""Formats and rounding against an independent integer oracle, ml_dtypes and NumPy casts."""

import ml_dtypes
import numpy as np
import pytest

from amla_sim.formats import FORMATS, get_format, round_significand, round_to
from amla_sim.testing import assert_bitwise_equal, bits_of

SMALL = ["fp16", "bf16", "e4m3", "e5m2"]
TARGETS = ["fp32", "tf32", "fp16", "bf16", "e4m3", "e5m2"]


def _widen(x: np.ndarray, to: type = np.float64) -> np.ndarray:
    """The test's own widening of every code of a format: NaN codes raise numpy's invalid flag, which is the point."""
    with np.errstate(invalid="ignore"):
        return x.astype(to)


def _all_codes(name):
    f = get_format(name)
    return np.arange(1 << (8 * f.dtype.itemsize), dtype=np.int64).astype(f.uint_dtype).view(f.dtype)


# --- the format table ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, bits, ebits, mbits, bias, max_finite, min_normal, min_sub, has_inf",
    [
        ("fp64", 64, 11, 52, 1023, np.finfo(np.float64).max, 2.0**-1022, 2.0**-1074, True),
        ("fp32", 32, 8, 23, 127, float.fromhex("0x1.fffffep127"), 2.0**-126, 2.0**-149, True),
        ("tf32", 19, 8, 10, 127, float.fromhex("0x1.ffcp127"), 2.0**-126, 2.0**-136, True),
        ("fp16", 16, 5, 10, 15, 65504.0, 2.0**-14, 2.0**-24, True),
        ("bf16", 16, 8, 7, 127, float.fromhex("0x1.fep127"), 2.0**-126, 2.0**-133, True),
        ("e4m3", 8, 4, 3, 7, 448.0, 2.0**-6, 2.0**-9, False),
        ("e5m2", 8, 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, True),
    ],
)
def test_format_table(name, bits, ebits, mbits, bias, max_finite, min_normal, min_sub, has_inf):
    f = FORMATS[name]
    assert (f.bits, f.exponent_bits, f.mantissa_bits, f.bias) == (bits, ebits, mbits, bias)
    assert (f.max_finite, f.min_normal, f.min_subnormal, f.has_inf) == (max_finite, min_normal, min_sub, has_inf)


def test_get_format_aliases_and_errors():
    assert get_format("float8_e4m3fn") is FORMATS["e4m3"]
    assert get_format(ml_dtypes.bfloat16) is FORMATS["bf16"]
    assert get_format(np.float32) is FORMATS["fp32"]
    with pytest.raises(ValueError, match="fmt"):
        get_format("fp7")
    with pytest.raises(ValueError, match="fmt"):
        get_format(np.int32)


# --- exhaustive round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("mode", ["nearest-even", "toward-zero", "stochastic"])
@pytest.mark.parametrize("via", [None, np.float32, np.float64])
def test_every_code_round_trips(name, mode, via):
    x = _all_codes(name)
    src = x if via is None else _widen(x, via)
    y = round_to(src, name, mode=mode, seed=0)
    nan = np.isnan(_widen(x))
    assert np.isnan(_widen(y[nan])).all()
    assert_bitwise_equal(y[~nan], x[~nan])


@pytest.mark.parametrize("name", SMALL)
def test_satfinite_round_trip_clamps_only_infinities(name):
    f = get_format(name)
    x = _all_codes(name)
    y = round_to(x, name, overflow="satfinite")
    xd = _widen(x)
    keep = np.isfinite(xd)
    assert_bitwise_equal(y[keep], x[keep])
    assert (y[np.isinf(xd)].astype(np.float64) == np.copysign(f.max_finite, xd[np.isinf(xd)])).all()


# --- the integer oracle ----------------------------------------------------------------------------------


def oracle_round_fp32(u32, fmt, mode, overflow, uniforms=None):
    """Round FP32 bit patterns to `fmt` with integer arithmetic on the significand (no float rounding)."""
    u = u32.astype(np.int64)
    sign = (u >> 31) & 1
    e_field = (u >> 23) & 0xFF
    frac = u & 0x7FFFFF
    is_special = e_field == 0xFF
    sig = np.where(e_field == 0, frac, frac | (1 << 23))
    exp2 = np.where(e_field == 0, -149, e_field - 150)  # value = sig * 2^exp2
    bitlen = (sig[:, None] >= (np.int64(1) << np.arange(25))[None, :]).sum(axis=1)
    top = exp2 + bitlen - 1  # floor(log2(value)) for value > 0
    qe = np.maximum(top, fmt.emin) - fmt.mantissa_bits
    shift = np.clip(qe - exp2, -64, 40)
    left = np.maximum(-shift, 0)
    right = np.maximum(shift, 0)
    q = np.where(shift <= 0, sig << np.minimum(left, 40), sig >> right)
    rem = np.where(shift <= 0, 0, sig & ((np.int64(1) << right) - 1))
    half = np.where(shift <= 0, 1, np.int64(1) << np.maximum(right - 1, 0))
    if mode == "nearest-even":
        up = (rem > half) | ((rem == half) & (shift > 0) & (q & 1 == 1))
    elif mode == "toward-zero":
        up = np.zeros_like(q, dtype=bool)
    else:  # stochastic with the same uniforms as the implementation: up iff u < rem / 2^shift
        up = (shift > 0) & (np.ldexp(uniforms, qe - exp2) < rem)  # uncapped shift: u * 2^s is exact
    r = q + up
    mag = np.ldexp(r.astype(np.float64), qe)
    over = mag > fmt.max_finite
    if overflow == "satfinite" or mode == "toward-zero":
        mag = np.where(over, fmt.max_finite, mag)
    else:
        mag = np.where(over, np.inf if fmt.has_inf else np.nan, mag)
    inf_in = is_special & (frac == 0)
    mag = np.where(inf_in, fmt.max_finite if overflow == "satfinite" else (np.inf if fmt.has_inf else np.nan), mag)
    mag = np.where(is_special & (frac != 0), np.nan, mag)
    return np.where(sign == 1, -mag, mag).astype(fmt.dtype)


def _neighbours(values32):
    """Each value and its FP32 neighbours, both signs."""
    v = np.asarray(values32, dtype=np.float32)
    out = [v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))]
    a = np.concatenate(out)
    return np.concatenate([a, -a])


def hard_inputs(n_random=700_000, seed=1234):
    """Over 10^6 FP32 inputs: random bits plus ties, extremes, overflow thresholds, subnormals, zeros."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 1 << 32, n_random, dtype=np.uint64).astype(np.uint32).view(np.float32)]
    for name in TARGETS:
        f = get_format(name)
        # ties: midpoints between consecutive representable values over the whole range, then their neighbours
        if name in SMALL:
            with np.errstate(invalid="ignore"):  # ml_dtypes warns when it widens the NaN codes
                codes = _all_codes(name).astype(np.float64)
            codes = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
        else:
            e = rng.integers(-150, 128, 20_000)
            m = rng.integers(0, 1 << f.mantissa_bits, 20_000)
            codes = np.unique(np.ldexp(1.0 + m / 2.0**f.mantissa_bits, e))
            codes = codes[codes <= f.max_finite]
        mids = (codes[:-1] + codes[1:]) / 2
        ulp_top = 2.0 ** (f.emax - f.mantissa_bits)
        specials = [f.max_finite, f.max_finite + ulp_top / 2, f.max_finite + ulp_top, f.min_normal,
                    f.min_subnormal, f.min_subnormal / 2, f.min_subnormal * 1.5, f.min_normal - f.min_subnormal]
        with np.errstate(over="ignore"):
            parts.append(_neighbours(np.concatenate([codes, mids, specials]).astype(np.float32)))
    parts.append(np.float32([0.0, -0.0, np.inf, -np.inf, np.nan]))
    sub = rng.integers(0, 1 << 23, 50_000, dtype=np.uint32)  # FP32 subnormals
    parts.append(np.concatenate([sub, sub | (1 << 31)]).view(np.float32))
    x = np.concatenate(parts).astype(np.float32)
    assert x.size >= 1_000_000
    return x


@pytest.fixture(scope="module")
def inputs():
    return hard_inputs()


@pytest.mark.parametrize("name", TARGETS)
@pytest.mark.parametrize("mode", ["nearest-even", "toward-zero"])
@pytest.mark.parametrize("overflow", ["ieee", "satfinite"])
def test_rounding_matches_integer_oracle(inputs, name, mode, overflow):
    f = get_format(name)
    got = round_to(inputs, f, mode=mode, overflow=overflow)
    want = oracle_round_fp32(inputs.view(np.uint32), f, mode, overflow)
    nan = np.isnan(_widen(want))
    assert np.isnan(_widen(got[nan])).all()
    assert_bitwise_equal(got[~nan], want[~nan], err_msg=f"{name} {mode} {overflow}")


@pytest.mark.parametrize("name", ["bf16", "fp16", "tf32", "e4m3", "e5m2"])
def test_float64_nans_whose_rounding_carries_into_the_sign_stay_nan(name):
    """NaN payloads at the top of the float64 code space: adding half an ulp to their bits carries into the sign
    bit (or wraps to zero), which must not pass them off as finite numbers."""
    x = np.array([0x7FFF_FFFF_FFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0001, 0x7FF8_0000_0000_0000,
                  0x3FF0_0000_0000_0000], np.uint64).view(np.float64)  # four NaNs, then 1.0
    with np.errstate(invalid="ignore"):
        got = round_to(x, name).astype(np.float64)
    assert np.isnan(got[:4]).all() and got[4] == 1.0


@pytest.mark.parametrize("name", TARGETS)
def test_stochastic_rounding_matches_oracle_with_same_draws(inputs, name, engine):
    f = get_format(name)
    got = round_to(inputs, f, mode="stochastic", seed=7)
    uniforms = np.random.default_rng(7).random(inputs.shape)
    want = oracle_round_fp32(inputs.view(np.uint32), f, "stochastic", "ieee", uniforms)
    nan = np.isnan(want.astype(np.float64))
    assert_bitwise_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("bitgen", [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64,
                                    np.random.MT19937])
def test_stochastic_rounding_uses_the_generators_uniforms(inputs, bitgen, engine):
    """The bit path reads raw draws where Generator.random() is (raw >> 11) 2^-53, the uniforms elsewhere
    (MT19937): the same bits either way, and the Generator ends in the same state."""
    x = inputs[:200_000]
    g = np.random.Generator(bitgen(11))
    got = round_to(x, "bf16", mode="stochastic", seed=g)
    ref = np.random.Generator(bitgen(11))
    want = oracle_round_fp32(x.view(np.uint32), get_format("bf16"), "stochastic", "ieee", ref.random(x.shape))
    nan = np.isnan(want.astype(np.float64))
    assert_bitwise_equal(got[~nan], want[~nan])
    assert g.random() == ref.random()


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = np.full(200_000, 1.0 + 2.0**-9, dtype=np.float32)  # a quarter of a bf16 ulp above 1
    y = round_to(x, "bf16", mode="stochastic", seed=3).astype(np.float64)
    assert set(np.unique(y)) == {1.0, 1.0 + 2.0**-7}
    frac_up = np.mean(y > 1.0)
    assert abs(frac_up - 0.25) < 0.005  # 5 sigma of a binomial(200000, 0.25) mean is 0.0048
    assert_bitwise_equal(round_to(x, "bf16", mode="stochastic", seed=3), round_to(x, "bf16", mode="stochastic", seed=3))


@pytest.mark.parametrize("name", ["fp16", "bf16", "e4m3", "e5m2"])
def test_nearest_even_ieee_agrees_with_ml_dtypes(inputs, name):
    f = get_format(name)
    with np.errstate(over="ignore", invalid="ignore"):
        want = inputs.astype(f.dtype)
    got = round_to(inputs, f)
    nan = np.isnan(want.astype(np.float64))
    assert np.array_equal(nan, np.isnan(got.astype(np.float64)))
    assert_bitwise_equal(got[~nan], want[~nan])


def test_float64_inputs_round_like_numpy_casts():
    rng = np.random.default_rng(5)
    x = rng.integers(0, 1 << 63, 300_000, dtype=np.int64).view(np.float64)
    x = np.where(rng.random(x.size) < 0.5, -x, x)
    x = np.concatenate([x, np.ldexp(rng.random(100_000), rng.integers(-160, 130, 100_000))])
    with np.errstate(over="ignore", invalid="ignore"):
        for dt in (np.float32, np.float16):
            want = x.astype(dt)
            got = round_to(x, dt)
            nan = np.isnan(want)
            assert_bitwise_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("bits", [14, 11, 24])
def test_round_significand_matches_oracle(inputs, bits):
    from amla_sim.formats import _fp32_container

    got = round_significand(inputs, bits)
    want = oracle_round_fp32(inputs.view(np.uint32), _fp32_container("x", bits - 1), "toward-zero", "ieee")
    nan = np.isnan(want)
    assert_bitwise_equal(got[~nan], want[~nan])
    assert np.all(bits_of(got[np.isfinite(got)]) & ((1 << (24 - bits)) - 1) == 0)


def test_satfinite_like_cvt_rn_satfinite():
    x = np.float32([448.0, 464.0, 465.0, 1e6, np.inf, -np.inf, np.nan, -1e9])
    got = round_to(x, "e4m3", overflow="satfinite").astype(np.float32)
    assert_bitwise_equal(got[:6], np.float32([448, 448, 448, 448, 448, -448]))
    assert np.isnan(got[6]) and got[7] == -448
    got = round_to(np.float32([61440.0, 61439.0, np.inf]), "e5m2", overflow="satfinite").astype(np.float32)
    assert_bitwise_equal(got, np.float32([57344, 57344, 57344]))
    ieee = round_to(np.float32([61440.0, 61439.0]), "e5m2").astype(np.float32)
    assert_bitwise_equal(ieee, np.float32([np.inf, 57344]))


@pytest.mark.parametrize("mode", ["nearest-even", "toward-zero", "stochastic"])
@pytest.mark.parametrize("name", ["bf16", "fp16", "e4m3", "e5m2"])
def test_a_scalar_rounds_as_an_array_element(name, mode):
    """0-d inputs on every path, the edges that leave the fast paths included (a 0-d subnormal under toward-zero
    raised an IndexError once)."""
    edges = np.array([1e-40, -1e-40, 3e38, -3e38, np.inf, -np.inf, np.nan, 0.0, -0.0, 1.2345], np.float32)
    for x in edges:  # a stochastic scalar takes the first draw of its seed, as the first element of an array does
        one = round_to(np.float32(x), name, mode=mode, seed=3)
        assert one.shape == () and bits_of(one) == bits_of(round_to(np.full(2, x), name, mode=mode, seed=3)[0]), x


def test_signed_zero_kept():
    got = round_to(np.float32([-0.0, -1e-30, 1e-30]), "bf16")
    assert_bitwise_equal(got, np.array([-0.0, -1e-30, 1e-30]).astype(ml_dtypes.bfloat16))
    got = round_to(np.float32([-1e-30, 1e-30]), "e4m3")
    assert bits_of(got).tolist() == [0x80, 0x00]


@pytest.mark.parametrize(
    "kwargs, exc, word",
    [
        ({"x": np.arange(3), "fmt": "bf16"}, TypeError, "x"),
        ({"x": np.ones(3), "fmt": "bf17"}, ValueError, "fmt"),
        ({"x": np.ones(3), "fmt": "bf16", "mode": "up"}, ValueError, "mode"),
        ({"x": np.ones(3), "fmt": "bf16", "overflow": "wrap"}, ValueError, "overflow"),
        ({"x": np.ones(3), "fmt": "bf16", "mode": "stochastic"}, ValueError, "seed"),
        ({"x": np.ones(3), "fmt": "bf16", "mode": "stochastic", "seed": 1.5}, TypeError, "seed"),
    ],
)
def test_bad_input_names_the_argument(kwargs, exc, word):
    x = kwargs.pop("x")
    fmt = kwargs.pop("fmt")
    with pytest.raises(exc, match=word):
        round_to(x, fmt, **kwargs)


@pytest.mark.parametrize("bits", [0, 25])
def test_round_significand_rejects_widths(bits):
    with pytest.raises(ValueError, match="significant_bits"):
        round_significand(np.ones(2, np.float32), bits)


@pytest.mark.parametrize("name", ["bf16", "fp16", "e4m3", "e5m2", "tf32"])
def test_float64_inputs_against_fraction_oracle(name):
    """float64 inputs take a bit-level nearest-even path: check it against Fractions, ties and extremes included."""
    from fractions import Fraction

    from _oracles import round_fraction

    f = get_format(name)
    rng = np.random.default_rng(8)
    x = np.ldexp(rng.random(6000) + 0.5, rng.integers(f.emin - 12, f.emax + 3, 6000)) * rng.choice([-1, 1], 6000)
    codes = np.abs(round_to(x, f).astype(np.float64))
    codes = codes[np.isfinite(codes)]
    ulp = np.ldexp(1.0, np.maximum(np.frexp(codes)[1] - 1, f.emin) - f.mantissa_bits)
    x = np.concatenate([x, codes + ulp / 2, codes - ulp / 2, np.nextafter(codes + ulp / 2, np.inf), [f.max_finite]])
    x = x[np.isfinite(x)]
    got = round_to(x, f).astype(np.float64)
    for xi, gi in zip(x, got):
        want = round_fraction(Fraction(float(xi)), f.mantissa_bits, f.emin, f.emax, "rne", f.max_finite)
        if not f.has_inf and abs(want) == np.inf:
            assert np.isnan(gi)
        else:
            assert gi == want, (xi, gi, want)


def test_tf32_operand_is_toward_zero_on_finite_values_and_keeps_19_bits():
    from amla_sim.formats import tf32_operand

    rng = np.random.default_rng(3)
    x = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    finite = np.isfinite(x)
    got = tf32_operand(x)
    assert_bitwise_equal(got[finite], round_to(x[finite], "tf32", mode="toward-zero"))
    assert (got.view(np.uint32) & np.uint32(0x1FFF) == 0).all()
    assert np.isinf(tf32_operand(np.uint32([0x7F800001]).view(np.float32)))[0]  # payload only in the low bits


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_exponent_of_nonfinite_values_without_a_warning(dtype, frexp_refuses_nonfinite):
    """formats.exponent never hands frexp an Inf or NaN (issue 23: a RuntimeWarning on some builds); the finite
    values keep their exponents."""
    from amla_sim.formats import exponent

    x = np.array([np.nan, -np.inf, np.inf, 1.0, 3.0, 0.25, 2.0**-140], dtype)
    e = exponent(x, -126)
    want = np.array([-1, -1, -1, 0, 1, -2, -126 if dtype != np.float16 else -1])
    finite = np.isfinite(x)
    np.testing.assert_array_equal(e[finite], want[finite])
    assert (e[~finite] == -1).all()
