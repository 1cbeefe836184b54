"""deepseek-ai/FlashMLA's decodes and FlashMLA-ETAP: their case tables, replayed by :func:`.deployed.replay_deployed`.

A case records ``out`` (b, s_q, H, 512) BF16 (ETAP: or FP16) bits, ``lse`` (b, H, s_q) FP32 bits, and the kernel's
own split schedule (``sched``, ``num_splits``), which the models' schedulers are tested against. The sparse FP8
decode's inputs (cache, indices, topk_length, sink) are drawn from the recipe's seed (:func:`sparse_inputs`);
FlashMLA's cache quantizer has cases of its own (:data:`QUANT_CASES`, :func:`quant_inputs`).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._validate import check_int
from ..algorithms.deployed.flashmla import FLASHMLA_COMMIT
from ..algorithms.deployed.flashmla.combine import combine_width
from ..algorithms.deployed.flashmla.dense import flashmla
from ..algorithms.deployed.flashmla.etap import ETAP_COMMIT, flashmla_etap
from ..algorithms.deployed.flashmla.fp8_cache import layout_of, pages, quantize_kv_cache
from ..algorithms.deployed.flashmla.scheduler import num_sm_parts
from ..algorithms.deployed.flashmla.sparse_fp8 import flashmla_sparse_fp8, sparse_schedule
from ..experiments.inputs import make_inputs
from ..formats import round_to
from .files import CaptureError, input_crc
from .kernel import DeployedKernel, Stage, case_inputs, stage

__all__ = ["FLASHMLA_CASES", "FLASHMLA_CAUSAL_CASES", "ETAP_CASES", "SPARSE_FP8_CASES", "QUANT_CASES", "FLASHMLA", "FLASHMLA_ETAP",
           "FLASHMLA_SPARSE_FP8", "sparse_inputs", "quant_inputs"]

#: (batch, s_q, heads, seqlens, dist, seed): what scripts/capture_thirdparty.py ran
FLASHMLA_CASES = [
    (1, 1, 128, (4096,), "flashmla", 11),
    (1, 1, 128, (4096,), "normal:1", 12),
    (1, 2, 128, (1000,), "flashmla", 13),
    (2, 1, 64, (64, 3001), "flashmla", 14),
    (3, 2, 128, (8192, 77, 5000), "normal:1", 15),
    (4, 1, 128, (513, 2048, 4097, 129), "flashmla", 16),
]
#: FP16 inputs (a model served in half precision): (batch, s_q, heads, seqlens, dist, seed, scale, causal)
FLASHMLA_FP16_CASES = [
    (2, 1, 64, (64, 3001), "flashmla", 121, None, False),
    (3, 2, 128, (8192, 77, 5000), "normal:1", 122, 0.1352337788608801, False),
    (4, 2, 16, (2, 63, 66, 9000), "flashmla", 123, None, True),
    (1, 1, 128, (20000,), "rope-outliers", 124, 192 ** -0.5, False),
]
#: FlashMLA's dense decode as vLLM calls it for multi-token (MTP) steps, ``causal=True``: (batch, s_q, heads,
#: seqlens, dist, seed, scale); each m-block of 64 rows ends where its last row's mask lets it, and the splits that
#: the scheduler cut for the whole request (it does not see the mask) may then hold no block at all
FLASHMLA_CAUSAL_CASES = [
    (1, 2, 64, (4096,), "flashmla", 101, None),
    (2, 2, 64, (1025, 4097), "normal:1", 102, 0.1352337788608801),
    (3, 4, 32, (64, 5000, 777), "flashmla", 103, 192 ** -0.5),
    (2, 2, 128, (129, 3000), "normal:1", 104, None),
    (4, 3, 16, (2, 63, 66, 9000), "flashmla", 105, 0.1352337788608801),
    (8, 4, 16, (4, 64, 65, 128, 700, 2500, 4097, 129), "normal:1", 106, None),
    (1, 4, 128, (20000,), "flashmla", 107, 192 ** -0.5),
    (2, 3, 64, (3, 130), "normal:1", 108, None),
]
#: (batch, s_q, heads, seqlens, format, dist, seed, scale): what scripts/capture_thirdparty.py ran; s_q = 2 is causal
ETAP_CASES = [
    (1, 1, 16, (4096,), "fp16", "normal:1", 21, None),
    (1, 1, 128, (2048,), "bf16", "flashmla", 22, None),
    (2, 2, 64, (1, 1000), "bf16", "flashmla", 23, 0.1352),
    (4, 1, 32, (63, 64, 65, 3001), "fp16", "normal:1", 24, None),
    (2, 2, 16, (16500, 129), "fp16", "flashmla", 25, None),
    (16, 1, 16, (512, 1, 2048, 777, 64, 1500, 65, 3000, 100, 2500, 63, 1024, 4096, 300, 129, 2000), "fp16",
     "normal:1", 26, None),
    (3, 1, 64, (3000, 77, 2049), "bf16", "normal:1", 27, 0.1352),
    (8, 2, 32, (1, 63, 64, 65, 700, 2500, 4097, 129), "bf16", "flashmla", 28, None),
]
ETAP_PAGE_SIZE = 64  # the kernel's only page size (kBlockN)
#: FlashMLA's sparse FP8 decode: (batch, s_q, heads, layout, seqlens (tokens each request's cache holds), topk,
#: topk_length, share of empty (-1) slots, attention sink, dist, seed, scale, power-of-two scales, num_sms); slots
#: past a request's tokens are empty; a sink "normal" is N(6, 4) per head, "edge" that with heads 0-2 at -inf, +inf,
#: 0; num_sms (None: the GPU's) sets the split schedule the kernel is handed (fewer SMs: requests in one split)
SPARSE_FP8_CASES = [
    (1, 1, 128, "v32", (4096,), 2048, None, 0.0, None, "flashmla", 31, None, True, None),
    (1, 1, 64, "v32", (1000,), 512, None, 0.1, "normal", "normal:1", 32, None, True, 1),
    (2, 2, 128, "v32", (300, 5000), 384, None, 0.0, None, "normal:1", 33, 0.1352, True, None),
    (3, 1, 64, "v32", (100, 2000, 64), 128, None, 0.0, "edge", "rope-outliers", 34, None, False, 2),
    (2, 1, 128, "model1", (4096, 700), 1024, (1024, 300), 0.0, None, "flashmla", 35, None, True, None),
    (4, 2, 64, "model1", (64, 1500, 3000, 200), 256, (0, 256, 100, 65), 0.05, "normal", "normal:1", 36, None, True,
     None),
    (1, 2, 128, "model1", (2048,), 2048, None, 0.3, "edge", "normal:4", 37, None, True, None),
    (2, 1, 128, "v32", (3000, 3000), 128, None, 0.5, "normal", "normal:1", 38, 0.1352, False, 16),
]
SPARSE_PAGE_SIZE = 64
# FlashMLA's cache quantizer: (layout, pages of 64 tokens, dist, seed, edge rows written over the first tokens)
QUANT_CASES = [
    ("v32", 2, "normal:1", 41, True),
    ("v32", 2, "rope-outliers", 42, False),
    ("v32", 2, "normal:3000", 43, True),
    ("model1", 2, "normal:1", 44, True),
    ("model1", 2, "flashmla", 45, False),
    ("model1", 2, "uniform:1e-3", 46, True),
]


def sparse_inputs(case: dict) -> dict[str, np.ndarray | None]:
    """A sparse FP8 case's inputs from its recipe: q (b, s_q, h, d) BF16, the packed cache (pages of 64 tokens,
    request i owning the pages from i * ceil(S_max / 64)), indices (b, s_q, topk), topk_length, attn_sink."""
    lay = layout_of(case["layout"], "layout")
    b, sq, H, topk = case["batch"], case.get("sq", 1), case["heads"], case["topk"]
    q, kv = make_inputs(case["dist"], batch=b, heads=H, sq=sq, context=max(case["seqlens"]), d_k=lay.d,
                        d_v=lay.d_nope, seed=case["seed"])
    kpages, base = pages(kv, SPARSE_PAGE_SIZE)
    cache = quantize_kv_cache(kpages, lay.name, power_of_two=case.get("power_of_two", True))
    rng = np.random.default_rng([case["seed"], 7])
    idx = np.full((b, sq, topk), -1, np.int32)
    for i, n in enumerate(case["seqlens"]):
        for j in range(sq):
            k = min(topk, n)
            idx[i, j, :k] = base[i] + rng.choice(n, k, replace=False)
            idx[i, j, rng.random(topk) < case.get("invalid", 0.0)] = -1
    tl_, sink = _length_and_sink(case, rng, H)
    got = {"q": q, "kv_cache": cache, "indices": idx, "topk_length": tl_, "attn_sink": sink}
    if "input_crc" in case and _sparse_crc(got) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return got


def quant_inputs(case: dict) -> np.ndarray:
    """A quantizer case's BF16 pages (pages, 64, 1, d); with `edges`, the first tokens hold a zero token, tiny,
    subnormal, huge and exactly-448 * 2^k amaxes, and a tile of equal values."""
    lay = layout_of(case["layout"], "layout")
    _, kv = make_inputs(case["dist"], batch=1, heads=1, context=case["pages"] * SPARSE_PAGE_SIZE, d_k=lay.d,
                        d_v=lay.d_nope, seed=case["seed"])
    x = kv[0].astype(np.float32)
    if case.get("edges"):
        x[0] = 0.0
        x[1, :lay.tile] *= np.float32(1e-30)
        x[2, :lay.tile] = np.float32(2.0**-133) * np.sign(x[2, :lay.tile])  # BF16 subnormals
        x[3, lay.tile:2 * lay.tile] = np.float32(3e38)
        x[4, :lay.tile] = np.float32(448.0)
        x[5, :] = np.float32(1.75 * 2.0**-20) * np.sign(x[5])
        x[6, :lay.tile] = np.float32(-0.3)
    return round_to(x, "bf16").astype(np.float32).reshape(case["pages"], SPARSE_PAGE_SIZE, 1, lay.d)


def _length_and_sink(case: dict, rng: np.random.Generator, H: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A sparse case's topk_length (int32, or None) and attention sink drawn from `rng` after its indices: "normal"
    is N(6, 2) a head, "edge" that with heads 0-2 at -inf, +inf and 0."""
    tl_ = None if case.get("topk_length") is None else np.array(case["topk_length"], np.int32)
    sink = None
    if case.get("sink") is not None:
        sink = rng.normal(6.0, 2.0, H).astype(np.float32)
        if case["sink"] == "edge":
            sink[:3] = [-np.inf, np.inf, 0.0]
    return tl_, sink


