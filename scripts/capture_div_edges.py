"""Record Triton's a / b (div.full.f32) and rcp.approx.ftz.f32 where their range handling shows: subnormal,
tiny, huge and special divisors and dividends; and print the PTX Triton emits for a / b.

Run on a CUDA machine with torch and triton:  python scripts/capture_div_edges.py OUTDIR

Writes div_edges.npz: ``a``, ``b``, ``div`` (a / b in a Triton kernel), ``rcp_x`` and ``rcp`` (the PTX
instruction on its own), and ``unit_diff``: rcp.approx.ftz.f32 on every FP32 in [1, 2) as the ulp difference
from the correctly rounded 1 / x (the table of amla_sim's div.full model).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

from capture_device import binary_kernel, run_binary


@triton.jit
def rcp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                  pack=1)
    tl.store(y_ptr + offs, y, mask=mask)


def rcp(x: np.ndarray) -> np.ndarray:
    xt = torch.from_numpy(x).cuda()
    y = torch.empty_like(xt)
    rcp_kernel[(triton.cdiv(x.size, 1024),)](xt, y, x.size, 1024)
    return y.cpu().numpy()


def operands() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    edges = []
    for e in (-149, -140, -127, -126, -125, -100, -64, -1, 0, 1, 63, 100, 125, 126, 127):
        for m in (1.0, 1.5, 1.9999999):
            edges += [m * 2.0**e, -m * 2.0**e]
    edges += [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38]
    edges = np.array(edges, dtype=np.float32)
    a, b = np.meshgrid(edges, edges)
    rand_b = np.concatenate([rng.uniform(1, 2, 4096) * 2.0 ** rng.integers(-149, 128, 4096),
                             rng.uniform(1, 2, 4096) * 2.0 ** rng.integers(120, 128, 4096),
                             rng.uniform(1, 2, 4096) * 2.0 ** rng.integers(-149, -120, 4096)])
    rand_b *= rng.choice([-1, 1], rand_b.size)
    rand_a = rng.uniform(1, 2, rand_b.size) * 2.0 ** rng.integers(-149, 128, rand_b.size)
    a = np.concatenate([a.ravel(), rand_a]).astype(np.float32)
    b = np.concatenate([b.ravel(), rand_b]).astype(np.float32)
    return a, b, edges


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    a, b, edges = operands()
    res = {"a": a, "b": b, "div": run_binary(a, b, np.ones_like(a), 0)}
    sub = np.arange(1, 1 << 23, 97, dtype=np.uint32).view(np.float32)  # subnormal inputs of both signs
    rx = np.concatenate([edges, sub, -sub, b]).astype(np.float32)
    res["rcp_x"], res["rcp"] = rx, rcp(rx)
    x = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
    cr = (1.0 / x.astype(np.float64)).astype(np.float32)
    diff = rcp(x).view(np.int32).astype(np.int64) - cr.view(np.int32).astype(np.int64)
    res["unit_diff"] = np.clip(diff, -127, 127).astype(np.int8)
    np.savez_compressed(os.path.join(out, "div_edges.npz"), **res)
    print("div edges:", a.size, "pairs;", rx.size, "rcp inputs; unit diff", dict(zip(*np.unique(diff, return_counts=True))))
    ones = torch.ones(1024, device="cuda")
    ptx = binary_kernel[(1,)](ones, ones, ones, torch.empty_like(ones), 1024, 0, 1024).asm["ptx"]
    print("a / b in PTX:", sorted({line.split()[0] for line in ptx.splitlines() if "div" in line}))


if __name__ == "__main__":
    main()
