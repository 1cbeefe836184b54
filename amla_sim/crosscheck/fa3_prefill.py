"""FlashAttention-3's MHA-form MLA prefill (q/k 192, v 128): its case table, replayed by
:func:`.deployed.replay_deployed`.

A case is one ``flash_attn_varlen_func`` call as vLLM's MLA prefill makes it: the new tokens' causal call, or a
context chunk's non-causal call (every query of a request against the chunk's keys), per request ``qlens`` queries
and ``seqlens`` keys. It records ``out`` (T, h, 128) BF16 or FP16 bits, ``lse`` (h, T) FP32 bits and, where the
launch splits requests dynamically, each request's split count from ``get_scheduler_metadata`` (``splits``). The
capture keeps the first ``keep_heads`` query heads' out and LSE (the heads are independent; the replay computes
those heads under the whole launch's split choice).
Inputs are regenerated, never stored: q, k and v drawn by :func:`~amla_sim.experiments.inputs.make_inputs` at the
case's seed (k at seed + 1000, v at seed + 2000).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._validate import check_int
from ..algorithms.deployed.fa3 import FA3_COMMIT
from ..algorithms.deployed.fa3.prefill import cu_seqlens, fa3_prefill, kernel_dims, prefill_schedule
from ..algorithms.deployed.fa3.scheduler import window
from ..algorithms.deployed.scalars import api_float
from ..experiments.inputs import make_inputs
from ..resources import run_bytes
from .files import CaptureError, input_crc
from .kernel import DeployedKernel, Stage, check_fa3_options, run_twice, stage

__all__ = ["PREFILL_CASES", "FA3_PREFILL", "HEAD_DIMS", "prefill_inputs", "draw_heads"]

#: the compiled head dims (q's) a recipe's ``head_dim`` runs on: any multiple of 8 up to 256 rounds up to one of them
HEAD_DIMS = (64, 96, 128, 192, 256)
_DS = 0.1352337788608801  # DeepSeek-V3's softmax scale: 192^-0.5 mscale^2 (YaRN)
_K2 = 192 ** -0.5  # Kimi-K2's (no YaRN on its prefill scale)
#: query heads whose out and LSE a capture keeps
KEEP_HEADS = 2
#: a case's input formats (``e4m3``: BF16 draws cast to E4M3 as vLLM's FP8 prefill casts them, no descale)
_FORMATS = ("bf16", "fp16", "e4m3")

#: (heads, heads_k, qlens, key lengths, causal, format, dist, seed, scale, num_splits): the new tokens' causal call
#: (key lengths = qlens) or a context chunk's call (causal False); num_splits 0 as vLLM passes it by default, 1 in
#: its batch-invariant mode (and always in SGLang's call)
PREFILL_CASES = [
    (128, 128, (1000,), (1000,), True, "bf16", "normal:1", 301, _DS, 0),  # a prompt, TP1
    (16, 16, (257, 100, 700), (257, 100, 700), True, "bf16", "flashmla", 302, _DS, 0),  # TP8, partial m-blocks
    (16, 16, (300, 200), (2000, 0), False, "bf16", "normal:1", 303, _DS, 0),  # a context chunk: splits
    (16, 16, (200,), (1500,), False, "fp16", "normal:1", 304, _K2, 1),  # batch-invariant mode: one split
    (16, 16, (128,), (1500,), False, "bf16", "normal:1", 305, _DS, 0),  # alone: its split count ...
    (16, 16, (128, 128), (1500, 3000), False, "bf16", "normal:1", 305, _DS, 0),  # ... changed by a batchmate
    (16, 16, (100, 37), (0, 0), False, "bf16", "normal:1", 306, _DS, 0),  # a chunk of no key: out 0, LSE +inf
    (16, 4, (200, 90), (200, 90), True, "bf16", "normal:1", 307, _K2, 0),  # grouped heads: packed rows
    (32, 32, (400,), (400,), True, "fp16", "rope-outliers", 308, _DS, 0),
    (16, 16, (1, 129, 255), (1, 129, 255), True, "bf16", "normal:1", 309, _DS, 0),
    (8, 8, (64, 700), (5000, 700), False, "bf16", "flashmla", 310, _K2, 0),  # TP16: many splits
]


def draw_heads(dist: str, tokens: int, heads: int, width: int, seed: int, fmt: str = "bf16") -> np.ndarray:
    """(tokens, heads, width) drawn by :func:`~amla_sim.experiments.inputs.make_inputs` (one query step of `tokens`
    positions), the RoPE columns, where the distribution has them, past the first 128 (k = [k_nope, k_pe])."""
    return make_inputs(dist, batch=1, heads=heads, sq=tokens, context=1, d_k=width, d_v=min(128, width), seed=seed,
                       fmt=fmt)[0][0]


def _dims(case: dict) -> tuple[int, int]:
    """A recipe's head dims (q's, v's): its ``head_dim`` (192, the MLA prefill's, unless given) and ``head_dim_v``
    (128 for 192 unless given, else q's)."""
    d = case.get("head_dim", 192)
    return d, case.get("head_dim_v", 128 if d == 192 else d)


def prefill_inputs(case: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (T, h, d), k (T_k, h_k, d), v (T_k, h_k, dv) from a recipe (checked against its CRC), d its ``head_dim``
    (192, the MLA prefill's, unless given; dv 128 there, d elsewhere); T_k is at least 1 (a call of no key still
    passes a row) unless the recipe's ``k_rows`` is 0."""
    H, Hk, dist, seed = case["heads"], case["heads_k"], case["dist"], case["seed"]
    fmt = "bf16" if case["format"] == "e4m3" else case["format"]  # E4M3: BF16 draws, cast on the device
    T, Tk = sum(case["qlens"]), max(1, sum(case["seqlens"]))
    rows = 0 if case.get("k_rows") == 0 else Tk  # a call whose k and v hold no row at all
    d, dv = _dims(case)
    got = (draw_heads(dist, T, H, d, seed, fmt), draw_heads(dist, Tk, Hk, d, seed + 1000, fmt)[:rows],
           draw_heads(dist, Tk, Hk, dv, seed + 2000, fmt)[:rows])
    if "input_crc" in case and input_crc(*got) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return got


class _Fa3Prefill(DeployedKernel):
    def recipes(self, seed: int) -> list[dict]:
        return [{"batch": len(ql), "sq": max(ql), "heads": H, "heads_k": Hk, "qlens": list(ql), "seqlens": list(kl),
                 "causal": causal, "format": fmt, "dist": dist, "seed": s + seed, "scale": scale, "num_splits": ns,
                 "keep_heads": min(H, max(KEEP_HEADS, H // Hk))}
                for H, Hk, ql, kl, causal, fmt, dist, s, scale, ns in PREFILL_CASES]

    def scale_template(self) -> dict:
        return {"batch": 2, "sq": 300, "heads": 16, "heads_k": 16, "qlens": [300, 40], "seqlens": [1200, 700],
                "causal": False, "format": "bf16", "dist": "normal:1", "seed": 500, "scale": None, "num_splits": 0,
                "keep_heads": 2}

    def check(self, case: dict) -> None:
        if case.get("format") not in _FORMATS:
            raise ValueError(f"format: the prefill model takes {', '.join(_FORMATS)}, got {case.get('format')!r}")
        H = case["heads"]
        Hk = check_int(case["heads_k"], "heads_k", lo=1, hi=H)
        if H % Hk:
            raise ValueError(f"heads_k: {Hk} does not divide heads ({H})")
        qlens = [check_int(n, "qlens", lo=0) for n in case["qlens"]]
        if len(qlens) != case["batch"] or max(qlens) != case["sq"] or max(qlens) < 1:
            raise ValueError(f"qlens: {case['batch']} lengths, the longest sq ({case['sq']})")
        check_int(case["num_splits"], "num_splits", lo=0, hi=256)
        keep = check_int(case["keep_heads"], "keep_heads", lo=1, hi=H)
        if keep % (H // Hk):
            raise ValueError(f"keep_heads: whole groups of {H // Hk} heads, got {keep}")
        d, dv = _dims(case)
        check_int(d, "head_dim", lo=1)
        check_int(dv, "head_dim_v", lo=1)
        kernel_dims(d, dv, 1 if case["format"] == "e4m3" else 2, "head_dim")
        if case["causal"] not in (True, False):
            raise TypeError(f"causal: expected true or false, got {case['causal']!r}")
        for x in ("q_descale", "k_descale", "v_descale"):
            if x in case:
                if case["format"] != "e4m3":
                    raise ValueError(f"{x}: only an E4M3 call takes descales, got format {case['format']!r}")
                api_float(case[x], x)
        check_fa3_options(case)
        if case.get("k_rows", 1) != 1 and (case["k_rows"] != 0 or max(case["seqlens"]) > 0):
            raise ValueError(f"k_rows: 0 (k and v of no row, every request of no key) or absent, got "
                             f"{case['k_rows']!r}")

    def memory(self, case: dict) -> int:
        """The model's peak over its fixed part (a decode of one key's): per kept head an m-block's scores and their
        temporaries over the longest request and its gathered keys and values, and the call's rows in FP32."""
        H, nk = case["keep_heads"], max(1, *case["seqlens"])
        return (run_bytes(batch=1, sq=1, heads=1, context=1, mufu_tables=True)
                + H * (128 * nk * 4 * 4 + nk * 320 * 8) + sum(case["qlens"]) * H * 320 * 8)

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        T, H = sum(case["qlens"]), case["keep_heads"]
        return {"out": ((T, H, _dims(case)[1]), np.uint16, True), "lse": ((H, T), np.uint32, True),
                "splits": ((case["batch"],), np.int32, False)}

    def _schedule(self, case: dict) -> tuple[int, list[int], bool]:
        ql, kl = case["qlens"], case["seqlens"]
        d, dv = _dims(case)
        causal, local, left, right = window(case["causal"], case.get("window", (-1, -1)), max(ql), max(kl))
        return prefill_schedule(ql, kl, heads=case["heads"], heads_k=case["heads_k"], d=d, dv=dv,
                                num_splits=case["num_splits"], causal=causal, max_seqlen_q=max(ql),
                                max_seqlen_k=max(kl), element_size=1 if case["format"] == "e4m3" else 2,
                                build=case.get("build", "vllm"), local=(left, right) if local else None,
                                softcap=bool(api_float(case.get("softcap", 0.0), "softcap") > 0))

    def readbacks(self, case: dict) -> set[str]:
        """The split counts, where the launch splits dynamically (its split bound over 1)."""
        return {"splits"} if self._schedule(case)[0] > 1 else set()

    def label(self, case: dict) -> str:
        kind = "causal" if case["causal"] else "context chunk"
        d, dv = _dims(case)
        dims = "" if "head_dim" not in case else f" d={d}" if dv == d else f" d={d}/{dv}"
        return (f" {case['format']}{dims} {kind} h_k={case['heads_k']} qlens={case['qlens']} "
                f"num_splits={case['num_splits']} (heads 0-{case['keep_heads'] - 1} kept)")

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        q, k, v = prefill_inputs(case)
        if case["format"] == "e4m3":  # torch's .to(float8_e4m3fn): nearest even
            q, k, v = (x.astype(ml_dtypes.float8_e4m3fn) for x in (q, k, v))
        keep, qpk = case["keep_heads"], case["heads"] // case["heads_k"]
        descales = {f"{x}_descale": np.full((case["batch"], keep // qpk), case[f"{x}_descale"], np.float32)
                    for x in "qkv" if f"{x}_descale" in case}  # one value a call
        res = fa3_prefill(q[:, :keep], k[:, :keep // qpk], v[:, :keep // qpk], cu_seqlens(case["qlens"]),
                          cu_seqlens(case["seqlens"]), scale=case["scale"], causal=case["causal"],
                          num_splits=case["num_splits"], launch_heads=case["heads"], build=case.get("build", "vllm"),
                          softcap=case.get("softcap", 0.0), window_size=tuple(case.get("window", (-1, -1))),
                          trace=True, **descales)
        out = []
        if f"c{i}_splits" in arrays:
            out.append(("splits", arrays[f"c{i}_splits"], np.array(res.trace["splits"], np.int32)))
        fmt = np.float16 if case["format"] == "fp16" else ml_dtypes.bfloat16  # E4M3's out: BF16
        d, dv = _dims(case)
        written = kernel_dims(d, dv, 1 if case["format"] == "e4m3" else 2)[1]
        name, device, sim = stage("out", arrays[f"c{i}_out"], res.out, fmt)
        if written < dv:  # the FP8 64 / 64 kernel writes the first 64 columns; the rest are what the buffer held
            name = f"out[..., :{written}] (the kernel leaves columns {written}-{dv - 1} unwritten)"
            device, sim = device[..., :written], sim[..., :written]
        return out + [stage("lse", arrays[f"c{i}_lse"], res.lse.astype(np.float32), np.float32), (name, device, sim)]

    def load(self, source: str | None) -> Any:
        raise ValueError("build: the prefill is captured from vLLM's shipped FA3 library (--build vllm)")

    def load_shipped(self, source: str, build: str) -> Any:
        """vLLM's: its wheel's library (`source`: the unpacked wheel). SGLang's: sgl-flash-attn built from its
        checkout (`source`) with SGLang's switches (its shipped ``flash_ops``, 1.1 GB, does not travel), a build for
        the MLA prefill's head dims and one for the others (64, 96, 128, 256), each when a case first needs it."""
        from ..gpu.adapters.fa3 import build_fa3, load_shipped_fa3

        if build == "vllm":
            return load_shipped_fa3(source)
        builds: dict[str, Any] = {}

        def for_dims(d: int) -> Any:  # q's head dim, each build made when first needed
            path = "prefill" if 128 < d <= 192 else "mha"  # the 192 kernels', or 64, 96, 128 and 256
            if path not in builds:
                builds[path] = build_fa3(source, fork="sglang", path=path)
            return builds[path]

        return for_dims

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        from ..gpu.adapters.fa3 import run_fa3_prefill

        q, k, v = prefill_inputs(recipe)
        recipe = {**recipe, "scale": 192**-0.5 if recipe["scale"] is None else recipe["scale"]}
        keep = recipe["keep_heads"]
        causal, local, _, _ = window(recipe["causal"], recipe.get("window", (-1, -1)), max(recipe["qlens"]),
                                     max(recipe["seqlens"]))
        fa3 = kernel(_dims(recipe)[0]) if callable(kernel) else kernel  # SGLang's: the build for the head dim

        def kept() -> dict[str, np.ndarray]:
            got = run_fa3_prefill(fa3, q, k, v, recipe, head_swizzle=causal or local)
            return {**got, "out": np.ascontiguousarray(got["out"][:, :keep]), "lse": got["lse"][:keep].copy()}

        got, same = run_twice(kept)
        return got, {**recipe, "input_crc": input_crc(q, k, v), "repeat_identical": same}


#: FA3's MHA-form MLA prefill as the cross-check drives it.
FA3_PREFILL = _Fa3Prefill(
    name="fa3-prefill",
    summary=f"FlashAttention-3's MHA-form MLA prefill (vllm-project/flash-attention {FA3_COMMIT}; vLLM's new-token "
            "and context-chunk calls, q/k 192 and v 128; head dims 64, 96, 128 and 256), BF16, FP16 and FP8 E4M3",
    version_key="fa3_commit", version=FA3_COMMIT, source_flag="--fa3-dir",
    source_help="--build vllm: vLLM 0.33.0's unpacked wheel (vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so); --build "
                "sglang: a sgl-project/sgl-flash-attn checkout (cb303cf) with CUTLASS 57e3cfb at csrc/cutlass",
    builds=("vllm", "sglang"),
    empty_requests=True)
