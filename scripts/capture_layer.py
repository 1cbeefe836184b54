"""The dense MLA layer on a GPU, chained as each engine chains its kernels: requests of
:data:`amla_sim.crosscheck.layer.LAYER_CASES` prefilled in the chunks the engine's scheduler makes and decoded token by
token, and cuBLAS's ``torch.bmm`` on :data:`amla_sim.crosscheck.layer.CUBLAS_SHAPES`.

Run on a CUDA machine:
    python scripts/capture_layer.py OUTDIR VLLM_ROOT BMM_BUNDLE DEEPGEMM_BUNDLE MERGE_BUNDLE SGL_QUANT_XZ [OFFSET]
OFFSET (fresh inputs): added to every case's seed, the file named layer_fresh{OFFSET}_{dev}.npz.

The kernels: vLLM 0.33.0's shipped FA3 (``_vllm_fa3_C``) for both forms; DeepGEMM as vLLM vendors it for
``kv_b_proj``, its activations quantized as vLLM's kernel reads (``absmax / 448`` a division, UE8M0, a multiply by
the exact reciprocal); W_UK and W_UV dequantized as ``(fp32(w) s).to(bf16)`` and multiplied through each engine's
exact bmm call (cuBLAS's ``torch.bmm`` in the normal modes, the engine's Triton ``bmm_batch_invariant`` in the
deterministic ones). SGLang's absorbed calls (num_splits 1) run through the same FA3 binary with a page of 1: its
build's MLA kernels do vLLM's fork's arithmetic, a decode's split bound passed as the ``max_seqlen_k`` its page table
sets; SGLang's MHA chunks quantize through its JIT kernel (``capture_sglang_quant.py``) and run FA3 unsplit.
Writes OUTDIR/layer_{dev}.npz: per case ``c{i}_{side}_{stage}``
(side prefill or decode; stage out (kept, h, 128), attn, lse, w_uk, splits) as raw bits, and ``meta`` (the cases,
versions, the CRC of each MHA chunk's quantized activations); ``cublas_crc`` (shape, engine, op) rows.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.algorithms.deployed.mla_layer import LAYER_MODES
from amla_sim.crosscheck.layer import CUBLAS_SHAPES, LAYER_CASES, case_request, crc_bits
from amla_sim.crosscheck.projections import bmm_inputs
from amla_sim.invariance.routing import Prompt, route


def main() -> None:
    out_dir, vllm_root, bmm_dir, dg_dir, merge_dir, sgl_quant = sys.argv[1:7]
    offset = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    import torch

    sys.path[:0] = [bmm_dir, dg_dir, merge_dir]
    from build_merge import build_vllm
    from load_bmm import (
        load_sglang,
        load_vllm,
        sglang_w_uk,
        sglang_w_uv,
        sglang_weights,
        vllm_w_uk,
        vllm_w_uv,
        vllm_weights,
    )
    from run_deepgemm import setup

    from amla_sim.algorithms.deployed.vllm.mla_prefill import (
        chunk_rows,
        plan_context_chunks,
    )
    from amla_sim.gpu.adapters.fa3 import (
        load_shipped_fa3,
        run_fa3,
        run_fa3_prefill,
        run_vllm_prefill_chain,
    )

    fa3, dg = load_shipped_fa3(vllm_root), setup(os.path.join(dg_dir, "vllm033-deep_gemm.tar.xz"))
    merge = build_vllm()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from capture_sglang_quant import build as build_sglang_quant

    sgl_quant_lib = build_sglang_quant(sgl_quant)
    triton_bmm = {"vllm": load_vllm().bmm_batch_invariant, "sglang": load_sglang().bmm_batch_invariant}
    calls = {"vllm": (vllm_weights, vllm_w_uk, vllm_w_uv), "sglang": (sglang_weights, sglang_w_uk, sglang_w_uv)}

    def gpu(a, dtype=torch.bfloat16):
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a.view(np.int16 if a.itemsize == 2 else np.uint8)).cuda().view(dtype)

    def bits(t):
        return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)

    def weights(x, engine):
        w = gpu(x.kv_b, torch.float8_e4m3fn).float()
        s = torch.from_numpy(x.kv_b_scale).cuda().repeat_interleave(128, 0).repeat_interleave(128, 1)
        wb = (w * s).to(torch.bfloat16)
        return calls[engine][0](wb.T if engine == "vllm" else wb, x.heads)

    def absorbed(x, mode, t, causal_step):
        wk, wv = weights(x, mode.engine)
        bmm = torch.bmm if mode.bmm == "cublas" else triton_bmm[mode.engine]
        ql = calls[mode.engine][1](bmm, gpu(x.q_nope[t]), wk).contiguous()
        q = torch.cat([ql, gpu(x.q_pe[t])], dim=-1)
        kv = np.concatenate([x.c_kv, x.k_pe], axis=-1)
        n, h = len(t), x.heads
        if causal_step:
            lens, qq, kk = [int(t[-1]) + 1], bits(q)[None], kv[None, :t[-1] + 1]
        else:
            lens, qq = [int(i) + 1 for i in t], bits(q)[:, None]
            kk = np.stack([np.pad(kv[:i + 1], ((0, int(max(t)) - i), (0, 0))) for i in t])
        # SGLang's decode under a CUDA graph bounds FA3's splits by its page table, max_context_len pages wide
        # (flash_api.cpp:749 in its build; vLLM's library takes the same bound as max_seqlen_k)
        bound = mode.max_context_len if mode.engine == "sglang" and not causal_step else None
        res = run_fa3(fa3, qq, kk, {"seqlens": lens, "page_size": mode.page_size, "format": "bf16",
                                    "scale": x.scale, "causal": True, "num_splits": mode.fa3_num_splits(n),
                                    "seed": 5, "max_seqlen_k": bound})
        attn = gpu(res["out"].reshape(n, h, 512))
        out = calls[mode.engine][2](bmm, attn, wv)
        splits = res.get("splits", np.ones(len(lens), np.int32))
        return {"out": bits(out), "attn": res["out"].reshape(n, h, 512),
                "lse": res["lse"].reshape(h, n).T.copy(), "w_uk": bits(ql),
                "splits": np.repeat(splits, n) if causal_step else splits.astype(np.int32)}

    def quant_vllm(x):
        """vLLM's per_token_group_quant_fp8 as its kernel reads: a true division by 448, UE8M0, exact reciprocal."""
        M = x.shape[0]
        xg = x.float().view(M, 4, 128)
        amax = xg.abs().amax(-1).clamp_min(1e-10)
        s = amax / torch.full_like(amax, 448.0)
        s = torch.exp2(torch.ceil(torch.log2(s.clamp_min(1e-10))))
        q = (xg * (1.0 / s)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(M, 512)
        sc = torch.empty((4, M), dtype=torch.float32, device="cuda").T
        sc.copy_(s)
        return q, sc

    def quant_sglang(x):
        """SGLang's JIT quantizer (scripts/capture_sglang_quant.py's build): FP32 scales, column-major."""
        M = x.shape[0]
        q = torch.empty((M, 512), dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty((4, M), dtype=torch.float32, device="cuda").permute(1, 0)
        import ctypes
        if sgl_quant_lib.sgl_quant(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(q.data_ptr()),
                                   ctypes.c_void_p(s.data_ptr()), M, 512):
            raise SystemExit("SGLang's quantizer failed")
        return q, s

    def kvb(x, rows, meta, engine="vllm"):
        """kv_b_proj of latent rows through the engine's quantizer and DeepGEMM: (n, h, 256) BF16."""
        c = gpu(x.c_kv[rows]).contiguous()
        a, a_s = quant_vllm(c) if engine == "vllm" else quant_sglang(c)
        meta.setdefault("quant_crc", []).append([rows.start or 0, rows.stop, crc_bits(a.view(torch.uint8).cpu()
                                                 .numpy()) ^ crc_bits(a_s.contiguous().cpu().numpy())])
        w = gpu(x.kv_b, torch.float8_e4m3fn)
        out = torch.empty((c.shape[0], w.shape[0]), dtype=torch.bfloat16, device="cuda")
        dg.fp8_gemm_nt((a, a_s), (w, torch.from_numpy(x.kv_b_scale).cuda()), out,
                       disable_ue8m0_cast=engine != "vllm")
        return out.view(c.shape[0], x.heads, 256)

    def mha(x, mode, start, n, meta):
        """vLLM's MHA chunk: the new tokens' causal call, its context (tokens before `start`) in workspace chunks
        merged by merge_attn_states (forward_mha)."""
        if mode.engine != "vllm" and start:
            raise SystemExit("the device check chains SGLang's MHA chunks of no prefix only")
        new = slice(start, start + n)
        kv = kvb(x, new, meta, mode.engine)
        k = torch.cat([kv[..., :128], gpu(x.k_pe[new])[:, None].expand(n, x.heads, 64)], dim=-1)
        q = torch.cat([gpu(x.q_nope[new]), gpu(x.q_pe[new])], dim=-1)
        splits = 1 if mode.deterministic or mode.engine == "sglang" else 0  # SGLang never splits its MHA
        if not start:
            res = run_fa3_prefill(fa3, bits(q), bits(k), bits(kv[..., 128:]), {
                "format": "bf16", "qlens": [n], "seqlens": [n], "scale": x.scale, "causal": True,
                "num_splits": splits})
            return {"out": res["out"], "attn": res["out"]}
        ctx = kvb(x, slice(0, start), meta)
        kc = torch.cat([ctx[..., :128], gpu(x.k_pe[:start])[:, None].expand(start, x.heads, 64)], dim=-1)
        step = {"qlens": [n], "context_lens": [start], "num_splits": splits, "scale": x.scale}
        chunks = []
        for ch in plan_context_chunks([start], 64 * 1024):
            r, c, merged = chunk_rows(ch, step["qlens"], step["context_lens"])
            chunks.append((r, c, merged, step["qlens"][ch.request_start:ch.request_end], list(ch.seq_lens)))
        out = run_vllm_prefill_chain(fa3, merge, bits(q), bits(k), bits(kv[..., 128:]), bits(kc),
                                     bits(ctx[..., 128:]), step, chunks)
        return {"out": out, "attn": out}

    arrays, meta_cases = {}, []
    for i, (name, T, h, seed, budget, keep, batch) in enumerate(LAYER_CASES):
        seed += offset
        mode, x = LAYER_MODES[name], case_request((name, T, h, seed))
        chunks = route(mode.engine, [Prompt(T)], budget=budget, deterministic=mode.deterministic)
        meta = {"mode": name, "tokens": T, "heads": h, "seed": seed, "budget": budget, "keep": list(keep),
                "decode_batch": batch}
        pre = {}
        for c in chunks:
            mine = [t for t in keep if c.context <= t < c.context + c.tokens]
            if not mine:
                continue
            got = (mha(x, mode, c.context, c.tokens, meta) if c.path == "mha" else
                   absorbed(x, mode, np.arange(c.context, c.context + c.tokens), True))
            for t in mine:
                pre[t] = {k: v[t - c.context] for k, v in got.items()}
        for stage in pre[keep[0]]:
            arrays[f"c{i}_prefill_{stage}"] = np.stack([pre[t][stage] for t in keep])
        dec = [absorbed(x, mode, np.array([t] * batch), False) for t in keep]
        for stage in dec[0]:
            arrays[f"c{i}_decode_{stage}"] = np.stack([d[stage][0] for d in dec])
        same = int(sum((arrays[f"c{i}_prefill_out"][j] == arrays[f"c{i}_decode_out"][j]).all()
                       for j in range(len(keep))))
        meta_cases.append(meta)
        print(f"layer case {i} {name} T={T}: {same} of {len(keep)} kept tokens identical", flush=True)
    rows = []
    for m, h in CUBLAS_SHAPES:
        q, attn, w = (gpu(a) for a in bmm_inputs(m, h, 7 + offset))
        for engine, (wts, uk, uv) in calls.items():
            wk, wv = wts(w.T if engine == "vllm" else w, h)
            rows.append([m, h, engine == "vllm", 0, crc_bits(bits(uk(torch.bmm, q, wk))[:, :2])])
            rows.append([m, h, engine == "vllm", 1, crc_bits(bits(uv(torch.bmm, attn, wv))[:, :2])])
    device = torch.cuda.get_device_name()
    meta = {"kernel": "mla-layer", "vllm": "0.33.0", "sglang": "0.5.23", "device": device, "torch": torch.__version__,
            "cuda": torch.version.cuda, "deep_gemm": dg.__version__, "cases": meta_cases,
            "cublas_columns": ["tokens", "heads", "is_vllm", "is_w_uv", "crc_first_two_heads"]}
    tag = "h200" if "H200" in device else "h100" if "H100" in device else "gpu"
    meta["seed_offset"] = offset
    name = f"layer_fresh{offset}_{tag}.npz" if offset else f"layer_{tag}.npz"
    atomic_savez(os.path.join(out_dir, name), meta=np.array(json.dumps(meta)),
                 cublas_crc=np.array(rows, np.int64), **arrays)


if __name__ == "__main__":
    main()
