"""SGLang's FP4 MLA cache (``fp4_mx_block16``), bit for bit: the model against SGLang 0.5.23's own compiled
quantizer and dequantizer (scripts/capture_sglang_fp4.py, tests/data/sglang_fp4_cache.npz, inputs rebuilt from the
recipe in its meta) on every case and device captured; round trips, monotonicity and the scale rule as properties,
exhaustive over every E2M1 code and scale byte; every modelled choice shown to matter on named cases; bad calls
refused by name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from amla_sim.algorithms.deployed.sglang import fp4_cache as fp4
from amla_sim.algorithms.deployed.sglang.fp4_cache import (E2M1_BOUNDS, E2M1_VALUES, batched_dequantize,
                                                           batched_quantize, dequantize_mla_kv, e2m1_codes,
                                                           pack_e2m1, quantize_mla_kv, scale_exponents,
                                                           through_fp4_pool, unpack_e2m1)

ROOT = Path(__file__).parents[1]
CAPTURE = ROOT / "tests" / "data" / "sglang_fp4_cache.npz"
_spec = importlib.util.spec_from_file_location("capture_sglang_fp4", ROOT / "scripts" / "capture_sglang_fp4.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

BF16 = ml_dtypes.bfloat16
BF16_MAX = float.fromhex("0x1.fep127")


@pytest.fixture(scope="module")
def cap():
    with np.load(CAPTURE) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = json.loads(str(z["meta"]))
    return meta, arrays, script.quantize_inputs(meta["recipe"]), script.dequantize_inputs(meta["recipe"])


def _rows(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16).reshape(-1, 1, 576)


def _model(x: np.ndarray, device: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pool's rows and the keys read back, as the capture holds them (keys as BF16 bits)."""
    r = _rows(x)
    kv, sc = quantize_mla_kv(r[..., :512], r[..., 512:], device=device)
    return kv, sc, dequantize_mla_kv(kv, sc, device=device).view(np.uint16)


# --- the capture: SGLang's own functions -----------------------------------------------------------------------

QCASES = ["grid", "ties", "saturation", "zeros", "subnormal", "every_scale", "every_value", "random", "nonfinite"]


def test_the_capture_is_sglangs(cap):
    """SGLang 0.5.23's functions from the wheel, compiled as the server runs them, on a CPU at least; splitting a
    row into k_nope and k_rope (the pool's two calls) gives the bytes of one call; under 1 MB."""
    meta, arrays, qin, din = cap
    assert meta["sglang"] == "0.5.23" and meta["recipe"] == script.RECIPE
    assert "cpu" in meta["captures"] and set(meta["captures"]) <= {"cpu", "cuda"}
    assert all(c["split_is_whole"] for c in meta["captures"].values())
    assert list(qin) == QCASES and list(din) == ["codes"]
    for dev in meta["captures"]:
        names = {k for k in arrays if k.startswith(f"{dev}__")}
        assert names == ({f"{dev}__q_{c}_{p}" for c in QCASES for p in ("packed", "scales", "deq")}
                         | {f"{dev}__d_codes", f"{dev}__eager_saturation_scales"})
    assert set().union(*({k for k in arrays if k.startswith(f"{d}__")} for d in meta["captures"])) == set(arrays)
    assert CAPTURE.stat().st_size < 1 << 20


