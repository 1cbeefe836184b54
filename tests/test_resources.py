"""Resource bounds (issue 15, R11): the memory estimate against measured peaks, and refusals before any work."""

import tracemalloc

import numpy as np
import pytest

from amla_sim.algorithms import ALGORITHMS, golden
from amla_sim.experiments.inputs import make_inputs
from amla_sim.experiments.metrics import all_metrics
from amla_sim.resources import _BASE, ResourceError, available_bytes, check_fits, run_bytes


@pytest.mark.parametrize("alg", ["base", "snapmla"])
@pytest.mark.parametrize("b, sq, G, L", [(1, 1, 32, 4096), (2, 2, 16, 2048), (1, 1, 128, 1024)])
def test_estimate_bounds_the_measured_peak_of_the_run_path(alg, b, sq, G, L):
    tracemalloc.start()
    try:
        q, kv = make_inputs("normal:1", batch=b, sq=sq, heads=G, context=L, fmt="fp32" if alg == "snapmla" else "bf16")
        res = ALGORITHMS[alg](q, kv, machine="ieee32")
        all_metrics(res.out, golden(q, kv).out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    est = run_bytes(batch=b, sq=sq, heads=G, context=L) - _BASE  # tracemalloc sees arrays, not the interpreter
    assert peak <= est <= 3 * peak, (peak, est)


def test_the_estimate_grows_with_every_size():
    one = run_bytes(batch=1, sq=1, heads=8, context=1024)
    for kw in ({"batch": 2}, {"sq": 2}, {"heads": 16}, {"context": 2048}):
        assert run_bytes(**{"batch": 1, "sq": 1, "heads": 8, "context": 1024, **kw}) > one
    assert run_bytes(batch=1, sq=1, heads=8, context=1024, mufu_tables=True) > one


def test_refusal_names_the_arguments_that_lower_it():
    assert available_bytes() > 0
    with pytest.raises(ResourceError, match=r"needs about 1\.0 GiB .* lower --context") as e:
        check_fits(2**30, what="run", lower="--context", limit=2**20)
    assert isinstance(e.value, ValueError)
    check_fits(2**20, what="run", lower="--context", limit=2**30)


def test_a_million_tokens_at_128_heads_needs_about_12_gib():
    # 576 M cache elements at 16 bytes and 128 M FP64 scores at 32 bytes, with the fixed costs
    assert np.isclose(run_bytes(batch=1, sq=1, heads=128, context=1_000_000) / 2**30, 12.5, atol=0.1)
