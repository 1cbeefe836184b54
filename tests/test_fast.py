"""The numba engine (the ``[fast]`` extra) against the NumPy reference: the same bits on every model row.

The reference itself is held to the hardware captures and to a Fraction oracle (test_mma.py); the capture tests
also run on both engines (the ``engine`` fixture).
"""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from amla_sim import mma
from amla_sim.arith import elementwise as ew
from amla_sim.engine import ENGINES, get_engine, numba_available, set_engine, use_engine
from amla_sim.formats import FORMATS
from amla_sim.testing import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed (the [fast] extra)")

DT = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "tf32": np.float32, "e4m3": ml_dtypes.float8_e4m3fn,
      "e5m2": ml_dtypes.float8_e5m2}
ROWS = [(m.name, fmt) for m in mma.MODEL_TABLE.values() for fmt in m.rows]
KINDS = ("bits", "narrow", "one-binade", "tiny", "huge", "cancel")


def _operand(rng: np.random.Generator, fmt: str, shape: tuple[int, ...], kind: str, specials: bool) -> np.ndarray:
    """Operands of one flavour: any bit pattern, a few binades, one binade, near the bottom or the top of the
    range, or pairs of equal magnitude and opposite sign; zeros sprinkled in, Inf and NaN when `specials`."""
    f, dt = FORMATS[fmt], np.dtype(DT[fmt])
    if kind == "bits":
        u = rng.integers(0, 1 << (8 * dt.itemsize), shape, dtype=np.uint64).astype(f"u{dt.itemsize}")
        x = u.view(dt)
    else:
        lo, hi = {"narrow": (-6, 6), "one-binade": (0, 0), "tiny": (f.emin - f.mantissa_bits, f.emin + 2),
                  "huge": (f.emax - 3, f.emax), "cancel": (-2, 2)}[kind]
        sig = rng.integers(1, 1 << (f.mantissa_bits + 1), shape) * rng.choice([-1, 1], shape)
        x = np.ldexp(sig.astype(np.float64), rng.integers(lo, hi + 1, shape) - f.mantissa_bits)
        if kind == "cancel":
            x[..., 1::2] = -x[..., ::2][..., : x[..., 1::2].shape[-1]]
        with np.errstate(over="ignore"):
            x = np.clip(x, -f.max_finite, f.max_finite).astype(dt)
    with np.errstate(invalid="ignore"):
        x = np.where(rng.random(shape) < 0.1, dt.type(0), x).astype(dt)
        bad = ~np.isfinite(x.astype(np.float64))
    if not specials:
        x = np.where(bad, dt.type(1), x).astype(dt)
    if fmt == "tf32":
        x = (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32) if rng.random() < 0.5 else x
    return x


@pytest.mark.parametrize("model, fmt", ROWS)
@given(seed=st.integers(0, 2**32 - 1), kind_a=st.sampled_from(KINDS), kind_b=st.sampled_from(KINDS),
       m=st.sampled_from([1, 2, 5, 9, 17]), blocks=st.integers(1, 4), tail=st.integers(0, 7),
       n=st.sampled_from([1, 7, 40, 513]),
       batch=st.sampled_from([(), (2,)]), dot_k=st.sampled_from([None, 32, 64]), specials=st.booleans(),
       c_kind=st.sampled_from(["none", "zero", "bits", "normal"]), zero_row=st.booleans())
# found by the ci profile (issue 23): tiny products that all truncate to 0 with a negative c below the grid; the
# sum is an integer, so S = +0 (the float64 sum of the vector kernel's wide path made -0)
@example(seed=0, kind_a="tiny", kind_b="bits", m=2, blocks=2, tail=0, n=513, batch=(2,), dot_k=None, specials=False,
         c_kind="none", zero_row=False)
def test_numba_engine_gives_the_reference_bits(model, fmt, seed, kind_a, kind_b, m, blocks, tail, n, batch, dot_k,
                                               specials, c_kind, zero_row):
    rng = np.random.default_rng(seed)
    row = mma.MODEL_TABLE[model].rows[fmt]
    k = blocks * row.L + tail
    a = _operand(rng, fmt, (*batch, m, k), kind_a, specials)
    b = _operand(rng, fmt, (*batch, k, n), kind_b, specials)
    if zero_row:
        a[..., 0, :] = 0
    c_dt = np.float16 if row.output == "fp16-rne" else np.float32
    c = None
    if c_kind == "zero":
        c = np.where(rng.random((m, n)) < 0.5, -0.0, 0.0).astype(c_dt)
    elif c_kind == "bits":
        width = 16 if c_dt == np.float16 else 32
        c = rng.integers(0, 1 << width, (m, n), dtype=np.uint64).astype(f"u{width // 8}").view(c_dt)
        if not specials:
            c = np.where(np.isfinite(c), c, c_dt(0)).astype(c_dt)
    elif c_kind == "normal":
        c = (rng.standard_normal((m, n)) * 2.0 ** rng.integers(-12, 12, (m, n))).astype(c_dt)
    with use_engine("numpy"):
        want = mma.matmul(a, b, c, model=model, dot_k=dot_k)
    with use_engine("numba"):
        got = mma.matmul(a, b, c, model=model, dot_k=dot_k)
    assert_bitwise_equal(got, want, err_msg=f"{model} {fmt} a:{kind_a} b:{kind_b} c:{c_kind}")


