"""Kernel benchmark on the GPU: Base and AMLA on the AMLA paper's Table 5 grid, against the measured bf16 peak.

    python scripts/bench_kernels.py [--out results.json]

Batch 96, 128 heads, s_q in {1, 2}, context in {1K, 2K, 3K, 4K, 6K, 16K}. Times are medians of
triton.testing.do_bench (CUDA events). FLOPs are the useful ones, 2 b h s_q S (576 + 512) (FlashMLA's formula);
FU is TFLOP/s over the bf16 peak of a large torch.matmul measured in the same run. The kernels run in their
hardware mode (tl.exp, '/'), as a production kernel would. Reference: a plain torch implementation
(cuBLAS bmm, FP32 softmax, cuBLAS bmm).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from amla_sim.gpu.kernels import mla_decode_kernel

B, H, D, DV = 96, 128, 576, 512
BLOCK = 64


def peak_bf16() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * n**3 / ms / 1e9  # TFLOP/s


def kernel_fn(algo: int, q, kv, out, obuf, sq: int, S: int):
    R = sq * H
    nblk = triton.cdiv(S, BLOCK)
    dummy = torch.zeros(1, device="cuda", dtype=torch.float32)
    dummy_i = torch.zeros(1, device="cuda", dtype=torch.int32)
    grid = (triton.cdiv(R, 64), B, 2)

    def run():
        mla_decode_kernel[grid](q, kv, out, obuf, obuf.view(torch.int32), dummy, dummy, dummy, dummy, dummy,
                                dummy_i, dummy, R, S, H, sq, nblk, D ** -0.5, D=D, DV=DV, DVH=DV // 2,
                                BLOCK_M=64, BLOCK_N=BLOCK, ALGO=algo, EXP_MODE=0, DIV_MODE=0, DEBUG=False,
                                num_warps=4, num_stages=1, enable_fp_fusion=False)
    return run


def torch_ref(q, kv, sq: int):
    def run():
        s = torch.bmm(q, kv.transpose(1, 2)).float() * D ** -0.5
        p = torch.softmax(s, dim=-1).to(torch.bfloat16)
        return torch.bmm(p, kv[..., :DV])
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    peak = peak_bf16()
    name = torch.cuda.get_device_name()
    print(f"{name}: measured bf16 matmul peak {peak:.0f} TFLOP/s (8192^3 torch.matmul)")
    rows = []
    print(f"{'s_q':>3s} {'ctx':>6s} | {'Base ms':>8s} {'TF/s':>6s} {'FU':>6s} | {'AMLA ms':>8s} {'TF/s':>6s} {'FU':>6s}"
          f" | {'AMLA/Base':>9s} | {'torch ms':>8s} {'TF/s':>6s}")
    for sq in (1, 2):
        for S in (1024, 2048, 3072, 4096, 6144, 16384):
            R = sq * H
            q = torch.randn(B, R, D, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(B, R, DV, device="cuda", dtype=torch.bfloat16)
            obuf = torch.empty(B, R, DV, device="cuda", dtype=torch.float32)
            flops = 2 * B * H * sq * S * (D + DV)
            res = {"sq": sq, "context": S}
            for label, fn in (("base", kernel_fn(0, q, kv, out, obuf, sq, S)), ("amla", kernel_fn(1, q, kv, out, obuf, sq, S)),
                              ("torch", torch_ref(q, kv, sq))):
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                res[label] = {"ms": ms, "tflops": flops / ms / 1e9, "fu": flops / ms / 1e9 / peak}
            res["amla_over_base"] = res["amla"]["ms"] / res["base"]["ms"]
            rows.append(res)
            b_, a_, t_ = res["base"], res["amla"], res["torch"]
            print(f"{sq:3d} {S:6d} | {b_['ms']:8.3f} {b_['tflops']:6.1f} {100 * b_['fu']:5.1f}% | {a_['ms']:8.3f} "
                  f"{a_['tflops']:6.1f} {100 * a_['fu']:5.1f}% | {res['amla_over_base']:9.3f} | {t_['ms']:8.3f} "
                  f"{t_['tflops']:6.1f}", flush=True)
            del q, kv, out, obuf
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "peak_tflops": peak, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