def _sparse_crc(inputs: dict) -> int:
    return input_crc(*(a for a in inputs.values() if a is not None))


def _check_etap_recipe(case: dict) -> None:
    """What the FlashMLA-ETAP model covers: BF16 or FP16, pages of 64 tokens, one KV head of 576."""
    if case["format"] not in ("bf16", "fp16"):
        raise ValueError(f"format: the kernel takes bf16 or fp16 (q and kv alike), got {case['format']!r}")
    if case.get("page_size", ETAP_PAGE_SIZE) != ETAP_PAGE_SIZE:
        raise ValueError(f"page_size: the kernel takes pages of {ETAP_PAGE_SIZE} tokens, got {case['page_size']!r}")
    if case.get("head_dim", 576) != 576 or case.get("heads_k", 1) != 1:
        raise ValueError(f"head_dim: the model covers one KV head of 576 (V its first 512), got "
                         f"{case.get('heads_k', 1)} of {case.get('head_dim', 576)}")
    if not isinstance(case["causal"], bool):
        raise TypeError(f"causal: expected true or false, got {case['causal']!r}")


def _check_sparse_recipe(case: dict) -> None:
    """What the sparse FP8 model covers, as the kernel's own checks say (a recipe outside them is refused)."""
    lay = layout_of(case["layout"], "layout")
    topk = check_int(case["topk"], "topk", lo=64)
    if topk % 64 or case["heads"] not in (64, 128):
        raise ValueError(f"topk, heads: the kernel takes topk a multiple of 64 and 64 or 128 heads, got "
                         f"{topk} and {case['heads']}")
    if case.get("topk_length") is not None:
        if lay.name != "model1":
            raise ValueError("topk_length: only MODEL1 caches take one")
        if len(case["topk_length"]) != case["batch"]:
            raise ValueError(f"topk_length: {len(case['topk_length'])} lengths for batch {case['batch']}")
        for n in case["topk_length"]:
            check_int(n, "topk_length", lo=0, hi=topk)
    if case.get("power_of_two", True) not in (True, False) or (lay.scale_type != "fp32" and not case["power_of_two"]):
        raise ValueError(f"power_of_two: true or false (false for V3.2's FP32 scales only), got "
                         f"{case['power_of_two']!r} for {lay.name}")
    if not 0 <= float(case.get("invalid", 0.0)) <= 1:
        raise ValueError(f"invalid: a share of empty slots in [0, 1], got {case['invalid']!r}")
    if case.get("sink") not in (None, "normal", "edge"):
        raise ValueError(f"sink: expected null, 'normal' or 'edge', got {case['sink']!r}")
    sms = check_int(case.get("num_sms", 132), "num_sms", lo=1)
    combine_width(num_sm_parts(s_q=case.get("sq", 1), heads_q=case["heads"], num_sms=sms), sms)
    if case.get("page_size", SPARSE_PAGE_SIZE) != SPARSE_PAGE_SIZE:
        raise ValueError(f"page_size: recipes use pages of {SPARSE_PAGE_SIZE} tokens, got {case['page_size']!r}")


