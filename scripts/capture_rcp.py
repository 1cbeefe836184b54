"""Record MUFU.RCP (rcp.approx.ftz.f32) on every FP32 in [1, 2), and how Triton lowers a / b, for modelling
div.full.f32 (the division AMLA's kernels use in hardware mode).

Run on a CUDA machine with torch and triton:  python scripts/capture_rcp.py OUTDIR

Writes rcp_unit.npz: ``ulp_diff``, rcp.approx.ftz.f32(x) minus the correctly rounded 1/x in ulps for every x in
[1, 2); and prints the PTX that Triton emits for ``a / b``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from capture_device import binary_kernel  # noqa: E402


@triton.jit
def rcp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                  pack=1)
    tl.store(y_ptr + offs, y, mask=mask)


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    x = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
    xt = torch.from_numpy(x).cuda()
    y = torch.empty_like(xt)
    rcp_kernel[(triton.cdiv(x.size, 1024),)](xt, y, x.size, 1024)
    y = y.cpu().numpy()
    cr = (1.0 / x.astype(np.float64)).astype(np.float32)
    diff = y.view(np.int32).astype(np.int64) - cr.view(np.int32).astype(np.int64)
    print("rcp.approx on [1,2): ulp diff histogram", dict(zip(*np.unique(diff, return_counts=True))))
    np.savez_compressed(os.path.join(out, "rcp_unit.npz"), ulp_diff=np.clip(diff, -127, 127).astype(np.int8))
    a = torch.ones(1024, device="cuda")
    k = binary_kernel[(1,)](a, a, a, torch.empty_like(a), 1024, 0, 1024)
    ptx = k.asm["ptx"]
    print("\n".join(line for line in ptx.splitlines() if any(w in line for w in ("div", "rcp", "mul", "fma", "setp",
                                                                                  "selp", "abs"))))
    sass = k.asm.get("sass", "")
    print("\n".join(line for line in sass.splitlines() if any(w in line for w in ("MUFU", "FMUL", "FFMA", "FSETP",
                                                                                   "FSEL", "FCHK", "CALL")))[:3000])


if __name__ == "__main__":
    main()
