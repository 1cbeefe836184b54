"""Capture FlashMLA's kernels as the engines ship them: every case table, scale table and fresh seed of the four
FlashMLA kernels through vLLM 0.33.0's and sgl-flash-mla 1.0.0's libraries.

Run on a CUDA machine:  python scripts/capture_builds.py OUTDIR VLLM_ROOT SGLANG_ROOT [SEED]
                         python scripts/capture_builds.py --fp16 OUTDIR VLLM_ROOT [SEED]

VLLM_ROOT holds ``vllm/_flashmla_C.abi3.so`` and ``vllm/_flashmla_extension_C.abi3.so`` (the wheel, unpacked),
SGLANG_ROOT ``flash_mla/_C_legacy.abi3.so``. Writes OUTDIR/captures.tar: ``{kernel}_{build}.npz`` (the case table,
seed 0), ``scales_{kernel}_{build}.npz`` (DeepSeek's scales and 20 random ones) and ``{kernel}_{build}_fresh.npz``
(the case table at SEED, default 6000), each as :func:`amla_sim.crosscheck.deployed.capture` writes it. With
``--fp16``: FlashMLA's dense decode on FP16 inputs through vLLM's library,
:data:`amla_sim.crosscheck.flashmla.FLASHMLA_FP16_CASES` at seed 0 and SEED (default 1000), OUTDIR/flashmla_fp16_vllm
{,_fresh}.npz.
"""

from __future__ import annotations

import os
import sys
import tarfile
import tempfile
import time
import traceback

from amla_sim.crosscheck.deployed import capture

KERNELS = ("flashmla", "flashmla-sparse-fp8", "flashmla-sparse-prefill", "flashmla-dense-fp8")


def fp16(out: str, root: str, seed: int) -> None:
    from amla_sim.crosscheck.flashmla import FLASHMLA_FP16_CASES

    for name, s0 in (("flashmla_fp16_vllm", 0), ("flashmla_fp16_vllm_fresh", seed)):
        cases = [{"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "dist": dist, "seed": s + s0,
                  "scale": scale, "causal": causal, "format": "fp16"}
                 for b, sq, H, lens, dist, s, scale, causal in FLASHMLA_FP16_CASES]
        capture("flashmla", os.path.join(out, name + ".npz"), source=root, build="vllm", cases=cases)
        print(name, "done", flush=True)


def main() -> None:
    if sys.argv[1] == "--fp16":
        return fp16(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1000)
    out, roots = sys.argv[1], {"vllm": sys.argv[2], "sglang": sys.argv[3]}
    fresh = int(sys.argv[4]) if len(sys.argv) > 4 else 6000
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp()
    failed = []
    for build, root in roots.items():
        for kernel in KERNELS:
            stem = kernel.replace("-", "_")
            for name, kw in ((f"{stem}_{build}", {}), (f"scales_{stem}_{build}", {"scales": 20}),
                             (f"{stem}_{build}_fresh", {"seed": fresh})):
                t0 = time.time()
                try:
                    capture(kernel, os.path.join(work, name + ".npz"), source=root, build=build, **kw)
                    print(f"{name}: {time.time() - t0:.1f} s", flush=True)
                except Exception:  # one kernel's failure is reported, the others still run
                    failed.append(name)
                    traceback.print_exc()
    with tarfile.open(os.path.join(out, "captures.tar"), "w") as tar:
        for f in sorted(os.listdir(work)):
            tar.add(os.path.join(work, f), arcname=f)
    print("failed:", failed or "none")


if __name__ == "__main__":
    main()
