"""Capture the absorbed MLA projections on a GPU: vLLM 0.33's and SGLang 0.5.23's batch-invariant Triton bmm (the
batch-invariant-bmm bundle's ``load_bmm.py``, the engines' files run unchanged, their exact W_UK / W_UV calls) and
cuBLAS's ``torch.bmm`` through the same calls (each engine's normal mode), on
:data:`amla_sim.crosscheck.projections.BMM_CASES`.

Run on a CUDA machine:  python scripts/capture_bmm.py OUTDIR BUNDLE_DIR
Cut a capture for committing (anywhere):  python scripts/capture_bmm.py --trim IN OUT CASE[,CASE...] HEADS
Writes OUTDIR/bmm_{dev}.npz: per case c{i}_{engine}_{op}_{impl} (engine vllm or sglang, op w_uk or w_uv, impl
triton or cublas), the first two heads' raw BF16 bits, and ``meta`` (the cases, the device, torch, Triton and
CUDA versions; each call run twice alike).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.crosscheck.projections import BMM_CASES, bmm_inputs

KEEP = 2


def trim(src: str, dst: str, keep: list[int], heads: int) -> None:
    """Some cases of a capture, renumbered, each array cut to its first `heads` heads (byte-equal otherwise)."""
    with np.load(src) as z:
        meta = json.loads(str(z["meta"]))
        arrays = {f"c{new}_{k.split('_', 1)[1]}": z[k][:, :heads] for new, old in enumerate(keep) for k in z.files
                  if k.startswith(f"c{old}_")}
    meta.update(cases=[meta["cases"][i] for i in keep], keep_heads=heads, trimmed_from={"cases": keep})
    atomic_savez(dst, meta=np.array(json.dumps(meta)), **arrays)


def main() -> None:
    if sys.argv[1] == "--trim":
        return trim(sys.argv[2], sys.argv[3], [int(c) for c in sys.argv[4].split(",")], int(sys.argv[5]))
    out_dir, bundle = sys.argv[1], sys.argv[2]
    sys.path.insert(0, bundle)
    import torch
    import triton
    from load_bmm import (load_sglang, load_vllm, sglang_w_uk, sglang_w_uv, sglang_weights, vllm_w_uk, vllm_w_uv,
                          vllm_weights)

    v, s = load_vllm(), load_sglang()

    def gpu(a):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16).cuda()

    def bits(t):
        return t[:, :KEEP].contiguous().cpu().view(torch.int16).numpy().view(np.uint16).copy()

    arrays, same = {}, True
    for i, case in enumerate(BMM_CASES):
        q, attn, w = (gpu(x) for x in bmm_inputs(*case))
        h = case[1]
        vk, vv = vllm_weights(w.T, h)  # vLLM holds kv_b_proj's weight transposed (its layer's .weight.T)
        sk, sv = sglang_weights(w, h)
        calls = {"vllm_w_uk": lambda bmm: vllm_w_uk(bmm, q, vk), "vllm_w_uv": lambda bmm: vllm_w_uv(bmm, attn, vv),
                 "sglang_w_uk": lambda bmm: sglang_w_uk(bmm, q, sk),
                 "sglang_w_uv": lambda bmm: sglang_w_uv(bmm, attn, sv)}
        impls = {"triton": {"vllm": v.bmm_batch_invariant, "sglang": s.bmm_batch_invariant},
                 "cublas": {"vllm": torch.bmm, "sglang": torch.bmm}}
        for name, call in calls.items():
            for impl, fns in impls.items():
                runs = [bits(call(fns[name.split("_")[0]])) for _ in range(2)]
                torch.cuda.synchronize()
                same &= bool(np.array_equal(*runs))
                arrays[f"c{i}_{name}_{impl}"] = runs[0]
        print(f"case {i} {case}: done", flush=True)
    device = torch.cuda.get_device_name()
    meta = {"kernel": "absorbed-bmm", "vllm": "0.33.0", "sglang": "0.5.23", "device": device,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "cases": [list(c) for c in BMM_CASES], "keep_heads": KEEP, "repeat_identical": bool(same)}
    tag = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    atomic_savez(os.path.join(out_dir, f"bmm_{tag}.npz"), meta=np.array(json.dumps(meta)), **arrays)
    print("repeat identical:", same)


if __name__ == "__main__":
    main()
