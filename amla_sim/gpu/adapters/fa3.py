"""FlashAttention-3's MLA decode: the extension that a folder's ``build_fa3_mla.py`` builds (vllm-project/flash-
attention's ``hopper/`` forward for head dims 64 / 512), called as vLLM calls it (``run_vllm_decode``: the
scheduler metadata, then ``flash_attn_varlen_func`` with ``q_v`` and a block table over shuffled pages) or, for a
cache that is not paged, as SGLang's ``flash_attn_with_kvcache``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ._common import bits16, load_built

__all__ = ["load_fa3", "run_fa3"]


def load_fa3(folder: str | Path):
    """The build folder's helpers (its ``build_fa3_mla`` module), with the built extension as ``.mod``."""
    mod = load_built(folder, "build_fa3_mla.py", "fa3-mla")
    helpers = sys.modules["build_fa3_mla"]
    helpers.mod = mod
    return helpers


def run_fa3(fa3, q: np.ndarray, kv: np.ndarray, recipe: dict) -> dict[str, np.ndarray]:
    """One case on the GPU: q (b, s_q, h, 576) and kv (b, S_max, 576) bits of `recipe`'s format. Returns out
    (b * s_q, h, 512) and lse (the kernel's layout) as raw bits, and each request's split count where the
    scheduler metadata holds one."""
    import torch

    b, sq, H, _ = q.shape
    lens, page, fmt = recipe["seqlens"], recipe["page_size"], recipe["format"]
    qt = bits16(torch, q.reshape(b * sq, H, q.shape[-1]), fmt)
    res = {}
    if page is None:
        cache = bits16(torch, kv, fmt)
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q4 = qt.view(b, sq, H, -1)
        out, lse = fa3.flash_attn_with_kvcache(fa3.mod, q4[..., 512:], cache[..., 512:].unsqueeze(-2),
                                               cache[..., :512].unsqueeze(-2), qv=q4[..., :512], cache_seqlens=sl,
                                               softmax_scale=recipe["scale"], causal=recipe["causal"],
                                               num_splits=recipe["num_splits"], return_softmax_lse=True)
    else:
        reqs = [bits16(torch, kv[i, :n], fmt).cpu() for i, n in enumerate(lens)]
        cache, table = fa3.make_paged(reqs, page, seed=recipe["seed"])
        out, lse, meta = fa3.run_vllm_decode(fa3.mod, qt, cache, table, list(lens), sq, recipe["scale"],
                                             num_splits=recipe["num_splits"])
        m = meta.cpu().numpy()
        rounded = -(-b // 4) * 4  # vectors of b rounded up to 4: rows, [splits if dynamic], [heads in L2 if causal]
        if (m.size - 1) // rounded - 1 - (sq > 1) == 1:
            res["splits"] = m[rounded:rounded + b].astype(np.int32)
    torch.cuda.synchronize()
    res["out"] = out.reshape(b * sq, H, -1).view(torch.int16).cpu().numpy().view(np.uint16)
    res["lse"] = lse.float().contiguous().cpu().numpy().view(np.uint32)
    return res
