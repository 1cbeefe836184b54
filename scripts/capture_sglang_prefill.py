"""Capture SGLang 0.5.23's MHA-form MLA prefill chained on a GPU as ``forward_mha.py`` chains it: SGLang's FA3 build
(sgl-flash-attn cb303cf with SGLang's switches, ``num_splits`` 1) and its fast-math ``merge_state_v2`` (the mla-merge
bundle's ``build_sglang``), on :data:`amla_sim.crosscheck.prefill_chain.SGLANG_CHAIN_CASES`: one shot (the new
tokens over prefix and new tokens in one causal call) and chunked (the new tokens' causal call, then each prefix
chunk's non-causal call merged in as the prefix operand), BF16 and E4M3 (an FP8 cache).

Run on a CUDA machine:  python scripts/capture_sglang_prefill.py OUTDIR SGL_CHECKOUT MERGE_BUNDLE
Writes OUTDIR/sglang_prefill_chain_{dev}.npz: per case ``c{i}_out`` (T, keep, 128) raw BF16 bits (and, chunked,
``c{i}_lse`` (T, keep) FP32 bits), and ``meta``. The chunk capacity is the recipe's: SGLang's 128K in the engine; a
few thousand here, so that small batches are cut into several chunks.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.algorithms.deployed.fa3.prefill import cu_seqlens
from amla_sim.algorithms.deployed.sglang.mha_prefill import prefix_chunks
from amla_sim.crosscheck.prefill_chain import SGLANG_CHAIN_CASES, sglang_chain_inputs


def main() -> None:
    out_dir, checkout, bundle = sys.argv[1:4]
    sys.path.insert(0, bundle)
    import torch
    from build_merge import build_sglang, sglang_merge_state

    from amla_sim.gpu.adapters._common import bits16
    from amla_sim.gpu.adapters.fa3 import build_fa3, fa3_varlen

    fa3, merge = build_fa3(checkout, fork="sglang", path="prefill"), build_sglang(fast_math=True)
    arrays, recipes = {}, []
    for i, case in enumerate(SGLANG_CHAIN_CASES):
        (q, k, v, kp, vp), crc = sglang_chain_inputs(case)
        ql, pl, keep = case["qlens"], case["prefix_lens"], case["keep_heads"]
        qt, kt, vt, kpt, vpt = (bits16(torch, x) for x in (q, k, v, kp, vp))  # gathered in BF16, then cast
        scale = case["scale"]

        def fp(x):  # SGLang's FP8 cache: q cast by prepare_paged_mha_query, k and v with .to(q.dtype)
            return x.to(torch.float8_e4m3fn) if case["format"] == "e4m3" else x

        def run():
            if case["mode"] == "one-shot":
                cu, po = cu_seqlens(ql), cu_seqlens(pl)
                kk, vv = (torch.cat([x for j in range(len(ql)) for x in (pre[po[j]:po[j + 1]], new[cu[j]:cu[j + 1]])])
                          for pre, new in ((kpt, kt), (vpt, vt)))
                out, _, _, _ = fa3_varlen(fa3, fp(qt), fp(kk), fp(vv), ql, [p + n for p, n in zip(pl, ql)],
                                          scale=scale, causal=True, num_splits=1)
                return {"out": out}
            out, lse, _, _ = fa3_varlen(fa3, fp(qt), fp(kt), fp(vt), ql, ql, scale=scale, causal=True, num_splits=1)
            acc, acc_lse = out, lse.T.contiguous()
            po = cu_seqlens(pl)
            for starts, lens in prefix_chunks(pl, case["capacity"]):
                rows = np.concatenate([np.arange(po[j] + s, po[j] + s + n) for j, (s, n) in enumerate(zip(starts,
                                                                                                        lens))])
                idx = torch.from_numpy(rows).cuda()
                o, l, _, _ = fa3_varlen(fa3, fp(qt), fp(kpt[idx]), fp(vpt[idx]), ql, lens, scale=scale,
                                        causal=False, num_splits=1)
                acc, acc_lse = sglang_merge_state(merge, o, l.T.contiguous(), acc, acc_lse)
            return {"out": acc, "lse": acc_lse}

        runs = []
        for _ in range(2):
            got = run()
            torch.cuda.synchronize()
            runs.append({"out": got["out"][:, :keep].contiguous().view(torch.int16).cpu().numpy().view(np.uint16),
                         **({"lse": got["lse"][:, :keep].float().contiguous().cpu().numpy().view(np.uint32)}
                            if "lse" in got else {})})
        arrays.update({f"c{i}_{k}": a for k, a in runs[0].items()})
        recipes.append({**case, "input_crc": crc,
                        "repeat_identical": all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])})
        print(f"sglang chain case {i}: done", flush=True)
    device = torch.cuda.get_device_name()
    meta = {"kernel": "sglang-prefill-chain", "sglang": "0.5.23", "sgl_fa3_commit": "cb303cf", "device": device,
            "torch": torch.__version__, "cases": recipes}
    tag = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    atomic_savez(os.path.join(out_dir, f"sglang_prefill_chain_{tag}.npz"), meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    main()
