"""Capture what the kernels compute at the edges of what they take: a request shorter than its causal (MTP) step
(its first query rows see no key), a request of no key, through vLLM 0.33.0's shipped FA3 and dense FP8 FlashMLA
libraries and vLLM's Triton MLA decode, each as vLLM calls it.

Run on a CUDA machine:  python scripts/capture_limits.py OUTDIR VLLM_ROOT VLLM_TRITON_FILE

VLLM_ROOT holds ``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so`` and ``vllm/_flashmla_extension_C.abi3.so`` (vLLM
0.33.0's wheel, unpacked); VLLM_TRITON_FILE is vLLM 0.33.0's ``triton_decode_attention.py``. Writes
OUTDIR/limits_{kernel}.npz, each as :func:`amla_sim.crosscheck.deployed.capture` writes it (the cases below, their
recipes recorded); the replay is ``amla-sim crosscheck --replay FILE``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from amla_sim.crosscheck.deployed import capture

_192 = 192 ** -0.5
_DS = 0.1352


def _fa3(b, sq, H, lens, fmt, dist, seed, page, ns, scale=_192):  # vLLM's op takes the scale as given
    return {"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": fmt, "dist": dist, "seed": seed,
            "scale": scale, "page_size": page, "num_splits": ns, "varlen_q": page is not None, "causal": True}


def _fp8(b, sq, H, lens, dist, seed, scale, qs, ks):
    return {"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": "bf16", "dist": dist, "seed": seed,
            "scale": scale, "q_scale": qs, "k_scale": ks}


def _triton(b, sq, H, lens, dist, seed, scale, cache, ks, page):
    return {"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": "bf16", "dist": dist, "seed": seed,
            "scale": scale, "kv_cache": cache, "k_scale": ks, "page_size": page, "batch_invariant": False,
            "num_kv_splits": 1}  # the run sets vLLM's count for the batch


#: kernel -> (build, source key, cases): requests shorter than their step of s_q queries, requests of no key
CASES = {
    "fa3-mla": ("vllm", "vllm", [
        _fa3(2, 2, 64, (1, 5000), "fp16", "normal:1", 901, 16, 0),  # vLLM's MTP call: row 0 of request 0 sees none
        _fa3(2, 4, 16, (2, 8), "bf16", "normal:1", 902, 16, 0),
        _fa3(4, 4, 128, (1, 3, 300, 7000), "bf16", "flashmla", 903, 64, 32),  # split, with short requests
        _fa3(3, 3, 64, (0, 2, 1000), "bf16", "normal:1", 904, 16, 0),  # a request of no key
        _fa3(2, 2, 16, (1, 700), "fp16", "normal:1", 905, None, 0),  # SGLang's flash_attn_with_kvcache form
        _fa3(2, 4, 128, (3, 4097), "bf16", "normal:1", 906, 16, 0, _DS),
    ]),
    "flashmla-dense-fp8": ("vllm", "vllm", [
        _fp8(2, 2, 128, (1, 64), "flashmla", 911, _192, 1.0, 1.0),
        _fp8(3, 4, 64, (2, 3, 500), "normal:1", 912, _DS, 1 / 448, 1 / 448),
        _fp8(2, 2, 16, (1, 3000), "normal:1", 913, _192, 0.05, 0.03),
    ]),
    "vllm-triton-mla": ("upstream", "triton", [
        _triton(2, 2, 16, (1, 700), "normal:1", 921, _192, "bf16", 1.0, 16),
        _triton(2, 4, 16, (2, 8), "normal:1", 922, _DS, "fp8", 0.05, 16),
        _triton(3, 2, 128, (0, 1, 3000), "flashmla", 923, _192, "bf16", 1.0, 1),  # a request of no key
        _triton(2, 1, 16, (0, 100), "normal:1", 924, _192, "bf16", 1.0, 16),  # a decode of no key
    ]),
}


def main() -> None:
    out, sources = sys.argv[1], {"vllm": sys.argv[2], "triton": sys.argv[3]}
    os.makedirs(out, exist_ok=True)
    failed = []
    for kernel, (build, source, cases) in CASES.items():
        t0 = time.time()
        try:
            capture(kernel, os.path.join(out, f"limits_{kernel.replace('-', '_')}.npz"), source=sources[source],
                    build=build, cases=cases)
            print(f"{kernel}: {len(cases)} cases, {time.time() - t0:.1f} s", flush=True)
        except Exception:  # one kernel's failure is reported, the others still run
            failed.append(kernel)
            traceback.print_exc()
    print("failed:", failed or "none")


if __name__ == "__main__":
    main()
