"""FlashInfer's sm90 FP8 block-scale GEMM as vLLM 0.33 runs an FP8 block linear of fewer than 32 tokens on Hopper
(``flashinfer.gemm.fp8_blockscale_gemm_sm90(input=x, weight=w, weight_scale=ws, out_dtype=torch.bfloat16)``, BF16
activations quantized inside), on :data:`amla_sim.crosscheck.deepgemm.FI_GEMM_CASES`.

Run on a CUDA machine:  python scripts/capture_fi_gemm.py OUTDIR FI_DIR DEEPGEMM_DIR [SEED_OFFSET]
FI_DIR holds ``fi072post1_gemm.tar.xz`` (``scripts/make_fi_gemm_bundle.sh``) and an apache-tvm-ffi wheel;
DEEPGEMM_DIR the deepgemm-fp8 bundle (vLLM's vendored DeepGEMM). Writes OUTDIR/fi_gemm_{dev}.npz: per case
``c{i}_out`` (M, N) BF16 bits of vLLM's call, ``c{i}_q`` (M, K) E4M3 bytes and ``c{i}_s`` (M, K / 128) FP32 scales
as the call's quantizer left them in its workspace (the same call through the runner with a workspace of ours), and
``meta``: per case, whether DeepGEMM given those bytes and scales gives the same bits (``same_as_deepgemm``), and
how many of the rows differ from DeepGEMM's at 32 rows with vLLM's UE8M0 quantizer (``rows_differ_at_32``: the
rows of the same tokens in a prefill's launch). SEED_OFFSET (a fresh-seed check) adds to every case's seed and to the
file's name.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.crosscheck.deepgemm import FI_GEMM_CASES, fi_gemm_inputs, quantize_weight_blocks

SITE = "/tmp/fi_site"


def setup(fi_dir: str):
    if not os.path.exists(os.path.join(SITE, "flashinfer")):
        os.makedirs(SITE, exist_ok=True)
        wheel = glob.glob(os.path.join(fi_dir, "apache_tvm_ffi-*.whl"))[0]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", SITE,
                        wheel], check=True)
        with tarfile.open(os.path.join(fi_dir, "fi072post1_gemm.tar.xz")) as t:
            t.extractall(SITE)
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fiws")
    os.environ.setdefault("MAX_JOBS", "16")
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    sys.path.insert(0, SITE)
    from flashinfer.gemm import gemm_base
    return gemm_base


def main() -> None:
    out_dir, fi_dir, dg_dir = sys.argv[1:4]
    offset = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    import torch
    fi = setup(fi_dir)
    sys.path.insert(0, dg_dir)
    from run_deepgemm import quant_act
    from run_deepgemm import setup as dg_setup
    dg = dg_setup(os.path.join(dg_dir, "vllm033-deep_gemm.tar.xz"))
    dev = torch.cuda.get_device_name()
    arrays, cases = {}, []
    max_rows = 0

    def cuda(a):
        if a.dtype == np.float32:
            return torch.from_numpy(a).cuda()
        return torch.from_numpy(a.view(np.uint8 if a.itemsize == 1 else np.int16)).cuda()

    for i, (M, N, K, seed, kind) in enumerate(FI_GEMM_CASES):
        seed += offset
        x, wb = fi_gemm_inputs(M, N, K, seed, kind)
        wq, ws = quantize_weight_blocks(wb, "ue8m0")
        xt = cuda(x).view(torch.bfloat16)
        wt = cuda(wq).view(torch.float8_e4m3fn)
        wst = cuda(np.ascontiguousarray(ws, np.float32))
        out = fi.fp8_blockscale_gemm_sm90(input=xt, weight=wt, weight_scale=wst, out_dtype=torch.bfloat16)
        again = fi.fp8_blockscale_gemm_sm90(input=xt, weight=wt, weight_scale=wst, out_dtype=torch.bfloat16)
        # the same call through the runner with our workspace, to read the quantizer's bytes and scales back
        runner = fi.get_fp8_blockscale_gemm_runner_sm90()
        size = runner.get_workspace_size(M, N, K)
        work = torch.zeros(size, dtype=torch.uint8, device="cuda")
        runner.configure_workspace(work)
        out2 = torch.empty_like(out)
        runner.run_gemm(xt, wt, out2, None, wst)
        torch.cuda.synchronize()
        # the workspace: the E4M3 rows, then the scales (K / 128 columns of ceil(M / 4) 4), after room for the
        # largest M the runner (one object, whatever module.init() is called) has seen (fp8_blockscale_gemm.cu:219)
        m4 = -(-M // 4) * 4
        rows = max_rows = max(max_rows, m4)
        q = work[:M * K].view(M, K)
        s = work[rows * K:rows * K + m4 * (K // 128) * 4].view(torch.float32).view(K // 128, m4)
        s = s[:, :M].T.contiguous()
        # DeepGEMM (vLLM's, M >= 32 path) on FlashInfer's own bytes and scales: the same chain?
        s_cm = torch.empty((K // 128, M), dtype=torch.float32, device="cuda").T
        s_cm.copy_(s)
        dgo = torch.empty_like(out)
        dg.fp8_gemm_nt((q.view(torch.float8_e4m3fn), s_cm), (wt, wst), dgo, disable_ue8m0_cast=True)
        # the same tokens in a launch of 32 rows, as a prefill runs them: vLLM's UE8M0 quantizer and DeepGEMM
        pad = torch.cat([xt, xt[:1].expand(max(32 - M, 0), K)]) if M < 32 else xt
        a, a_s = quant_act(pad, True)
        big = torch.empty((pad.shape[0], N), dtype=torch.bfloat16, device="cuda")
        dg.fp8_gemm_nt((a, a_s), (wt, wst), big, disable_ue8m0_cast=False)
        torch.cuda.synchronize()
        bits = out.view(torch.int16).cpu().numpy().view(np.uint16)
        arrays[f"c{i}_out"] = bits
        arrays[f"c{i}_q"] = q.cpu().numpy()
        arrays[f"c{i}_s"] = s.cpu().numpy()
        cases.append({"M": M, "N": N, "K": K, "seed": seed, "kind": kind,
                      "rerun_equal": bool(torch.equal(out.view(torch.int16), again.view(torch.int16))),
                      "runner_equal": bool(torch.equal(out.view(torch.int16), out2.view(torch.int16))),
                      "same_as_deepgemm": bool(torch.equal(out.view(torch.int16), dgo.view(torch.int16))),
                      "rows_differ_at_32": int((big[:M].view(torch.int16) != out.view(torch.int16)).any(1).sum())})
        print(i, cases[-1], flush=True)
    meta = {"device": dev, "flashinfer": "0.7.2.post1", "torch": torch.__version__, "cases": cases,
            "call": "flashinfer.gemm.fp8_blockscale_gemm_sm90(input=x, weight=w, weight_scale=ws, "
                    "out_dtype=torch.bfloat16)"}
    tag = ("h100" if "H100" in dev else "h200" if "H200" in dev else "gpu") + (f"_seed{offset}" if offset else "")
    meta["seed_offset"] = offset
    atomic_savez(os.path.join(out_dir, f"fi_gemm_{tag}.npz"), meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    main()
