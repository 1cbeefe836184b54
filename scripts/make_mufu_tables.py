"""Build the MUFU tables of amla_sim.arith.elementwise from the H200 captures in tests/data.

    python scripts/make_mufu_tables.py

ex2_sm90.npz: tests/data/triton_exp2_unit.npz holds tl.exp2 on every FP32 in [1, 2) as the ulp difference from
the correctly rounded value (scripts/capture_device.py); adding it back gives the unit's 24-bit significand
M(f) of 2^(f / 2^23) for every 23-bit fraction f. Stored as M(0) and the steps M(f + 1) - M(f) (0 to 3).

rcp_sm90.npz: tests/data/div_edges.npz holds rcp.approx.ftz.f32 on every FP32 in [1, 2) the same way
(scripts/capture_div_edges.py); adding it back gives the FP32 bits of the unit's 1/m for every significand m.
Stored as the first bits and the steps (-2 to 0).

Both compress to about 140 KB; the package sums the steps back.

tanh_sm90.npz (``python scripts/make_mufu_tables.py --tanh DUMP``): DUMP is ``scripts/probe_tanh.py dump``'s file
(tanh.approx.f32 on every FP32 of the binades 2^-8 to 2^4, 36 MB, not committed). In each binade 2^e, e = -8 to 2,
the unit's output is constant over runs of 2^k consecutive inputs (it reads the fraction's top 23 - k bits); stored
per binade: k, the output bits of each run's first input as the first and the steps. From 8 up the output is 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent.parent
UNIT = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)  # every FP32 in [1, 2)


def device_bits(diff: np.ndarray, correctly_rounded: np.ndarray) -> np.ndarray:
    return correctly_rounded.astype(np.float32).view(np.int32).astype(np.int64) + diff.astype(np.int64)


def save(name: str, bits: np.ndarray, lo: int, hi: int) -> None:
    step = np.diff(bits)
    assert lo <= step.min() and step.max() <= hi, (name, step.min(), step.max())
    np.savez_compressed(ROOT / "amla_sim" / "arith" / name, first=bits[:1].astype(np.uint32),
                        step=step.astype(np.int8))
    print(f"{name}: first {bits[0]:#x}, steps {dict(zip(*np.unique(step, return_counts=True)))}")


def tanh_table(dump: str) -> None:
    """tanh_sm90.npz from the probe's dump (the module docstring)."""
    out = {}
    with np.load(dump) as z:
        for e in range(-8, 3):
            y = np.cumsum(z[f"e{e}"].astype(np.int64))
            k = max(k for k in range(13) if (y.reshape(-1, 1 << k) == y.reshape(-1, 1 << k)[:, :1]).all())
            runs = y[:: 1 << k]
            step = np.diff(runs)
            assert -32768 <= step.min() and step.max() < 32768, (e, step.min(), step.max())
            out[f"e{e}_shift"], out[f"e{e}_first"], out[f"e{e}_step"] = np.int8(k), np.uint32(runs[0]), step.astype(
                np.int16)
            print(f"2^{e}: runs of {1 << k}, {runs.size} entries, steps {step.min()} to {step.max()}")
        for e in (3, 4):
            assert (np.cumsum(z[f"e{e}"].astype(np.int64)) == 0x3F800000).all(), e  # 1 from 8 up
    np.savez_compressed(ROOT / "amla_sim" / "arith" / "tanh_sm90.npz", **out)


def main() -> None:
    if sys.argv[1:2] == ["--tanh"]:
        tanh_table(sys.argv[2])
        return
    data = ROOT / "tests" / "data"
    ex2 = device_bits(np.load(data / "triton_exp2_unit.npz")["ulp_diff"], np.exp2(UNIT.astype(np.float64)))
    save("ex2_sm90.npz", ex2 & ((1 << 23) - 1) | (1 << 23), 0, 127)  # the significand of 2^(1 + f) = of 2^f
    rcp = device_bits(np.load(data / "div_edges.npz")["unit_diff"], 1.0 / UNIT.astype(np.float64))
    save("rcp_sm90.npz", rcp, -127, 0)


if __name__ == "__main__":
    main()
