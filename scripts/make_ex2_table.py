"""Build amla_sim/arith/ex2_sm90.npz, the MUFU.EX2 core table, from the H200 capture in tests/data.

    python scripts/make_ex2_table.py

tests/data/triton_exp2_unit.npz holds tl.exp2 on every FP32 in [1, 2) as the ulp difference from the correctly
rounded value (scripts/capture_device.py). Adding it back gives the unit's 24-bit significand M(f) of 2^(f / 2^23)
for every 23-bit fraction f. The table stores M(0) and the steps M(f + 1) - M(f) (0 to 3), which compress to
140 KB; amla_sim.arith.elementwise sums them back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent.parent


def main() -> None:
    diff = np.load(ROOT / "tests" / "data" / "triton_exp2_unit.npz")["ulp_diff"].astype(np.int64)
    x = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)  # 1 + f / 2^23
    cr = np.exp2(x.astype(np.float64)).astype(np.float32)
    M = (cr.view(np.int32).astype(np.int64) + diff) & ((1 << 23) - 1) | (1 << 23)  # device significand
    step = np.diff(M)
    assert M[0] == 1 << 23 and step.min() >= 0 and step.max() <= 255
    np.savez_compressed(ROOT / "amla_sim" / "arith" / "ex2_sm90.npz", first=M[:1].astype(np.uint32),
                        step=step.astype(np.uint8))
    print(f"M(0) = {M[0]:#x}, steps {dict(zip(*np.unique(step, return_counts=True)))}")


if __name__ == "__main__":
    main()
