"""FlashAttention-3's MLA decode (vllm-project/flash-attention): its case table, replayed by
:func:`.deployed.replay_deployed`.

A case records ``out`` (b * s_q, h, 512) BF16 or FP16 bits and ``lse`` FP32 bits in the kernel's layouts ((h, b *
s_q) for vLLM's varlen call, (b, h, s_q) for ``flash_attn_with_kvcache`` without ``cu_seqlens_q``), and, where the
launch splits requests dynamically, each request's split count from the scheduler metadata (``splits``), which
the model's scheduler is tested against. Inputs are regenerated, never stored: q from
:func:`~amla_sim.experiments.inputs.make_inputs` at the case's seed, each request's KV drawn on its own (seed
``100 * seed + i + 1``), so that a long request costs its own tokens only.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._validate import check_int
from ..algorithms._common import D_K, D_V
from ..algorithms.deployed.fa3 import FA3_COMMIT, SGL_FA3_COMMIT, fa3_mla, fa3_mla_sparse, sgl_fa3_mla
from ..algorithms.deployed.fa3.scheduler import launch_splits, window
from ..experiments.inputs import make_inputs
from .files import CaptureError, input_crc
from .kernel import DeployedKernel, Stage, check_fa3_options, run_twice, stage

__all__ = ["FA3_CASES", "FA3_MLA", "fa3_inputs", "SPARSE_CASES", "FA3_MLA_SPARSE", "fa3_sparse_inputs", "SGL_CASES",
           "SGL_FA3_MLA", "SGL_FA3_MLA_SPARSE"]

_DS = 0.1352  # DeepSeek-V3's softmax scale (1 / sqrt(192) with its YaRN mscale)
_192 = 192 ** -0.5

#: (batch, s_q, heads, seqlens, format, dist, seed, scale, page, num_splits); page None: the cache not paged
#: (flash_attn_with_kvcache, SGLang's form), else vLLM's paged call; num_splits as vLLM passes it (0: FA3's
#: heuristic, 32: full CUDA graphs, 1: batch-invariant mode)
FA3_CASES = [
    (1, 1, 128, (4096,), "bf16", "flashmla", 51, _192, 16, 0),
    (1, 1, 128, (4096,), "bf16", "normal:1", 52, _DS, 64, 32),
    (2, 2, 128, (1000, 3001), "fp16", "flashmla", 53, _192, 64, 0),
    (4, 1, 16, (1, 63, 64, 16000), "bf16", "normal:1", 54, _192, 1, 0),
    (3, 1, 64, (513, 2048, 129), "fp16", "normal:1", 55, _DS, None, 0),
    (16, 1, 16, (512, 1, 2048, 777, 64, 1500, 65, 3000, 100, 2500, 63, 1024, 4096, 300, 129, 2000), "bf16",
     "flashmla", 56, _192, 16, 32),
    (2, 1, 128, (8192, 77), "fp16", "flashmla", 57, _DS, 16, 1),
    (1, 2, 64, (2500,), "bf16", "normal:1", 58, _192, 64, 32),
    (5, 1, 128, (300, 5000, 64, 1, 2049), "bf16", "normal:1", 59, _DS, 1, 1),
    (2, 2, 16, (700, 9000), "fp16", "normal:1", 60, _192, None, 32),
    (8, 1, 128, (1, 63, 64, 65, 700, 2500, 4097, 129), "bf16", "flashmla", 61, _192, 64, 0),
    (1, 1, 16, (16000,), "fp16", "flashmla", 62, _DS, 16, 0),
    # causal m-blocks cut short: query 0's rows end a block before query 1's (seqlen 64 k + 1)
    (2, 2, 128, (1025, 4097), "bf16", "normal:1", 63, _192, 64, 0),
    (1, 2, 64, (129,), "fp16", "flashmla", 64, _DS, 16, 32),
    # MTP rows whose first request splits in two: query 0's m-blocks end a block before query 1's
    (2, 2, 128, (129, 3000), "bf16", "normal:1", 65, _192, 16, 32),
]


def _bound(case: dict, max_seqlen_k: int) -> int:
    """The launch's split bound as :func:`~amla_sim.algorithms.deployed.fa3.scheduler.launch_splits` gives it: the
    metadata holds each request's split count only where it is over 1."""
    sq = case.get("sq", 1)
    causal, local, left, right = window(case.get("causal", True), tuple(case.get("window", (-1, -1))), sq,
                                        max_seqlen_k)
    return launch_splits(max_seqlen_k, s_q=sq, heads=case["heads"], num_splits=case["num_splits"],
                         causal=causal, batch=case["batch"], local=(left, right) if local else None)


