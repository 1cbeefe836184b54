"""The FP8 MLA decodes vLLM serves on Hopper: vLLM's dense FP8 FlashMLA decode (``flashmla-dense-fp8``) and vLLM's
Triton MLA decode (``vllm-triton-mla``, BF16 or FP8 cache), their case tables, replayed by
:func:`.deployed.replay_deployed`.

Inputs are regenerated, never stored: BF16 q and kv from the recipe as :func:`.fa3.fa3_inputs` draws them, then
quantized as vLLM does (:mod:`amla_sim.algorithms.deployed.vllm.fp8`) with the case's scales. The GPU quantizes with
torch as vLLM does; the capture records whether its bytes equal this project's (``quant_identical``) and the CRC
of the kernel's inputs. A dense FP8 case records ``out`` (b, s_q, h, 512) BF16 bits, ``lse`` (b, h, s_q) FP32 bits
and each request's split count from the metadata (``splits``); a Triton case records ``out`` (b s_q, h, 512) and
``lse`` (b s_q, h), both BF16 bits, and the launch's split count in its recipe.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._validate import check_int
from ..algorithms._common import D_V
from ..algorithms.deployed.flashmla.dense_fp8 import DENSE_FP8_COMMIT, flashmla_dense_fp8
from ..algorithms.deployed.scalars import api_float
from ..algorithms.deployed.vllm.fp8 import quantize_cache_fp8, quantize_query_fp8
from ..algorithms.deployed.vllm.triton_mla import VLLM_VERSION, vllm_num_kv_splits, vllm_triton_mla
from .fa3 import fa3_inputs
from .files import CaptureError, input_crc
from .kernel import DeployedKernel, Stage, run_twice, stage

_SHIPPED = ("vllm", "sglang")  # the engines' libraries a capture may come from (crosscheck --build)

__all__ = ["DENSE_FP8_CASES", "TRITON_CASES", "FLASHMLA_DENSE_FP8", "VLLM_TRITON_MLA", "fp8_inputs"]

_DS = 0.1352  # DeepSeek-V3's softmax scale (1 / sqrt(192) with its YaRN mscale)
_192 = 192 ** -0.5
_CAL = 1 / 448  # a calibrated scale for FlashMLA's inputs (|x| <= 1 onto E4M3's 448)

#: (batch, s_q, heads, seqlens, dist, seed, scale, q_scale, k_scale): vLLM's FLASHMLA call with an FP8 cache
DENSE_FP8_CASES = [
    (1, 1, 128, (4096,), "flashmla", 71, _192, 1.0, 1.0),
    (1, 1, 128, (4096,), "normal:1", 72, _DS, 1.0, 1.0),
    (4, 1, 16, (1, 63, 64, 8000), "normal:1", 73, _192, 0.02, 0.0125),
    (2, 2, 128, (1000, 3001), "flashmla", 74, _DS, _CAL, _CAL),
    (3, 1, 64, (513, 2048, 129), "normal:1", 75, _192, 0.5, 2.0),
    (8, 1, 128, (1, 63, 64, 65, 700, 2500, 4097, 129), "flashmla", 76, _192, 1.0, 1.0),
    # causal: query 0's rows see one key less, the last block holding only that key (seqlen 64 k + 1)
    (2, 2, 64, (1025, 4097), "normal:1", 77, _192, 0.017, 0.023),
    (1, 1, 16, (8192,), "flashmla", 78, _DS, _CAL, _CAL),
    (16, 1, 16, (512, 1, 2048, 777, 64, 1500, 65, 3000, 100, 2500, 63, 1024, 4096, 300, 129, 2000), "normal:1",
     79, _192, 0.05, 0.03),
    (2, 2, 16, (129, 3000), "flashmla", 80, _192, 1.0, _CAL),
]

#: (batch, s_q, heads, seqlens, dist, seed, scale, kv_cache, k_scale, page, batch_invariant): vLLM's TRITON_MLA call
TRITON_CASES = [
    (1, 1, 128, (4096,), "flashmla", 81, _192, "bf16", 1.0, 16, False),
    (2, 1, 128, (64, 3001), "normal:1", 82, _DS, "fp8", 1.0, 16, False),
    (4, 1, 16, (1, 63, 700, 9000), "normal:1", 83, _192, "fp8", 0.0125, 1, False),
    (2, 2, 128, (1000, 3001), "flashmla", 84, _DS, "fp8", _CAL, 64, False),
    (3, 1, 64, (513, 2048, 129), "normal:1", 85, _192, "bf16", 1.0, 64, True),
    (2, 2, 16, (1025, 4097), "normal:1", 86, _192, "fp8", 0.023, 16, True),
    (8, 1, 16, (1, 63, 64, 65, 700, 2500, 4097, 129), "flashmla", 87, _192, "bf16", 1.0, 1, False),
    (1, 1, 16, (20000,), "normal:1", 88, _DS, "fp8", 0.05, 16, False),
    (2, 2, 64, (129, 3000), "flashmla", 89, _192, "bf16", 1.0, 16, False),
    (16, 1, 16, (512, 1, 2048, 777, 64, 1500, 65, 3000, 100, 2500, 63, 1024, 4096, 300, 129, 2000), "flashmla",
     90, _DS, "fp8", _CAL, 64, False),
]


def fp8_inputs(case: dict) -> tuple[np.ndarray, np.ndarray]:
    """A case's q and kv as the kernel takes them: the dense FP8 decode's both E4M3; the Triton decode's q BF16 and
    its cache BF16 or E4M3. Checked against the recipe's CRC when it has one."""
    q, kv = fa3_inputs({k: v for k, v in case.items() if k != "input_crc"})
    if "q_scale" in case:
        q, kv = quantize_query_fp8(q, case["q_scale"]), quantize_cache_fp8(kv, case["k_scale"])
    elif case["kv_cache"] == "fp8":
        kv = quantize_cache_fp8(kv, case["k_scale"])
    if "input_crc" in case and input_crc(q, kv) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return q, kv


