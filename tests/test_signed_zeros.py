"""How the tensor cores sign exact zeros, against an H200 capture (scripts/capture_signed_zeros.py).

Every exact zero the hardware produced is +0: products of -0, an accumulator of -0, and cancelling sums alike,
in both ways a Triton kernel adds a product to its accumulator. MMA-Sim's WGMMA, run on the same operands on the
device, agrees. The sm90 model must give the same bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from amla_sim import mma
from amla_sim.testing import assert_bitwise_equal

DATA = np.load(__file__.replace("test_signed_zeros.py", "data/signed_zeros.npz"))


@pytest.mark.parametrize("K", [16, 32])
@pytest.mark.parametrize("form", ["fused", "add", "mmasim"])
def test_exact_zeros_are_positive_as_on_the_device(K, form, engine):
    a = DATA[f"K{K}/a"].view(ml_dtypes.bfloat16)
    b = DATA[f"K{K}/b"].view(ml_dtypes.bfloat16)
    c = DATA[f"K{K}/c"].view(np.float32)
    want = DATA[f"K{K}/{form}"].view(np.float32)
    assert (want == 0).sum() >= 500  # the capture is mostly exact zeros ...
    negative_zero_inputs = np.signbit(c) & (c == 0) & (a.astype(np.float32) == 0).all(axis=1)[:, None]
    assert negative_zero_inputs.sum() >= 20  # ... among them -0 products onto a -0 accumulator
    assert_bitwise_equal(mma.matmul(a, b, c, model="sm90"), want, err_msg=f"{form}, K = {K}")
