"""Benchmark: the deployed-kernel models against the float32 BLAS products of the same shapes, in one run.

    python benchmarks/bench_kernel_models.py [--sizes small,large] [--engines numpy,numba] [--repeat 3]
        [--models flashmla,splitkv_decode,...] [--clock wall|cpu] [--json FILE]

For each model and size: the median seconds of a whole simulated decode on each engine (numba: after one call
that compiles), its ratio to the yardstick, and the peak of NumPy's allocations during one call (tracemalloc).
The yardstick is what the decode would cost as plain float32 BLAS: per request, Q K^T ((s_q h) x 576 by 576 x L)
and P V ((s_q h) x L by L x 512), timed in the same run. Every engine's output is checked bit-identical.
``--clock cpu`` times both by this process's CPU seconds instead of the wall clock: on a machine that other work
keeps busy, with one thread each (``NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1``), so that neither waits on a
descheduled thread of its own.

Sizes: ``small``: 2 requests, 32 heads (64 for the sparse FP8 decode: its least), seqlens 1 and 2049 (FlashInfer's
MLA decode: SGLang's call, page size 1, its plan splitting the second request over the SMs); FlashMLA with
s_q 4, SGLang with 1 and 4 splits. ``large``: batch 4 x 128 heads x 4096 tokens; vLLM's FP8 decodes (the dense FP8
FlashMLA decode, the Triton decode with an FP8 cache and its 8 splits) with the mixed lengths 4096, 3000, 4096,
1234.

DeepSeek V3.2's sparse attention with a BF16 cache (FA3's sparse call, FlashMLA's sparse prefill kernel): one query
token a request, topk 2048, each token's list a seeded draw of 2048 of its request's rows in the indexer's (unsorted)
order, -1 past them. ``small``: 2 tokens, 64 heads (the sparse prefill's least), contexts 1 and 2049 (1 and 2048
valid entries); ``large``: 4 tokens x 128 heads, contexts 4096. Their yardstick is the products over the keys the
lists select (2048 a token).

FA3's MHA-form MLA prefill (q/k 192, v 128, vLLM's calls): ``fa3_prefill``, the new tokens' causal call, and
``fa3_prefill_chunk``, a context chunk's call, BF16; ``fa3_prefill_fp8`` the causal call in E4M3 (the two-level
accumulation). ``small``: 16 heads (DeepSeek on TP8), new tokens 257 and 700 / 300 queries over 2,000 keys;
``large``: 128 heads x 1,000 new tokens (TP1) / 16 heads, 512 queries over 8,192 keys. Their yardstick is Q K^T and
P V of every request and head over all its keys (a causal call's blocks above the diagonal included: the model
skips them, the yardstick does not).
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from _timing import CLOCKS, median_time  # benchmarks/, the script's own folder
from amla_sim.algorithms import (amla, base, fa3_mla, fa3_mla_sparse, flashinfer_mla, flashmla, flashmla_dense_fp8,
                                 flashmla_etap,
                                 flashmla_sparse_fp8, flashmla_sparse_prefill, quantize_cache_fp8, quantize_query_fp8,
                                 splitkv_decode, vllm_triton_mla)
from amla_sim.algorithms.deployed.fa3.prefill import cu_seqlens, fa3_prefill
from amla_sim.algorithms.deployed.flashmla.fp8_cache import pages, quantize_kv_cache
from amla_sim.crosscheck.fa3_prefill import draw_heads
from amla_sim.engine import ENGINES, numba_available, use_engine
from amla_sim.experiments.inputs import make_inputs


def _inputs(batch: int, sq: int, heads: int, seqlens: list[int], seed: int = 0):
    q, kv = make_inputs("normal:1", batch=batch, sq=sq, heads=heads, context=max(seqlens), seed=seed)
    return q, kv, np.array(seqlens)


def _sparse(q, kv, lens):
    """The sparse FP8 decode with every token of each request selected (V3.2 cache), as the sweep entry does."""
    paged, base0 = pages(kv)
    cache = quantize_kv_cache(paged)
    topk = -(-int(lens.max()) // 64) * 64
    idx = np.full((q.shape[0], q.shape[1], topk), -1, np.int32)
    for i, n in enumerate(lens):
        idx[i, :, :n] = base0[i] + np.arange(n)
    return lambda: flashmla_sparse_fp8(q, cache, idx)


V32_TOPK = 2048  # DeepSeek V3.2's index_topk
V32_MODELS = ("fa3_mla_sparse", "flashmla_sparse_prefill")


def _v32(model: str, q, kv, lens, seed: int = 0):
    """DeepSeek V3.2's BF16-cache sparse attention: request i's query token attends to a seeded draw of
    min(lens[i], topk) of its rows, in no order (as the indexer lists them), -1 after them. (the call, and the keys
    it selects as the yardstick's (q, kv, lens): one query a token, its keys gathered)."""
    b, _, h, d = q.shape
    S = kv.shape[1]
    rng = np.random.default_rng(seed)
    idx = np.full((b, V32_TOPK), -1, np.int32)
    for i, n in enumerate(lens):
        k = min(int(n), V32_TOPK)
        idx[i, :k] = i * S + rng.permutation(int(n))[:k]
    cache, qt = kv.reshape(b * S, d), q[:, 0]
    valid = np.minimum(lens, V32_TOPK)
    keys = np.zeros((b, V32_TOPK, d), kv.dtype)
    for i, n in enumerate(valid):
        keys[i, :n] = cache[idx[i, :n]]
    if model == "fa3_mla_sparse":  # vLLM's FLASH_ATTN_MLA_SPARSE call: FA3's own split count over the tokens
        fn = lambda: fa3_mla_sparse(qt, cache, idx)  # noqa: E731
    else:  # vLLM's FLASHMLA_SPARSE with a BF16 cache (no topk_length: the kernel walks all topk slots)
        fn = lambda: flashmla_sparse_prefill(qt, cache[:, None], idx[:, None])  # noqa: E731
    return fn, (q, keys, valid)


PREFILL_MODELS = ("fa3_prefill", "fa3_prefill_chunk", "fa3_prefill_fp8")


def _prefill(model: str, size: str):
    """FA3's prefill calls: (the call, (q, k, v, qlens, klens) for the yardstick)."""
    import ml_dtypes

    if model == "fa3_prefill_chunk":
        h, ql, kl, causal = (16, [300], [2000], False) if size == "small" else (16, [512], [8192], False)
    else:
        h, ql, kl, causal = (16, [257, 700], [257, 700], True) if size == "small" else (128, [1000], [1000], True)
    q, k, v = (draw_heads("normal:1", sum(n), h, w, s) for n, w, s in ((ql, 192, 1), (kl, 192, 2), (kl, 128, 3)))
    if model == "fa3_prefill_fp8":
        q, k, v = (x.astype(ml_dtypes.float8_e4m3fn) for x in (q, k, v))
    fn = lambda: fa3_prefill(q, k, v, cu_seqlens(ql), cu_seqlens(kl), causal=causal)  # noqa: E731
    return fn, (q, k, v, ql, kl)


def prefill_yardstick(q, k, v, qlens, klens, repeat: int, clock: str = "wall") -> float:
    """Median seconds of Q K^T and P V in float32 BLAS for every request and head of a prefill call."""
    mats, cq, ck = [], cu_seqlens(qlens), cu_seqlens(klens)
    for i in range(len(qlens)):
        for j in range(q.shape[1]):
            Q = q[cq[i]:cq[i + 1], j].astype(np.float32)
            K = np.ascontiguousarray(k[ck[i]:ck[i + 1], j].astype(np.float32))
            V = np.ascontiguousarray(v[ck[i]:ck[i + 1], j].astype(np.float32))
            mats.append((Q, K, np.ones((Q.shape[0], K.shape[0]), np.float32), V))

    def run() -> None:
        for Q, K, P, V in mats:
            Q @ K.T
            P @ V

    return median_time(run, max(repeat, 20), clock)


def cases(size: str) -> dict[str, tuple[Callable[[], object], tuple]]:
    """model -> (a call that simulates the decode, the inputs' (q, kv, seqlens) for the yardstick)."""
    if size == "small":
        shapes = {"flashmla": (2, 4, 32, [1, 2049]), "splitkv_decode": (2, 1, 32, [1, 2049]),
                  "flashmla_etap": (2, 1, 32, [1, 2049]), "flashmla_sparse_fp8": (2, 1, 64, [1, 2049]),
                  "base": (2, 1, 32, [2049, 2049]), "amla": (2, 1, 32, [2049, 2049]),
                  "fa3_mla": (2, 1, 32, [1, 2049]), "flashmla_dense_fp8": (2, 1, 32, [1, 2049]),
                  "vllm_triton_mla": (2, 1, 32, [1, 2049]), "flashinfer_mla": (2, 1, 32, [1, 2049]),
                  **{m: (2, 1, 64, [1, 2049]) for m in V32_MODELS}}
    else:
        shapes = {m: (4, 1, 128, [4096] * 4) for m in ("flashmla", "splitkv_decode", "flashmla_etap",
                                                       "flashmla_sparse_fp8", "base", "amla", "fa3_mla",
                                                       "flashinfer_mla")}
        # vLLM's FP8 decodes: mixed lengths (vLLM's Triton split count for them: 8)
        shapes.update({m: (4, 1, 128, [4096, 3000, 4096, 1234]) for m in ("flashmla_dense_fp8", "vllm_triton_mla")})
        shapes.update({m: (4, 1, 128, [4096] * 4) for m in V32_MODELS})
    out = {m: _prefill(m, size) for m in PREFILL_MODELS}
    for model, (b, sq, h, lens) in shapes.items():
        q, kv, lens = _inputs(b, sq, h, lens)
        if model in V32_MODELS:
            out[model] = _v32(model, q, kv, lens)
            continue
        if model == "flashmla":
            fn = lambda q=q, kv=kv, lens=lens: flashmla(q, kv, seqlens=lens)  # noqa: E731
        elif model == "splitkv_decode":
            splits = np.array([1, 4] if size == "small" else [8] * b)
            fn = lambda q=q, kv=kv, lens=lens, s=splits: splitkv_decode(q, kv, seqlens=lens, num_kv_splits=s,  # noqa: E731
                                                                        max_kv_splits=int(s.max()))
        elif model == "flashmla_etap":
            fn = lambda q=q, kv=kv, lens=lens: flashmla_etap(q, kv, seqlens=lens)  # noqa: E731
        elif model == "flashmla_sparse_fp8":
            fn = _sparse(q, kv, lens)
        elif model == "flashmla_dense_fp8":  # E4M3 q and cache as vLLM quantizes them (scales 1)
            q8, kv8 = quantize_query_fp8(q), quantize_cache_fp8(kv)
            fn = lambda q8=q8, kv8=kv8, lens=lens: flashmla_dense_fp8(q8, kv8, seqlens=lens)  # noqa: E731
        elif model == "vllm_triton_mla":  # vLLM's call with an FP8 cache: vLLM's split count over the batch
            kv8 = quantize_cache_fp8(kv)
            fn = lambda q=q, kv8=kv8, lens=lens: vllm_triton_mla(q, kv8, seqlens=lens)  # noqa: E731
        elif model == "flashinfer_mla":  # SGLang's flashinfer backend: the plan's split over the batch's KV
            fn = lambda q=q, kv=kv, lens=lens: flashinfer_mla(q, kv, seqlens=lens)  # noqa: E731
        elif model == "fa3_mla":  # vLLM's call: FA3's own split count
            fn = lambda q=q, kv=kv, lens=lens: fa3_mla(q, kv, seqlens=lens)  # noqa: E731
        else:
            alg = {"base": base, "amla": amla}[model]
            fn = lambda q=q, kv=kv, alg=alg: alg(q, kv, machine="sm90-triton", schedule="amla-sim-gpu")  # noqa: E731
        out[model] = (fn, (q, kv, lens))
    return out


def yardstick(q: np.ndarray, kv: np.ndarray, lens: np.ndarray, repeat: int, clock: str = "wall") -> float:
    """Median seconds of the float32 BLAS products of the decode: Q K^T and P V of every request."""
    b, sq, h, d = q.shape
    mats = []
    for i, n in enumerate(lens):
        Q = q[i].reshape(sq * h, d).astype(np.float32)
        K = np.ascontiguousarray(kv[i, :n].astype(np.float32))
        P = np.ones((sq * h, int(n)), np.float32)
        mats.append((Q, K, P, np.ascontiguousarray(K[:, :512])))

    def run() -> None:
        for Q, K, P, V in mats:
            Q @ K.T
            P @ V

    return median_time(run, max(repeat, 20), clock)


def _bits(res) -> bytes:
    return np.ascontiguousarray(res.out).tobytes() + np.ascontiguousarray(res.lse).tobytes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--engines", default=",".join(e for e in ENGINES if e != "numba" or numba_available()))
    ap.add_argument("--models", default="flashmla,splitkv_decode,flashmla_etap,flashmla_sparse_fp8,base,amla")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="wall seconds, or this process's CPU "
                    "seconds (a busy machine; run one thread each)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = []
    print(f"{'size':6s} {'model':24s} {'engine':6s} {'median s':>9s} {'BLAS ms':>8s} {'ratio':>7s} {'peak MB':>8s}")
    for size in args.sizes.split(","):
        for model, (fn, shape) in cases(size).items():
            if model not in args.models.split(","):
                continue
            if model in PREFILL_MODELS:
                blas = prefill_yardstick(*shape, args.repeat, args.clock)
                q, lens = shape[0], np.array(shape[4])
            else:
                q, kv, lens = shape
                blas = yardstick(q, kv, lens, args.repeat, args.clock)
            outs = []
            for engine in args.engines.split(","):
                with use_engine(engine):
                    outs.append(_bits(fn()))  # compiles, for numba
                    t = median_time(fn, args.repeat, args.clock)
                    tracemalloc.start()
                    fn()
                    peak = tracemalloc.get_traced_memory()[1] / 2**20
                    tracemalloc.stop()
                row = {"size": size, "model": model, "engine": engine, "seconds": t, "blas_seconds": blas,
                       "ratio": t / blas, "peak_mb": peak, "clock": args.clock, "shape": [int(v) for v in q.shape],
                       "seqlens": lens.tolist()}
                rows.append(row)
                print(f"{size:6s} {model:24s} {engine:6s} {t:9.3f} {blas * 1e3:8.2f} {t / blas:6.0f}x {peak:8.0f}",
                      flush=True)
            assert all(o == outs[0] for o in outs), f"{model} ({size}): engines differ"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, f, indent=1)
    for engine in args.engines.split(","):
        worst = {s: max(r["ratio"] for r in rows if r["size"] == s and r["engine"] == engine)
                 for s in dict.fromkeys(r["size"] for r in rows)}
        print(f"worst ratio on {engine}: " + ", ".join(f"{s} {v:.0f}x" for s, v in worst.items()))


if __name__ == "__main__":
    main()