def test_the_capture_covers_the_brief(cap):
    """Every E2M1 code under every scale byte a finite block can have (94..253), exact ties and the BF16 values
    beside them, amax at and past 6 * 2^e, +-0, every BF16 subnormal, every finite BF16 magnitude as a block's
    amax, every BF16 value in [-6, 6] under scale 1, random 576-wide rows, Inf and NaN; and the dequantizer on
    every code in both nibbles under all 256 scale bytes."""
    meta, arrays, qin, din = cap
    g = arrays["cpu__q_grid_scales"].ravel()[:160]
    assert (g == np.arange(94, 254)).all()
    codes = unpack_e2m1(arrays["cpu__q_grid_packed"]).reshape(-1, 16)[:160]
    assert all(set(c) == set(range(16)) for c in codes[:-1]) and set(codes[-1]) == set(range(16)) - {7, 15}
    q = qin["ties"].reshape(-1, 16)[:, 1:]
    scale = np.ldexp(1.0, arrays["cpu__q_ties_scales"].ravel().astype(int) - 127)[: len(q)]
    r = np.abs(q / scale[:, None])
    assert set(E2M1_BOUNDS.tolist()) <= set(r.ravel().tolist())
    amax = np.abs(qin["every_scale"]).reshape(-1, 16).max(axis=1)
    bits = np.unique(amax.astype(np.float32).view(np.uint32) >> 16)
    assert len(bits) == 0x7F80 and bits[-1] == 0x7F7F  # 0 up to BF16's largest
    every = np.arange(0x10000, dtype=np.uint32)
    every = every[np.abs(_from_bits(every)) <= 6]  # NaN compares False
    x = qin["every_value"].reshape(-1, 16)[:, 1:].astype(np.float32).view(np.uint32) >> 16
    assert set(np.unique(x).tolist()) == set(every.tolist())
    sub = qin["subnormal"].ravel()
    assert len(np.unique(sub[(sub != 0) & (np.abs(sub) < 2.0**-126)])) == 254
    z = qin["zeros"].ravel()
    assert (np.signbit(z) & (z == 0)).any() and (~np.signbit(z) & (z == 0)).any()
    assert np.isinf(qin["nonfinite"]).any() and np.isnan(qin["nonfinite"]).any()
    assert qin["random"].shape == (4 * meta["recipe"]["random_rows_per_dist"], 576)
    p, s = din["codes"]
    nib = unpack_e2m1(p).reshape(-1, 16)
    seen = {(int(sc), i % 2, int(c)) for blk, sc in zip(nib, s.ravel()) for i, c in enumerate(blk)}
    assert seen == {(sc, pos, c) for sc in range(256) for pos in (0, 1) for c in range(16)}


@pytest.mark.parametrize("case", QCASES)
def test_quantize_bit_exact(cap, case):
    """The pool's 288 code bytes and 36 scale bytes a token, and the keys read back, equal SGLang's on every device
    captured."""
    meta, arrays, qin, _ = cap
    for dev in meta["captures"]:
        kv, sc, keys = _model(qin[case], dev)
        for what, mine in (("packed", kv), ("scales", sc), ("deq", keys)):
            ref = arrays[f"{dev}__q_{case}_{what}"]
            assert mine.shape == ref.shape and mine.dtype == ref.dtype, (dev, case, what)
            bad = np.argwhere(mine != ref)
            assert len(bad) == 0, f"{dev} {case} {what}: {len(bad)} differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("case", ["random", "ties", "saturation"])
def test_the_keys_flashinfer_reads_are_sglangs(cap, case):
    """``through_fp4_pool``, the keys of a (b, S, 576) cache as SGLang's ``flashinfer`` backend hands them to the
    kernel (``flashinfer-mla`` with ``kv_cache=fp4_mx_block16``), are the keys SGLang read back on the GPU."""
    meta, arrays, qin, _ = cap
    assert "cuda" in meta["captures"]
    x = _rows(qin[case])
    keys = through_fp4_pool(x.reshape(1, -1, 576))
    assert keys.shape == (1, len(x), 576) and keys.dtype == BF16
    np.testing.assert_array_equal(keys.view(np.uint16).reshape(x.shape), arrays[f"cuda__q_{case}_deq"])


def test_dequantize_bit_exact(cap):
    """Every code in both nibbles under every scale byte, 0..255, on every device captured (NaN bits included)."""
    meta, arrays, _, din = cap
    p, s = din["codes"]
    for dev in meta["captures"]:
        mine = batched_dequantize(p, s, device=dev)
        assert mine.dtype == BF16 and mine.shape == (len(p), 1, 576)
        np.testing.assert_array_equal(mine.view(np.uint16), arrays[f"{dev}__d_codes"], err_msg=dev)


