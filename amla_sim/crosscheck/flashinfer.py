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
from ..algorithms.deployed.flashinfer.mla import _finite_positive
from ..algorithms.deployed.flashinfer.scheduler import STAGED_ARRAYS
from ..experiments.inputs import make_inputs
from .fa3 import fa3_inputs
from .files import CaptureError, input_crc
from .kernel import DeployedKernel, Stage, run_twice, stage

__all__ = ["FLASHINFER_CASES", "FLASHINFER_MLA", "flashinfer_inputs", "FLASHINFER_SPARSE_CASES",
           "FLASHINFER_MLA_SPARSE", "flashinfer_sparse_inputs"]

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
        with np.errstate(over="ignore"):  # a scale past FP32 is an infinity there, as the kernel's float
            s = np.concatenate([np.full(512, case["ckv_scale"]), np.full(64, case["kpe_scale"])]).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # a scale 0 as a float: +-inf, saturated
            kv = np.clip(kv.astype(np.float32) / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    if "input_crc" in case and input_crc(q, kv) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return q, kv


def _plan_stages(res: Any, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
    """The plan's 18 values, then its staged work lists where the capture read them back (in
    :data:`STAGED_ARRAYS` order), the device's beside the model's (`res`, run with trace)."""
    stages: list[Stage] = [("plan", arrays[f"c{i}_plan"], np.asarray(res.trace["plan"], np.int64))]
    if f"c{i}_work" in arrays:
        staged = res.trace["mla_plan"][0].arrays()
        stages.append(("work", arrays[f"c{i}_work"],
                       np.concatenate([staged[n] for n in STAGED_ARRAYS]).astype(np.int32)))
    return stages


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
                _finite_positive(case[key], key)

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        b, sq, H = case["batch"], case.get("sq", 1), case["heads"]
        return {"out": ((case["keep"] * sq, H, D_V), np.uint16, True), "lse": ((b * sq, H), np.uint32, True),
                "plan": ((18,), np.int64, True), "work": ((None,), np.int32, False)}  # its length: the plan's

    def readbacks(self, case: dict) -> set[str]:
        return {"work"}  # the adapter reads the staged work lists back from the pinned int workspace

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
        return [*_plan_stages(res, i, arrays),
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


#: Where both FlashInfer kernels come from: one checkout, one version, one flag.
_SOURCE = {"version_key": "flashinfer_version", "version": FLASHINFER_VERSION, "source_flag": "--flashinfer-dir",
           "empty_requests": True,
           "source_help": "a flashinfer-ai/flashinfer checkout at v0.7.2 (git clone --recursive) or flashinfer-python "
                          "0.7.2's source distribution unpacked, with apache-tvm-ffi importable: amla-sim compiles "
                          "its sm90 MLA module with FlashInfer's JIT flags and calls it through the checkout's "
                          "wrapper"}

#: FlashInfer's MLA (SGLang's flashinfer backend) as the cross-check drives it.
FLASHINFER_MLA = _FlashInfer(
    name="flashinfer-mla",
    summary="FlashInfer's MLA on Hopper (flashinfer-python 0.7.2, BatchMLAPagedAttentionWrapper's fa3 kernel: "
            "SGLang's flashinfer backend), BF16 and E4M3 caches",
    **_SOURCE)


_GLM = 256 ** -0.5  # GLM-5.3-Flash's softmax scale (qk_head_dim 256, no RoPE): what vLLM passes, 0.0625
_GLM_TOPK = 2176  # GLM's top-k buffer width (round_up(topk + kpool - 1, 128))
#: vLLM's FLASHINFER_MLA_SPARSE_SM90 (NoPE sparse MLA, head size 512): (tokens, heads, cache rows, topk, valid
#: counts (cycled over the tokens), cache, dist, seed, scale, k_scale, max_num_batched_tokens, upper bound (0: the
#: exact plan; else each row planned with valid + it, capped at topk, and kv_end clamped), tokens whose out is kept)
FLASHINFER_SPARSE_CASES = [
    (4, 64, 6000, 2048, (2048, 2048, 700, 1), "bf16", "normal:1", 121, _GLM, None, 8192, 0, 2),
    (2, 128, 5000, 2048, (2048, 1500), "e4m3", "normal:1", 122, _GLM, 1.0, 8192, 0, 2),
    (2, 16, 4000, 2048, (1500, 548), "e4m3", "flashmla", 123, _GLM, 0.0371, 2048, 0, 2),
    (16, 64, 8000, _GLM_TOPK, (2176, 100, 2048, 5), "bf16", "rope-outliers", 124, _GLM, None, 8192, 32, 4),
    (1, 128, 3000, 2048, (2048,), "bf16", "flashmla", 125, _V32, None, 1, 0, 1),  # unpadded: a 2-CTA cluster
    (3, 128, 4000, 2048, (300, 2048, 10), "e4m3", "normal:1", 126, _GLM, 0.5, 4096, 32, 3),
    (64, 16, 8000, 2048, (2048, 1, 1000), "bf16", "normal:1", 127, _GLM, None, 8192, 0, 2),
]


def flashinfer_sparse_inputs(case: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (T, h, 512) BF16, the latent cache rows (N, 512) (BF16, or E4M3 codes of the BF16 rows over the case's
    ``k_scale``) and indices (T, topk) int32: each token's valid rows drawn without replacement, at sorted random
    places of its list, -1 elsewhere; from a recipe (checked against its CRC)."""
    T, H, N, topk = case["batch"], case["heads"], case["rows"], case["topk"]
    q, _ = make_inputs(case["dist"], batch=T, heads=H, context=1, seed=case["seed"])
    _, kv = make_inputs(case["dist"], batch=1, heads=1, context=N, seed=case["seed"] + 1000)
    q, rows = np.ascontiguousarray(q[:, 0, :, :D_V]), np.ascontiguousarray(kv[0, :, :D_V])
    if case["kv_format"] == "e4m3":
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            rows = np.clip(rows.astype(np.float32) / np.float32(case["k_scale"]), -448, 448).astype(
                ml_dtypes.float8_e4m3fn)
    rng = np.random.default_rng([case["seed"], 9])
    idx = np.full((T, topk), -1, np.int32)
    for t, n in enumerate(case["seqlens"]):
        idx[t, np.sort(rng.choice(topk, int(n), replace=False))] = rng.choice(N, int(n), replace=False)
    if "input_crc" in case and input_crc(q, rows, idx) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return q, rows, idx


class _FlashInferSparse(_FlashInfer):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": T, "heads": H, "rows": N, "topk": topk, "seqlens": [spec[t % len(spec)] for t in range(T)],
                 "kv_format": cache, "dist": dist, "seed": s + seed, "scale": scale,
                 **({"k_scale": ks} if cache == "e4m3" else {}), "max_num_batched_tokens": pad,
                 "upper_bound": ub, "keep": keep}
                for T, H, N, topk, spec, cache, dist, s, scale, ks, pad, ub, keep in FLASHINFER_SPARSE_CASES]

    def scale_template(self) -> dict:
        return {"batch": 2, "heads": 16, "rows": 3000, "topk": 2048, "seqlens": [2048, 600], "kv_format": "e4m3",
                "dist": "normal:1", "seed": 500, "scale": None, "k_scale": 1.0, "max_num_batched_tokens": 2048,
                "upper_bound": 0, "keep": 2}

    def with_scalars(self, recipe: dict, rng: np.random.Generator) -> dict:
        return {**recipe, "k_scale": float(np.exp(rng.uniform(np.log(0.01), np.log(4.0))))}

    def check(self, case: dict) -> None:
        if case.get("kv_format") not in ("bf16", "e4m3"):
            raise ValueError(f"kv_format: vLLM's sparse SM90 backend reads a bf16 or e4m3 cache, got "
                             f"{case.get('kv_format')!r}")
        topk = check_int(case["topk"], "topk", lo=1)
        check_int(case["rows"], "rows", lo=topk)
        if max(case["seqlens"]) > topk:
            raise ValueError(f"seqlens: a token's valid count is at most topk ({topk})")
        check_int(case["max_num_batched_tokens"], "max_num_batched_tokens", lo=case["batch"])
        check_int(case["upper_bound"], "upper_bound", lo=0, hi=topk)
        if case["upper_bound"] and min(case["seqlens"]) < 1:
            raise ValueError("seqlens: an upper-bound plan needs every token to have a key")
        check_int(case["keep"], "keep", lo=1, hi=case["batch"])
        if case["kv_format"] == "e4m3":
            _finite_positive(case["k_scale"], "k_scale")  # the model refuses what it does not model, by name

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        T, H = case["batch"], case["heads"]
        return {"out": ((case["keep"], H, D_V), np.uint16, True), "lse": ((T, H), np.uint32, True),
                "plan": ((18,), np.int64, True), "work": ((None,), np.int32, False)}

    def label(self, case: dict) -> str:
        ub = f" upper bound +{case['upper_bound']}" if case["upper_bound"] else ""
        return (f" {case['kv_format']} topk={case['topk']} rows planned {case['max_num_batched_tokens']}{ub} "
                f"(out of {case['keep']} kept)")

    def _model(self, case: dict, q: np.ndarray, rows: np.ndarray, idx: np.ndarray, trace: bool = True):
        from ..algorithms.deployed.flashinfer.sparse import flashinfer_mla_sparse

        counts = (idx >= 0).sum(axis=1)
        plan = np.minimum(counts + case["upper_bound"], case["topk"]) if case["upper_bound"] else None
        return flashinfer_mla_sparse(q, rows, idx, scale=576**-0.5 if case["scale"] is None else case["scale"],
                                     k_scale=case.get("k_scale") if case["kv_format"] == "e4m3" else None,
                                     max_num_batched_tokens=case["max_num_batched_tokens"], plan_seqlens=plan,
                                     trace=trace)

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, rows, idx = flashinfer_sparse_inputs(case)
        res = self._model(case, q, rows, idx)
        return [*_plan_stages(res, i, arrays),
                stage("lse", arrays[f"c{i}_lse"], res.lse.astype(np.float32), np.float32),
                stage("out", arrays[f"c{i}_out"], res.out[:case["keep"]], ml_dtypes.bfloat16)]

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.flashinfer import run_flashinfer_mla_sparse

        q, rows, idx = flashinfer_sparse_inputs(recipe)
        recipe = {**recipe, "scale": 576**-0.5 if recipe["scale"] is None else recipe["scale"]}
        bits = rows.view(np.uint8 if recipe["kv_format"] == "e4m3" else np.uint16)
        got, same = run_twice(lambda: run_flashinfer_mla_sparse(kernel, q.view(np.uint16), bits, idx, recipe))
        lse_run = bool(got.pop("lse_run_same_out")[0])
        return got, {**recipe, "input_crc": input_crc(q, rows, idx), "repeat_identical": same,
                     "lse_run_same_out": lse_run}


#: vLLM's FLASHINFER_MLA_SPARSE_SM90 (NoPE sparse MLA) as the cross-check drives it.
FLASHINFER_MLA_SPARSE = _FlashInferSparse(
    name="flashinfer-mla-sparse",
    summary="FlashInfer's MLA on Hopper without RoPE (flashinfer-python 0.7.2, the <512, 0> fa3 kernel) as vLLM's "
            "FLASHINFER_MLA_SPARSE_SM90 calls it: top-k lists, BF16 and E4M3 caches",
    **_SOURCE)