def _log_uniform(rng: np.random.Generator) -> float:
    """A per-tensor scale between 2^-9 (a calibrated scale for inputs near 1) and 2: E4M3's range and beyond."""
    return float(2.0 ** rng.uniform(-9.0, 1.0))


class _DenseFp8(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": "bf16", "dist": dist,
                 "seed": s + seed, "scale": scale, "q_scale": qs, "k_scale": ks}
                for b, sq, H, lens, dist, s, scale, qs, ks in DENSE_FP8_CASES]

    def scale_template(self) -> dict:
        return {"batch": 1, "sq": 1, "heads": 16, "seqlens": [600], "format": "bf16", "dist": "normal:1",
                "seed": 500, "scale": None, "q_scale": 1.0, "k_scale": 1.0}

    def with_scalars(self, recipe: dict, rng: np.random.Generator) -> dict:
        return {**recipe, "q_scale": _log_uniform(rng), "k_scale": _log_uniform(rng)}

    def check(self, case: dict) -> None:
        for key in ("q_scale", "k_scale"):
            api_float(case[key], key)

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        b, sq, H = case["batch"], case.get("sq", 1), case["heads"]
        return {"out": ((b, sq, H, D_V), np.uint16, True), "lse": ((b, H, sq), np.uint32, True),
                "splits": ((b,), np.int32, False)}

    def label(self, case: dict) -> str:
        return f" descales {case['q_scale']:.4g}, {case['k_scale']:.4g}"

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, kv = fp8_inputs(case)
        res = flashmla_dense_fp8(q, kv, seqlens=np.array(case["seqlens"]), descale_q=case["q_scale"],
                                 descale_k=case["k_scale"], scale=case["scale"], trace=True,
                                 build=case.get("build", "upstream"))
        out = []
        if f"c{i}_splits" in arrays:
            out.append(("splits", arrays[f"c{i}_splits"],
                        np.array([len(r) for r in res.trace["split_blocks"]], np.int32)))
        return out + [stage("lse", arrays[f"c{i}_lse"], res.lse.astype(np.float32), np.float32),
                      stage("out", arrays[f"c{i}_out"], res.out, ml_dtypes.bfloat16)]

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.vllm import build_dense_fp8

        return build_dense_fp8(source)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.vllm import run_dense_fp8

        q, kv = fa3_inputs(recipe)
        got, same = run_twice(lambda: run_dense_fp8(kernel, q, kv, recipe))
        q8, kv8 = fp8_inputs(recipe)
        crc = input_crc(got["q8"], got["kv8"])
        meta = {**recipe, "input_crc": crc, "quant_identical": crc == input_crc(q8, kv8), "repeat_identical": same}
        return {k: got[k] for k in ("out", "lse", "splits")}, meta


