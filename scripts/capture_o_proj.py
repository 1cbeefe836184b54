"""o_proj after the layer, as vLLM 0.33 runs it on Hopper, on the layer's device capture: each vLLM case of
:data:`amla_sim.crosscheck.layer.LAYER_CASES`, each side's kept rows (the prefill's and the decode's layer outputs in
``tests/data/layer_h200.npz``, taken on an H200 through the real kernels) projected by o_proj's weight
(:func:`~amla_sim.crosscheck.layer.case_request`, 7,168 rows) through the kernel vLLM's dispatcher picks for the
side's step (``_dynamic_flashinfer_deepgemm_blockscale_gemm_impl``: FlashInfer's ``fp8_blockscale_gemm_sm90`` below 32
rows, else vLLM's UE8M0 quantizer (its torch rendering) and DeepGEMM's ``fp8_gemm_nt``; always DeepGEMM under
``VLLM_BATCH_INVARIANT``), the step's rows being its CUDA graph's (the chunk's tokens, or the decode batch, padded to
the capture size). The kept rows sit first in the launch; the other rows repeat them.

Also a probe of each kernel's rows against their batchmates: the same rows in launches of 1, 4 and 24 rows
(FlashInfer) and 32, 40 and 600 (DeepGEMM) with random other rows (``rows_invariant`` in ``meta``).

Run on a CUDA machine:  python scripts/capture_o_proj.py OUTDIR FI_DIR DEEPGEMM_DIR LAYER_NPZ
Writes OUTDIR/o_proj_{dev}.npz: per case ``c{i}_prefill_o`` and ``c{i}_decode_o`` (kept, 7168) BF16 bits, ``meta``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.algorithms.deployed.fp8_linear import vllm_graph_tokens
from amla_sim.crosscheck.layer import LAYER_CASES, case_request
from amla_sim.invariance.routing import Prompt, route

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture_fi_gemm import setup  # noqa: E402


def main() -> None:
    out_dir, fi_dir, dg_dir, layer = sys.argv[1:5]
    import torch
    fi = setup(fi_dir)
    sys.path.insert(0, dg_dir)
    from run_deepgemm import quant_act
    from run_deepgemm import setup as dg_setup
    dg = dg_setup(os.path.join(dg_dir, "vllm033-deep_gemm.tar.xz"))
    cap = np.load(layer)
    arrays, cases = {}, []

    def linear(rows, w, ws, invariant):
        """vLLM's dispatcher on a launch of `rows` (M, K) BF16."""
        if rows.shape[0] < 32 and not invariant:
            return fi.fp8_blockscale_gemm_sm90(input=rows, weight=w, weight_scale=ws, out_dtype=torch.bfloat16)
        a, a_s = quant_act(rows, True)
        out = torch.empty((rows.shape[0], w.shape[0]), dtype=torch.bfloat16, device="cuda")
        dg.fp8_gemm_nt((a, a_s), (w, ws), out, disable_ue8m0_cast=False)
        return out

    def launch(rows, m, w, ws, invariant, filler=None):
        n = rows.shape[0]
        pad = filler[:m - n] if filler is not None else rows[torch.arange(m - n, device="cuda") % n]
        return linear(torch.cat([rows, pad]), w, ws, invariant)[:n]

    for i, case in enumerate(LAYER_CASES):
        name, T, h, seed, budget, keep, batch = case
        if not name.startswith("vllm"):
            continue
        x = case_request(case)
        w = torch.from_numpy(x.w_o.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
        ws = torch.from_numpy(x.w_o_scale).cuda()
        invariant = name == "vllm-batch-invariant"
        chunks = route("vllm", [Prompt(T)], budget=budget, deterministic=invariant)
        meta = {"case": i, "mode": name, "launch": {}}
        for side in ("prefill", "decode"):
            rows = torch.from_numpy(cap[f"c{i}_{side}_out"].astype(np.int16)).cuda().view(torch.bfloat16)
            rows = rows.reshape(len(keep), h * 128)
            if side == "prefill":  # every kept token's chunk: the step of that many tokens
                steps = [next(c.tokens for c in chunks if c.context <= t < c.context + c.tokens) for t in keep]
            else:
                steps = [batch] * len(keep)
            got = []
            for r, step in enumerate(steps):
                m = vllm_graph_tokens(step)
                got.append(launch(rows[r:r + 1], m, w, ws, invariant))
                meta["launch"].setdefault(side, []).append(m)
            arrays[f"c{i}_{side}_o"] = torch.cat(got).view(torch.int16).cpu().numpy().view(np.uint16)
        # the rows against their batchmates: the prefill's rows in launches of other sizes, random other rows
        rows = torch.from_numpy(cap[f"c{i}_prefill_out"].astype(np.int16)).cuda().view(torch.bfloat16)
        rows = rows.reshape(len(keep), h * 128)
        g = torch.Generator(device="cuda").manual_seed(i)
        filler = (torch.randn((600, h * 128), generator=g, device="cuda") * 0.05).bfloat16()
        runs = {m: launch(rows, m, w, ws, invariant, filler) for m in (1, 4, 24, 32, 40, 600) if m >= len(keep)}
        fi_runs = [r for m, r in runs.items() if m < 32 and not invariant]
        dg_runs = [r for m, r in runs.items() if m >= 32 or invariant]
        meta["rows_invariant"] = all(torch.equal(a.view(torch.int16), fi_runs[0].view(torch.int16)) for a in fi_runs) \
            and all(torch.equal(a.view(torch.int16), dg_runs[0].view(torch.int16)) for a in dg_runs)
        torch.cuda.synchronize()
        cases.append(meta)
        print(i, meta, flush=True)
    dev = torch.cuda.get_device_name()
    tag = "h100" if "H100" in dev else "h200" if "H200" in dev else "gpu"
    atomic_savez(os.path.join(out_dir, f"o_proj_{tag}.npz"),
                 meta=np.array(json.dumps({"device": dev, "flashinfer": "0.7.2.post1", "vllm": "0.33.0",
                                           "torch": torch.__version__, "cases": cases})), **arrays)


if __name__ == "__main__":
    main()
