"""Capture the LSE merges of chunked MLA prefill on a GPU: vLLM 0.33's ``merge_attn_states`` (no fast math) and
SGLang's ``merge_state_v2`` (sgl-kernel's sm90 flags, ``-use_fast_math``), each built by the mla-merge bundle's
``build_merge.py``, on the inputs of :data:`amla_sim.crosscheck.merge.MERGE_CASES`: the first two partials merged
once by each op (vLLM's LSEs (h, T), with ``output_lse``; SGLang's (T, h)), then every partial chained in each
engine's order (vLLM: context chunks in place, then the new tokens, the last partial; SGLang: the first partial the
new tokens, each later one merged as the prefix).

Run on a CUDA machine:  python scripts/capture_merges.py OUTDIR BUNDLE_DIR [--triton]
Writes OUTDIR/merges_h200.npz (or the device's name): per case c{i}_{vllm,sglang}_{out,lse} and c{i}_{vllm,sglang}
_chain_{out,lse} as raw bits, and ``meta`` (the cases, the device, each op run twice alike). With ``--triton``,
instead OUTDIR/merges_triton_h200.npz: the engines' Triton fallbacks (vLLM's ``triton_merge_attn_states.py``,
SGLang's ``merge_state_triton``, executed unchanged from their files) on :data:`TRITON_MERGE_CASES`, one merge each:
c{i}_{vllm,sglang}_triton_{out,lse}.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.crosscheck.merge import MERGE_CASES, TRITON_MERGE_CASES, merge_inputs


def _gpu(a):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16).cuda() \
        if a.dtype != np.float32 else torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _bits(t):
    import torch

    t = t.contiguous().cpu()
    return (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else
            t.numpy().view(np.uint32)).copy()


def triton(out_dir: str) -> None:
    """The Triton fallbacks, each case twice."""
    import torch
    from build_merge import load_sglang_triton, load_vllm_triton

    vt, st = load_vllm_triton(), load_sglang_triton()
    arrays, same = {}, True
    for i, case in enumerate(TRITON_MERGE_CASES):
        outs, lses = merge_inputs(*case)
        o, l = [_gpu(x) for x in outs[:2]], [_gpu(x) for x in lses[:2]]
        runs = []
        for _ in range(2):
            out, out_lse = torch.empty_like(o[0]), torch.empty_like(l[0].T.contiguous())
            vt.merge_attn_states(out, o[0], l[0].T.contiguous(), o[1], l[1].T.contiguous(), output_lse=out_lse)
            so, sl = st.merge_state_triton(o[0], l[0], o[1], l[1])
            torch.cuda.synchronize()
            runs.append({"vllm_triton_out": _bits(out), "vllm_triton_lse": _bits(out_lse),
                         "sglang_triton_out": _bits(so), "sglang_triton_lse": _bits(sl)})
        same &= all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])
        arrays.update({f"c{i}_{k}": v for k, v in runs[0].items()})
        print(f"triton case {i} {case}: done", flush=True)
    device = torch.cuda.get_device_name()
    import triton as _triton

    meta = {"kernel": "mla-merge-triton", "vllm": "0.33.0", "sglang": "0.5.23", "triton": _triton.__version__,
            "device": device, "torch": torch.__version__, "cases": [list(c) for c in TRITON_MERGE_CASES],
            "repeat_identical": bool(same)}
    tag = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    atomic_savez(os.path.join(out_dir, f"merges_triton_{tag}.npz"), meta=np.array(json.dumps(meta)), **arrays)
    print("repeat identical:", same)


def main() -> None:
    out_dir, bundle = sys.argv[1], sys.argv[2]
    sys.path.insert(0, bundle)
    if "--triton" in sys.argv[3:]:
        return triton(out_dir)
    import torch
    from build_merge import build_sglang, build_vllm, sglang_merge_state, sglang_new_then_chunks, vllm_context_then_new

    os.environ.setdefault("MAX_JOBS", "16")
    vm, sm = build_vllm(), build_sglang(fast_math=True)
    arrays, same = {}, True

    gpu, bits = _gpu, _bits

    for i, case in enumerate(MERGE_CASES):
        outs, lses = merge_inputs(*case)
        o, l = [gpu(x) for x in outs], [gpu(x) for x in lses]
        for run in range(2):
            got = {}
            out, out_lse = torch.empty_like(o[0]), torch.empty_like(l[0].T.contiguous())
            vm(out, out_lse, o[0], l[0].T.contiguous(), o[1], l[1].T.contiguous(), None, None)
            got["vllm_out"], got["vllm_lse"] = bits(out), bits(out_lse)
            so, sl = sglang_merge_state(sm, o[0], l[0], o[1], l[1])
            got["sglang_out"], got["sglang_lse"] = bits(so), bits(sl)
            final, _, _ = vllm_context_then_new(vm, o, [x.T.contiguous() for x in l])
            got["vllm_chain_out"] = bits(final)
            co, cl = sglang_new_then_chunks(sm, o[0], l[0], o[1:], l[1:])
            got["sglang_chain_out"], got["sglang_chain_lse"] = bits(co), bits(cl)
            torch.cuda.synchronize()
            if run == 0:
                first = got
            else:
                same &= all(np.array_equal(first[k], got[k]) for k in got)
        arrays.update({f"c{i}_{k}": v for k, v in first.items()})
        print(f"case {i} {case}: done", flush=True)
    device = torch.cuda.get_device_name()
    meta = {"kernel": "mla-merge", "vllm": "0.33.0", "sglang_kernel": "6614f98 (sm90 flags, -use_fast_math)",
            "device": device, "torch": torch.__version__, "cases": [list(c) for c in MERGE_CASES],
            "repeat_identical": bool(same)}
    tag = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    atomic_savez(os.path.join(out_dir, f"merges_{tag}.npz"), meta=np.array(json.dumps(meta)), **arrays)
    print("repeat identical:", same)


if __name__ == "__main__":
    main()