# --- properties -------------------------------------------------------------------------------------------------

VALUES = E2M1_VALUES.astype(np.float64)


def _block(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float32).astype(BF16).reshape(1, 1, 16)


def test_every_code_under_every_scale_round_trips():
    """Exhaustive: each of the 16 codes, beside a 6 or a 4 that fixes the scale, under every byte 94..252 (253 is
    e = 126, where 4 * 2^126 is past BF16), dequantizes to value * 2^e and quantizes back to itself (code 8,
    -0, back to code 0: SGLang's sign bit is ``q < 0``)."""
    for anchor in (7, 6):  # 6 or 4: amax in (3, 6] 2^e
        codes = np.array([[anchor] + [c] * 15 for c in range(16)], np.uint8)  # (16, 16)
        for byte in range(94, 253):
            p = pack_e2m1(codes).reshape(16, 1, 8)
            s = np.full((16, 1), byte, np.uint8)
            x = batched_dequantize(p, s)
            np.testing.assert_array_equal(x.astype(np.float64).reshape(16, 16),
                                          VALUES[codes] * 2.0 ** (byte - 127))
            p2, s2 = batched_quantize(x)
            assert (s2 == byte).all()
            np.testing.assert_array_equal(unpack_e2m1(p2).reshape(16, 16), np.where(codes == 8, 0, codes))


bf16_finite = st.integers(0, 0xFFFF).filter(lambda b: (b & 0x7F80) != 0x7F80)


def _from_bits(bits) -> np.ndarray:
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


@given(st.integers(-33, 125), st.lists(st.integers(0, 15), min_size=15, max_size=15), st.sampled_from([4, 6, -4, -6]))
def test_representable_blocks_round_trip(e, codes, anchor):
    """A block whose values are E2M1 values times 2^e, its largest 4 or 6 (so that e is its scale), comes back
    exactly (-0 as +0)."""
    x = np.ldexp(np.concatenate([[anchor], VALUES[codes]]), e)
    y = batched_dequantize(*batched_quantize(_block(x))).astype(np.float64).ravel()
    np.testing.assert_array_equal(y, np.where(x == 0, 0.0, x))
    assert not np.signbit(y[y == 0]).any()


@given(st.lists(bf16_finite, min_size=16, max_size=16))
def test_scale_rule(bits):
    """The scale byte is 127 + the least e >= -33 with amax <= 6 * 2^e."""
    x = _from_bits(bits).reshape(1, 1, 16)
    _, s = batched_quantize(x)
    amax = float(np.abs(x).max())
    e = int(s[0, 0]) - 127
    assert -33 <= e <= 126 and amax <= 6 * 2.0**e and (e == -33 or amax > 6 * 2.0 ** (e - 1))


@given(st.lists(bf16_finite, min_size=16, max_size=16))
def test_nearest_ties_away(bits):
    """Each value comes back as a nearest E2M1 value times the block's 2^e, a tie the larger magnitude (then a
    value of 2^e * 6 or more would be past the grid: none is); the sign kept unless it comes back 0."""
    x = _from_bits(bits).reshape(1, 1, 16)
    p, s = batched_quantize(x)
    y = batched_dequantize(p, s).astype(np.float64).ravel()
    x = x.astype(np.float64).ravel()
    grid = VALUES[:8] * 2.0 ** (int(s[0, 0]) - 127)
    dist = np.abs(np.abs(x)[:, None] - grid[None, :])
    best = dist.min(axis=1)
    finite = np.isfinite(y)
    assert (np.abs(np.abs(y[finite]) - np.abs(x[finite])) == best[finite]).all()
    tie = (dist == best[:, None]).sum(axis=1) > 1
    assert (np.abs(y[tie & finite]) >= np.abs(x[tie & finite])).all()
    assert ((y == 0) | (np.sign(y) == np.sign(x))).all()
    if not finite.all():  # only a value rounding to 4 or 6 under e = 126: past BF16
        assert int(s[0, 0]) == 253 and (np.abs(x[~finite]) >= 3.5 * 2.0**126).all()