def _device_arrays(got: dict) -> dict[str, np.ndarray]:
    return {k: got[k] for k in ("out", "lse", "sched", "num_splits")}


class _Dense(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [*({"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "dist": dist, "seed": s + seed,
                   "scale": None} for b, sq, H, lens, dist, s in FLASHMLA_CASES),
                *({"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "dist": dist, "seed": s + seed,
                   "scale": scale, "causal": True} for b, sq, H, lens, dist, s, scale in FLASHMLA_CAUSAL_CASES)]

    def scale_template(self) -> dict:
        return {"batch": 1, "sq": 1, "heads": 16, "seqlens": [600], "dist": "normal:1", "seed": 500, "scale": None}

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, kv = case_inputs(case)
        res = flashmla(q, kv, seqlens=np.array(case["seqlens"]), scale=case.get("scale"),
                       causal=case.get("causal", False), build=case.get("build", "upstream"))
        fmt = np.float16 if case.get("format") == "fp16" else ml_dtypes.bfloat16
        return [stage("lse", arrays[f"c{i}_lse"], res.lse, np.float32),
                stage("out", arrays[f"c{i}_out"], res.out, fmt)]

    def check(self, case: dict) -> None:
        if case.get("format", "bf16") not in ("bf16", "fp16"):
            raise ValueError(f"format: the kernel takes bf16 or fp16 (q and kv alike), got {case['format']!r}")

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.flashmla import build_flashmla

        return build_flashmla(source)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.flashmla import run_flashmla

        q, kv = case_inputs(recipe)
        scale = 576**-0.5 if recipe["scale"] is None else recipe["scale"]
        got = run_flashmla(kernel, q.view(np.uint16), kv.view(np.uint16), recipe["seqlens"], scale,
                           recipe.get("causal", False), recipe.get("format", "bf16"))
        return _device_arrays(got), {**recipe, "input_crc": input_crc(q, kv)}


class _Etap(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": fmt, "dist": dist,
                 "seed": s + seed, "scale": scale, "causal": sq > 1, "page_size": ETAP_PAGE_SIZE}
                for b, sq, H, lens, fmt, dist, s, scale in ETAP_CASES]

    def scale_template(self) -> dict:
        return {"batch": 1, "sq": 1, "heads": 16, "seqlens": [600], "format": "bf16", "dist": "normal:1",
                "seed": 500, "scale": None, "causal": False, "page_size": ETAP_PAGE_SIZE}

    def check(self, case: dict) -> None:
        _check_etap_recipe(case)

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, kv = case_inputs(case)
        res = flashmla_etap(q, kv, seqlens=np.array(case["seqlens"]), scale=case.get("scale"), causal=case["causal"])
        fmt = np.float16 if case["format"] == "fp16" else ml_dtypes.bfloat16
        return [stage("lse", arrays[f"c{i}_lse"], res.lse, np.float32),
                stage("out", arrays[f"c{i}_out"], res.out, fmt)]

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.flashmla import build_etap

        return build_etap(source)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.flashmla import run_etap

        q, kv = case_inputs(recipe)
        scale = 576**-0.5 if recipe["scale"] is None else recipe["scale"]
        got = run_etap(kernel, q.view(np.uint16), kv.view(np.uint16), recipe["seqlens"], scale, recipe["causal"],
                       recipe["format"])
        return _device_arrays(got), {**recipe, "input_crc": input_crc(q, kv)}


