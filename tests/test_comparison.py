"""amla_sim.compare on hand-made arrays of every format: the counts a reader relies on, computed independently."""

import json

import ml_dtypes
import numpy as np
import pytest

from amla_sim import ComparisonReport, compare
from amla_sim.cli import main

FORMATS = {"fp64": (np.float64, np.uint64), "fp32": (np.float32, np.uint32), "fp16": (np.float16, np.uint16),
           "bf16": (ml_dtypes.bfloat16, np.uint16), "e4m3": (ml_dtypes.float8_e4m3fn, np.uint8),
           "e5m2": (ml_dtypes.float8_e5m2, np.uint8)}


def _values(dtype, n=64):
    """n positive normal values of the format, spaced so that bit + k stays finite and of one sign."""
    return np.linspace(0.5, 8.0, n).astype(dtype)


def _nudged(x, udtype, at_ulps):
    """x with element i moved up by at_ulps[i] ULPs (bit patterns of positive finite values are ordered)."""
    bits = x.view(udtype).copy()
    for i, k in at_ulps.items():
        bits[i] += udtype(k)
    return bits.view(x.dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_counts_ulps_and_histogram(fmt):
    dtype, udtype = FORMATS[fmt]
    sim = _values(dtype)
    dev = _nudged(sim, udtype, {3: 1, 10: 2, 11: 3, 40: 5})
    s = compare({"x": dev}, {"x": sim})["x"]
    assert (s.format, s.size, s.identical) == (fmt, 64, 60)
    assert s.bit_exact == 60 / 64 and s.max_ulp == 5 and s.median_ulp == 0.0
    assert s.histogram == {"0": 60, "1": 1, "2-3": 2, "4-15": 1, "16-255": 0, ">=256": 0, "nan": 0}
    assert s.first_mismatch["index"] == [3]
    assert s.first_mismatch["simulated"].startswith(repr(float(sim[3])))


@pytest.mark.parametrize("fmt", FORMATS)
def test_raw_bits_on_either_side_read_as_the_other_sides_format(fmt):
    dtype, udtype = FORMATS[fmt]
    sim = _values(dtype)
    dev = _nudged(sim, udtype, {7: 20})
    floats = compare(dev, sim)
    assert compare(dev.view(udtype), sim)["out"] == floats["out"]
    assert compare(dev, sim.view(udtype))["out"] == floats["out"]
    both_bits = compare(dev.view(udtype), sim.view(udtype), stages={"out": fmt})
    assert both_bits["out"] == floats["out"] and floats["out"].histogram["16-255"] == 1


def test_integer_stages_without_a_format_compare_as_integers():
    s = compare({"N": np.array([1, -2, 7], np.int32)}, {"N": np.array([1, 2, 7], np.int32)})["N"]
    assert (s.format, s.identical, s.max_ulp, s.histogram["4-15"]) == ("int", 2, 4, 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_nans_agree_whatever_their_payloads_and_count_when_alone(fmt):
    dtype, udtype = FORMATS[fmt]
    nan_a = np.array(np.nan, dtype).view(udtype)
    nan_b = np.iinfo(udtype).max >> 1  # every exponent and fraction bit set: another payload (E4M3's only NaN)
    assert np.isnan(np.array(nan_b, udtype).view(dtype).astype(np.float64))
    sim = _values(dtype, 8).view(udtype).copy()
    dev = sim.copy()
    sim[0] = sim[1] = nan_a
    dev[0] = nan_b  # NaN against NaN; element 1 is NaN on the simulator's side only
    s = compare(dev.view(dtype), sim.view(dtype))["out"]
    assert s.identical == 7 and s.nan_mismatch == 1 and s.histogram["nan"] == 1
    assert s.first_mismatch["index"] == [1] and s.max_ulp == 0 and sum(s.histogram.values()) == 8


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "e4m3"])  # E4M3 (fn) has no infinity
def test_infinities_that_disagree_are_counted(fmt):
    dtype, _ = FORMATS[fmt]
    big = ml_dtypes.finfo(dtype).max
    sim = np.array([np.inf, -np.inf, big, 1.0, np.inf], dtype)
    dev = np.array([np.inf, np.inf, np.inf, 1.0, big], dtype)
    s = compare(dev, sim)["out"]
    assert (s.identical, s.inf_mismatch) == (2, 3)
    assert s.histogram["1"] == 2  # Inf is one past the largest finite value


@pytest.mark.parametrize(("narrow", "wide"), [("e4m3", "fp32"), ("e5m2", "fp16"), ("bf16", "fp32"), ("e4m3", "fp16"),
                                              ("fp16", "fp64")])
def test_a_narrow_format_is_compared_exactly_inside_a_wider_one(narrow, wide):
    """A kernel that stores an E4M3 P in FP32: the simulated E4M3 values widen exactly, so bits still mean bits."""
    sim = _values(FORMATS[narrow][0], 16)
    dev = sim.astype(FORMATS[wide][0])
    dev[5] = np.nextafter(dev[5], np.inf) if wide != "bf16" else dev[5]
    for a, b in ((dev, sim), (sim, dev)):
        s = compare(a, b)["out"]
        assert (s.format, s.identical, s.max_ulp) == (wide, 15, 1)