@given(st.integers(-33, 125), bf16_finite, bf16_finite)
def test_monotonic(e, a, b):
    """Under one scale, a larger value never comes back smaller."""
    lo, hi = sorted(_from_bits([a, b]).astype(np.float64))
    lim = 6 * 2.0**e
    lo, hi = np.clip([lo, hi], -lim, lim)
    y = batched_dequantize(*batched_quantize(_block([lim, lo, hi] + [0] * 13))).astype(np.float64).ravel()
    assert y[1] <= y[2]


def test_monotonic_exhaustive(cap):
    """Every BF16 value in [-6, 6] under scale 1, sorted: the keys read back never decrease."""
    _, arrays, qin, _ = cap
    x = qin["every_value"].reshape(-1, 16)[:, 1:].ravel()
    y = arrays["cpu__q_every_value_deq"].view(BF16).reshape(-1, 16)[:, 1:].ravel().astype(np.float64)
    order = np.argsort(x, kind="stable")
    assert (np.diff(y[order]) >= 0).all()


def test_gpu_reciprocal_gives_the_same_scales():
    """A GPU's Inductor multiplies amax by fl32(1/6) where a CPU divides by 6: for every finite BF16 amax both
    give the same e (the quotient never lands across a power of two)."""
    a = _from_bits(np.arange(0, 0x7F80))
    recip = np.float32(1.0) / np.float32(6.0)
    mul = fp4._ceil_log2(np.maximum(a * recip, np.float32(1e-10)))
    np.testing.assert_array_equal(scale_exponents(a), mul)


def test_split_rows_are_one_call():
    """The pool's two calls (k_nope, k_rope) write the bytes of one call on the 576 values."""
    x = _rows(script.random_inputs(7, 2))
    kv, sc = quantize_mla_kv(x[..., :512], x[..., 512:])
    p, s = batched_quantize(x)
    np.testing.assert_array_equal(kv, p)
    np.testing.assert_array_equal(sc, s)


def test_pack_unpack():
    c = np.arange(16, dtype=np.uint8)
    assert pack_e2m1(c).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    all_bytes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(pack_e2m1(unpack_e2m1(all_bytes)), all_bytes)


# --- each modelled choice matters -------------------------------------------------------------------------------


def _quantize_variant(x: np.ndarray, *, ties_even=False, mx_scale=False, eager_log2=False, floor=1e-10,
                      sign_of_x=False, signbit=False, swap_nibbles=False) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's quantizer with one choice changed (CPU bytes)."""
    r = _rows(x).astype(np.float32)
    b = r.reshape(len(r), -1, 16)
    amax = np.abs(b).max(axis=-1)
    with np.errstate(all="ignore"):
        if mx_scale:  # OCP MX: 2^(floor(log2 amax) - emax), emax = 2 for E2M1, saturating
            e = np.floor(np.log2(np.maximum(amax, 2.0**-133))) - 2
            e = np.maximum(e, -33).astype(np.float32)
        elif eager_log2:  # eager torch: every op rounds to BF16
            qq = (amax / np.float32(6)).astype(BF16).astype(np.float32)
            qq = np.maximum(qq, np.float32(floor).astype(BF16).astype(np.float32))
            e = np.ceil(np.log2(qq).astype(np.float32).astype(BF16).astype(np.float32))
        else:
            e = fp4._ceil_log2(np.maximum(amax / np.float32(6), np.float32(floor)))
        byte = (e + 127).astype(np.uint8)
        q = np.ldexp(b.astype(np.float64), -e.astype(np.int64)[..., None]).astype(np.float32)
        if ties_even:
            mag = np.abs(q).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 7
            codes = ((q < 0).astype(np.uint8) << 3) | mag
        else:
            codes = e2m1_codes(q)
        if sign_of_x:
            codes = np.where(b < 0, codes | 8, codes)
        if signbit:
            codes = np.where(np.signbit(b), codes | 8, codes)
    codes = codes.reshape(len(r), 1, 576)
    packed = pack_e2m1(codes)
    if swap_nibbles:
        packed = (packed << 4) | (packed >> 4)
    return packed, byte.reshape(len(r), -1)