class _SparseFP8(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": b, "sq": sq, "heads": H, "layout": layout, "seqlens": list(lens), "topk": topk,
                 "topk_length": None if tlen is None else list(tlen), "invalid": invalid, "sink": sink,
                 "dist": dist, "seed": s + seed, "scale": scale, "power_of_two": pow2, "page_size": SPARSE_PAGE_SIZE,
                 "num_sms": sms, "schedule": "given" if sms else "kernel"}
                for b, sq, H, layout, lens, topk, tlen, invalid, sink, dist, s, scale, pow2, sms in SPARSE_FP8_CASES]

    def scale_template(self) -> dict:  # 64 heads: the kernel's fewest
        return {"batch": 1, "sq": 1, "heads": 64, "layout": "v32", "seqlens": [600], "topk": 256,
                "topk_length": None, "invalid": 0.1, "sink": "normal", "dist": "normal:1", "seed": 500,
                "scale": None, "power_of_two": True, "page_size": SPARSE_PAGE_SIZE, "num_sms": None,
                "schedule": "kernel"}

    def check(self, case: dict) -> None:
        _check_sparse_recipe(case)

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        res = flashmla_sparse_fp8(**sparse_inputs(case), scale=case.get("scale"), num_sms=case.get("num_sms", 132),
                                  build=case.get("build", "upstream"))
        return [stage("lse", arrays[f"c{i}_lse"], res.lse, np.float32),
                stage("out", arrays[f"c{i}_out"], res.out, ml_dtypes.bfloat16)]

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.flashmla import build_sparse_fp8

        return build_sparse_fp8(source)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.flashmla import run_sparse_fp8

        inputs = sparse_inputs(recipe)
        b, sq, H, sms, tlen = recipe["batch"], recipe["sq"], recipe["heads"], recipe["num_sms"], recipe["topk_length"]
        given = None
        if sms is not None:  # FlashMLA's schedule for fewer SMs
            parts, cum = sparse_schedule(list(tlen or [recipe["topk"]] * b), s_q=sq, heads=H, num_sms=sms)
            given = (np.array([p.as_ints()[:7] for p in parts], np.int32), cum)
        scale = layout_of(recipe["layout"]).d ** -0.5 if recipe["scale"] is None else recipe["scale"]
        got = run_sparse_fp8(kernel, **inputs, scale=scale, schedule=given)
        return _device_arrays(got), {**recipe, "num_sms": got["num_sms"] if sms is None else sms,
                                     "input_crc": _sparse_crc(inputs)}


