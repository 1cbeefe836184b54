"""The device check beside ``amla-sim route``: one request whose prefill vLLM 0.33 routes differently when a batchmate
arrives before it, run both ways through vLLM's shipped FA3 and its ``merge_attn_states``.

Run on a CUDA machine:  python scripts/capture_route.py OUTDIR VLLM_ROOT MERGE_BUNDLE

The request: a prompt of 1,000 tokens, 16 heads (DeepSeek-V3 on TP8), ``max_num_batched_tokens`` 2048. Alone it is
prefilled in one step: one causal FA3 call over its 1,000 tokens. Behind a prompt of 1,700 tokens, the scheduler
leaves it 348 tokens in the first step (the absorbed decode kernel: 348 <= 512) and the other 652 in the next (the
MHA prefill: a causal call over the 652, a context chunk of the 348, ``merge_attn_states``). Tokens 348-999 are
computed by the MHA form both times, so their outputs compare directly. Writes OUTDIR/route_vllm_{dev}.npz:
``alone_out`` (1000, 2, 128) and ``batch_out`` (652, 2, 128), raw BF16 bits of the first two heads, and ``meta``
(the recipe; the inputs are drawn again from it by ``amla_sim.crosscheck.fa3_prefill.draw_heads``).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.crosscheck.fa3_prefill import draw_heads
from amla_sim.crosscheck.files import input_crc

#: the request and the split the batchmate makes of it (``amla-sim route --requests 1700,1000 --budget 2048``)
RECIPE = {"heads": 16, "tokens": 1000, "first_chunk": 348, "dist": "normal:1", "seed": 610,
          "scale": 0.1352337788608801, "num_splits": 0, "workspace": 2048, "block_size": 16, "keep_heads": 2,
          "budget": 2048, "batchmate": 1700}


def inputs(recipe: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (T, h, 192), k (T, h, 192), v (T, h, 128) of the request's tokens."""
    T, H, s = recipe["tokens"], recipe["heads"], recipe["seed"]
    return (draw_heads(recipe["dist"], T, H, 192, s), draw_heads(recipe["dist"], T, H, 192, s + 1000),
            draw_heads(recipe["dist"], T, H, 128, s + 2000))


def main() -> None:
    out_dir, vllm_root, bundle = sys.argv[1:4]
    import torch

    sys.path.insert(0, bundle)
    from build_merge import build_vllm

    from amla_sim.algorithms.deployed.vllm.mla_prefill import chunk_rows, plan_context_chunks
    from amla_sim.gpu.adapters.fa3 import load_shipped_fa3, run_fa3_prefill, run_vllm_prefill_chain

    fa3, merge = load_shipped_fa3(vllm_root), build_vllm()
    r = RECIPE
    q, k, v = inputs(r)
    T, c, keep = r["tokens"], r["first_chunk"], r["keep_heads"]
    alone = run_fa3_prefill(fa3, q, k, v, {"format": "bf16", "qlens": [T], "seqlens": [T], "scale": r["scale"],
                                           "causal": True, "num_splits": r["num_splits"]})
    step = {"qlens": [T - c], "context_lens": [c], "num_splits": r["num_splits"], "scale": r["scale"]}
    chunks = []
    for ch in plan_context_chunks([c], r["workspace"], block_size=r["block_size"]):
        rows, ctx, merged = chunk_rows(ch, step["qlens"], step["context_lens"])
        chunks.append((rows, ctx, merged, step["qlens"][ch.request_start:ch.request_end], list(ch.seq_lens)))
    batch = run_vllm_prefill_chain(fa3, merge, q[c:], k[c:], v[c:], k[:c], v[:c], step, chunks)
    meta = {"kernel": "vllm-route", "vllm": "0.33.0", "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "recipe": r, "input_crc": input_crc(q, k, v)}
    atomic_savez(os.path.join(out_dir, f"route_vllm_{'h200' if 'H200' in meta['device'] else 'h100'}.npz"),
                 meta=np.array(json.dumps(meta)), alone_out=np.ascontiguousarray(alone["out"][:, :keep]),
                 batch_out=np.ascontiguousarray(batch[:, :keep]))
    differ = np.mean(alone["out"][c:, :keep] != batch[:, :keep])
    print(f"route check: tokens {c}..{T - 1}, {differ:.1%} of their output bits differ alone vs behind a batchmate")


if __name__ == "__main__":
    main()
