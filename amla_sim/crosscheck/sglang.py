"""SGLang's Triton MLA decode (sglang 0.5.23): its case table, replayed by :func:`.deployed.replay_deployed`.

A case records stage 2's output ``o`` (b, H, 512) BF16 bits, stage 1's LSEs (b, H, max_kv_splits) FP32 bits and,
for the first cases, stage 1's partial outputs ``mid``.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._validate import check_int
from ..algorithms._common import D_V
from ..algorithms.deployed.scalars import api_float
from ..algorithms.deployed.sglang.decode import SGLANG_VERSION, splitkv_decode
from ..experiments.inputs import make_inputs
from .files import input_crc
from .kernel import DeployedKernel, Stage, case_inputs, stage

__all__ = ["SGLANG_CASES", "SGLANG"]

#: (batch, heads, seqlens, num_kv_splits, max_kv_splits, dist, seed, scale): what scripts/capture_thirdparty.py ran
SGLANG_CASES = [
    (1, 128, (4096,), (8,), 8, "flashmla", 1, None),
    (1, 128, (4096,), (8,), 8, "normal:1", 2, None),
    (1, 128, (1000,), (4,), 8, "normal:1", 3, 0.1352),
    (2, 128, (64, 3001), (1, 8), 8, "flashmla", 4, None),
    (3, 64, (8192, 77, 5000), (16, 2, 7), 16, "normal:1", 5, None),
    (4, 128, (513, 2048, 4097, 129), (3, 8, 8, 1), 8, "flashmla", 6, None),
    (1, 64, (8192,), (32,), 32, "flashmla", 7, 0.1352),
    (2, 128, (2000, 6000), (5, 11), 16, "uniform:3", 8, None),
]
MID_CASES = 3  # the first cases also record stage 1's partial outputs


class _SGLangDecode(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": b, "heads": H, "seqlens": list(lens), "num_kv_splits": list(splits),
                 "max_kv_splits": top, "dist": dist, "seed": s + seed, "scale": scale}
                for b, H, lens, splits, top, dist, s, scale in SGLANG_CASES]

    def scale_template(self) -> dict:
        return {"batch": 1, "heads": 16, "seqlens": [600], "num_kv_splits": [4], "max_kv_splits": 8,
                "dist": "normal:1", "seed": 500, "scale": None}

    def check(self, case: dict) -> None:
        splits = [check_int(n, "num_kv_splits", lo=1) for n in case["num_kv_splits"]]
        check_int(case["max_kv_splits"], "max_kv_splits", lo=max(splits, default=1))
        if "v_scale" in case:
            api_float(case["v_scale"], "v_scale")

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        b, H, top = case["batch"], case["heads"], case["max_kv_splits"]
        return {"o": ((b, H, D_V), np.uint16, True), "lse": ((b, H, top), np.uint32, True),
                "mid": ((b, H, top, D_V), np.uint32, False)}

    def label(self, case: dict) -> str:
        return ""

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, kv = case_inputs(case)
        res = splitkv_decode(q, kv, seqlens=np.array(case["seqlens"]), num_kv_splits=np.array(case["num_kv_splits"]),
                             max_kv_splits=case["max_kv_splits"], scale=case.get("scale"),
                             v_scale=case.get("v_scale", 1.0))
        stages = []
        if f"c{i}_mid" in arrays:
            stages.append(stage("mid", arrays[f"c{i}_mid"], res.mid, np.float32))
        stages.append(stage("lse", arrays[f"c{i}_lse"], res.lse, np.float32))
        stages.append(stage("out", arrays[f"c{i}_o"], res.out[:, 0], ml_dtypes.bfloat16))
        return stages

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.sglang import load_sglang

        return load_sglang(source)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.sglang import run_sglang

        b, H, lens = recipe["batch"], recipe["heads"], recipe["seqlens"]
        q, kv = make_inputs(recipe["dist"], batch=b, heads=H, context=max(lens), seed=recipe["seed"])
        scale = 576**-0.5 if recipe["scale"] is None else recipe["scale"]
        got = run_sglang(kernel, np.ascontiguousarray(q[:, 0]).view(np.uint16), kv.view(np.uint16), list(lens),
                         np.array(recipe["num_kv_splits"]), recipe["max_kv_splits"], scale,
                         recipe.get("v_scale", 1.0))
        keep = ("o", "lse", "mid") if i < MID_CASES else ("o", "lse")
        return {k: got[k] for k in keep}, {**recipe, "input_crc": input_crc(q, kv)}


#: SGLang's decode as the cross-check drives it.
SGLANG = _SGLangDecode(
    name="sglang-triton", summary="SGLang's Triton MLA decode (sglang 0.5.23)", version_key="sglang",
    version=SGLANG_VERSION, source_flag="--sglang-file",
    source_help="the kernel file of the sglang wheel (default: the installed sglang package)",
    launch={"block_n": 32, "block_h": 16, "num_warps": 4, "num_stages": 2, "min_block_kv": 32, "page_size": 1,
            "logit_cap": 0.0},
    needs_source=False, empty_requests=True)