_SHIPPED = ("vllm", "sglang")  # the engines' libraries a capture may come from (crosscheck --build)
_CHECKOUT = "a {} checkout at {} with CUTLASS at csrc/cutlass (git clone --recursive), compiled here"

#: FlashMLA's sm90 dense decode as the cross-check drives it.
FLASHMLA = _Dense(
    name="flashmla", summary=f"FlashMLA's sm90 dense decode (commit {FLASHMLA_COMMIT})", version_key="flashmla_commit",
    version=FLASHMLA_COMMIT, source_flag="--flashmla-dir", builds=_SHIPPED, empty_requests=True,
    source_help=_CHECKOUT.format("deepseek-ai/FlashMLA", FLASHMLA_COMMIT))
#: FlashMLA-ETAP, the ETAP paper's kernel, as the cross-check drives it.
FLASHMLA_ETAP = _Etap(
    name="flashmla-etap", summary=f"the ETAP paper's kernel (pengcuo/FlashMLA-ETAP {ETAP_COMMIT}), BF16 and FP16",
    version_key="etap_commit", version=ETAP_COMMIT, source_flag="--etap-dir",
    source_help=_CHECKOUT.format("pengcuo/FlashMLA-ETAP", ETAP_COMMIT))
#: FlashMLA's sm90 sparse FP8 decode as the cross-check drives it.
FLASHMLA_SPARSE_FP8 = _SparseFP8(
    name="flashmla-sparse-fp8",
    summary=f"FlashMLA's sm90 sparse FP8 decode ({FLASHMLA_COMMIT}), DeepSeek V3.2's and MODEL1's caches",
    version_key="flashmla_commit", version=FLASHMLA_COMMIT, source_flag="--flashmla-dir", builds=_SHIPPED,
    source_help=_CHECKOUT.format("deepseek-ai/FlashMLA", FLASHMLA_COMMIT))


