"""Why vLLM's Triton MLA decode with an FP8 cache needs its own k order: on a GPU, the kernel's FP8-cache runs
against BF16-cache runs of the same dequantized values, and the dot operand layouts Triton chose for each.

    TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR=/tmp/dump TRITON_ALWAYS_COMPILE=1 \\
        python scripts/vllm_triton_kwidth.py VLLM_FILE_OR_CHECKOUT /tmp/dump OUT.json

For two FP8 cases of the ``vllm-triton-mla`` case table (seed 0), the kernel runs once on the E4M3 cache and once on
a BF16 cache holding ``bf16(fl32(x) k_scale)`` (what stage 1 dequantizes to): if only the values mattered the two
would give the same bits. Then, from the dumped TTGIR of stage 1, each ``tt.dot``'s operand ``kWidth`` for the
BF16 and the FP8 compilation, and from the PTX the mma instructions each uses. Writes the counts to OUT.json.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from amla_sim._files import atomic_write
from amla_sim.algorithms import quantize_cache_fp8
from amla_sim.crosscheck.fa3 import fa3_inputs
from amla_sim.crosscheck.vllm import VLLM_TRITON_MLA
from amla_sim.gpu.adapters.vllm import load_vllm_triton, run_vllm_triton

CASES = (1, 5)  # FP8 caches: k_scale 1 (the values exact in BF16) and 0.023


def main(source: str, dump: str, out: str) -> None:
    import torch

    mod = load_vllm_triton(source)
    res: dict = {"device": torch.cuda.get_device_name(), "cases": {}}
    for i in CASES:
        r = VLLM_TRITON_MLA.recipes(0)[i]
        q, kv = fa3_inputs(r)
        fp8 = run_vllm_triton(mod, q, kv, r, r["num_kv_splits"])
        deq = (quantize_cache_fp8(kv, r["k_scale"]).astype(np.float32) * np.float32(r["k_scale"]))
        bf16 = run_vllm_triton(mod, q, deq.astype(np.float32).astype(ml_dtypes.bfloat16), {**r, "kv_cache": "bf16"},
                               r["num_kv_splits"])
        res["cases"][i] = {k: int((fp8[k] != bf16[k]).sum()) for k in ("out", "lse")}
        print(f"case {i}: FP8 cache against BF16 of its dequantized values: {res['cases'][i]} elements differ")
    kernels = []
    for ttgir in sorted(Path(dump).rglob("_fwd_grouped_kernel_stage1.ttgir")):
        text = ttgir.read_text()
        ptx = next(ttgir.parent.glob("*.ptx")).read_text()
        kernels.append({"fp8_cache": "K_Buffer: !tt.ptr<f8E4M3FN>" in text,
                        "dot_kwidth": sorted(set(int(k) for k in re.findall(r"tt\.dot .*?kWidth = (\d+)", text))),
                        "mma": sorted(set(re.findall(r"(?:mma|wgmma)\.[a-z0-9._]*", ptx)))})
        print(kernels[-1])
    res["stage1_compilations"] = kernels
    atomic_write(Path(out), json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