def fa3_inputs(case: dict) -> tuple[np.ndarray, np.ndarray]:
    """q (b, s_q, h, 576) and kv (b, S_max, 576), zero past each request, from a recipe (checked against its CRC)."""
    b, sq, H, lens, fmt = case["batch"], case.get("sq", 1), case["heads"], case["seqlens"], case["format"]
    q, _ = make_inputs(case["dist"], batch=b, heads=H, sq=sq, context=1, seed=case["seed"], fmt=fmt)
    kv = np.zeros((b, max(lens), D_K), q.dtype)
    for i, n in enumerate(lens):
        if n == 0:  # a request of no key: nothing to draw
            continue
        kv[i, :n] = make_inputs(case["dist"], batch=1, heads=1, context=n, seed=100 * case["seed"] + i + 1,
                                fmt=fmt)[1][0]
    if "input_crc" in case and input_crc(q, kv) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return q, kv


class _Fa3(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": fmt, "dist": dist,
                 "seed": s + seed, "scale": scale, "page_size": page, "num_splits": ns, "varlen_q": page is not None,
                 "causal": True}
                for b, sq, H, lens, fmt, dist, s, scale, page, ns in FA3_CASES]

    def scale_template(self) -> dict:
        return {"batch": 1, "sq": 1, "heads": 16, "seqlens": [600], "format": "bf16", "dist": "normal:1",
                "seed": 500, "scale": None, "page_size": 64, "num_splits": 0, "varlen_q": True, "causal": True}

    def check(self, case: dict) -> None:
        if case.get("format") not in ("bf16", "fp16"):
            raise ValueError(f"format: FA3's MLA path takes bf16 or fp16, got {case.get('format')!r}")
        check_int(case["num_splits"], "num_splits", lo=0, hi=256)
        if case["page_size"] is not None:
            check_int(case["page_size"], "page_size", lo=1)
        for key in ("varlen_q", "causal"):
            if case[key] not in (True, False):
                raise TypeError(f"{key}: expected true or false, got {case[key]!r}")
        check_fa3_options(case)

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        b, sq, H = case["batch"], case.get("sq", 1), case["heads"]
        lse = (H, b * sq) if case["varlen_q"] else (b, H, sq)
        return {"out": ((b * sq, H, D_V), np.uint16, True), "lse": (lse, np.uint32, True),
                "splits": ((b,), np.int32, False)}

    def readbacks(self, case: dict) -> set[str]:
        """The split counts where the call's scheduler metadata holds them: vLLM's paged call on a launch whose
        split bound (the caller's count, or FA3's heuristic from the longest request) is over 1."""
        return {"splits"} if case["page_size"] is not None and _bound(case, max(case["seqlens"])) > 1 else set()

    def label(self, case: dict) -> str:
        page = "not paged" if case["page_size"] is None else f"page {case['page_size']}"
        return f" {case['format']} {page} num_splits={case['num_splits']}"

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, kv = fa3_inputs(case)
        res = fa3_mla(q, kv, seqlens=np.array(case["seqlens"]), scale=case["scale"], causal=case["causal"],
                      page_size=case["page_size"], num_splits=case["num_splits"], varlen_q=case["varlen_q"],
                      softcap=case.get("softcap", 0.0), window_size=tuple(case.get("window", (-1, -1))),
                      trace=True)
        out = []
        if f"c{i}_splits" in arrays:
            splits = np.array(res.trace["schedule"][0].splits, np.int32)
            out.append(("splits", arrays[f"c{i}_splits"], splits))
        fmt = np.float16 if case["format"] == "fp16" else ml_dtypes.bfloat16
        b, sq, H = case["batch"], case.get("sq", 1), case["heads"]
        return out + [stage("lse", arrays[f"c{i}_lse"], res.lse.astype(np.float32), np.float32),
                      stage("out", arrays[f"c{i}_out"], res.out.reshape(b * sq, H, D_V), fmt)]

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.fa3 import build_fa3

        return build_fa3(source)

    def load_shipped(self, source: str, build: str) -> Any:
        from ..gpu.adapters.fa3 import load_shipped_fa3

        return load_shipped_fa3(source)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.fa3 import run_fa3

        q, kv = fa3_inputs(recipe)
        sq = recipe.get("sq", 1)
        causal, local, _, _ = window(recipe["causal"], tuple(recipe.get("window", (-1, -1))), sq,
                                     recipe.get("max_seqlen_k") or max(recipe["seqlens"]))
        got, same = run_twice(lambda: run_fa3(kernel, q, kv, recipe, head_swizzle=causal or local))
        return got, {**recipe, "input_crc": input_crc(q, kv), "repeat_identical": same}