# --- FlashMLA's sm90 sparse prefill (flash_mla_sparse_fwd) ----------------------------------------------------

from ..algorithms.deployed.flashmla.sparse_prefill import B_TOPK as _PREFILL_BLOCK  # noqa: E402
from ..algorithms.deployed.flashmla.sparse_prefill import D_QK as _PREFILL_D_QK  # noqa: E402
from ..algorithms.deployed.flashmla.sparse_prefill import HEADS as _PREFILL_HEADS  # noqa: E402
from ..algorithms.deployed.flashmla.sparse_prefill import flashmla_sparse_prefill  # noqa: E402
from ..algorithms._common import D_V  # noqa: E402
from .kernel import run_twice  # noqa: E402

__all__ += ["SPARSE_PREFILL_CASES", "FLASHMLA_SPARSE_PREFILL", "sparse_prefill_inputs"]

#: FlashMLA's sparse prefill: (s_q, heads, d_qk, s_kv, topk, topk_length, share of -1 slots, share of slots >= s_kv,
#: tail (the valid rows first and the empty slots after them, as vLLM and SGLang fill a list; else shuffled),
#: attention sink, dist, seed, scale). Each token names min(topk, s_kv) distinct rows of the cache, then the shares
#: of its slots are made -1 and out of range (s_kv .. 2^31 - 1); a sink "normal" is N(6, 4) per head, "edge" that
#: with heads 0-2 at -inf, +inf, 0. The outputs total 2.6 MB (s_q h_q 512 BF16 values).
SPARSE_PREFILL_CASES = [
    (1, 128, 576, 4096, 2048, None, 0.0, 0.0, False, None, "flashmla", 61, None),
    (8, 64, 576, 3000, 512, None, 0.1, 0.05, False, "normal", "normal:1", 62, None),
    (3, 128, 576, 200, 128, (128, 0, 77), 0.2, 0.0, False, "edge", "rope-outliers", 63, 0.1352),
    (4, 64, 512, 1000, 256, (256, 1, 64, 200), 0.0, 0.1, False, "edge", "normal:1", 64, None),
    (2, 128, 512, 5000, 2048, (1500, 2048), 0.05, 0.05, False, "normal", "flashmla", 65, None),
    (13, 64, 576, 300, 256, None, 0.3, 0.2, False, None, "normal:1", 66, 0.1352),
    (1, 64, 576, 384, 384, (300,), 0.0, 0.0, True, None, "rope-outliers", 67, None),
    (2, 64, 576, 50, 128, (50, 20), 0.0, 0.0, True, "normal", "flashmla", 68, None),
]


