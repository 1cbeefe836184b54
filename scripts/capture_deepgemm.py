"""Capture DeepGEMM's FP8 block GEMM as vLLM 0.33 runs kv_b_proj (the deepgemm-fp8 bundle: vLLM's vendored DeepGEMM,
JIT-compiled on the device), on :data:`amla_sim.crosscheck.deepgemm.DEEPGEMM_CASES`.

Run on a CUDA machine:  python scripts/capture_deepgemm.py OUTDIR BUNDLE_DIR
BUNDLE_DIR holds ``vllm033-deep_gemm.tar.xz`` (``make_bundle.sh``) and ``run_deepgemm.py``. Writes
OUTDIR/deepgemm_{dev}.npz: per case ``c{i}_out`` (M, 256) raw BF16 bits, and ``meta`` with each case's ``a_crc`` and ``w_crc`` (CRC32 of
the device's quantized activations and weight with their scales, to show the model quantizes alike).
"""

from __future__ import annotations

import json
import os
import sys
import zlib

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.crosscheck.deepgemm import DEEPGEMM_CASES, KEEP_COLUMNS, deepgemm_inputs


def crc(*arrays) -> int:
    c = 0
    for a in arrays:
        c = zlib.crc32(np.ascontiguousarray(a).tobytes(), c)
    return c


def main() -> None:
    out_dir, bundle = sys.argv[1:3]
    sys.path.insert(0, bundle)
    import torch
    from run_deepgemm import quant_act, setup, vllm_kv_b_proj

    dg = setup(os.path.join(bundle, "vllm033-deep_gemm.tar.xz"))
    arrays, recipes = {}, []
    for i, (M, N, ue8m0, wscales, seed) in enumerate(DEEPGEMM_CASES):
        x, wb = (torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16).cuda()
                 for a in deepgemm_inputs(M, N, seed))
        a, a_s = quant_act(x, ue8m0)
        wg = wb.float().view(N // 128, 128, 4, 128)
        ws = wg.abs().amax((1, 3)) / 448.0
        if wscales == "ue8m0":
            ws = torch.exp2(torch.ceil(torch.log2(ws.clamp_min(1e-10))))
        w = (wg / ws[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(N, 512)
        runs = [vllm_kv_b_proj(dg, a, a_s, w, ws, ue8m0=ue8m0) for _ in range(2)]
        torch.cuda.synchronize()
        bits = [r[:, :KEEP_COLUMNS].contiguous().view(torch.int16).cpu().numpy().view(np.uint16) for r in runs]
        arrays[f"c{i}_out"] = bits[0]
        np_a, np_as = a.view(torch.uint8).cpu().numpy(), a_s.contiguous().cpu().numpy()
        np_w, np_ws = w.view(torch.uint8).cpu().numpy(), ws.contiguous().cpu().numpy()
        recipes.append({"tokens": M, "n": N, "ue8m0": ue8m0, "weight_scales": wscales, "seed": seed,
                        "a_crc": crc(np_a, np_as), "w_crc": crc(np_w, np_ws),
                        "repeat_identical": bool(np.array_equal(*bits)) and bool(torch.equal(*runs))})
        print(f"deepgemm case {i}: done", flush=True)
    device = torch.cuda.get_device_name()
    meta = {"kernel": "deepgemm-fp8-gemm-nt", "deep_gemm": dg.__version__, "vllm": "0.33.0", "device": device,
            "torch": torch.__version__, "keep_columns": KEEP_COLUMNS, "cases": recipes}
    tag = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    atomic_savez(os.path.join(out_dir, f"deepgemm_{tag}.npz"), meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    main()
