"""A request's tokens through each V3.2 serving stack's prefill and decode launches on an H100/H200, as the stacks
call the kernels, for the prefill-versus-decode answer (amla_sim.invariance.prefill_decode) to be checked against.

    python scripts/capture_prefill_decode.py OUT.npz [--flashmla DIR] [--fa3 DIR]

Per case of CASES: the request from amla_sim.invariance.prefill_decode.request_inputs; the prefill launch of all
its tokens and, for each listed token, a decode launch of `decode_batch` copies of it, through the stack's kernels
(FA3's sparse call as vLLM makes it; FlashMLA's sparse prefill with the heads zero-padded to 64). Writes, per case
k, the listed tokens' ``c{k}_prefill_out`` / ``c{k}_decode_out`` (tokens, h, 512) BF16 bits and ``c{k}_prefill_lse``
/ ``c{k}_decode_lse`` (tokens, h) FP32 bits, natural log, and a JSON meta of the cases.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from amla_sim._files import atomic_savez
from amla_sim.gpu.adapters.fa3 import build_fa3, run_fa3_sparse
from amla_sim.gpu.adapters.flashmla import build_sparse_prefill, run_sparse_prefill
from amla_sim.invariance.prefill_decode import STACKS, request_inputs

V32 = 0.1352337788608801  # DeepSeek V3.2's softmax scale
#: (stack, length, heads, topk, tokens checked, decode batch, dist, seed)
CASES = [
    ("sglang-dsa", 300, 16, 256, [0, 150, 299], 1, "normal:1", 1),
    ("vllm-fa3-sparse", 400, 16, 2048, [63, 399], 1, "normal:1", 2),
    ("vllm-fa3-sparse", 400, 16, 2048, [399], 64, "normal:1", 2),
    ("vllm-flashmla-sparse", 300, 16, 256, [0, 150, 299], 1, "normal:1", 1),
    ("sglang-dsa-deterministic", 400, 16, 2048, [399], 1, "normal:1", 2),
]


def launch(kernels, kernel: str, q, kv, idx, valid, num_splits: int) -> tuple[np.ndarray, np.ndarray]:
    """One launch over the tokens of q: out (T, h, 512) uint16 and lse (T, h) uint32 bits."""
    if kernel == "fa3-mla-sparse":
        got = run_fa3_sparse(kernels["fa3"], q, kv, idx, valid, {"format": "bf16", "scale": V32,
                                                                 "num_splits": num_splits}, len(q))
        return got["out"], got["lse"].T
    h = q.shape[1]
    qp = np.concatenate([q, np.zeros((q.shape[0], 64 - h, q.shape[2]), q.dtype)], axis=1) if h < 64 else q
    got = run_sparse_prefill(kernels["prefill"], qp, kv[:, None], idx[:, None], valid, None, V32)
    return got["out"][:, :h], got["lse"][:, :h]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--flashmla", default=".third_party/FlashMLA")
    p.add_argument("--fa3", default=".third_party/flash-attention")
    args = p.parse_args()
    kernels = {"fa3": build_fa3(args.fa3), "prefill": build_sparse_prefill(args.flashmla)}
    arrays, cases = {}, []
    for k, (stack, length, heads, topk, tokens, batch, dist, seed) in enumerate(CASES):
        st = STACKS[stack]
        q, kv, idx = request_inputs(length, heads=heads, topk=topk, dist=dist, seed=seed)
        valid = (idx >= 0).sum(axis=1)
        out, lse = launch(kernels, st.prefill, q, kv, idx, valid, st.num_splits)
        arrays[f"c{k}_prefill_out"], arrays[f"c{k}_prefill_lse"] = out[tokens], lse[tokens]
        dec = [launch(kernels, st.decode, q[[t] * batch], kv, idx[[t] * batch], valid[[t] * batch], st.num_splits)
               for t in tokens]
        arrays[f"c{k}_decode_out"] = np.stack([o[0] for o, _ in dec])
        arrays[f"c{k}_decode_lse"] = np.stack([s[0] for _, s in dec])
        cases.append({"stack": stack, "length": length, "heads": heads, "topk": topk, "tokens": tokens,
                      "decode_batch": batch, "dist": dist, "seed": seed, "scale": V32})
        pre, dec_out = arrays[f"c{k}_prefill_out"], arrays[f"c{k}_decode_out"]
        same = [bool((pre[j] == dec_out[j]).all()) for j in range(len(tokens))]
        print(f"case {k} {stack}: prefill == decode per token {dict(zip(tokens, same))}", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": cases}
    atomic_savez(args.out, meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    main()
