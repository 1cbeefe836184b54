"""Capture FlashAttention-3's MHA-form MLA prefill as vLLM 0.33.0 ships it (``_vllm_fa3_C.abi3.so``), and vLLM's
chained prefill (the new tokens' causal call, a non-causal call per context chunk, ``merge_attn_states``).

Run on a CUDA machine:  python scripts/capture_prefill.py OUTDIR VLLM_ROOT [MERGE_BUNDLE] [--seed N]
                            [--only JOB,...] [--sgl SGL_CHECKOUT]

VLLM_ROOT holds ``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so`` (vLLM 0.33.0's wheel, unpacked). Writes:

- OUTDIR/fa3_prefill_{dev}.npz: :data:`amla_sim.crosscheck.fa3_prefill.PREFILL_CASES`, as
  :func:`amla_sim.crosscheck.deployed.capture` writes it (replay: ``amla-sim crosscheck --replay FILE``);
- OUTDIR/fa3_prefill_seed{N}_{dev}.npz: the same table at fresh seeds (N: 1000, or ``--seed N``), held out;
- OUTDIR/edges_fa3_prefill_{dev}.npz: :data:`EDGE_CASES`, the softmax scales no kernel checks and a call whose k
  holds no row; OUTDIR/tiny_fa3_prefill_{dev}.npz: :data:`TINY_SCALES`, subnormal ones at FP32's normal boundary;
  OUTDIR/descale_fa3_prefill_{dev}.npz: FP8 calls with q's and v's descales at :data:`EDGE_FACTORS`;
- OUTDIR/fa3_prefill_e4m3_{dev}.npz: :data:`E4M3_CASES`, vLLM's FP8 prefill (q, k, v cast to E4M3, no descale);
- OUTDIR/scales_fa3_prefill.npz: the kernel's scale table (DeepSeek's scales and 20 random ones, as
  ``amla-sim crosscheck --kernel fa3-prefill --build vllm --scales 20`` runs it); the committed
  ``tests/data/scales_fa3_prefill.npz`` is this file cut to one head a call by
  ``scripts/trim_capture.py IN OUT 0,1,...,25 --keep-heads 1``;
- OUTDIR/fa3_prefill_hd128_{dev}.npz: :data:`HD128_CASES`, head dim 128 through the same library;
- OUTDIR/fa3_prefill_hdx_{dev}.npz: :data:`HDX_CASES`, head dims 64, 96 and 256; fa3_prefill_hdx_seed{N}_{dev}.npz
  the same at fresh seeds (seed + N), held out;
- OUTDIR/fa3_prefill_pad_{dev}.npz: :data:`PAD_CASES`, head dims between the compiled ones and the 192 / 192
  kernel; fa3_prefill_pad_seed{N}_{dev}.npz the same at fresh seeds (seed + N), held out;
- OUTDIR/fa3_prefill_e4m3_seed{N}_{dev}.npz: :data:`E4M3_CASES` at fresh seeds (seed + N), held out;
- OUTDIR/small_fa3_prefill_{dev}.npz: q, k and v near FP32's subnormal range (:data:`SMALL_DISTS`); the committed
  file is cases 0, 1 and 3 cut to one head (``scripts/trim_capture.py IN OUT 0,1,3 --keep-heads 1``);
- OUTDIR/fa3_prefill_wide_{dev}.npz: :data:`WIDE_CASES`, a v wider than q at q <= 64 (committed cut to one head or
  group, ``--keep-heads 1``); fa3_prefill_wide_seed{N}_{dev}.npz the same at fresh seeds (committed: cases
  0,1,3,4,5,7);
- OUTDIR/fa3_prefill_wide_fp8_{dev}.npz: :data:`WIDE_FP8_CASES` and the same at fresh seeds (seed + N), an FP8 v
  wider than q at q <= 64;
- OUTDIR/fa3_prefill_window_{dev}.npz: :data:`WINDOW_CASES`, local windows; fa3_prefill_window_seed{N}_{dev}.npz
  the same at fresh seeds; OUTDIR/fa3_prefill_caps_{dev}.npz: :data:`CAP_CASES`, softcaps and windows (the committed
  ``fa3_prefill_softcap_h200.npz`` is its cases 1,2,3,8 cut to one head);
- with SGL_CHECKOUT (sgl-project/sgl-flash-attn cb303cf, CUTLASS 57e3cfb at csrc/cutlass), SGLang's build as SGLang
  calls it (``num_splits`` 1 always): OUTDIR/fa3_prefill_sglang_{dev}.npz, the case table and :data:`E4M3_CASES`
  (SGLang's FP8 cache) at seed + N - 1000 (0 for the default N); OUTDIR/fa3_prefill_sglang_hd128_{dev}.npz:
  :data:`SGL_HD128_CASES` through its build of the MHA head dims (committed, from an earlier build of its 128 kernels
  alone: cases 1-5, ``--keep-heads 1``); OUTDIR/fa3_prefill_sglang_mha_{dev}.npz: :data:`SGL_MHA_CASES`, head dims
  64, 96, 128 and 256, BF16 and E4M3, local windows (committed: all but case 12, ``--keep-heads 1``), and
  fa3_prefill_sglang_mha_seed{N}_{dev}.npz the same at fresh seeds (committed: cases 1,2,3,4,7,13,15,16,19,22,23);
- with MERGE_BUNDLE (the mla-merge bundle, whose ``build_merge.py`` builds vLLM's ``merge_attn_states``):
  OUTDIR/vllm_prefill_chain_{dev}.npz: :data:`amla_sim.crosscheck.prefill_chain.CHAIN_CASES` chained as vLLM
  chains them: per case ``c{i}_out`` (the final merged output, raw BF16 bits) and ``meta``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

from amla_sim._files import atomic_savez
from amla_sim.crosscheck.deployed import KERNELS, capture
# this folder's: the scales, descales and draws every kernel's edge captures take
from capture_limits import EDGE_FACTORS, EDGE_SCALES, SMALL_DISTS, TINY_SCALES

_DS = 0.1352337788608801


def _e4m3(H, ql, kl, causal, dist, seed, ns):
    return {"batch": len(ql), "sq": max(ql), "heads": H, "heads_k": H, "qlens": list(ql), "seqlens": list(kl),
            "causal": causal, "format": "e4m3", "dist": dist, "seed": seed, "scale": _DS, "num_splits": ns,
            "keep_heads": 4}


#: vLLM's FP8 prefill (``use_prefill_query_quantization``): the same calls on E4M3 q, k, v
E4M3_CASES = [
    _e4m3(16, (257, 100, 700), (257, 100, 700), True, "normal:1", 321, 0),
    _e4m3(16, (300, 200), (2000, 0), False, "normal:1", 322, 0),  # splits
    _e4m3(16, (200,), (1500,), False, "flashmla", 323, 1),
    _e4m3(64, (200,), (200,), True, "normal:1", 324, 0),
]


def _hd128(H, Hk, ql, kl, causal, fmt, seed, ns):
    return {"batch": len(ql), "sq": max(ql), "heads": H, "heads_k": Hk, "qlens": list(ql), "seqlens": list(kl),
            "causal": causal, "format": fmt, "dist": "normal:1", "seed": seed, "scale": 128 ** -0.5,
            "num_splits": ns, "keep_heads": max(2, H // Hk), "head_dim": 128}


#: head dim 128 (q, k and v), the Llama- and Qwen-class prefill through the same library: grouped heads, the
#: 64-row tile of one warpgroup (a launch's longest query run times the group at most 64), FP8
HD128_CASES = [
    _hd128(32, 8, (1000,), (1000,), True, "bf16", 331, 0),  # Llama-3-8B, TP1
    _hd128(8, 8, (300, 200), (2000, 0), False, "bf16", 332, 0),
    _hd128(16, 16, (40,), (3000,), False, "bf16", 333, 0),  # one warpgroup, 176-key blocks
    _hd128(8, 2, (16, 10), (16, 10), True, "fp16", 334, 0),  # one warpgroup, causal: 128-key blocks
    _hd128(16, 16, (257, 100, 700), (257, 100, 700), True, "e4m3", 335, 0),
    _hd128(16, 16, (30,), (2000,), False, "e4m3", 336, 0),  # FP8, one warpgroup
    _hd128(8, 8, (200,), (1500,), False, "bf16", 337, 1),
]


def _hdx(d, H, Hk, ql, kl, causal, fmt, seed, ns):
    return {**_hd128(H, Hk, ql, kl, causal, fmt, seed, ns), "scale": d ** -0.5, "head_dim": d}


#: head dims 64, 96 and 256 (q, k and v) through the same library: 192-row tiles (64, 96), one warpgroup (64), 80-key
#: blocks (256), grouped heads, splits, FP8
HDX_CASES = [
    _hdx(64, 16, 4, (700, 300), (700, 300), True, "bf16", 341, 0),
    _hdx(64, 8, 8, (20,), (3000,), False, "bf16", 342, 0),  # one warpgroup, split
    _hdx(64, 16, 16, (300, 200), (2000, 0), False, "e4m3", 343, 0),
    _hdx(96, 16, 16, (500,), (500,), True, "bf16", 344, 0),
    _hdx(96, 8, 2, (300, 200), (2000, 0), False, "fp16", 345, 0),
    _hdx(256, 8, 8, (600, 100), (600, 100), True, "bf16", 346, 0),  # Gemma-class
    _hdx(256, 8, 4, (40,), (4000,), False, "bf16", 347, 0),
    _hdx(256, 8, 8, (257, 300), (257, 300), True, "e4m3", 348, 0),
    _hdx(64, 8, 8, (200,), (1500,), False, "bf16", 349, 1),
]


def _tiny() -> list[dict]:
    base = KERNELS["fa3-prefill"].scale_template()
    return [{**base, "seed": 1100 + j, "scale": s} for j, s in enumerate(TINY_SCALES)]


def _pad(d, dv, H, Hk, ql, kl, causal, fmt, seed, ns):
    return {**_hd128(H, Hk, ql, kl, causal, fmt, seed, ns), "scale": d ** -0.5, "head_dim": d, "head_dim_v": dv}


#: head dims between the compiled ones (FA3 runs the next compiled kernel, the columns past the call's read as
#: zero): 48, 80, 120, 200, a v narrower than q at 64 and 144, the 192 / 192 kernel (160, 176, 192), FP8 among them;
#: 120 at 20 query rows, where 128 would take one warpgroup's tile
PAD_CASES = [
    _pad(80, 80, 16, 4, (700, 300), (700, 300), True, "bf16", 361, 0),
    _pad(120, 120, 8, 8, (20,), (3000,), False, "bf16", 362, 0),
    _pad(144, 112, 16, 16, (300, 200), (2000, 0), False, "fp16", 363, 0),
    _pad(160, 160, 8, 8, (500,), (500,), True, "bf16", 364, 0),
    _pad(192, 192, 8, 2, (300, 200), (2000, 0), False, "bf16", 365, 0),
    _pad(200, 200, 8, 8, (257, 300), (257, 300), True, "bf16", 366, 0),
    _pad(48, 48, 16, 16, (300,), (1500,), False, "bf16", 367, 0),
    _pad(64, 32, 8, 8, (40,), (4000,), False, "bf16", 368, 0),
    _pad(112, 112, 16, 16, (300, 200), (2000, 0), False, "e4m3", 369, 0),
    _pad(160, 128, 8, 8, (600,), (600,), True, "e4m3", 370, 0),
    _pad(176, 176, 8, 8, (300,), (1200,), False, "e4m3", 371, 0),
]


def _descales() -> list[dict]:
    base = {**KERNELS["fa3-prefill"].scale_template(), "format": "e4m3", "scale": 192 ** -0.5}
    return [{**base, "seed": 1400 + 10 * i + j, key: f} for i, key in enumerate(("q_descale", "v_descale"))
            for j, f in enumerate(EDGE_FACTORS)]


def _edges() -> list[dict]:
    base = KERNELS["fa3-prefill"].scale_template()
    cases = [{**base, "seed": 950 + j, "scale": s} for j, s in enumerate(EDGE_SCALES)]
    return cases + [{**base, "seed": 960, "scale": _DS, "seqlens": [0, 0], "k_rows": 0}]  # mha_fwd launches nothing


def _tag(device: str) -> str:
    return "h200" if "H200" in device else "h100" if "H100" in device else "gpu"


def _chain(out_dir: str, vllm_root: str, bundle: str, tag: str) -> None:
    import torch

    sys.path.insert(0, bundle)
    from build_merge import build_vllm

    from amla_sim.algorithms.deployed.vllm.mla_prefill import chunk_rows, plan_context_chunks
    from amla_sim.crosscheck.prefill_chain import CHAIN_CASES, chain_inputs
    from amla_sim.gpu.adapters.fa3 import load_shipped_fa3, run_vllm_prefill_chain

    fa3, merge = load_shipped_fa3(vllm_root), build_vllm()
    arrays, recipes = {}, []
    for i, case in enumerate(CHAIN_CASES):
        inputs, crc = chain_inputs(case)
        chunks = []
        for ch in plan_context_chunks(case["context_lens"], case["workspace"], block_size=case["block_size"]):
            rows, ctx, merged = chunk_rows(ch, case["qlens"], case["context_lens"])
            chunks.append((rows, ctx, merged, case["qlens"][ch.request_start:ch.request_end], list(ch.seq_lens)))
        runs = [run_vllm_prefill_chain(fa3, merge, *inputs, case, chunks)[:, :case["keep_heads"]].copy()
                for _ in range(2)]
        arrays[f"c{i}_out"] = runs[0]
        recipes.append({**case, "input_crc": crc, "repeat_identical": bool(np.array_equal(*runs))})
        print(f"chain case {i}: done", flush=True)
    meta = {"kernel": "vllm-prefill-chain", "vllm": "0.33.0", "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cases": recipes}
    atomic_savez(os.path.join(out_dir, f"vllm_prefill_chain_{tag}.npz"), meta=np.array(json.dumps(meta)), **arrays)


def _option(args: list[str], flag: str, default: str | None) -> str | None:
    if flag not in args:
        return default
    i = args.index(flag)
    value = args[i + 1]
    del args[i:i + 2]
    return value


#: a v wider than q at q <= 64: FA3's 64 / 256 kernel (128 x 96 tiles, P V from registers, no intra-warpgroup
#: overlap) and its 64 / 512 kernel (64 x 64 tiles, v's columns over two warpgroups), padded calls among them, splits
WIDE_CASES = [
    _pad(64, 256, 16, 16, (300, 200), (2000, 0), False, "bf16", 381, 0),
    _pad(64, 256, 8, 2, (150, 40), (150, 40), True, "bf16", 382, 0),
    _pad(64, 512, 16, 16, (300,), (1500,), False, "bf16", 383, 0),
    _pad(64, 512, 4, 2, (100, 57), (100, 57), True, "fp16", 384, 0),
    _pad(48, 200, 8, 8, (40,), (4000,), False, "bf16", 385, 0),
    _pad(64, 320, 16, 16, (20,), (3000,), False, "bf16", 386, 0),
    _pad(64, 512, 8, 8, (200,), (1500,), False, "bf16", 387, 1),
    _pad(32, 96, 8, 8, (100, 30), (100, 30), True, "fp16", 388, 0),
]

#: an FP8 v wider than q at q <= 64: FP8 has only the 64 / 64 kernel there, which reads v's first 64 columns and
#: writes the output's first 64 (the rest as the buffer held them): causal and context chunks, grouped heads, a
#: padded q, one warpgroup
WIDE_FP8_CASES = [
    _pad(64, 128, 16, 16, (300, 200), (2000, 0), False, "e4m3", 421, 0),
    _pad(64, 256, 8, 2, (150, 40), (150, 40), True, "e4m3", 422, 0),
    _pad(48, 96, 8, 8, (40,), (4000,), False, "e4m3", 423, 0),
    _pad(64, 192, 16, 16, (20,), (3000,), False, "e4m3", 424, 0),
]


def _small() -> list[dict]:
    """The scale template and two other calls with values near FP32's subnormal range (``capture_limits.py``'s
    :data:`SMALL_DISTS`)."""
    base = KERNELS["fa3-prefill"].scale_template()
    return [{**base, "seed": 1400 + j, "dist": dist, "scale": 0.1352} for j, dist in enumerate(SMALL_DISTS)] + [
        {**c, "seed": 1402, "dist": "normal:1e-36"} for c in (WIDE_CASES[2], HDX_CASES[1])]


def _cap(d, H, Hk, ql, kl, causal, fmt, seed, ns, softcap=0.0, window=(-1, -1)):
    return {**_hd128(H, Hk, ql, kl, causal, fmt, seed, ns), "scale": d ** -0.5, "head_dim": d, "softcap": softcap,
            "window": list(window), "keep_heads": H // Hk}


#: ``softcap`` (``tanh(S softmax_scale / softcap)`` times softcap, MUFU.TANH) and local windows (``window_size``),
#: which vLLM's FlashAttention backend passes for models that have them (Gemma-2: head dim 256, cap 50, windows of
#: 4,096): causal and context-chunk calls, splits, grouped heads, FP8, the MLA prefill's 192 / 128
CAP_CASES = [
    _cap(256, 8, 4, (300, 100), (300, 100), True, "bf16", 391, 0, softcap=50.0),
    _cap(128, 8, 8, (40,), (3000,), False, "bf16", 392, 0, softcap=30.0),
    _cap(192, 8, 8, (200,), (200,), True, "bf16", 393, 0, softcap=20.0),
    _cap(128, 8, 8, (257, 100), (257, 100), True, "e4m3", 394, 0, softcap=50.0),
    _cap(128, 8, 8, (300,), (300,), True, "bf16", 395, 0, window=(128, 0)),
    _cap(64, 8, 8, (200,), (1200,), False, "bf16", 396, 0, window=(256, 256)),
    _cap(128, 8, 8, (30,), (3000,), False, "fp16", 397, 0, window=(1000, -1)),
    _cap(256, 8, 4, (400,), (400,), True, "bf16", 398, 0, softcap=50.0, window=(100, 0)),
    _cap(96, 8, 8, (300,), (300,), False, "bf16", 399, 0, softcap=5.0, window=(50, 20)),
]


#: local windows alone: splits over a long window, grouped heads, the MLA prefill's 192 / 128, FP8 at 256 (64-key
#: blocks), one query, a non-causal call whose window (-1, 0) makes it causal, a window of one key
WINDOW_CASES = [c for c in CAP_CASES if not c["softcap"]] + [
    _cap(128, 4, 4, (20,), (8000,), False, "bf16", 401, 0, window=(4000, 10)),
    _cap(192, 16, 16, (500, 200), (500, 200), True, "bf16", 402, 0, window=(300, 0)),
    _cap(128, 16, 4, (300, 120), (300, 120), True, "bf16", 403, 0, window=(64, 0)),
    _cap(256, 8, 8, (200,), (600,), False, "e4m3", 404, 0, window=(100, 100)),
    _cap(96, 8, 8, (1,), (500,), True, "bf16", 405, 0, window=(50, -1)),
    _cap(64, 8, 8, (300,), (300,), False, "bf16", 406, 0, window=(-1, 0)),
    _cap(128, 8, 8, (100, 50), (2000, 3000), False, "bf16", 407, 0, window=(0, 0)),
    _cap(64, 8, 2, (40,), (5000,), False, "bf16", 408, 0, window=(2000, 40)),
]


#: head dim 128 through SGLang's build as its ``fa3`` backend calls it (``num_splits`` 1, BF16): the cases of
#: :data:`HD128_CASES` but FP8, and a non-causal one (128 x 176 tiles there, 128 x 160 in vLLM's fork)
SGL_HD128_CASES = [{**c, "num_splits": 1, "format": "bf16"} for c in HD128_CASES if c["format"] != "e4m3"] + [
    _hd128(8, 8, (200, 100), (3000, 700), False, "bf16", 338, 1)]


def _sgl(c: dict) -> dict:
    return {**c, "num_splits": 1, "build": "sglang"}


#: SGLang's build at the head dims of MHA models (64, 96, 128, 256) as its ``fa3`` backend calls it (``num_splits``
#: 1), BF16 and E4M3: where its tiles part from the fork's (64's local 192-key blocks with overlap, one warpgroup in a
#: window, FP8's one-level tiles: 192 x 160, 64 x 128, 192 x 128, 128 x 224, 64 x 96, 128 x 128), local windows
#: (whose unmasked blocks it bounds by the m-block's keys), grouped heads, causal and context chunks
SGL_MHA_CASES = [_sgl(c) for c in (
    _hdx(64, 16, 4, (700, 300), (700, 300), True, "bf16", 501, 1),
    _hdx(64, 8, 8, (300, 200), (2000, 0), False, "bf16", 502, 1),
    _hdx(64, 8, 8, (20,), (3000,), False, "bf16", 503, 1),  # one warpgroup
    _cap(64, 8, 8, (500,), (500,), True, "bf16", 504, 1, window=(100, 0)),
    _cap(64, 4, 4, (30,), (2000,), False, "bf16", 505, 1, window=(300, 10)),  # one warpgroup in a window
    _hdx(96, 16, 16, (500,), (500,), True, "bf16", 506, 1),
    _cap(96, 8, 2, (300, 200), (300, 200), True, "bf16", 507, 1, window=(64, 0)),
    _cap(128, 8, 8, (20,), (3000,), False, "bf16", 508, 1, window=(500, 0)),
    _cap(128, 32, 8, (300,), (300,), True, "bf16", 509, 1, window=(128, 0)),
    _cap(128, 8, 8, (200, 100), (3000, 700), False, "bf16", 510, 1, window=(1000, 100)),
    _hdx(256, 8, 8, (600, 100), (600, 100), True, "bf16", 511, 1),
    _cap(256, 8, 4, (400,), (400,), True, "bf16", 512, 1, window=(100, 0)),  # Gemma-3-class
    _hdx(128, 32, 8, (1000,), (1000,), True, "bf16", 513, 1),
    _cap(128, 8, 8, (500, 200), (500, 200), True, "bf16", 514, 1, window=(300, 0)),  # the fork's bare blocks part
    _cap(256, 8, 8, (500,), (500,), True, "bf16", 515, 1, window=(300, 0)),
    _hdx(64, 16, 16, (257, 100), (257, 100), True, "e4m3", 521, 1),
    _hdx(64, 8, 8, (30,), (2000,), False, "e4m3", 522, 1),
    _hdx(96, 16, 16, (300,), (1500,), False, "e4m3", 523, 1),
    _hdx(128, 16, 16, (257, 100, 700), (257, 100, 700), True, "e4m3", 524, 1),
    _hdx(128, 16, 16, (30,), (2000,), False, "e4m3", 525, 1),
    _hdx(128, 32, 8, (200,), (200,), True, "e4m3", 526, 1),
    _hdx(256, 8, 8, (200,), (600,), False, "e4m3", 527, 1),
    _cap(256, 8, 8, (200,), (600,), False, "e4m3", 528, 1, window=(100, 100)),
    _cap(128, 8, 8, (300,), (300,), True, "e4m3", 529, 1, window=(64, 0)),
)]


def _sglang_cases(seed: int) -> list[dict]:
    """The case table and the FP8 calls as SGLang makes them: ``num_splits`` 1 (sgl_kernel's default, never passed);
    BF16 in place of FP16 (DeepSeek's checkpoints are BF16 or FP8; the build leaves FP16 out); one KV head a query
    head, as the MHA form always has (the build leaves the grouped-head kernels out)."""
    table = KERNELS["fa3-prefill"].recipes(seed)
    fp8 = [{**c, "seed": c["seed"] + seed} for c in E4M3_CASES]
    return [{**c, "num_splits": 1, "format": "bf16" if c["format"] == "fp16" else c["format"]} for c in table + fp8
            if c["heads_k"] == c["heads"]]


def main() -> None:
    args = sys.argv[1:]
    seed = int(_option(args, "--seed", "1000"))
    jobs_all = ("table,seed,e4m3,e4m3-seed,edges,tiny,descales,small,wide,wide-seed,wide-fp8,caps,caps-seed,window,"
                "window-seed,"
                "sglang-hd128,sglang-mha,sglang-mha-seed,scales,hd128,hdx,hdx-seed,pad,pad-seed,chain,sglang")
    only = set(_option(args, "--only", jobs_all).split(","))
    sgl = _option(args, "--sgl", None)
    out_dir, vllm_root = args[0], args[1]
    bundle = args[2] if len(args) > 2 else None
    import torch

    tag = _tag(torch.cuda.get_device_name())
    spec = KERNELS["fa3-prefill"]
    jobs = [("table", f"fa3_prefill_{tag}.npz", {}), ("seed", f"fa3_prefill_seed{seed}_{tag}.npz", {"seed": seed}),
            ("e4m3", f"fa3_prefill_e4m3_{tag}.npz", {"cases": E4M3_CASES}),
            ("e4m3-seed", f"fa3_prefill_e4m3_seed{seed}_{tag}.npz",
             {"cases": [{**c, "seed": c["seed"] + seed} for c in E4M3_CASES]}),
            ("edges", f"edges_fa3_prefill_{tag}.npz", {"cases": _edges()}),
            ("tiny", f"tiny_fa3_prefill_{tag}.npz", {"cases": _tiny()}),
            ("descales", f"descale_fa3_prefill_{tag}.npz", {"cases": _descales()}),
            ("small", f"small_fa3_prefill_{tag}.npz", {"cases": _small()}),
            ("wide", f"fa3_prefill_wide_{tag}.npz", {"cases": WIDE_CASES}),
            ("caps", f"fa3_prefill_caps_{tag}.npz", {"cases": CAP_CASES}),
            ("wide-fp8", f"fa3_prefill_wide_fp8_{tag}.npz",
             {"cases": WIDE_FP8_CASES + [{**c, "seed": c["seed"] + seed} for c in WIDE_FP8_CASES]}),
            ("caps-seed", f"fa3_prefill_caps_seed{seed}_{tag}.npz",
             {"cases": [{**c, "seed": c["seed"] + seed} for c in CAP_CASES]}),
            ("window", f"fa3_prefill_window_{tag}.npz", {"cases": WINDOW_CASES}),
            ("window-seed", f"fa3_prefill_window_seed{seed}_{tag}.npz",
             {"cases": [{**c, "seed": c["seed"] + seed} for c in WINDOW_CASES]}),
            ("wide-seed", f"fa3_prefill_wide_seed{seed}_{tag}.npz",
             {"cases": [{**c, "seed": c["seed"] + seed} for c in WIDE_CASES]}),
            ("hd128", f"fa3_prefill_hd128_{tag}.npz", {"cases": HD128_CASES}),
            ("hdx", f"fa3_prefill_hdx_{tag}.npz", {"cases": HDX_CASES}),
            ("hdx-seed", f"fa3_prefill_hdx_seed{seed}_{tag}.npz",
             {"cases": [{**c, "seed": c["seed"] + seed} for c in HDX_CASES]}),
            ("pad", f"fa3_prefill_pad_{tag}.npz", {"cases": PAD_CASES}),
            ("pad-seed", f"fa3_prefill_pad_seed{seed}_{tag}.npz",
             {"cases": [{**c, "seed": c["seed"] + seed} for c in PAD_CASES]}),
            ("scales", "scales_fa3_prefill.npz", {"scales": 20})]
    if sgl:
        jobs.append(("sglang", f"fa3_prefill_sglang_{tag}.npz",
                     {"cases": _sglang_cases(seed - 1000), "build": "sglang", "source": sgl}))
        jobs.append(("sglang-hd128", f"fa3_prefill_sglang_hd128_{tag}.npz",
                     {"cases": SGL_HD128_CASES, "build": "sglang", "source": sgl}))
        jobs.append(("sglang-mha", f"fa3_prefill_sglang_mha_{tag}.npz",
                     {"cases": SGL_MHA_CASES, "build": "sglang", "source": sgl}))
        jobs.append(("sglang-mha-seed", f"fa3_prefill_sglang_mha_seed{seed}_{tag}.npz",
                     {"cases": [{**c, "seed": c["seed"] + seed} for c in SGL_MHA_CASES], "build": "sglang",
                      "source": sgl}))
    for job, name, kw in jobs:
        if job not in only:
            continue
        t0 = time.time()
        try:
            capture(spec.name, os.path.join(out_dir, name), **{"source": vllm_root, "build": "vllm", **kw})
            print(f"{name}: {time.time() - t0:.1f} s", flush=True)
        except Exception:
            traceback.print_exc()
    if bundle and "chain" in only:
        try:
            _chain(out_dir, vllm_root, bundle, tag)
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
