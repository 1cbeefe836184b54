"""The torch-op machine: the algorithms' own code with torch primitives (skipped where torch is missing)."""

import numpy as np
import pytest

from amla_sim.algorithms import ALGORITHMS, golden
from amla_sim.experiments.inputs import make_inputs
from amla_sim.experiments.metrics import cos_diff
from amla_sim.formats import round_to
from amla_sim.testing import assert_bitwise_equal, ulp_distance

torch = pytest.importorskip("torch")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def mc(request):
    from amla_sim.gpu.torch_machine import torch_machine

    return torch_machine(request.param)


def test_casts_are_round_to_nearest_even(mc):
    x = (np.random.default_rng(0).standard_normal(100_000) * 50).astype(np.float32)
    for fmt in ("bf16", "fp16", "e4m3", "e5m2"):
        assert_bitwise_equal(mc.cast(x, fmt), round_to(x, fmt, overflow="satfinite" if fmt[0] == "e" else "ieee"))


def test_exp_is_close_to_correctly_rounded(mc):
    x = np.random.default_rng(1).uniform(-40, 0, 100_000).astype(np.float32)
    assert np.abs(ulp_distance(mc.exp(x), np.exp(x.astype(np.float64)).astype(np.float32))).max() <= 2


@pytest.mark.parametrize("name", ["base", "amla", "seesaw", "etap"])
def test_bf16_algorithms_on_torch_pass_flashmla_check(mc, name):
    q, kv = make_inputs("normal:1", heads=16, sq=2, context=300, seed=4)
    assert cos_diff(ALGORITHMS[name](q, kv, machine=mc).out, golden(q, kv).out) < 5e-6


def test_snapmla_on_torch_within_the_ports_tolerance(mc):
    q, kv = make_inputs("normal:0.1", heads=16, sq=2, context=300, seed=4, fmt="fp32")
    out = ALGORITHMS["snapmla"](q, kv, machine=mc).out.astype(np.float64)
    ref = golden(q, kv, precision="fp32").out.astype(np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 5e-2


def test_missing_cuda_is_a_clear_message():
    from amla_sim.gpu import GPUUnavailable
    from amla_sim.gpu.torch_machine import torch_machine

    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(GPUUnavailable, match="CUDA"):
        torch_machine("cuda")