def _prefill_d_v(d_qk: int) -> int:
    """The columns make_inputs draws as content (the rest as RoPE): V3.2's 512 of 576, MODEL1's 448 of 512."""
    return 512 if d_qk == 576 else 448


def sparse_prefill_inputs(case: dict) -> dict[str, np.ndarray | None]:
    """A sparse prefill case's inputs from its recipe: q (s_q, h, d_qk) and kv (s_kv, 1, d_qk) BF16, indices
    (s_q, 1, topk) int32, topk_length (s_q,) int32 or None, attn_sink (h,) float32 or None."""
    sq, H, d, topk = case.get("sq", 1), case["heads"], case["d_qk"], case["topk"]
    s_kv = case["seqlens"][0]
    q, kv = make_inputs(case["dist"], batch=1, heads=H, sq=sq, context=s_kv, d_k=d, d_v=_prefill_d_v(d),
                        seed=case["seed"])
    rng = np.random.default_rng([case["seed"], 7])
    idx = np.full((sq, topk), -1, np.int64)
    for j in range(sq):
        k = min(topk, s_kv)
        idx[j, :k] = rng.choice(s_kv, k, replace=False)
        if not case.get("tail", False):
            idx[j] = rng.permutation(idx[j])
        idx[j, rng.random(topk) < case.get("invalid", 0.0)] = -1
        far = rng.random(topk) < case.get("out_of_range", 0.0)
        idx[j, far] = rng.integers(s_kv, 2**31 - 1, int(far.sum()), endpoint=True)
    tl_, sink = _length_and_sink(case, rng, H)
    got = {"q": q[0], "kv": kv[0][:, None, :], "indices": idx.astype(np.int32)[:, None, :], "topk_length": tl_,
           "attn_sink": sink}
    if "input_crc" in case and _sparse_crc(got) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return got


def _check_prefill_recipe(case: dict) -> None:
    """What the sparse prefill model covers, as the kernel's API and host checks say (a recipe outside them is
    refused): one launch (batch 1, seqlens [s_kv]), 64 or 128 heads, d_qk 576 or 512, topk a multiple of 128."""
    if case["batch"] != 1 or len(case["seqlens"]) != 1:
        raise ValueError(f"batch: a sparse prefill case is one launch (batch 1, seqlens [s_kv]), got batch "
                         f"{case['batch']} and {len(case['seqlens'])} lengths")
    if case["heads"] not in _PREFILL_HEADS:
        raise ValueError(f"heads: the kernel takes 64 or 128, got {case['heads']}")
    if case["d_qk"] not in _PREFILL_D_QK:
        raise ValueError(f"d_qk: the kernel takes 576 or 512, got {case['d_qk']!r}")
    topk = check_int(case["topk"], "topk", lo=2 * _PREFILL_BLOCK)
    if topk % (2 * _PREFILL_BLOCK):
        raise ValueError(f"topk: the kernel takes a multiple of {2 * _PREFILL_BLOCK}, got {topk}")
    if case.get("topk_length") is not None:
        if len(case["topk_length"]) != case.get("sq", 1):
            raise ValueError(f"topk_length: {len(case['topk_length'])} lengths for s_q {case.get('sq', 1)}")
        for n in case["topk_length"]:
            check_int(n, "topk_length", lo=0, hi=topk)
    for key in ("invalid", "out_of_range"):
        if not 0 <= float(case.get(key, 0.0)) <= 1:
            raise ValueError(f"{key}: a share of slots in [0, 1], got {case[key]!r}")
    if case.get("tail", False) not in (True, False):
        raise ValueError(f"tail: true or false, got {case['tail']!r}")
    if case.get("sink") not in (None, "normal", "edge"):
        raise ValueError(f"sink: expected null, 'normal' or 'edge', got {case['sink']!r}")


