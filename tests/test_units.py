"""Machines as sets of unit models, schedules apart from them: swapping one unit changes that unit only."""

from dataclasses import replace

import numpy as np
import pytest

from amla_sim.algorithms import ALGORITHMS, amla, base, etap
from amla_sim.arith import elementwise as ew
from amla_sim.arith import mma
from amla_sim.crosscheck.own import load_capture
from amla_sim.experiments.grid import Grid, sample_errors
from amla_sim.experiments.inputs import make_inputs
from amla_sim.machines import get_machine
from amla_sim.schedules import SCHEDULES, Schedule, get_schedule
from amla_sim.testing import assert_bitwise_equal
from amla_sim.units import DivUnit, ExpUnit, LogUnit, MatrixUnit, ReduceUnit

DATA = "tests/data/"


@pytest.fixture(scope="module")
def x():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((4, 64)) * 8).astype(np.float32), rng.uniform(0.5, 4, (4, 64)).astype(np.float32)


@pytest.mark.parametrize("unit, value, method", [
    ("division", DivUnit("ieee"), "div"), ("exponential", ExpUnit("correctly-rounded"), "exp"),
    ("reduction", ReduceUnit("sequential"), "rowsum")])
def test_a_what_if_machine_differs_in_the_swapped_unit_only(x, unit, value, method):
    a, b = x
    hw, whatif = get_machine("sm90-triton"), get_machine("sm90-triton", **{unit: value})
    calls = {"div": lambda m: m.div(a, b), "exp": lambda m: m.exp(-np.abs(a)), "rowsum": lambda m: m.rowsum(a),
             "mul_add": lambda m: m.mul_add(a, b, a), "matmul": lambda m: m.matmul(a.astype("float32"), b.T),
             "cast": lambda m: m.cast(a, "bf16"), "log": lambda m: m.log(b)}
    for name, call in calls.items():
        same = np.array_equal(call(hw).view(np.uint8), call(whatif).view(np.uint8))
        assert same != (name == method), name  # the swapped unit's results change, nothing else does


def test_a_what_if_machine_says_what_it_is():
    """Swapping a unit makes another machine: its name says which unit, and it no longer claims the captures."""
    whatif = get_machine("sm90-triton", division=DivUnit("ieee"))
    assert whatif.name == "sm90-triton with division=DivUnit(mode='ieee')" and not whatif.verified
    assert get_machine("sm90-triton", division=DivUnit("sm90")) == get_machine("sm90-triton")  # nothing swapped
    assert get_machine("ieee32", division=DivUnit("sm90"), name="mine", verified=True).verified


def test_the_swapped_unit_computes_its_model(x):
    a, b = x
    assert_bitwise_equal(get_machine("sm90-triton", division=DivUnit("ieee")).div(a, b), ew.div(a, b, mode="ieee"))
    assert_bitwise_equal(get_machine("ieee32", division=DivUnit("sm90")).div(a, b), ew.div(a, b, mode="sm90"))


def test_a_wider_accumulator_is_one_row_away():
    """sm90 with 27 aligned fraction bits instead of 25: a what-if matrix unit from a model row of one's own. The
    hardware's row rebuilt by hand gives the named model's bits; the wider one moves some of them."""
    row = mma.MODEL_TABLE["sm90"].rows["bf16"]
    q, kv = make_inputs("normal:1", heads=64, context=512, seed=2)
    a, bt = q[0, 0], kv[0].T
    hw = get_machine("sm90-triton").matmul(a, bt)
    rebuilt = mma.MMAModel("sm90-by-hand", {"bf16": replace(row)})
    assert_bitwise_equal(get_machine("sm90-triton", matrix=MatrixUnit(rebuilt)).matmul(a, bt), hw)
    wide = get_machine("sm90-triton", matrix=MatrixUnit(mma.MMAModel("sm90-f27", {"bf16": replace(row, F=27)})))
    moved = np.mean(wide.matmul(a, bt).view(np.uint32) != hw.view(np.uint32))
    assert 0.01 < moved < 0.9, moved


@pytest.mark.parametrize("make, argname", [
    (lambda: ExpUnit("fast"), "mode"), (lambda: DivUnit("rn"), "mode"), (lambda: LogUnit(ln="exact"), "ln"),
    (lambda: ReduceUnit("tree"), "order"), (lambda: MatrixUnit("sm100"), "model"),
    (lambda: get_machine("ieee32", exp=ExpUnit()), "exp"), (lambda: get_machine("h100"), "machine"),
    (lambda: Schedule(dot_k=0), "dot_k"), (lambda: Schedule(reduce_layout=(2, 4)), "reduce_layout"),
    (lambda: Schedule(etap_lanes=0), "etap_lanes"), (lambda: get_schedule("triton"), "schedule"),
    (lambda: Grid(algorithms=("base",), schedule="triton"), "schedule"),
    (lambda: amla(*make_inputs("normal:1", heads=2, context=64), guard=-1.0), "guard"),
])
def test_bad_units_and_schedules_name_the_argument(make, argname):
    with pytest.raises((ValueError, TypeError), match=argname):
        make()


