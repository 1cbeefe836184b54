"""Device captures for the third-party kernels and the units they use. Runs on an H100/H200.

    python scripts/capture_thirdparty.py OUT [--sglang FILE] [--flashmla DIR] [--etap DIR] [--seed N]
                                         [--steps lg2,nan,sglang,flashmla,etap,sparse]

lg2:      MUFU.LG2 on every FP32 significand in [1, 2) (delta-coded), and tl.log / tl.log2 / lg2.approx(.ftz) on
          random and edge inputs over every binade; the PTX that tl.log and tl.log2 lower to.
nan:      tl.dot (bf16; M = 16 takes mma.sync, M = 64 wgmma) with NaN and Inf operands: the NaN bits written.
sglang:   SGLang's Triton MLA decode (the grouped stage 1 + stage 2 path, run from FILE, the kernel module of the
          sglang 0.5.23 wheel: amla_sim.gpu.adapters.sglang) over amla_sim.sglang_cases.SGLANG_CASES: stage 1's partial
          outputs and LSEs and the output (amla_sim.crosscheck.deployed.capture).
flashmla: FlashMLA's sm90 dense decode, compiled from the FlashMLA checkout DIR; out, lse and the split schedule.
etap:     FlashMLA-ETAP (the ETAP paper's kernel), compiled from its checkout DIR, over amla_sim.flashmla_cases.ETAP_CASES
          (seeds + N): out, lse, the tile-scheduler metadata and split counts (etap.npz, or etap_seedN.npz).
sparse:   FlashMLA's sm90 sparse FP8 decode, compiled from the FlashMLA checkout (--flashmla), over
          amla_sim.flashmla_cases.SPARSE_FP8_CASES (seeds + N), run three times (runs_identical: whether the three
          agree): sparse_fp8.npz (or sparse_fp8_seedN.npz); and FlashMLA's own cache quantizer (tests/quant.py)
          on the GPU over amla_sim.flashmla_cases.QUANT_CASES: flashmla_fp8_quant.npz.
ptx.txt:  the PTX of every Triton kernel compiled in the run (how tl.log, tl.exp and the FMAs lower).

Every case records its inputs' CRC (amla_sim.crosscheck.files.input_crc), so the replay proves it rebuilt them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from amla_sim.algorithms.deployed.flashmla import FLASHMLA_COMMIT
from amla_sim.crosscheck import flashmla as flashmla_cases
from amla_sim.crosscheck import sglang as sglang_cases
from amla_sim.crosscheck.deployed import capture

# --- lg2 --------------------------------------------------------------------------------------------------


@triton.jit
def _log_kernel(X, Y_LOG, Y_LOG2, Y_RAW, Y_FTZ, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + offs, mask=m, other=1.0)
    tl.store(Y_LOG + offs, tl.log(x), mask=m)
    tl.store(Y_LOG2 + offs, tl.log2(x), mask=m)
    raw = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    ftz = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                    pack=1)
    tl.store(Y_RAW + offs, raw, mask=m)
    tl.store(Y_FTZ + offs, ftz, mask=m)


def _run_log(x: np.ndarray) -> dict[str, np.ndarray]:
    xs = torch.from_numpy(x.view(np.float32).copy()).cuda()
    outs = [torch.empty_like(xs) for _ in range(4)]
    block = 1024
    _log_kernel[(triton.cdiv(xs.numel(), block),)](xs, *outs, xs.numel(), BLOCK=block)
    torch.cuda.synchronize()
    names = ("log", "log2", "raw", "ftz")
    return {n: o.cpu().numpy().view(np.uint32) for n, o in zip(names, outs)}


def lg2_step(out: Path) -> None:
    frac = np.arange(1 << 23, dtype=np.uint32)
    one = (np.uint32(127 << 23) | frac)
    res = _run_log(one.view(np.float32))
    raw = res["raw"].astype(np.int64)
    half = _run_log((np.uint32(126 << 23) | frac).view(np.float32))["raw"].astype(np.int64)  # [0.5, 1)
    rng = np.random.default_rng(12)
    # random inputs over every binade and sign, subnormals, and edges
    bits = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    pos = rng.integers(1, 0x7F800000, 1 << 18, dtype=np.uint64).astype(np.uint32)
    edges = []
    for e in range(0, 256):
        for f in (0, 1, 2, 3, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFD, 0x7FFFFE, 0x7FFFFF):
            edges.append((e << 23) | f)
    near_one = np.concatenate([np.arange(0x3F7F0000, 0x3F800000), np.arange(0x3F800000, 0x3F810000)]).astype(np.uint32)
    specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001,
                         0x007FFFFF, 0x00800000, 0xBF800000], np.uint32)
    x = np.concatenate([bits, pos, np.array(edges, np.uint32), near_one, specials])
    rand = _run_log(x.view(np.float32))
    # other binades of every 64th significand: e = -126..127 would be too many; take a spread of exponents
    exps = np.array([-126, -125, -64, -24, -2, -1, 1, 2, 3, 23, 24, 64, 126, 127])
    sub = frac[::512]
    xb = ((exps[:, None] + 127).astype(np.uint32) << 23 | sub[None, :]).ravel()
    binades = _run_log(xb.view(np.float32))
    meta = np.array(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                "torch": torch.__version__}))
    np.savez_compressed(out / "lg2_table.npz", table_first=raw[:1], table_delta=np.diff(raw).astype(np.int32),
                        half_first=half[:1], half_delta=np.diff(half).astype(np.int32),
                        log2_minus_raw=(res["log2"].astype(np.int64) - raw).astype(np.int32),
                        ftz_minus_raw=(res["ftz"].astype(np.int64) - raw).astype(np.int32),
                        log_every16=res["log"][::16], meta=meta)
    np.savez_compressed(out / "lg2_inputs.npz", x=x, **{f"x_{k}": v for k, v in rand.items()},
                        xb=xb, **{f"xb_{k}": v for k, v in binades.items()}, meta=meta)
    print("lg2: table of", raw.size, "significands;", x.size, "random/edge inputs;", xb.size, "binade inputs")


# --- NaN from the tensor cores ---------------------------------------------------------------------------


@triton.jit
def _dot_kernel(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(A + rm[:, None] * K + rk[None, :])
    b = tl.load(B + rk[:, None] * N + rn[None, :])
    tl.store(C + rm[:, None] * N + rn[None, :], tl.dot(a, b))


def nan_step(out: Path) -> None:
    rng = np.random.default_rng(5)
    rows = {}
    for M in (16, 64):
        N, K = 32, 64
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((K, N)).astype(np.float32)
        nan_bits = np.array([0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FA5], np.uint16)
        av = torch.tensor(a).bfloat16().view(torch.int16).numpy().view(np.uint16).copy()
        bv = torch.tensor(b).bfloat16().view(torch.int16).numpy().view(np.uint16).copy()
        for i in range(M // 2):  # NaNs of several payloads and signs in the first half of the rows
            av[i, rng.integers(0, K)] = nan_bits[i % 5]
        bv[0, :] = bv[1, :] = 0x3F80  # 1.0: row M-1 is +Inf + finite, row M-2 is +Inf - Inf
        av[M - 1, 0] = 0x7F80
        av[M - 2, 0], av[M - 2, 1] = 0x7F80, 0xFF80
        A = torch.from_numpy(av.view(np.int16)).view(torch.bfloat16).cuda()
        B = torch.from_numpy(bv.view(np.int16)).view(torch.bfloat16).cuda()
        C = torch.empty((M, N), dtype=torch.float32, device="cuda")
        k = _dot_kernel[(1,)](A, B, C, M=M, N=N, K=K)
        torch.cuda.synchronize()
        rows[f"a{M}"], rows[f"b{M}"] = av, bv
        rows[f"c{M}"] = C.cpu().numpy().view(np.uint32)
        ptx = k.asm["ptx"]
        rows[f"instr{M}"] = np.array("wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "?"))
    np.savez_compressed(out / "nan_dot.npz", **rows)
    print("nan: instructions", rows["instr16"], rows["instr64"])


# --- SGLang and FlashMLA ------------------------------------------------------------------------------------


def sglang_step(out: Path, path: str) -> None:
    capture("sglang-triton", out / "sglang.npz", source=path)
    print("sglang:", len(sglang_cases.SGLANG_CASES), "cases")


def flashmla_step(out: Path, folder: str) -> None:
    capture("flashmla", out / "flashmla.npz", source=folder)
    print("flashmla:", len(flashmla_cases.FLASHMLA_CASES), "cases")


def etap_step(out: Path, folder: str, seed: int) -> None:
    name = "etap.npz" if seed == 0 else f"etap_seed{seed}.npz"
    capture("flashmla-etap", out / name, source=folder, seed=seed)
    print("etap:", len(flashmla_cases.ETAP_CASES), "cases ->", name)


def sparse_step(out: Path, folder: str, seed: int) -> None:
    from amla_sim._files import atomic_savez
    from amla_sim.gpu.adapters import flashmla as adapters

    name = "sparse_fp8.npz" if seed == 0 else f"sparse_fp8_seed{seed}.npz"
    runs = [out / name] + [out / f"rerun{k}_{name}" for k in (1, 2)]
    for path in runs:
        capture("flashmla-sparse-fp8", path, source=folder, seed=seed)
    with np.load(runs[0]) as z:
        first = {k: z[k] for k in z.files if k != "meta"}
    same = dict.fromkeys(first, True)
    for path in runs[1:]:
        with np.load(path) as other:
            for k in first:
                same[k] = same[k] and np.array_equal(first[k], other[k])
        path.unlink()
    print("sparse:", len(flashmla_cases.SPARSE_FP8_CASES), "cases ->", name, "runs_identical:",
          {k: v for k, v in same.items() if not v} or "all")
    if seed == 0:
        arrays, recipes = {}, []
        for i, (layout, n, dist, case_seed, edges) in enumerate(flashmla_cases.QUANT_CASES):
            case = {"layout": layout, "pages": n, "dist": dist, "seed": case_seed, "edges": edges}
            arrays[f"q{i}"] = adapters.flashmla_quantize(folder, flashmla_cases.quant_inputs(case), layout)
            recipes.append(case)
        atomic_savez(out / "flashmla_fp8_quant.npz", meta=np.array(json.dumps({
            "flashmla_commit": FLASHMLA_COMMIT, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cases": recipes})), **arrays)


def collect_ptx(cache: Path, out: Path) -> None:
    """Every PTX file Triton compiled in this run, in one text file."""
    with open(out / "ptx.txt", "w") as f:
        for path in sorted(cache.rglob("*.ptx")):
            f.write(f"// ===== {path.name}\n{path.read_text()}\n")


def main() -> None:
    cache = Path(os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/amla-capture-triton-cache"))
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--sglang", default=".third_party/sglang/decode_attention.py")
    p.add_argument("--flashmla", default=".third_party/FlashMLA", help="a FlashMLA checkout")
    p.add_argument("--etap", default=".third_party/FlashMLA-ETAP", help="a FlashMLA-ETAP checkout")
    p.add_argument("--seed", type=int, default=0, help="added to every case's seed (etap, sparse)")
    p.add_argument("--steps", default="lg2,nan,sglang,flashmla,etap")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for step in a.steps.split(","):
        t0 = time.time()
        try:
            {"lg2": lambda: lg2_step(out), "nan": lambda: nan_step(out), "sglang": lambda: sglang_step(out, a.sglang),
             "flashmla": lambda: flashmla_step(out, a.flashmla), "etap": lambda: etap_step(out, a.etap, a.seed),
             "sparse": lambda: sparse_step(out, a.flashmla, a.seed)}[step]()
        except Exception as e:  # one step's failure must not lose the others' captures
            import traceback

            traceback.print_exc()
            print(f"step {step} failed: {e}")
        print(f"step {step}: {time.time() - t0:.1f} s", flush=True)
    collect_ptx(cache, out)


if __name__ == "__main__":
    main()