def test_signed_zeros_differ_in_bits_at_zero_ulps():
    s = compare(np.array([0.0, -0.0], np.float32), np.array([-0.0, -0.0], np.float32))["out"]
    assert (s.identical, s.max_ulp) == (1, 0)


def test_the_first_stage_in_order_that_differs_and_its_explanation():
    sim = {"S": np.ones(4, np.float32), "P": np.ones(4, np.float32), "out": np.ones(4, ml_dtypes.bfloat16)}
    dev = {**sim, "P": np.array([1, 1, 2, 1], np.float32), "out": np.array([1, 1, 1, 3], ml_dtypes.bfloat16)}
    rep = compare(dev, sim, explanations={"P": "the exp model"}, meta={"kernel": "mine"})
    assert [s.name for s in rep.stages] == ["S", "P", "out"] and rep.first_difference == "P"
    assert rep.responsible == "the exp model" and not rep.bit_exact and "P" in rep and "m" not in rep
    assert compare(dev, sim, stages=["out", "P"]).first_difference == "out"
    assert compare(dev, sim, stages=["S"]).bit_exact
    text = str(rep)
    assert "first difference at P (first at (2,): device 2.0 (0x40000000), simulated 1.0 (0x3f800000))" in text
    assert "depends on: the exp model" in text


def test_to_json_is_strict_and_complete():
    sim = {"l": np.array([np.nan, 1.0, np.inf], np.float32)}
    dev = {"l": np.array([1.0, 1.0, -np.inf], np.float32)}
    rep = compare(dev, sim, meta={"case": 3})
    data = json.loads(rep.to_json(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert data["case"] == 3 and data["first_difference"] == "l" and data["bit_exact"] is False
    (st,) = data["stages"]
    assert st["shape"] == [3] and st["identical"] == 1 and st["nan_mismatch"] == 1 and st["inf_mismatch"] == 1
    assert st["first_mismatch"] == {"index": [0], "device": "1.0 (0x3f800000)", "simulated": "nan (0x7fc00000)"}
    assert isinstance(compare(dev, sim), ComparisonReport)


@pytest.mark.parametrize(("dev", "sim", "kwargs", "match"), [
    ({"x": np.ones(3, np.float32)}, {"x": np.ones(4, np.float32)}, {}, "stage 'x': device has shape"),
    ({"x": np.ones(3, ml_dtypes.bfloat16)}, {"x": np.ones(3, np.float16)}, {}, "neither holding the other"),
    ({"x": np.ones(3, np.float16)}, {"x": np.ones(3, np.uint16)}, {"stages": {"x": "e4m3"}}, "given as e4m3"),
    ({"x": np.ones(3, np.float32)}, {"y": np.ones(3, np.float32)}, {}, "share no stage"),
    ({"x": np.ones(3, np.float32)}, {"x": np.ones(3, np.float32)}, {"stages": ["x", "y"]}, "device has no stage 'y'"),
    ({"x": np.ones(3, np.uint16)}, {"x": np.ones(3, np.float32)}, {}, "uint16 bits, not the 32-bit words"),
    ({"x": np.ones(3, np.float32)}, {"x": np.ones(3, np.float32)}, {"stages": {"x": "bf16"}}, "given as bf16"),
    ({"x": np.ones(3, np.uint16)}, {"x": np.ones(3, np.uint16)}, {"stages": {"x": "bf17"}}, r"stages\['x'\]"),
    ({"x": np.ones(3, bool)}, {"x": np.ones(3, bool)}, {}, "device: stage 'x' has dtype bool"),
    ({"x": np.ones(3)}, {"x": np.ones(3)}, {"stages": "x"}, "stages: expected stage names"),
])
def test_bad_input_names_the_argument(dev, sim, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        compare(dev, sim, **kwargs)


def test_cli_compare_files(tmp_path, capsys):
    sim = {"S": np.linspace(0, 1, 8, dtype=np.float32), "out": np.linspace(0, 1, 8).astype(ml_dtypes.bfloat16)}
    dev = {"S": sim["S"], "out": sim["out"].view(np.uint16)}  # a device dump: BF16 as raw bits
    np.savez(tmp_path / "dev.npz", **dev)
    np.savez(tmp_path / "sim.npz", **sim)  # ml_dtypes' BF16 as np.save writes it (void words)
    args = ["compare", str(tmp_path / "dev.npz"), str(tmp_path / "sim.npz")]
    assert main(args + ["--format", "out=bf16"]) == 0
    assert "every stage bit-identical" in capsys.readouterr().out
    dev["out"] = dev["out"].copy()
    dev["out"][5] += 1
    np.savez(tmp_path / "dev.npz", **dev)
    assert main(args + ["--format", "out=bf16", "--json"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["first_difference"] == "out" and data["stages"][1]["identical"] == 7
    assert main(args + ["--stages", "S"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(args + ["--format", "P=bf16"])
    assert e.value.code == 2 and "--format: 'P' is not among the stages" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["compare", str(tmp_path / "none.npz"), str(tmp_path / "sim.npz")])
    assert e.value.code == 1 and "compare:" in capsys.readouterr().err