def _differs(cap, variant: dict, cases: list[str]) -> set[str]:
    meta, arrays, qin, _ = cap
    out = set()
    for case in QCASES:
        if case == "nonfinite":
            continue
        p, s = _quantize_variant(qin[case], **variant)
        ref_p, ref_s = arrays[f"cpu__q_{case}_packed"], arrays[f"cpu__q_{case}_scales"]
        if not (np.array_equal(p, ref_p) and np.array_equal(s, ref_s)):
            out.add(case)
    assert set(cases) <= out, (variant, out)
    return out


def test_the_variant_harness_is_sglang(cap):
    assert _differs(cap, {}, []) == set()


@pytest.mark.parametrize("variant, cases", [
    ({"ties_even": True}, ["ties", "every_value", "random"]),  # 0.25 -> 0, 2.5 -> 2, 5 -> 4 ...
    ({"mx_scale": True}, ["saturation", "every_scale", "random"]),  # amax in (6, 8) 2^e keeps e and saturates
    ({"floor": 2.0**-127}, ["zeros", "subnormal", "every_scale"]),  # E8M0's floor instead of 1e-10's 2^-33
    ({"sign_of_x": True}, ["subnormal"]),  # the sign of x, not of q (which underflows to -0)
    ({"signbit": True}, ["zeros"]),  # -0 as code 8
    ({"swap_nibbles": True}, ["grid", "ties", "random"]),  # element 2j in the high nibble
])
def test_each_choice_matters(cap, variant, cases):
    _differs(cap, variant, cases)


def test_compiled_not_eager(cap):
    """The server runs the quantizer compiled: FP32 from amax to ceil. Eager torch rounds each op to BF16, which
    floors e where log2 is large (SGLang's own eager run, captured, agrees with that variant), and differs."""
    meta, arrays, qin, _ = cap
    _, s = _quantize_variant(qin["saturation"], eager_log2=True)
    for dev in meta["captures"]:
        np.testing.assert_array_equal(s, arrays[f"{dev}__eager_saturation_scales"])
    assert not np.array_equal(s, arrays["cpu__q_saturation_scales"])


def test_dequantize_overflow_matters(cap):
    """6 * 2^126 is past BF16: SGLang's keys are Inf there (``saturation``, ``grid``), not BF16's largest."""
    _, arrays, qin, _ = cap
    for case in ("saturation", "grid"):
        keys = arrays[f"cpu__q_{case}_deq"].view(BF16).astype(np.float32)
        assert np.isinf(keys).any() and np.isfinite(qin[case]).all()


def test_what_the_device_changes(cap):
    """SGLang's functions on an H100 and on a CPU (both captured) write the same codes and scale bytes for every
    finite block; they part on an Inf block's scale byte (255 on the GPU, 0 on the CPU) and, reading back, on
    code 8 (-0: +0 on the GPU, whose Triton negation is ``0 - v``), scale byte 0 (``exp2(-127)`` flushed) and NaN
    bits. The model with the other device's choice fails the capture on exactly those."""
    meta, arrays, qin, din = cap
    assert set(meta["captures"]) == {"cpu", "cuda"}
    for case in QCASES:
        for what in ("packed", "scales"):
            same = np.array_equal(arrays[f"cpu__q_{case}_{what}"], arrays[f"cuda__q_{case}_{what}"])
            assert same == (case != "nonfinite" or what == "packed"), (case, what)
    p, s = din["codes"]
    gpu, cpu = arrays["cuda__d_codes"].reshape(len(p), -1), arrays["cpu__d_codes"].reshape(len(p), -1)
    codes = unpack_e2m1(p).reshape(len(p), -1)
    scale = np.repeat(s.reshape(len(p), -1), 16, axis=1)
    differ, neg_zero = gpu != cpu, (codes == 8) & (scale > 0) & (scale < 255)
    assert not differ[(codes != 8) & (scale > 0) & (scale < 255)].any()
    assert differ[neg_zero].all() and (gpu[neg_zero] == 0).all() and (cpu[neg_zero] == 0x8000).all()
    assert differ[scale == 0].any() and differ[scale == 255].any()
    for dev, other in (("cuda", "cpu"), ("cpu", "cuda")):
        mine = batched_dequantize(p, s, device=other).view(np.uint16)
        assert not np.array_equal(mine, arrays[f"{dev}__d_codes"]), dev


