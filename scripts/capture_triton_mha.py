"""Capture vLLM's and SGLang's Triton decodes with one query head: their ``decode_attention_fwd`` then takes the MHA
kernel (``decode_attention_fwd_normal``: ``_fwd_kernel_stage1`` of 64 keys and 4 warps, q times K summed along 1,024
padded columns, then ``_fwd_kernel_stage2``), as an MLA layer of one head per rank calls it.

Run on a CUDA machine:  python scripts/capture_triton_mha.py OUTDIR VLLM_TRITON_FILE SGLANG_FILE [SEED]

VLLM_TRITON_FILE is vLLM 0.33.0's ``triton_decode_attention.py``, SGLANG_FILE sglang 0.5.23's
``decode_attention.py``. Writes OUTDIR/mha_vllm_triton_mla.npz and OUTDIR/mha_sglang_triton.npz (the cases below at
seed offset SEED, default 0), each as :func:`amla_sim.crosscheck.deployed.capture` writes it (replay: ``amla-sim
crosscheck --replay FILE``), and OUTDIR/ir.tar: the stage-1 kernels' TTGIR and PTX from Triton's cache (the
layouts the reductions follow).
"""

from __future__ import annotations

import glob
import os
import sys
import tarfile
import time
import traceback

_192 = 192 ** -0.5
_DS = 0.1352


def _vllm(b, sq, lens, dist, seed, scale, cache, ks, page, inv=False):
    from amla_sim.algorithms.deployed.vllm.triton_mla import vllm_num_kv_splits

    return {"batch": b, "sq": sq, "heads": 1, "seqlens": list(lens), "format": "bf16", "dist": dist, "seed": seed,
            "scale": scale, "kv_cache": cache, "k_scale": ks, "page_size": page, "batch_invariant": inv,
            "num_kv_splits": vllm_num_kv_splits(max(lens), batch_invariant=inv)}


def _sglang(b, lens, splits, dist, seed, scale):
    return {"batch": b, "heads": 1, "seqlens": list(lens), "num_kv_splits": list(splits),
            "max_kv_splits": max(splits), "dist": dist, "seed": seed, "scale": scale}


#: vLLM's TRITON_MLA with one head: BF16 and FP8 caches, MTP rows, splits, batch-invariant mode
VLLM_CASES = [
    (2, 1, (700, 1500), "normal:1", 1201, _192, "bf16", 1.0, 16),
    (1, 1, (64,), "normal:1", 1202, _DS, "bf16", 1.0, 1),
    (3, 2, (1, 300, 2000), "normal:1", 1203, _192, "fp8", 0.05, 16),
    (1, 1, (5000,), "flashmla", 1204, _DS, "bf16", 1.0, 64),
    (4, 1, (63, 65, 129, 3001), "flashmla", 1205, _192, "fp8", 1.0, 16),
    (2, 3, (700, 4097), "normal:1", 1206, _192, "bf16", 1.0, 16, True),
]
#: SGLang's Triton decode with one head: its split counts, one split and many, short and long requests
SGLANG_CASES = [
    (2, (700, 1500), (2, 3), "normal:1", 1211, _192),
    (1, (64,), (1,), "normal:1", 1212, _DS),
    (3, (1, 300, 2000), (1, 4, 8), "normal:1", 1213, _192),
    (1, (5000,), (16,), "flashmla", 1214, _DS),
    (4, (63, 65, 129, 3001), (1, 2, 2, 5), "flashmla", 1215, _192),
]


def main() -> None:
    out, vllm_file, sglang_file = sys.argv[1:4]
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    cache = "/tmp/triton-mha-cache"  # a fresh cache: the kernels compile here, their IR is read back
    os.environ["TRITON_CACHE_DIR"] = cache
    from amla_sim.crosscheck.deployed import capture

    os.makedirs(out, exist_ok=True)
    jobs = [("vllm-triton-mla", vllm_file, [_vllm(*c[:4], c[4] + seed, *c[5:]) for c in VLLM_CASES]),
            ("sglang-triton", sglang_file, [_sglang(*c[:4], c[4] + seed, c[5]) for c in SGLANG_CASES])]
    for kernel, source, cases in jobs:
        t0 = time.time()
        try:
            capture(kernel, os.path.join(out, f"mha_{kernel.replace('-', '_')}.npz"), source=source,
                    build="upstream", cases=cases)
            print(f"{kernel}: {len(cases)} cases, {time.time() - t0:.1f} s", flush=True)
        except Exception:
            traceback.print_exc()
    with tarfile.open(os.path.join(out, "ir.tar"), "w") as tar:
        for path in glob.glob(os.path.join(cache, "*", "_fwd_kernel_stage*.*")):
            if path.endswith((".ttgir", ".ptx", ".json")):
                tar.add(path, arcname=os.path.relpath(path, cache))


if __name__ == "__main__":
    main()