#: FlashAttention-3's MLA decode as the cross-check drives it.
FA3_MLA = _Fa3(
    name="fa3-mla",
    summary=f"FlashAttention-3's MLA decode (vllm-project/flash-attention {FA3_COMMIT}, vLLM's FLASH_ATTN_MLA and "
            "SGLang's fa3), BF16 and FP16",
    version_key="fa3_commit", version=FA3_COMMIT, source_flag="--fa3-dir",
    source_help=f"a vllm-project/flash-attention checkout at {FA3_COMMIT} with CUTLASS at csrc/cutlass (git clone "
                "--recursive), compiled here", builds=("vllm",), empty_requests=True)


_V32 = 0.1352337788608801  # DeepSeek V3.2's softmax scale: 192^-0.5 mscale^2 (YaRN)
#: FA3's sparse call (vLLM's FLASH_ATTN_MLA_SPARSE): (tokens, heads, cache rows, topk, valid counts (cycled over the
#: tokens), format, dist, seed, num_splits, tokens whose out the capture keeps (every token's LSE is kept)); a
#: launch of more than 992 tokens is never split, one of a few long lists is
SPARSE_CASES = [
    (4, 128, 6000, 2048, (2048, 2048, 700, 1), "bf16", "normal:1", 101, 0, 2),
    (1, 128, 3000, 2048, (1500,), "bf16", "flashmla", 102, 0, 1),
    (16, 16, 3000, 512, (512, 0, 300, 1, 64, 65, 511, 128), "fp16", "normal:1", 103, 0, 16),
    (2, 128, 4000, 2048, (2048, 900), "bf16", "normal:1", 104, 1, 1),  # SGLang's deterministic mode
    (1000, 16, 4000, 512, (512, *(0,) * 48, 3), "bf16", "normal:1", 105, 0, 8),  # over 992 tokens: one split
    (8, 64, 5000, 1024, (1024, 1024, 512, 100, 1024, 7, 1000, 1024), "bf16", "rope-outliers", 106, 0, 4),
    (24, 16, 8000, 1024, (1024,), "bf16", "normal:1", 107, 0, 2),  # a decode batch: a few splits each
    (2, 128, 3000, 2048, (600, 300), "bf16", "normal:1", 108, 0, 2),  # short lists: the bound is still topk's
]


