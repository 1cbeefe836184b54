"""vLLM 0.33.0's activation quantizer for kv_b_proj, run from the library its wheel ships (``_C_stable_libtorch``'s
``per_token_group_fp8_quant``, loaded as it is) with the arguments vLLM passes for DeepGEMM (groups of 128, eps 1e-10,
E4M3's +-448, column-major scales), UE8M0 and FP32 scales, on :data:`amla_sim.crosscheck.layer.ACT_QUANT_CASES`.

Run on a CUDA machine:  python scripts/capture_vllm_quant.py OUTDIR LIB_XZ
Writes OUTDIR/vllm_quant_{dev}.npz: per case and scale rule ``c{i}_{rule}_q`` (M, K) E4M3 bytes and ``c{i}_{rule}_s``
(M, K / 128) FP32 scales, and ``meta``.
"""

from __future__ import annotations

import json
import lzma
import os
import sys

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.crosscheck.layer import ACT_QUANT_CASES, act_quant_inputs


def main() -> None:
    out_dir, lib_xz = sys.argv[1:3]
    import torch

    lib = "/tmp/_C_stable_libtorch.abi3.so"
    if not os.path.exists(lib):
        with lzma.open(lib_xz) as src, open(lib, "wb") as dst:
            dst.write(src.read())
    torch.ops.load_library(lib)
    arrays = {}
    for i, case in enumerate(ACT_QUANT_CASES):
        x = torch.from_numpy(act_quant_inputs(case).view(np.int16)).cuda().view(torch.bfloat16)
        M, K = x.shape
        for rule, ue8m0 in (("ue8m0", True), ("fp32", False)):
            q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device="cuda")
            s = torch.empty((K // 128, M), dtype=torch.float32, device="cuda").permute(1, 0)
            torch.ops._C.per_token_group_fp8_quant(x, q, s, 128, 1e-10, -448.0, 448.0, ue8m0, True, False)
            torch.cuda.synchronize()
            arrays[f"c{i}_{rule}_q"] = q.view(torch.uint8).cpu().numpy()
            arrays[f"c{i}_{rule}_s"] = s.contiguous().cpu().numpy()
        print(f"quant case {i} {case}: done", flush=True)
    device = torch.cuda.get_device_name()
    meta = {"kernel": "vllm-per-token-group-fp8-quant", "vllm": "0.33.0", "library": "_C_stable_libtorch.abi3.so",
            "device": device, "torch": torch.__version__, "cases": [list(c) for c in ACT_QUANT_CASES]}
    tag = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    atomic_savez(os.path.join(out_dir, f"vllm_quant_{tag}.npz"), meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    main()