@pytest.mark.parametrize("model", ["sm90", "sm80"])
def test_numba_engine_on_a_decode_sized_product(model):
    """One MLA decode step's Q K^T at full width (several column tiles, both sums of the kernel; few tiles, so the
    rows are cut into chunks for the threads)."""
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((64, 576)) * 3).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((576, 1500)).astype(ml_dtypes.bfloat16)
    with use_engine("numpy"):
        want = mma.matmul(a, b, model=model)
    with use_engine("numba"):
        got = mma.matmul(a, b, model=model)
    assert_bitwise_equal(got, want)


def test_engine_setting():
    assert get_engine() in ENGINES
    with use_engine("numba"):
        assert get_engine() == "numba"
        with use_engine("numpy"):
            assert get_engine() == "numpy"
        assert get_engine() == "numba"
    with pytest.raises(ValueError, match="engine"):
        set_engine("cuda")


def test_a_bad_engine_variable_is_refused_when_used_not_at_import():
    env = {**os.environ, "AMLA_SIM_ENGINE": "gpu"}
    use = ("import numpy as np; from amla_sim import mma; "
           "mma.matmul(np.ones((2, 2), np.float16), np.ones((2, 2), np.float16), model='sm90')")
    r = subprocess.run([sys.executable, "-c", use], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "AMLA_SIM_ENGINE: expected one of" in r.stderr
    r = subprocess.run([sys.executable, "-c", "import amla_sim"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# --- the compiled elementwise units (arith/_elementwise_numba.py) -------------------------------------------


def _fp32_draws(rng: np.random.Generator, n: int) -> np.ndarray:
    """Any bit pattern (NaNs of every payload, infinities, subnormals) and ordinary values of every scale."""
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ordinary = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n))).astype(np.float32)
    return np.where(rng.random(n) < 0.5, bits, ordinary)


LAYOUTS = [((4096,), (4096,), (4096,)), ((64, 64), (), (64, 1)), ((8, 1, 64), (1, 64, 1), (64, 64))]  # a, b, c: broadcast


@pytest.mark.parametrize("shapes", LAYOUTS)
@pytest.mark.parametrize("seed", range(3))
def test_compiled_fma_gives_the_reference_bits(shapes, seed):
    rng = np.random.default_rng(seed)
    a, b, c = (_fp32_draws(rng, int(np.prod(s))).reshape(s) for s in shapes)
    finite = [np.where(np.isnan(x), np.float32(1.5), x) for x in (a, b, c)]  # the compiled path itself
    for ops in ((a, b, c), finite):
        with use_engine("numpy"):
            want = ew.fma(*ops)
        with use_engine("numba"):
            got = ew.fma(*ops)
        assert_bitwise_equal(got, want)


def test_compiled_fma_leaves_nan_operands_to_the_reference():
    """Two NaN operands: which payload survives depends on the order the CPU instruction gets them, which a
    compiler may swap; the compiled kernel refuses such arrays and the NumPy path answers."""
    from amla_sim.arith import _elementwise_numba as fast

    a = np.uint32([0x7FC00001, 0x3F800000]).view(np.float32)
    b = np.uint32([0x7FC00002, 0x3F800000]).view(np.float32)
    c = np.float32([1.0, 2.0])
    assert fast.fma(a, b, c) is None
    assert fast.fma(c, c, c) is not None
    with use_engine("numpy"):
        want = ew.fma(a, b, c)
    with use_engine("numba"):
        assert_bitwise_equal(ew.fma(a, b, c), want)


@pytest.mark.parametrize("ftz", [True, False])
def test_compiled_ex2_gives_the_reference_bits(ftz):
    """Every bit pattern at random, and every 256th FP32 across the unit's whole range [-260, 260] (both signs,
    the flush and saturation edges, subnormal inputs and results)."""
    rng = np.random.default_rng(7)
    dense = np.arange(0, 0x43820000, 256, dtype=np.uint32).view(np.float32)  # 0 .. 260
    x = np.concatenate([_fp32_draws(rng, 1 << 16), dense, -dense])
    with use_engine("numpy"):
        want = ew.ex2_approx(x, ftz=ftz)
    with use_engine("numba"):
        got = ew.ex2_approx(x, ftz=ftz)
    assert_bitwise_equal(got, want)