class _VllmTriton(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": "bf16", "dist": dist,
                 "seed": s + seed, "scale": scale, "kv_cache": cache, "k_scale": ks, "page_size": page,
                 "batch_invariant": inv, "num_kv_splits": vllm_num_kv_splits(max(lens), batch_invariant=inv)}
                for b, sq, H, lens, dist, s, scale, cache, ks, page, inv in TRITON_CASES]

    def scale_template(self) -> dict:  # 1500 tokens: two splits
        return {"batch": 1, "sq": 1, "heads": 16, "seqlens": [1500], "format": "bf16", "dist": "normal:1",
                "seed": 500, "scale": None, "kv_cache": "fp8", "k_scale": 1.0, "page_size": 16,
                "batch_invariant": False, "num_kv_splits": vllm_num_kv_splits(1500, batch_invariant=False)}

    def with_scalars(self, recipe: dict, rng: np.random.Generator) -> dict:
        return {**recipe, "k_scale": _log_uniform(rng)}

    def check(self, case: dict) -> None:
        api_float(case["k_scale"], "k_scale")
        if case["kv_cache"] not in ("bf16", "fp8"):
            raise ValueError(f"kv_cache: expected 'bf16' or 'fp8', got {case['kv_cache']!r}")
        check_int(case["page_size"], "page_size", lo=1)
        check_int(case["num_kv_splits"], "num_kv_splits", lo=1)
        if case["batch_invariant"] not in (True, False):
            raise TypeError(f"batch_invariant: expected true or false, got {case['batch_invariant']!r}")

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        rows, H = case["batch"] * case.get("sq", 1), case["heads"]
        return {"out": ((rows, H, D_V), np.uint16, True), "lse": ((rows, H), np.uint16, True),
                "mid": ((rows, H, case["num_kv_splits"], D_V + 1), np.uint32, False)}

    def label(self, case: dict) -> str:
        cache = "FP8 cache" if case["kv_cache"] == "fp8" else "BF16 cache"
        return f" {cache} page {case['page_size']} {case['num_kv_splits']} splits"

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, kv = fp8_inputs(case)
        res = vllm_triton_mla(q, kv, seqlens=np.array(case["seqlens"]), scale=case["scale"],
                              k_scale=case["k_scale"] if case["kv_cache"] == "fp8" else 1.0,
                              num_kv_splits=case["num_kv_splits"], page_size=case["page_size"], trace=True)
        rows, H = case["batch"] * case.get("sq", 1), case["heads"]
        stages = []
        if f"c{i}_mid" in arrays:  # stage 1's buffer: each split's output, its LSE in column 512
            mid = np.concatenate([res.trace["mid"][0], res.trace["split_lse"][0][..., None]], axis=-1)
            stages.append(stage("mid", arrays[f"c{i}_mid"], mid.astype(np.float32), np.float32))
        return stages + [stage("lse", arrays[f"c{i}_lse"], res.lse.reshape(rows, H), ml_dtypes.bfloat16),
                         stage("out", arrays[f"c{i}_out"], res.out.reshape(rows, H, D_V), ml_dtypes.bfloat16)]

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.vllm import load_vllm_triton

        return load_vllm_triton(source)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        import torch

        from ..gpu.adapters.vllm import run_vllm_triton

        q, kv = fa3_inputs(recipe)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        n = vllm_num_kv_splits(max(recipe["seqlens"]), sms, batch_invariant=recipe["batch_invariant"])
        recipe = {**recipe, "num_kv_splits": n, "sms": sms}
        got, same = run_twice(lambda: run_vllm_triton(kernel, q, kv, recipe, n))
        q_in, kv_in = fp8_inputs(recipe)
        meta = {**recipe, "input_crc": input_crc(q_in, got.get("kv8", kv_in)), "repeat_identical": same}
        if "kv8" in got:
            meta["quant_identical"] = input_crc(kv_in) == input_crc(got["kv8"])
        keep = ("out", "lse", "mid") if recipe["heads"] == 1 else ("out", "lse")  # mid: the MHA kernel's cases
        return {k: got[k] for k in keep}, meta


#: vLLM's dense FP8 FlashMLA decode as the cross-check drives it.
FLASHMLA_DENSE_FP8 = _DenseFp8(
    name="flashmla-dense-fp8",
    summary=f"vLLM's dense FP8 FlashMLA decode (vllm-project/FlashMLA {DENSE_FP8_COMMIT}, the FLASHMLA backend with an "
            "FP8 KV cache), E4M3 q and cache",
    version_key="flashmla_fp8_commit", version=DENSE_FP8_COMMIT, source_flag="--flashmla-fp8-dir", builds=_SHIPPED,
    source_help=f"a vllm-project/FlashMLA checkout at {DENSE_FP8_COMMIT} with CUTLASS at csrc/cutlass (git clone "
                "--recursive), compiled here")

#: vLLM's Triton MLA decode as the cross-check drives it.
VLLM_TRITON_MLA = _VllmTriton(
    name="vllm-triton-mla",
    summary=f"vLLM's Triton MLA decode (vLLM {VLLM_VERSION}, the TRITON_MLA backend), BF16 or FP8 cache",
    version_key="vllm", version=VLLM_VERSION, source_flag="--vllm-file",
    source_help="vLLM's vllm/v1/attention/ops/triton_decode_attention.py, or a vLLM checkout holding it (default: "
                "the installed vllm package)",
    launch={"block_n": 32, "block_h": 16, "num_warps": 4, "num_stages": 2},
    needs_source=False, empty_requests=True)
