"""FlashInfer's MLA on Hopper (flashinfer-python 0.7.2's FA3-style sm90 kernel, SGLang's ``flashinfer`` backend):
its case table, replayed by :func:`.deployed.replay_deployed`.

A case records ``out`` ((keep s_q, h, 512) BF16 bits: the first ``keep`` requests), every row's ``lse`` ((b s_q,
h) FP32 bits, base 2, as FlashInfer returns it), the plan's 18 values (``plan``, int64: ``MLAPlanInfo`` as
``plan`` returns it) and, where the capture read them back, the work lists the plan staged (``work``, int32, in
:data:`~amla_sim.algorithms.deployed.flashinfer.scheduler.STAGED_ARRAYS` order), which the model's scheduler is compared with. Inputs are regenerated, never stored, as
:func:`.fa3.fa3_inputs` draws them; an E4M3 cache is the BF16 rows divided by the case's ``ckv_scale`` (the first
512 columns) and ``kpe_scale`` (the last 64) and rounded to E4M3 (saturating at 448).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._validate import check_int
from ..algorithms._common import D_V
from ..algorithms.deployed.flashinfer import FLASHINFER_VERSION
from ..algorithms.deployed.flashinfer.scheduler import STAGED_ARRAYS
from ..algorithms.deployed.scalars import api_float
from .fa3 import fa3_inputs
from .files import input_crc
from .kernel import DeployedKernel, Stage, run_twice, stage

__all__ = ["FLASHINFER_CASES", "FLASHINFER_MLA", "flashinfer_inputs"]

_V32 = 0.1352337788608801  # 192^-0.5 mscale^2 (DeepSeek-V3 / V3.2 with YaRN)
_192 = 192 ** -0.5
_MIXED = (512, 1, 2048, 777, 64, 1500, 65, 3000, 100, 2500, 63, 1024, 4096, 300, 129, 2000)
#: (batch, s_q, heads, seqlens, cache, dist, seed, scale, page, causal, keep, (ckv_scale, kpe_scale)): SGLang's
#: calls (page 1, BF16, causal only for the MTP verify step, s_q > 1), then FlashInfer's own E4M3 cache and pages
FLASHINFER_CASES = [
    (1, 1, 128, (4096,), "bf16", "flashmla", 81, _V32, 1, False, 1, None),
    (4, 1, 16, (100, 2000, 7000, 1), "bf16", "normal:1", 82, _V32, 1, False, 4, None),
    (16, 1, 16, _MIXED, "bf16", "flashmla", 83, _192, 1, False, 4, None),
    (2, 2, 128, (1000, 3001), "bf16", "normal:1", 84, _V32, 1, True, 2, None),
    (8, 1, 128, (1, 63, 64, 65, 700, 2500, 4097, 129), "bf16", "normal:1", 85, _V32, 1, False, 2, None),
    (1, 1, 16, (30000,), "bf16", "normal:1", 86, _V32, 1, False, 1, None),
    (3, 4, 64, (513, 2048, 129), "bf16", "rope-outliers", 87, _V32, 1, True, 3, None),
    (64, 1, 128, tuple(_MIXED * 4), "bf16", "normal:1", 91, _V32, 1, False, 1, None),
    (2, 1, 128, (3000, 700), "bf16", "normal:1", 88, _V32, 64, False, 2, None),
    (2, 1, 128, (3000, 700), "e4m3", "normal:1", 89, _V32, 1, False, 2, (0.05, 0.03)),
    (4, 1, 16, (5000, 1, 300, 2048), "e4m3", "flashmla", 90, _192, 64, False, 4, (0.02, 0.125)),
]


def flashinfer_inputs(case: dict) -> tuple[np.ndarray, np.ndarray]:
    """q (b, s_q, h, 576) BF16 and kv (b, S_max, 576): BF16, or E4M3 codes of the rows over the case's scales."""
    q, kv = fa3_inputs({k: v for k, v in case.items() if k != "input_crc"} | {"format": "bf16"})
    if case["kv_format"] == "e4m3":
        s = np.concatenate([np.full(512, case["ckv_scale"]), np.full(64, case["kpe_scale"])]).astype(np.float32)
        kv = np.clip(kv.astype(np.float32) / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    if "input_crc" in case and input_crc(q, kv) != case["input_crc"]:
        from .files import CaptureError

        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return q, kv


class _FlashInfer(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        out = []
        for b, sq, H, lens, cache, dist, s, scale, page, causal, keep, kv_scales in FLASHINFER_CASES:
            r = {"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "kv_format": cache, "dist": dist,
                 "seed": s + seed, "scale": scale, "page_size": page, "causal": causal, "keep": keep}
            if kv_scales is not None:
                r["ckv_scale"], r["kpe_scale"] = kv_scales
            out.append(r)
        return out

    def scale_template(self) -> dict:
        return {"batch": 1, "sq": 1, "heads": 16, "seqlens": [600], "kv_format": "bf16", "dist": "normal:1",
                "seed": 500, "scale": None, "page_size": 1, "causal": False, "keep": 1}

    def check(self, case: dict) -> None:
        if case.get("kv_format") not in ("bf16", "e4m3"):
            raise ValueError(f"kv_format: FlashInfer's MLA reads a bf16 or e4m3 cache, got {case.get('kv_format')!r}")
        check_int(case["page_size"], "page_size", lo=1)
        check_int(case["keep"], "keep", lo=1, hi=case["batch"])
        if case["causal"] not in (True, False):
            raise TypeError(f"causal: expected true or false, got {case['causal']!r}")
        if case["kv_format"] == "e4m3":
            for key in ("ckv_scale", "kpe_scale"):
                api_float(case[key], key)

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        b, sq, H = case["batch"], case.get("sq", 1), case["heads"]
        return {"out": ((case["keep"] * sq, H, D_V), np.uint16, True), "lse": ((b * sq, H), np.uint32, True),
                "plan": ((18,), np.int64, True), "work": ((None,), np.int32, False)}  # its length: the plan's

    def label(self, case: dict) -> str:
        return f" {case['kv_format']} page {case['page_size']} causal={case['causal']} (out of {case['keep']} kept)"

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        from ..algorithms.deployed.flashinfer import flashinfer_mla

        q, kv = flashinfer_inputs(case)
        e4m3 = case["kv_format"] == "e4m3"
        res = flashinfer_mla(q, kv, seqlens=np.array(case["seqlens"]), page_size=case["page_size"],
                             causal=case["causal"], scale=case["scale"],
                             ckv_scale=case.get("ckv_scale") if e4m3 else None,
                             kpe_scale=case.get("kpe_scale") if e4m3 else None, trace=True)
        b, sq, H = case["batch"], case.get("sq", 1), case["heads"]
        keep = case["keep"] * sq
        work = []
        if f"c{i}_work" in arrays:  # the staged work lists, where the capture read them back
            staged = res.trace["mla_plan"][0].arrays()
            work = [("work", arrays[f"c{i}_work"], np.concatenate([staged[n] for n in STAGED_ARRAYS]).astype(np.int32))]
        return [("plan", arrays[f"c{i}_plan"], np.asarray(res.trace["plan"], np.int64)), *work,
                stage("lse", arrays[f"c{i}_lse"], res.lse.reshape(b * sq, H).astype(np.float32), np.float32),
                stage("out", arrays[f"c{i}_out"], res.out.reshape(b * sq, H, D_V)[:keep], ml_dtypes.bfloat16)]

    def load(self, source: str | None) -> Any:
        from ..gpu.adapters.flashinfer import load_flashinfer

        return load_flashinfer(source, FLASHINFER_VERSION)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.flashinfer import run_flashinfer_mla

        q, kv = flashinfer_inputs(recipe)
        recipe = {**recipe, "scale": 576**-0.5 if recipe["scale"] is None else recipe["scale"]}
        got, same = run_twice(lambda: run_flashinfer_mla(kernel, q.view(np.uint16), kv.view(
            np.uint8 if recipe["kv_format"] == "e4m3" else np.uint16), recipe))
        return got, {**recipe, "input_crc": input_crc(q, kv), "repeat_identical": same}


#: FlashInfer's MLA (SGLang's flashinfer backend) as the cross-check drives it.
FLASHINFER_MLA = _FlashInfer(
    name="flashinfer-mla",
    summary="FlashInfer's MLA on Hopper (flashinfer-python 0.7.2, BatchMLAPagedAttentionWrapper's fa3 kernel: "
            "SGLang's flashinfer backend), BF16 and E4M3 caches",
    version_key="flashinfer_version", version=FLASHINFER_VERSION, source_flag="--flashinfer-dir", empty_requests=True,
    source_help="a folder holding the flashinfer package (an unpacked flashinfer-python 0.7.2 wheel, with "
                "apache-tvm-ffi importable), whose JIT compiles the MLA module on first use")
