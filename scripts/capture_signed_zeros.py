"""Record how Hopper's tensor cores sign exact zeros, for tests/test_signed_zeros.py.

Run on a CUDA machine with torch and triton:  python scripts/capture_signed_zeros.py OUTDIR

One 64 x 32 tile, BF16 inputs with K = 16 and 32, an FP32 accumulator loaded from memory, in the two ways
Triton code adds a product to it: ``acc = tl.dot(a, b, acc)`` and ``acc += tl.dot(a, b)``. The rows of a, the
columns of b and the accumulator cycle through signed zeros, exact cancellations, subnormals and plain values,
so that many elements sum to an exact zero. Writes signed_zeros.npz (operands and results as raw bits) and, where
PyPI mmasim is installed, MMA-Sim's WGMMA result for the first form.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
import torch
import triton
import triton.language as tl

M, N = 64, 32


def operands(K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(K)
    x = rng.standard_normal(K // 2)
    tiny = 2.0**-133  # BF16's smallest subnormal
    rows = [np.full(K, -0.0), np.zeros(K), np.tile([0.0, -0.0], K // 2), np.repeat(x, 2) * np.tile([1, -1], K // 2),
            rng.standard_normal(K), np.tile([-0.0, tiny, -tiny, 0.0], K // 4), np.where(rng.random(K) < 0.5, -0.0,
            rng.standard_normal(K)), np.repeat(x * 1e30, 2) * np.tile([1, -1], K // 2)]
    cols = [np.ones(K), -np.ones(K), np.full(K, -0.0), rng.standard_normal(K)]
    a = np.stack([rows[i % len(rows)] for i in range(M)])
    b = np.stack([cols[j % len(cols)] for j in range(N)], axis=1)
    accs = np.array([0.0, -0.0, -(2.0**-149), 2.0**-149, 1.0, -1.0, 2.0**-100, -3.0], dtype=np.float32)
    c = accs[(np.arange(M)[:, None] // 8 + np.arange(N)[None, :]) % len(accs)]
    return a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16), c


@triton.jit
def dot_acc_kernel(a_ptr, bt_ptr, c_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, FUSED: tl.constexpr):
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc = tl.load(c_ptr + offs_m[:, None] * N + offs_n[None, :])
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :])
        b = tl.load(bt_ptr + offs_n[None, :] * K + (k0 + offs_k)[:, None])  # B stored (N, K): K-major
        if FUSED:
            acc = tl.dot(a, b, acc)
        else:
            acc += tl.dot(a, b)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc)


def main() -> None:
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    res: dict[str, np.ndarray] = {"device": np.array(torch.cuda.get_device_name())}
    for K in (16, 32):
        a, b, c = operands(K)
        a_t = torch.from_numpy(a.view(np.int16).copy()).cuda().view(torch.bfloat16)
        bt_t = torch.from_numpy(np.ascontiguousarray(b.T).view(np.int16).copy()).cuda().view(torch.bfloat16)
        c_t = torch.from_numpy(c.copy()).cuda()
        res[f"K{K}/a"], res[f"K{K}/b"], res[f"K{K}/c"] = a.view(np.uint16), b.view(np.uint16), c.view(np.uint32)
        for fused in (True, False):
            out = torch.empty((M, N), device="cuda", dtype=torch.float32)
            kern = dot_acc_kernel[(1,)](a_t, bt_t, c_t, out, K, N, M, N, 16, fused, num_warps=4)
            torch.cuda.synchronize()
            assert "wgmma" in kern.asm["ptx"]
            res[f"K{K}/{'fused' if fused else 'add'}"] = out.cpu().numpy().view(np.uint32)
        try:
            from mmasim.nv_ptx import WGMMA
        except ImportError:
            continue
        sim = WGMMA("Hopper", "m64n8k16.f32.bf16.bf16")
        acc = torch.from_numpy(c.copy())
        for k0 in range(0, K, 16):  # one wgmma per k16, chained through the accumulator
            parts = []
            for j0 in range(0, N, 8):
                A = torch.from_numpy(a[:, k0:k0 + 16].view(np.int16).copy()).view(torch.bfloat16)
                B = torch.from_numpy(np.ascontiguousarray(b[k0:k0 + 16, j0:j0 + 8]).view(np.int16)).view(torch.bfloat16)
                parts.append(sim(A, B, acc[:, j0:j0 + 8].contiguous()))
            acc = torch.cat(parts, dim=1)
        res[f"K{K}/mmasim"] = acc.numpy().view(np.uint32)
    np.savez_compressed(os.path.join(out_dir, "signed_zeros.npz"), **res)
    print({k: v.shape for k, v in res.items()})


if __name__ == "__main__":
    main()
