"""What the adapters share: raw bits as CUDA tensors, a contiguous cache as FlashMLA's pages, requests' rows in
shuffled pages as vLLM's block tables address them."""

from __future__ import annotations

import numpy as np

from .. import to_torch

__all__ = ["bits16", "paged", "shuffled_pages"]


def bits16(torch, bits: np.ndarray, fmt: str = "bf16"):
    """BF16 (or FP16, `fmt`) bits, as uint16 or the float type, as a CUDA tensor."""
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    return to_torch(np.ascontiguousarray(bits).view(np.int16), "cuda").view(dtype)


def paged(torch, kv_bits: np.ndarray, fmt: str = "bf16"):
    """A (b, S_max, 576) cache as pages of 64 tokens (num_blocks, 64, 1, 576), zero past S_max, and its block
    table (request i owns pages i * n .. i * n + n - 1)."""
    b, L, d = kv_bits.shape
    nblk = -(-L // 64)
    kpad = np.zeros((b, nblk * 64, d), np.uint16)
    kpad[:, :L] = kv_bits.view(np.uint16)
    kc = bits16(torch, kpad, fmt).view(b * nblk, 64, 1, d)
    return kc, torch.arange(b * nblk, dtype=torch.int32, device="cuda").view(b, nblk)


def shuffled_pages(torch, reqs: list, page: int, seed: int, dtype):
    """Requests' rows (each (L_i, 576) on the GPU) scattered into a cache of pages in a shuffled order, unused
    slots holding finite noise of `dtype`: the cache (num_pages, page, 576) and the block table."""
    rng = np.random.default_rng(seed)
    counts = [-(-int(r.shape[0]) // page) for r in reqs]
    total = sum(counts) + 3
    cache = torch.from_numpy(rng.standard_normal((total, page, reqs[0].shape[1]), dtype=np.float32)).cuda().to(dtype)
    order = rng.permutation(total)
    table = np.zeros((len(reqs), max(counts) + 2), np.int32)
    used = 0
    for i, r in enumerate(reqs):
        for j in range(counts[i]):
            p = int(order[used])
            used += 1
            rows = r[j * page:(j + 1) * page]
            cache[p, :rows.shape[0]] = rows
            table[i, j] = p
    return cache, torch.from_numpy(table).cuda()