class _SparsePrefill(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": 1, "sq": sq, "heads": H, "d_qk": d, "seqlens": [s_kv], "topk": topk,
                 "topk_length": None if tlen is None else list(tlen), "invalid": invalid, "out_of_range": far,
                 "tail": tail, "sink": sink, "dist": dist, "seed": s + seed, "scale": scale}
                for sq, H, d, s_kv, topk, tlen, invalid, far, tail, sink, dist, s, scale in SPARSE_PREFILL_CASES]

    def scale_template(self) -> dict:  # 64 heads: the kernel's fewest
        return {"batch": 1, "sq": 1, "heads": 64, "d_qk": 576, "seqlens": [600], "topk": 256, "topk_length": None,
                "invalid": 0.1, "out_of_range": 0.05, "tail": False, "sink": "normal", "dist": "normal:1",
                "seed": 500, "scale": None}

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        sq, H = case.get("sq", 1), case["heads"]
        return {"out": ((sq, H, D_V), np.uint16, True), "lse": ((sq, H), np.uint32, True),
                "max_logits": ((sq, H), np.uint32, True)}

    def check(self, case: dict) -> None:
        _check_prefill_recipe(case)

    def label(self, case: dict) -> str:
        return f" d_qk={case['d_qk']} topk={case['topk']}"

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        res = flashmla_sparse_prefill(**sparse_prefill_inputs(case), scale=case.get("scale"),
                                      build=case.get("build", "upstream"))
        return [stage("max_logits", arrays[f"c{i}_max_logits"], res.max_logits, np.float32),
                stage("lse", arrays[f"c{i}_lse"], res.lse, np.float32),
                stage("out", arrays[f"c{i}_out"], res.out, ml_dtypes.bfloat16)]

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.flashmla import build_sparse_prefill

        return build_sparse_prefill(source)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.flashmla import run_sparse_prefill

        inputs = sparse_prefill_inputs(recipe)
        scale = recipe["d_qk"] ** -0.5 if recipe["scale"] is None else recipe["scale"]
        got, same = run_twice(lambda: run_sparse_prefill(kernel, inputs["q"].view(np.uint16),
                                                         inputs["kv"].view(np.uint16), inputs["indices"],
                                                         inputs["topk_length"], inputs["attn_sink"], scale))
        return got, {**recipe, "input_crc": _sparse_crc(inputs), "repeat_identical": same}


#: FlashMLA's sm90 sparse prefill (flash_mla_sparse_fwd) as the cross-check drives it.
FLASHMLA_SPARSE_PREFILL = _SparsePrefill(
    name="flashmla-sparse-prefill",
    summary=f"FlashMLA's sm90 sparse prefill flash_mla_sparse_fwd ({FLASHMLA_COMMIT}), DeepSeek V3.2's BF16-cache "
            "sparse attention (vLLM's FLASHMLA_SPARSE, SGLang's DSA prefill), d_qk 576 and 512",
    version_key="flashmla_commit", version=FLASHMLA_COMMIT, source_flag="--flashmla-dir", builds=_SHIPPED,
    source_help=_CHECKOUT.format("deepseek-ai/FlashMLA", FLASHMLA_COMMIT))