def fa3_sparse_inputs(case: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q (T, h, 576), the cache rows (N, 576), indices (T, topk) int32 (each token's valid rows drawn without
    replacement, -1 past them) and the valid counts, from a recipe (checked against its CRC)."""
    T, H, N, topk, fmt = case["batch"], case["heads"], case["rows"], case["topk"], case["format"]
    q, _ = make_inputs(case["dist"], batch=T, heads=H, context=1, seed=case["seed"], fmt=fmt)
    _, kv = make_inputs(case["dist"], batch=1, heads=1, context=N, seed=case["seed"] + 1000, fmt=fmt)
    valid = np.array(case["seqlens"], np.int64)
    rng = np.random.default_rng([case["seed"], 9])
    idx = np.full((T, topk), -1, np.int32)
    for t, n in enumerate(valid):
        idx[t, :n] = rng.choice(N, int(n), replace=False)
    got = q[:, 0], kv[0], idx, valid
    if "input_crc" in case and input_crc(*got[:3]) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return got


class _Fa3Sparse(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": T, "heads": H, "rows": N, "topk": topk, "seqlens": [spec[t % len(spec)] for t in range(T)],
                 "format": fmt, "dist": dist, "seed": s + seed, "scale": _V32, "num_splits": ns, "keep": keep}
                for T, H, N, topk, spec, fmt, dist, s, ns, keep in SPARSE_CASES]

    def scale_template(self) -> dict:
        return {"batch": 2, "heads": 16, "rows": 3000, "topk": 2048, "seqlens": [2048, 600], "format": "bf16",
                "dist": "normal:1", "seed": 500, "scale": None, "num_splits": 0, "keep": 2}

    def check(self, case: dict) -> None:
        if case.get("format") not in ("bf16", "fp16"):
            raise ValueError(f"format: FA3's MLA path takes bf16 or fp16, got {case.get('format')!r}")
        topk = check_int(case["topk"], "topk", lo=1)
        check_int(case["rows"], "rows", lo=topk)
        if max(case["seqlens"]) > topk:
            raise ValueError(f"seqlens: a token's valid count is at most topk ({topk})")
        check_int(case["num_splits"], "num_splits", lo=0, hi=256)
        check_int(case["keep"], "keep", lo=1, hi=case["batch"])

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        T, H = case["batch"], case["heads"]
        return {"out": ((case["keep"], H, D_V), np.uint16, True), "lse": ((H, T), np.uint32, True),
                "splits": ((T,), np.int32, False)}

    def readbacks(self, case: dict) -> set[str]:
        """The split counts ``get_scheduler_metadata`` gives for the call, where its split bound (from topk, the
        call's max_seqlen_k) is over 1."""
        return {"splits"} if _bound(case, case["topk"]) > 1 else set()

    def label(self, case: dict) -> str:
        return f" {case['format']} topk={case['topk']} num_splits={case['num_splits']} (out of {case['keep']} kept)"

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, rows, idx, valid = fa3_sparse_inputs(case)
        res = fa3_mla_sparse(q, rows, idx, valid_counts=valid, scale=case["scale"], num_splits=case["num_splits"],
                             trace=True)
        out = []
        if f"c{i}_splits" in arrays:
            out.append(("splits", arrays[f"c{i}_splits"], np.array(res.trace["schedule"][0].splits, np.int32)))
        fmt = np.float16 if case["format"] == "fp16" else ml_dtypes.bfloat16
        return out + [stage("lse", arrays[f"c{i}_lse"], res.lse.astype(np.float32), np.float32),
                      stage("out", arrays[f"c{i}_out"], res.out[:case["keep"]], fmt)]

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.fa3 import build_fa3

        return build_fa3(source)

    def load_shipped(self, source: str, build: str) -> Any:
        from ..gpu.adapters.fa3 import load_shipped_fa3

        return load_shipped_fa3(source)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.fa3 import run_fa3_sparse

        q, rows, idx, valid = fa3_sparse_inputs(recipe)
        recipe = {**recipe, "scale": 576**-0.5 if recipe["scale"] is None else recipe["scale"]}
        got, same = run_twice(lambda: run_fa3_sparse(kernel, q, rows, idx, valid, recipe, recipe["keep"]))
        return got, {**recipe, "input_crc": input_crc(q, rows, idx), "repeat_identical": same}


#: FA3's sparse call (DeepSeek V3.2 with a BF16 cache) as the cross-check drives it.
FA3_MLA_SPARSE = _Fa3Sparse(
    name="fa3-mla-sparse",
    summary=f"FlashAttention-3's sparse MLA call (vllm-project/flash-attention {FA3_COMMIT}: vLLM's "
            "FLASH_ATTN_MLA_SPARSE, SGLang's DSA fa3 decode), one-token pages, BF16 and FP16",
    version_key="fa3_commit", version=FA3_COMMIT, source_flag="--fa3-dir", empty_requests=True,
    source_help=f"a vllm-project/flash-attention checkout at {FA3_COMMIT} with CUTLASS at csrc/cutlass (git clone "
                "--recursive), compiled here", builds=("vllm",))



_MAX_CONTEXT = 163840  # DeepSeek-V3's context: SGLang's CUDA-graph page table holds this many keys
#: SGLang's fa3 backend through its own build: (batch, s_q, heads, seqlens, format, dist, seed, scale, page,
#: num_splits (0, or 1 in deterministic mode), page-table width in pages: the CUDA-graph decode's
#: ceil(max_context_len / page) or an eager batch's longest request)
SGL_CASES = [
    (1, 1, 128, (600,), "bf16", "flashmla", 71, _V32, 1, 0, _MAX_CONTEXT),
    (2, 1, 16, (300, 900), "bf16", "normal:1", 72, _V32, 64, 0, _MAX_CONTEXT // 64),
    (3, 1, 64, (513, 2048, 129), "fp16", "normal:1", 73, _192, 64, 0, 40),
    (4, 1, 16, (100, 2000, 7000, 1), "bf16", "normal:1", 74, _V32, 1, 0, _MAX_CONTEXT),
    (2, 2, 64, (1000, 3001), "bf16", "normal:1", 75, _V32, 64, 0, _MAX_CONTEXT // 64),
    (2, 1, 128, (8192, 77), "bf16", "flashmla", 76, _V32, 16, 1, _MAX_CONTEXT // 16),
    (16, 1, 16, (512, 1, 2048, 777, 64, 1500, 65, 3000, 100, 2500, 63, 1024, 4096, 300, 129, 2000), "bf16",
     "flashmla", 77, _192, 1, 0, _MAX_CONTEXT),
    (8, 1, 16, (1, 63, 64, 65, 700, 2500, 4097, 129), "bf16", "normal:1", 78, _V32, 1, 0, 4097),
    (1, 1, 16, (16000,), "fp16", "flashmla", 79, _DS, 1, 0, _MAX_CONTEXT),
]
_SGL_SOURCE = (f"a sgl-project/sgl-flash-attn checkout at {SGL_FA3_COMMIT} (sglang-kernel 0.4.10 pins f89bc23) with "
               "CUTLASS 57e3cfb at csrc/cutlass, compiled here")


class _SglFa3(_Fa3):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": fmt, "dist": dist,
                 "seed": s + seed, "scale": scale, "page_size": page, "num_splits": ns, "table_pages": width,
                 "varlen_q": True, "causal": True}
                for b, sq, H, lens, fmt, dist, s, scale, page, ns, width in SGL_CASES]

    def scale_template(self) -> dict:
        return {**super().scale_template(), "page_size": 1, "table_pages": _MAX_CONTEXT}

    def check(self, case: dict) -> None:
        super().check(case)
        page = check_int(case["page_size"], "page_size", lo=1)
        width = check_int(case["table_pages"], "table_pages", lo=1, hi=1 << 20)
        if width * page < max(case["seqlens"]):
            raise ValueError(f"table_pages: {width} pages of {page} keys hold fewer than the longest request")
        if case["num_splits"] not in (0, 1) or not case["varlen_q"] or not case["causal"]:
            raise ValueError("num_splits: SGLang passes 0 or 1, cu_seqlens_q and causal")

    def label(self, case: dict) -> str:
        return f" {case['format']} page {case['page_size']} table {case['table_pages']} num_splits={case['num_splits']}"

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, kv = fa3_inputs(case)
        res = sgl_fa3_mla(q, kv, seqlens=np.array(case["seqlens"]), table_pages=case["table_pages"],
                          page_size=case["page_size"], scale=case["scale"], num_splits=case["num_splits"], trace=True)
        fmt = np.float16 if case["format"] == "fp16" else ml_dtypes.bfloat16
        b, sq, H = case["batch"], case.get("sq", 1), case["heads"]
        return [("splits", arrays[f"c{i}_splits"], np.array(res.trace["schedule"][0].splits, np.int32)),
                stage("lse", arrays[f"c{i}_lse"], res.lse.astype(np.float32), np.float32),
                stage("out", arrays[f"c{i}_out"], res.out.reshape(b * sq, H, D_V), fmt)]

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        return {**super().outputs(case), "splits": ((case["batch"],), np.int32, True)}

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.fa3 import build_fa3

        return build_fa3(source, fork="sglang")

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.fa3 import run_sgl_fa3

        q, kv = fa3_inputs(recipe)
        got, same = run_twice(lambda: run_sgl_fa3(kernel, q, kv, recipe))
        return got, {**recipe, "input_crc": input_crc(q, kv), "repeat_identical": same}


#: SGLang's fa3 MLA backend through SGLang's own FA3 build.
SGL_FA3_MLA = _SglFa3(
    name="sgl-fa3-mla",
    summary=f"SGLang's fa3 MLA decode through its own FlashAttention-3 build (sgl-project/sgl-flash-attn "
            f"{SGL_FA3_COMMIT}): the split bound from the page table's width, BF16 and FP16",
    version_key="sgl_fa3_commit", version=SGL_FA3_COMMIT, source_flag="--sgl-fa3-dir", source_help=_SGL_SOURCE)


class _SglFa3Sparse(_Fa3Sparse):
    """SGLang's DSA decode (``_forward_fa3``) on the sparse cases of vLLM's call: the same inputs, the bound the
    same (topk), so a capture of each build is compared with the same model."""

    def check(self, case: dict) -> None:
        super().check(case)
        if case["num_splits"] not in (0, 1):
            raise ValueError(f"num_splits: SGLang passes 0 or 1, got {case['num_splits']}")

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.fa3 import build_fa3

        return build_fa3(source, fork="sglang")

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.fa3 import run_sgl_fa3_sparse

        q, rows, idx, valid = fa3_sparse_inputs(recipe)
        recipe = {**recipe, "scale": 576**-0.5 if recipe["scale"] is None else recipe["scale"]}
        got, same = run_twice(lambda: run_sgl_fa3_sparse(kernel, q, rows, idx, valid, recipe, recipe["keep"]))
        return got, {**recipe, "input_crc": input_crc(q, rows, idx), "repeat_identical": same}


#: SGLang's DSA decode (DeepSeek V3.2, BF16 cache) through SGLang's own FA3 build.
SGL_FA3_MLA_SPARSE = _SglFa3Sparse(
    name="sgl-fa3-mla-sparse",
    summary=f"SGLang's DSA fa3 decode (DeepSeek V3.2, BF16 cache) through its own FlashAttention-3 build "
            f"(sgl-project/sgl-flash-attn {SGL_FA3_COMMIT}), one-token pages",
    version_key="sgl_fa3_commit", version=SGL_FA3_COMMIT, source_flag="--sgl-fa3-dir", empty_requests=True,
    source_help=_SGL_SOURCE)
