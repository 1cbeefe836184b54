"""SGLang 0.5.23's activation quantizer for kv_b_proj on Hopper (``per_token_group_quant``, its JIT kernel from
``sglang/kernels/jit/csrc/gemm/per_token_group_quant.cuh``, unchanged), compiled on the device with SGLang's JIT flags
(``-DSGL_CUDA_ARCH=900 -std=c++20 -O3 --expt-relaxed-constexpr --use_fast_math``, sm_90a) and launched as its flat
launcher launches it
(256 threads a block, a thread per 8 of a group's 128 values), for BF16 in, E4M3 out, FP32 column-major scales (what
``sglang_per_token_group_quant_fp8`` asks of it for DeepGEMM on Hopper), on
:data:`amla_sim.crosscheck.layer.ACT_QUANT_CASES`.

Run on a CUDA machine:  python scripts/capture_sglang_quant.py OUTDIR BUNDLE_XZ
BUNDLE_XZ: a tarball of SGLang's kernel header and its ``sgl_kernel`` include tree, and apache-tvm-ffi 0.1.11's
headers and library (SGLang's pin). Writes OUTDIR/sglang_quant_{dev}.npz: per case ``c{i}_q`` (M, K) E4M3 bytes and
``c{i}_s`` (M, K / 128) FP32 scales, and ``meta``.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tarfile

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.crosscheck.layer import ACT_QUANT_CASES, act_quant_inputs

WORK = "/tmp/sgl-quant"
# a C entry point around SGLang's kernel: its parameters filled as build_quant_context fills them, its grid as
# launch_flat_kernel computes it
HARNESS = r"""
#include "per_token_group_quant.cuh"
using Trait = sglang::QuantTrait<sglang::bf16_t, sglang::fp8_e4m3_t, 128, /*ue8m0*/ false, /*row major*/ false,
                                 /*aligned*/ true,
                                 /*silu*/ false>;
extern "C" int sgl_quant(void* x, void* q, void* s, int M, int K) {
  sglang::QuantKernelParams p{};
  p.input = sglang::detail::TensorArgs{x, 0, K};
  p.output = sglang::detail::TensorArgs{q, 0, K};
  const uint32_t groups = K / 128;
  p.scale = sglang::detail::ScaleStoreArgs{s, 0, 1, (uint32_t)M, groups};
  p.num_tokens = M;
  p.hidden_size = K;
  const int64_t threads = int64_t{M} * groups * Trait::kNumLanes;
  const unsigned blocks = (threads + Trait::kBlockSize - 1) / Trait::kBlockSize;
  sglang::per_token_group_quant_flat_kernel<Trait, false, false><<<blocks, Trait::kBlockSize>>>(p);
  return (int)cudaDeviceSynchronize();
}
"""


def build(bundle: str) -> ctypes.CDLL:
    os.makedirs(WORK, exist_ok=True)
    with tarfile.open(bundle) as t:
        t.extractall(WORK)
    src = os.path.join(WORK, "sglang", "csrc", "gemm", "harness.cu")
    with open(src, "w") as f:
        f.write(HARNESS)
    lib = os.path.join(WORK, "libsglquant.so")
    tvm = os.path.join(WORK, "tvm_ffi")
    cmd = ["nvcc", "-shared", "-Xcompiler", "-fPIC", "-DSGL_CUDA_ARCH=900", "-std=c++20", "-O3",
           "--expt-relaxed-constexpr",
           "--use_fast_math", "-gencode=arch=compute_90a,code=sm_90a", "-I", os.path.join(WORK, "sglang", "include"),
           "-I", os.path.join(tvm, "include"), src, "-o", lib, "-L", os.path.join(tvm, "lib"), "-ltvm_ffi",
           "-Xlinker", "-rpath=" + os.path.join(tvm, "lib")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stdout[-4000:] + r.stderr[-6000:])
    return ctypes.CDLL(lib)


def main() -> None:
    out_dir, bundle = sys.argv[1:3]
    import torch

    lib = build(bundle)
    arrays = {}
    for i, case in enumerate(ACT_QUANT_CASES):
        x = torch.from_numpy(act_quant_inputs(case).view(np.int16)).cuda().view(torch.bfloat16).contiguous()
        M, K = x.shape
        q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty((K // 128, M), dtype=torch.float32, device="cuda").permute(1, 0)  # column-major
        rc = lib.sgl_quant(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(q.data_ptr()),
                           ctypes.c_void_p(s.data_ptr()), M, K)
        if rc:
            raise SystemExit(f"case {i}: CUDA error {rc}")
        arrays[f"c{i}_q"] = q.view(torch.uint8).cpu().numpy()
        arrays[f"c{i}_s"] = s.contiguous().cpu().numpy()
        print(f"quant case {i} {case}: done", flush=True)
    device = torch.cuda.get_device_name()
    meta = {"kernel": "sglang-per-token-group-quant", "sglang": "0.5.23", "tvm_ffi": "0.1.11", "device": device,
            "torch": torch.__version__, "cases": [list(c) for c in ACT_QUANT_CASES]}
    tag = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    atomic_savez(os.path.join(out_dir, f"sglang_quant_{tag}.npz"), meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    main()
