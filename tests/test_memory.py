"""Global memory with atomics: order laws as properties, and the H200's atomics as captures."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from amla_sim.arith.memory import GlobalMemory
from amla_sim.bits import mul_pow2_via_int_add
from amla_sim.testing import assert_bitwise_equal, float_arrays

DATA = Path(__file__).parent / "data"


@given(data=st.data())
def test_int32_atomics_are_order_independent(data):
    buf = data.draw(float_arrays("fp32", (6,), allow_nan=True, allow_infinity=True))
    adds = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=6))
    writers = [np.int64(a) for a in adds]
    results = []
    for order, seed in [("program", None), ("reversed", None), ("random", 1), ("random", 2)]:
        mem = GlobalMemory(buf, order=order, seed=seed)
        mem.atomic_add_int32(writers)
        results.append(mem.int32)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    want = (buf.view(np.int32).astype(np.int64) + sum(adds)) % 2**32
    np.testing.assert_array_equal(results[0].view(np.uint32).astype(np.int64), want)


@given(data=st.data())
def test_fp32_atomics_depend_on_order_reproducibly(data):
    vals = data.draw(st.lists(float_arrays("fp32", (3,), min_value=-1e6, max_value=1e6), min_size=2, max_size=5))
    seed = data.draw(st.integers(0, 2**31))
    a = GlobalMemory(np.zeros(3, np.float32), order="random", seed=seed)
    b = GlobalMemory(np.zeros(3, np.float32), order="random", seed=seed)
    a.atomic_add_fp32(vals)
    b.atomic_add_fp32(vals)
    assert_bitwise_equal(a.fp32, b.fp32)


def test_fp32_order_dependence_exists():
    vals = [np.float32(1.0), np.float32(2.0**-24), np.float32(2.0**-24)]
    prog = GlobalMemory(np.zeros(1, np.float32), order="program")
    rev = GlobalMemory(np.zeros(1, np.float32), order="reversed")
    prog.atomic_add_fp32(vals)
    rev.atomic_add_fp32(vals)
    assert prog.fp32[0] == np.float32(1.0) and rev.fp32[0] == np.float32(1.0 + 2.0**-23)


def test_trace_records_arrival():
    mem = GlobalMemory(np.zeros(2, np.float32), order="reversed", trace=True)
    mem.atomic_add_int32([np.int32(1), np.int32(2)])
    mem.atomic_add_fp32([np.float32(1.0)])
    assert [(t.op, t.call, t.writer, t.position) for t in mem.trace] == [
        ("int32", 0, 1, 0), ("int32", 0, 0, 1), ("fp32", 1, 0, 0)]


@pytest.fixture(scope="module")
def cap():
    return np.load(DATA / "triton_atomics.npz")


def test_device_fp32_sums_are_among_the_simulators_orders(cap):
    """Every sum the device showed is one the simulator reaches in some arrival order. The sums of all 8! orders
    come from the writers' subsets (a subset's sums: each of its writers added last onto the rest's sums, FP32 adds
    of normal numbers), each with one order that gives it; that order then runs through GlobalMemory."""
    v = cap["f32_small_values"]
    n = v.size
    reach: list[dict[bytes, list[int]]] = [{np.float32(0).tobytes(): []}]  # subset mask -> {sum's bits: an order}
    for mask in range(1, 1 << n):
        sums: dict[bytes, list[int]] = {}
        for i in (i for i in range(n) if mask >> i & 1):
            for bits, order in reach[mask ^ 1 << i].items():
                sums.setdefault((np.frombuffer(bits, np.float32)[0] + v[i]).tobytes(), order + [i])
        reach.append(sums)
    every = reach[-1]

    def through_memory(order):
        mem = GlobalMemory(np.zeros(1, np.float32))
        mem.atomic_add_fp32([v[i] for i in order])
        return mem.fp32[0].tobytes()

    rng = np.random.default_rng(0)
    assert all(through_memory(rng.permutation(n)) in every for _ in range(64))  # the subsets hold the simulator's
    observed = set(cap["f32_small_sums"].astype(np.float32).tobytes()[k:k + 4]
                   for k in range(0, 4 * cap["f32_small_sums"].size, 4))
    assert len(every) > 10 and len(observed) > 1  # the order matters, on the device too
    for bits in observed:
        assert bits in every and through_memory(every[bits]) == bits


def test_device_fp32_big_sums_vary_like_orders(cap):
    v, sums = cap["f32_big_values"], cap["f32_big_sums"]
    sim = set()
    for seed in range(20):
        mem = GlobalMemory(np.zeros(1, np.float32), order="random", seed=seed)
        mem.atomic_add_fp32(list(v))
        sim.add(float(mem.fp32[0]))
    exact = float(np.sum(v.astype(np.float64)))
    bound = v.size * 2.0**-24 * np.abs(v).sum()  # a crude bound on any order's rounding error
    assert len(set(sums.tolist())) > 1 and len(sim) > 1
    assert all(abs(s - exact) <= bound for s in list(sums) + list(sim))


def test_device_flushes_subnormals(cap):
    mem = GlobalMemory(np.zeros(1, np.float32))
    mem.atomic_add_fp32(np.float32([3e-39]))
    assert_bitwise_equal(mem.fp32, cap["f32_subnormal_one"])
    mem = GlobalMemory(np.zeros(1, np.float32))
    mem.atomic_add_fp32(list(cap["f32_subnormal_pair_values"]))
    assert_bitwise_equal(mem.fp32, cap["f32_subnormal_pair"])


def test_device_int32_adds_on_fp32_buffer(cap):
    mem = GlobalMemory(cap["i32_buf_before"], order="random", seed=0)
    mem.atomic_add_int32(list(cap["i32_adds"]))
    assert_bitwise_equal(mem.fp32, cap["i32_buf_after"])
    # an add of n * 2^23 is Lemma 3.1's trick, in the buffer
    buf = cap["i32_buf_before"]
    mem = GlobalMemory(buf)
    mem.atomic_add_int32(np.int32(-3 << 23))
    assert_bitwise_equal(mem.fp32, mul_pow2_via_int_add(buf, -3))


def test_bad_input():
    with pytest.raises(ValueError, match="order"):
        GlobalMemory(np.zeros(2, np.float32), order="lifo")
    with pytest.raises(ValueError, match="seed"):
        GlobalMemory(np.zeros(2, np.float32), order="random")
    mem = GlobalMemory(np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="values"):
        mem.atomic_add_int32([np.float32(1.0)])
    with pytest.raises(ValueError, match="values"):
        mem.atomic_add_fp32([np.zeros(3, np.float32)])