# --- refusals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.zeros((1, 1, 16), np.int32), np.zeros((1, 1, 16), bool),
                                 np.zeros((1, 1, 16), np.complex64), np.full((1, 1, 16), "a"),
                                 np.zeros((1, 1, 16), np.uint8)])
def test_refuses_non_float(bad):
    with pytest.raises(TypeError, match="^tensor: "):
        batched_quantize(bad)


@pytest.mark.parametrize("shape", [(1, 16), (1, 1, 1, 16), (1, 1, 15), (1, 1, 24), (1, 3, 6)])
def test_refuses_wrong_width(shape):
    with pytest.raises(ValueError, match="^tensor: "):
        batched_quantize(np.zeros(shape, np.float32))


@pytest.mark.parametrize("value", [1.0 + 2.0**-30, 1e300, -1e39, 2.0**-140])  # FP32 would round each to BF16
def test_float64_values_that_are_not_bf16_are_refused(value):
    with pytest.raises(ValueError, match="^tensor: .*BF16"):
        batched_quantize(np.full((1, 1, 16), value))
    batched_quantize(np.full((1, 1, 16), 1.5))  # a BF16 value held in float64 is one


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="^tensor: .*BF16"):
        batched_quantize(np.full((1, 1, 16), 1.0 + 2.0**-10, np.float32))
    ok = np.zeros((2, 1, 288), np.uint8), np.zeros((2, 36), np.uint8)
    with pytest.raises(TypeError, match="^quant_tensor: "):
        batched_dequantize(ok[0].astype(np.int8), ok[1])
    with pytest.raises(TypeError, match="^scale_factors: "):
        batched_dequantize(ok[0], ok[1].astype(np.float32))
    with pytest.raises(ValueError, match="^scale_factors: "):
        batched_dequantize(ok[0], ok[1][:, :35])
    with pytest.raises(ValueError, match="^quant_tensor: "):
        batched_dequantize(ok[0][0], ok[1])
    with pytest.raises(ValueError, match="^quant_tensor: "):
        batched_dequantize(np.zeros((2, 1, 4), np.uint8), np.zeros((2, 0), np.uint8))
    x = np.zeros((2, 1, 576), np.float32)
    with pytest.raises(ValueError, match="^k_rope: "):
        quantize_mla_kv(x[..., :512], x[:1, :, 512:])
    with pytest.raises(ValueError, match="^device: "):
        batched_quantize(x, device="gpu")
    with pytest.raises(ValueError, match="^device: "):
        batched_dequantize(*ok, device="sm90")
    with pytest.raises(ValueError, match="^codes: "):
        pack_e2m1(np.array([16, 0], np.uint8))
    with pytest.raises(TypeError, match="^packed: "):
        unpack_e2m1(np.zeros(2, np.int16))
    with pytest.raises(ValueError, match="^packed: .*one axis"):
        unpack_e2m1(np.uint8(3))
    with pytest.raises(ValueError, match="^kv: "):
        through_fp4_pool(np.zeros((2, 512), np.float32))


def test_flashinfer_decode_names_its_cache():
    from amla_sim.algorithms import ALGORITHMS

    q, kv = np.zeros((1, 1, 16, 576), BF16), np.zeros((1, 64, 576), BF16)
    with pytest.raises(ValueError, match="^kv_cache: expected one of \\['bf16', 'fp4_mx_block16'\\]"):
        ALGORITHMS["flashinfer-mla"](q, kv, kv_cache="nvfp4")
