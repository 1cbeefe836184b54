"""Capture what the kernels compute at the edges of what they take: a request shorter than its causal (MTP) step
(its first query rows see no key), a request of no key, through vLLM 0.33.0's shipped FA3 and dense FP8 FlashMLA
libraries and vLLM's Triton MLA decode, each as vLLM calls it.

With ``edges``: the softmax scales no kernel checks (0, negative, subnormal) through every kernel that takes them
(:data:`EDGE_SCALES`, each kernel's scale template), and requests of no key through FlashMLA's dense decode and
SGLang's Triton decode.

With ``flashinfer``: FlashInfer's MLA on requests shorter than their causal step and on the same scale edges.

With ``tiny``: the subnormal softmax scales at FP32's normal boundary (:data:`TINY_SCALES`: those whose product with
log2 e is normal where a host derives it in double, and one whose product is not) through every kernel that takes a
scale, FlashMLA's dense decode in vLLM's and SGLang's builds with negative subnormal scales over splits of odd and
even block counts, and FlashInfer's MLA; OUTDIR/tiny_{kernel}.npz.

With ``small``: q and the caches drawn near FP32's subnormal range (:data:`SMALL_DISTS`) through every kernel (the
FP8 ones at scales of 2^-125), FlashInfer's also over work items of several KV tiles and with E4M3 latents at 2^-125
and 1e-40; OUTDIR/small_{kernel}.npz.

With ``softcap`` or ``local``: FA3's MLA decode with a softcap (:data:`SOFTCAP`) or a local window
(:data:`LOCAL`), OUTDIR/softcap_fa3_mla.npz and softcap_fa3_mla_seed1000.npz (local_...).

With ``descales``: the descales and cache scales of the FP8 kernels (:data:`EDGE_FACTORS`: 0, negative, infinite,
NaN, subnormal) and SGLang's ``v_scale``; OUTDIR/descale_{kernel}.npz.

Run on a CUDA machine:  python scripts/capture_limits.py OUTDIR VLLM_ROOT VLLM_TRITON_FILE
                        [edges SGLANG_FILE ETAP_DIR | flashinfer FLASHINFER_CHECKOUT | softcap | local
                         | tiny|small SGLANG_FILE ETAP_DIR SGL_FLASH_MLA_ROOT FLASHINFER_CHECKOUT
                         | descales SGLANG_FILE FLASHINFER_CHECKOUT]

VLLM_ROOT holds ``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``, ``vllm/_flashmla_C.abi3.so`` and
``vllm/_flashmla_extension_C.abi3.so`` (vLLM 0.33.0's wheel, unpacked); VLLM_TRITON_FILE is vLLM 0.33.0's
``triton_decode_attention.py``, SGLANG_FILE sglang 0.5.23's ``decode_attention.py``, ETAP_DIR a FlashMLA-ETAP
checkout. Writes OUTDIR/limits_{kernel}.npz (or edges_{kernel}.npz), each as
:func:`amla_sim.crosscheck.deployed.capture` writes it (the cases below, their recipes recorded); the replay is
``amla-sim crosscheck --replay FILE``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from amla_sim.crosscheck.deployed import KERNELS, capture

_192 = 192 ** -0.5
_DS = 0.1352


def _fa3(b, sq, H, lens, fmt, dist, seed, page, ns, scale=_192):  # vLLM's op takes the scale as given
    return {"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": fmt, "dist": dist, "seed": seed,
            "scale": scale, "page_size": page, "num_splits": ns, "varlen_q": page is not None, "causal": True}


def _fp8(b, sq, H, lens, dist, seed, scale, qs, ks):
    return {"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": "bf16", "dist": dist, "seed": seed,
            "scale": scale, "q_scale": qs, "k_scale": ks}


def _triton(b, sq, H, lens, dist, seed, scale, cache, ks, page):
    return {"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "format": "bf16", "dist": dist, "seed": seed,
            "scale": scale, "kv_cache": cache, "k_scale": ks, "page_size": page, "batch_invariant": False,
            "num_kv_splits": 1}  # the run sets vLLM's count for the batch


#: kernel -> (build, source key, cases): requests shorter than their step of s_q queries, requests of no key
CASES = {
    "fa3-mla": ("vllm", "vllm", [
        _fa3(2, 2, 64, (1, 5000), "fp16", "normal:1", 901, 16, 0),  # vLLM's MTP call: row 0 of request 0 sees none
        _fa3(2, 4, 16, (2, 8), "bf16", "normal:1", 902, 16, 0),
        _fa3(4, 4, 128, (1, 3, 300, 7000), "bf16", "flashmla", 903, 64, 32),  # split, with short requests
        _fa3(3, 3, 64, (0, 2, 1000), "bf16", "normal:1", 904, 16, 0),  # a request of no key
        _fa3(2, 2, 16, (1, 700), "fp16", "normal:1", 905, None, 0),  # SGLang's flash_attn_with_kvcache form
        _fa3(2, 4, 128, (3, 4097), "bf16", "normal:1", 906, 16, 0, _DS),
    ]),
    "flashmla-dense-fp8": ("vllm", "vllm", [
        _fp8(2, 2, 128, (1, 64), "flashmla", 911, _192, 1.0, 1.0),
        _fp8(3, 4, 64, (2, 3, 500), "normal:1", 912, _DS, 1 / 448, 1 / 448),
        _fp8(2, 2, 16, (1, 3000), "normal:1", 913, _192, 0.05, 0.03),
    ]),
    "vllm-triton-mla": ("upstream", "triton", [
        _triton(2, 2, 16, (1, 700), "normal:1", 921, _192, "bf16", 1.0, 16),
        _triton(2, 4, 16, (2, 8), "normal:1", 922, _DS, "fp8", 0.05, 16),
        _triton(3, 2, 128, (0, 1, 3000), "flashmla", 923, _192, "bf16", 1.0, 1),  # a request of no key
        _triton(2, 1, 16, (0, 100), "normal:1", 924, _192, "bf16", 1.0, 16),  # a decode of no key
    ]),
}


#: softmax scales no kernel checks: 0, negative (DeepSeek's, signs flipped), subnormal (the smallest included)
EDGE_SCALES = (0.0, -0.0417, -0.1352, 1e-40, -3e-39, 1e-45)


def _scaled(kernel: str) -> list[dict]:
    return [{**KERNELS[kernel].scale_template(), "seed": 950 + j, "scale": s} for j, s in enumerate(EDGE_SCALES)]


def _dense(b, sq, H, lens, dist, seed, scale=_192):
    return {"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "dist": dist, "seed": seed, "scale": scale}


def _sglang(b, H, lens, splits, seed):
    return {"batch": b, "heads": H, "seqlens": list(lens), "num_kv_splits": list(splits), "max_kv_splits": max(splits),
            "dist": "normal:1", "seed": seed, "scale": _192}


#: kernel -> (build, source key, cases) of the edges run
EDGES = {
    **{k: ("vllm", "vllm", _scaled(k)) for k in ("fa3-mla", "fa3-mla-sparse", "flashmla", "flashmla-sparse-fp8",
                                                  "flashmla-sparse-prefill", "flashmla-dense-fp8")},
    "flashmla-etap": ("upstream", "etap", _scaled("flashmla-etap")),
    "vllm-triton-mla": ("upstream", "triton", _scaled("vllm-triton-mla")),
    "sglang-triton": ("upstream", "sglang", _scaled("sglang-triton") + [
        _sglang(2, 16, (0, 100), (1, 1), 971), _sglang(3, 128, (0, 1, 3000), (4, 4, 4), 972)]),
    "flashmla-empty": ("vllm", "vllm", [_dense(3, 1, 128, (0, 64, 3000), "normal:1", 961),
                                        _dense(3, 1, 128, (3000, 0, 3000), "flashmla", 962),
                                        _dense(3, 1, 16, (0, 0, 1), "normal:1", 963),
                                        _dense(4, 2, 64, (0, 700, 1, 0), "normal:1", 964)]),
}


#: subnormal scales at FP32's normal boundary (2^-126 = 1.18e-38): times log2 e in double (FA3's and FlashMLA's hosts)
#: 1e-38 to 8.2e-39 give a normal constant, 8.1e-39 a subnormal one; negative ones move FlashMLA's running max
TINY_SCALES = (1e-38, -1e-38, 9e-39, 8.2e-39, 8.1e-39, -3e-39)


def _tiny(kernel: str, seed: int = 1100) -> list[dict]:
    return [{**KERNELS[kernel].scale_template(), "seed": seed + j, "scale": s} for j, s in enumerate(TINY_SCALES)]


#: FlashMLA's dense decode at negative subnormal scales over splits of odd and even block counts
_ODD = [_dense(4, 1, 64, (600, 64, 129, 1000), "normal:1", 1110, -3e-39),
        _dense(3, 2, 16, (65, 700, 191), "normal:1", 1111, -1e-38),
        _dense(2, 1, 128, (3000, 1), "flashmla", 1112, -2e-39),
        _dense(3, 1, 16, (100, 2000, 333), "normal:1", 1113, 9e-39)]

#: kernel -> (build, source key, cases) of the tiny run
TINY = {
    **{k: ("vllm", "vllm", _tiny(k)) for k in ("fa3-mla", "fa3-mla-sparse", "flashmla-dense-fp8")},
    "flashmla": ("vllm", "vllm", _tiny("flashmla") + _ODD),
    "flashmla-sglang": ("sglang", "sgl-flash-mla", _tiny("flashmla") + _ODD),
    "flashmla-etap": ("upstream", "etap", _tiny("flashmla-etap")),
    "vllm-triton-mla": ("upstream", "triton", _tiny("vllm-triton-mla")),
    "sglang-triton": ("upstream", "sglang", _tiny("sglang-triton")),
    "flashinfer-mla": ("upstream", "flashinfer", _tiny("flashinfer-mla")),
}


#: descales and cache scales no kernel checks: 0, negative, infinite, NaN and subnormal, one scale at a time (the
#: query's and the cache's with vLLM's quantizers, which read them too)
EDGE_FACTORS = (0.0, -0.05, float("inf"), float("nan"), 1e-40)


#: FlashInfer's wrapper refuses a cache scale that is not finite and positive as a double: the edges it takes are a
#: subnormal one, one below FP32 (0 as the kernel's float), one above it (an infinity there), and 2^-120 and 2^-100,
#: normal, whose products with the cache's values reach FP32's subnormal range
FI_FACTORS = (1e-40, 1e-300, 1e39, 2.0 ** -120, 2.0 ** -100)


def _factors(kernel: str, key: str, seed: int, factors=EDGE_FACTORS, **base) -> list[dict]:
    return [{**KERNELS[kernel].scale_template(), "scale": _DS, **base, "seed": seed + j, key: f}
            for j, f in enumerate(factors)]


#: kernel -> (build, source key, cases) of the descales run
DESCALES = {
    "flashmla-dense-fp8": ("vllm", "vllm", _factors("flashmla-dense-fp8", "q_scale", 1300)
                           + _factors("flashmla-dense-fp8", "k_scale", 1310)),
    "vllm-triton-mla": ("upstream", "triton", _factors("vllm-triton-mla", "k_scale", 1320)),
    "sglang-triton": ("upstream", "sglang", _factors("sglang-triton", "v_scale", 1330)),
    "flashinfer-mla": ("upstream", "flashinfer",
                       _factors("flashinfer-mla", "ckv_scale", 1340, FI_FACTORS, kv_format="e4m3", kpe_scale=1.0)
                       + _factors("flashinfer-mla", "kpe_scale", 1350, FI_FACTORS, kv_format="e4m3", ckv_scale=1.0)),
    "flashinfer-mla-sparse": ("upstream", "flashinfer",
                              _factors("flashinfer-mla-sparse", "k_scale", 1360, FI_FACTORS)),
}


def _fi(b, sq, H, lens, seed, scale=_192):
    return {"batch": b, "sq": sq, "heads": H, "seqlens": list(lens), "kv_format": "bf16", "dist": "normal:1",
            "seed": seed, "scale": scale, "page_size": 1, "causal": sq > 1, "keep": b}


#: FlashInfer's MLA (SGLang's call): requests shorter than their causal step, then the scale edges
FLASHINFER = {"flashinfer-mla": ("upstream", "flashinfer", [
    _fi(2, 2, 16, (1, 700), 981), _fi(2, 4, 64, (2, 3000), 982), _fi(3, 3, 128, (1, 2, 300), 983),
    _fi(2, 200, 16, (150, 400), 984),  # a step longer than a request of more than two KV tiles
    *({**KERNELS["flashinfer-mla"].scale_template(), "seed": 990 + j, "scale": s}
      for j, s in enumerate(EDGE_SCALES))])}


#: values near FP32's subnormal range: q and the cache drawn at about 1e-38 (every output near or under 2^-126; a
#: fast-math build's multiplies write a subnormal result as 0) and about 1e-36 (partial outputs that pass through it)
SMALL_DISTS = ("normal:1e-38", "normal:1e-36")
#: the FP8 kernels' scales for them (2^-125: the quantized values normal E4M3, their products near 2^-126)
_S125 = 2.0 ** -125


def _small(kernel: str, seed: int = 1400, **over) -> list[dict]:
    return [{**KERNELS[kernel].scale_template(), "seed": seed + j, "dist": d, "scale": _DS, **over}
            for j, d in enumerate(SMALL_DISTS)]


#: kernel -> (build, source key, cases) of the small run; FlashInfer's also at 128 heads over 3,000 keys (work items
#: of several KV tiles, whose running O passes through the subnormal range) and with E4M3 latents at 2^-125 and 1e-40
SMALL = {
    **{k: ("vllm", "vllm", _small(k)) for k in ("fa3-mla", "fa3-mla-sparse", "flashmla", "flashmla-sparse-fp8",
                                                 "flashmla-sparse-prefill")},
    "flashmla-sglang": ("sglang", "sgl-flash-mla", _small("flashmla")),
    "flashmla-dense-fp8": ("vllm", "vllm", _small("flashmla-dense-fp8", q_scale=_S125, k_scale=_S125)),
    "flashmla-etap": ("upstream", "etap", _small("flashmla-etap")),
    "vllm-triton-mla": ("upstream", "triton", _small("vllm-triton-mla", k_scale=_S125)
                        + _small("vllm-triton-mla", 1402, kv_cache="bf16")),
    "sglang-triton": ("upstream", "sglang", _small("sglang-triton")),
    "flashinfer-mla": ("upstream", "flashinfer", _small("flashinfer-mla") + [
        {**_fi(4, 1, 128, (3000,) * 4, 1402, _DS), "dist": "normal:1e-36"},
        {**_fi(2, 1, 16, (3000, 700), 1403, _DS), "dist": "normal:1e-38", "kv_format": "e4m3", "ckv_scale": _S125,
         "kpe_scale": _S125, "keep": 2},
        {**_fi(1, 1, 16, (600,), 1404, 1.0), "kv_format": "e4m3", "ckv_scale": 1e-40, "kpe_scale": 1.0}]),
    "flashinfer-mla-sparse": ("upstream", "flashinfer", _small("flashinfer-mla-sparse", k_scale=_S125)),
}


#: FA3's MLA decode with a ``softcap`` (vLLM's library; vLLM's MLA backend never passes one, FA3 computes it):
#: vLLM's paged call (the split heuristic, an MTP step, the CUDA graphs' 32) and SGLang's unpaged form; the same at
#: seed + 1000
SOFTCAP = {name: ("vllm", "vllm", [{**_fa3(*args), "softcap": cap, "seed": args[6] + extra} for args, cap in (
    ((2, 1, 128, (700, 3000), "bf16", "normal:1", 931, 16, 0), 50.0),
    ((2, 2, 64, (1, 5000), "fp16", "normal:1", 932, 16, 0), 30.0),
    ((4, 1, 16, (100, 2000, 300, 4097), "bf16", "flashmla", 933, 64, 32), 20.0),
    ((2, 1, 16, (1, 700), "bf16", "rope-outliers", 934, None, 0), 5.0))])
    for name, extra in (("fa3-mla", 0), ("fa3-mla-seed1000", 1000))}


#: FA3's MLA decode with a local ``window_size`` (vLLM's library; vLLM's MLA backend never passes one, FA3 computes
#: it): windows behind the query, one with keys after it in an MTP step, one of a single key, the heuristic's splits
#: over the keys a window loads, the CUDA graphs' 32, SGLang's unpaged form; the same at seed + 1000
LOCAL = {name: ("vllm", "vllm", [{**_fa3(*args), "window": list(w), "causal": causal, "seed": args[6] + extra}
                                  for args, w, causal in (
    ((2, 1, 128, (700, 3000), "bf16", "normal:1", 941, 16, 0), (256, 0), True),
    ((2, 2, 64, (1, 5000), "fp16", "normal:1", 942, 16, 0), (1000, 0), True),
    ((4, 1, 16, (100, 2000, 300, 4097), "bf16", "flashmla", 943, 64, 32), (500, 0), True),
    ((2, 1, 16, (1, 700), "bf16", "rope-outliers", 944, None, 0), (100, 0), True),
    ((2, 4, 32, (50, 3000), "bf16", "normal:1", 945, None, 0), (200, 2), False),  # keys after the query too
    ((1, 2, 64, (2500,), "bf16", "normal:1", 946, 64, 0), (0, 0), True),
    ((2, 2, 16, (900, 6000), "bf16", "normal:1", 947, None, 0), (64, -1), False))])
    for name, extra in (("fa3-mla", 0), ("fa3-mla-seed1000", 1000))}


def main() -> None:
    out, sources = sys.argv[1], {"vllm": sys.argv[2], "triton": sys.argv[3]}
    mode = sys.argv[4] if len(sys.argv) > 4 else "limits"
    if mode in ("edges", "tiny", "small"):
        sources.update(sglang=sys.argv[5], etap=sys.argv[6])
    if mode in ("tiny", "small"):
        sources.update({"sgl-flash-mla": sys.argv[7], "flashinfer": sys.argv[8]})
    if mode == "descales":
        sources.update(sglang=sys.argv[5], flashinfer=sys.argv[6])
    if mode == "flashinfer":
        sources.update(flashinfer=sys.argv[5])
    os.makedirs(out, exist_ok=True)
    failed = []
    table = {"edges": EDGES, "flashinfer": FLASHINFER, "tiny": TINY, "small": SMALL, "descales": DESCALES,
             "limits": CASES, "softcap": SOFTCAP, "local": LOCAL}[mode]
    for name, (build, source, cases) in table.items():
        kernel = name.removesuffix("-empty").removesuffix("-sglang").removesuffix("-seed1000")
        t0 = time.time()
        try:
            prefix = {"limits": "limits", "tiny": "tiny", "small": "small", "descales": "descale",
                      "softcap": "softcap", "local": "local"}.get(mode, "edges")
            capture(kernel, os.path.join(out, f"{prefix}_{name.replace('-', '_')}.npz"),
                    source=sources[source], build=build if KERNELS[kernel].builds or build == "upstream" else
                    "upstream", cases=cases)
            print(f"{name}: {len(cases)} cases, {time.time() - t0:.1f} s", flush=True)
        except Exception:  # one kernel's failure is reported, the others still run
            failed.append(name)
            traceback.print_exc()
    print("failed:", failed or "none")


if __name__ == "__main__":
    main()