def test_the_schedule_decides_the_block_constraint():
    q, kv = make_inputs("normal:1", heads=2, context=100)
    base(q, kv, machine="sm90-triton", block=12)  # the reference schedule sums a row in Triton's own layout
    with pytest.raises(ValueError, match="block: schedule amla-sim-gpu .* multiple of 8"):
        base(q, kv, machine="sm90-triton", schedule="amla-sim-gpu", block=12)
    with pytest.raises(ValueError, match="etap_lanes must divide block"):
        etap(q, kv, schedule=get_schedule("reference", etap_lanes=5))


def test_kernel_bits_need_the_kernel_schedule():
    """A device capture is reproduced by the machine with the kernel's schedule, and not without it: the row-sum
    layout is the kernel's, not the hardware's."""
    meta, q, kv, device = load_capture(DATA + "crosscheck_amla_hw.npz")
    bits = np.asarray(device["l"][-1]).view(np.uint32)  # the row sums after the last block
    same = {s: np.mean(amla(q, kv, machine="sm90-triton", schedule=s, scale=meta["scale"], trace=True)
                       .trace["l"][-1].view(np.uint32) == bits) for s in SCHEDULES}
    assert same["amla-sim-gpu"] == 1 and same["reference"] < 1, same


@pytest.mark.parametrize("name", ["base", "amla", "etap"])
def test_a_schedule_runs_on_any_machine(name):
    """Machine and schedule are independent: the kernel schedule on the exact FP32 machine changes nothing where
    the unit's order ignores the layout (sequential sums, exact products, padding with masked zeros)."""
    q, kv = make_inputs("normal:1", heads=4, sq=2, context=300, seed=5)
    a = ALGORITHMS[name](q, kv, machine="ieee32", schedule="amla-sim-gpu")
    b = ALGORITHMS[name](q, kv, machine="ieee32")
    if name == "etap":  # ETAP's lanes are the schedule's: 64 partial sums per row instead of 4
        assert not np.array_equal(a.lse.view(np.uint32), b.lse.view(np.uint32))
    else:
        assert_bitwise_equal(a.out, b.out)
        assert_bitwise_equal(a.lse, b.lse)


def test_a_sweep_spec_may_name_its_own_schedule():
    kw = dict(dist="normal:1", seed=3, heads=4, sq=1, context=200, machine="sm90-triton")
    assert sample_errors(["base"], schedule="amla-sim-gpu", block=64, **kw) == \
        sample_errors(["base:schedule=amla-sim-gpu"], block=64, **kw)
    sample_errors(["base"], block=12, **kw)  # the schedule arrives: a block the kernel's layout cannot tile fails
    for where in ({"schedule": "amla-sim-gpu", "specs": ["base"]}, {"specs": ["base:schedule=amla-sim-gpu"]}):
        with pytest.raises(ValueError, match="multiple of 8"):
            sample_errors(where.pop("specs"), block=12, **where, **kw)


@pytest.mark.parametrize("machine", ["sm90-triton", "sm90-cuda", "ieee32", "ieee32-fast", "golden"])
@pytest.mark.parametrize("engine_name", ["numpy", "numba"])
@pytest.mark.parametrize(("rows", "keys"), [(64, 1000), (16, 4096), (3, 130)])
def test_a_product_of_many_blocks_has_each_blocks_bits(machine, engine_name, rows, keys):
    """matmul_blocks (the scores of every block at once) against one product a block, as the kernels make them:
    the same bits on every machine (the columnwise ones join blocks; BLAS machines do not)."""
    from amla_sim.engine import use_engine
    from amla_sim.experiments.inputs import make_inputs
    from amla_sim.machines import get_machine

    mc = get_machine(machine)
    q, kv = make_inputs("normal:1", heads=rows, context=keys, seed=rows + keys)
    a, b = mc.operand(q[0, 0]), mc.operand(np.ascontiguousarray(kv[0].T))
    with use_engine(engine_name):
        joined = mc.matmul_blocks(a, b, block=64)
        apart = np.concatenate([mc.matmul(a, b[:, j:j + 64]) for j in range(0, keys, 64)], axis=1)
    assert joined.dtype == apart.dtype and np.array_equal(joined.view(np.uint8), apart.view(np.uint8))
    assert (mc.block_width(rows, 64) > 64) == (machine not in ("ieee32-fast", "golden"))
