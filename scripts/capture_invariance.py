"""A request alone and in other launches, on an H100/H200: the device check of amla_sim.invariance.

    python scripts/capture_invariance.py OUT [--flashmla DIR] [--sparse DIR] [--sglang DIR] [--kernels a,b,c]

For each kernel of amla_sim.invariance.checks.DEVICE_CHECKS, the request is drawn from its recipe and run in each
launch of ``device_launches(kernel)`` (alone, with batchmates of its length, among batchmates of other lengths,
with more query rows, with a split count handed in), the whole launch on the GPU, twice. Kept per launch: the
request's row of interest (its last query row), out as BF16 bits and LSE as FP32 bits, whether the two runs gave
the same bytes, and FlashMLA's cumulative split counts. For SGLang, its backend's own ``get_num_kv_splits_triton``
(``sglang/kernels/ops/attention/metadata.py`` of the 0.5.23 wheel, DIR beside decode_attention.py) is also run
on every launch and on the 2,000 random batches of ``scheduler_batches()`` and 2,000 of near-equal lengths
(``scheduler_batches(near=True)``), its split counts kept. Writes OUT/invariance.npz and
OUT/invariance.json.

    python scripts/capture_invariance.py OUT --predict

runs no GPU: the models' predictions for the same launches (per launch the request's splits, how many out and LSE
elements differ from the request alone, the CRC-32 of the predicted bits), OUT/invariance_predicted.json, written
before the device run and committed with it.

DIR: FlashMLA's build folder (build_flashmla.py), the sparse decode's (build_sparse_fp8.py, ../flashmla beside
it), and a folder holding the wheel's decode_attention.py and metadata.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

from amla_sim.invariance import get_batch_kernel, invariance
from amla_sim.invariance.checks import DEVICE_CHECKS, device_launches, scheduler_batches


SEED_OFFSET = 0  # --seed: a fresh check, every request and batchmate drawn anew


def _request(name: str):
    c = DEVICE_CHECKS[name]
    k = get_batch_kernel(name)
    launches = device_launches(name, SEED_OFFSET)
    req = k.request(dist=c["dist"], seed=c["seed"] + SEED_OFFSET, length=c["length"], heads=c["heads"],
                    s_q=max(L.s_q for L in launches), **c["options"])
    return k, req, launches


def _twice(fn):
    a = fn()
    b = fn()
    same = all(np.array_equal(a[x], b[x]) for x in ("out", "lse") if x in a)
    return a, same


def flashmla_step(folder: str, arrays: dict, info: dict) -> None:
    from amla_sim.gpu.adapters.flashmla import load_flashmla, run_flashmla

    mod = load_flashmla(folder)
    k, req, launches = _request("flashmla")
    for i, L in enumerate(launches):
        bt = k.batch(req, L)
        got, same = _twice(lambda: run_flashmla(mod, bt["q"].view(np.uint16), bt["kv"].view(np.uint16),
                                                bt["seqlens"], 576**-0.5))
        p = L.position
        arrays[f"flashmla_l{i}_out"] = got["out"][p, -1]
        arrays[f"flashmla_l{i}_lse"] = got["lse"][p, :, -1]
        arrays[f"flashmla_l{i}_num_splits"] = got["num_splits"]
        info.setdefault("flashmla", []).append({**L.to_dict(), "runs_identical": same})


def sparse_step(folder: str, arrays: dict, info: dict) -> None:
    from amla_sim.gpu.adapters.flashmla import load_sparse_fp8, run_sparse_fp8

    mod = load_sparse_fp8(folder)
    k, req, launches = _request("flashmla-sparse-fp8")
    for i, L in enumerate(launches):
        bt = k.batch(req, L)
        got, same = _twice(lambda: run_sparse_fp8(mod, bt["q"], bt["kv_cache"], bt["indices"], None, None,
                                                  576**-0.5))
        p = L.position
        arrays[f"sparse_l{i}_out"] = got["out"][p, -1]
        arrays[f"sparse_l{i}_lse"] = got["lse"][p, :, -1]
        arrays[f"sparse_l{i}_num_splits"] = got["num_splits"]
        info.setdefault("flashmla-sparse-fp8", []).append({**L.to_dict(), "runs_identical": same,
                                                           "num_sms": int(got["num_sms"])})


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sglang_step(folder: str, arrays: dict, info: dict) -> None:
    import torch

    from amla_sim.gpu.adapters.sglang import load_sglang, run_sglang

    mod = load_sglang(Path(folder) / "decode_attention.py")
    meta = _load(Path(folder) / "metadata.py", "sglang_metadata")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def backend_splits(lens, heads: int, max_splits: int) -> np.ndarray:
        out = torch.empty(len(lens), dtype=torch.int32, device="cuda")
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        seq = 256 if len(lens) < 256 else 1 << (len(lens) - 1).bit_length()
        meta.get_num_kv_splits_triton[(1,)](out, sl, len(lens), 1, heads, 1, max_splits, sms, MAX_NUM_SEQ=seq)
        torch.cuda.synchronize()
        return out.cpu().numpy()

    k, req, launches = _request("sglang-triton")
    for i, L in enumerate(launches):
        bt = k.batch(req, L)
        splits = np.array(bt["num_kv_splits"])
        if L.num_kv_splits is None:
            arrays[f"sglang_l{i}_backend_splits"] = backend_splits(list(L.lengths), req.heads, bt["max_kv_splits"])
            splits = arrays[f"sglang_l{i}_backend_splits"]  # the backend's own choice drives the kernel
        got, same = _twice(lambda: run_sglang(mod, bt["q"].view(np.uint16), bt["kv"].view(np.uint16), bt["seqlens"],
                                              splits, bt["max_kv_splits"], 576**-0.5))
        arrays[f"sglang_l{i}_out"] = got["o"][L.position]
        info.setdefault("sglang-triton", []).append({**L.to_dict(), "runs_identical": same, "num_sms": sms})
    for key, near in (("sglang_sched_splits", False), ("sglang_sched_near_splits", True)):
        batches = scheduler_batches(near=near)
        arrays[key] = np.concatenate([backend_splits(lens.tolist(), h, top)
                                      for lens, h, top in batches]).astype(np.int32)
    info["sglang_sched_sms"] = sms


def predict(out: Path) -> None:
    import zlib

    got = {}
    for name, c in DEVICE_CHECKS.items():
        rep = invariance(name, launches=device_launches(name, SEED_OFFSET), length=c["length"], heads=c["heads"],
                         dist=c["dist"], seed=c["seed"] + SEED_OFFSET, **c["options"])
        k, req, launches = _request(name)
        rows = []
        for L, r in zip(launches, rep.results):
            bits = k.run(req, L, r.plan)
            rows.append({"label": L.label, "splits": len(r.plan), "changed": r.changed,
                         "crc32": {s: zlib.crc32(np.ascontiguousarray(v).tobytes()) for s, v in bits.items()}})
        got[name] = rows
        print(rep.format(), flush=True)
    (out / "invariance_predicted.json").write_text(json.dumps(got, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--flashmla", default=".third_party/flashmla")
    p.add_argument("--sparse", default=".third_party/flashmla-sparse-fp8")
    p.add_argument("--sglang", default=".third_party/sglang")
    p.add_argument("--kernels", default="flashmla,flashmla-sparse-fp8,sglang-triton")
    p.add_argument("--predict", action="store_true", help="the models' predictions, on the CPU")
    p.add_argument("--seed", type=int, default=0, help="added to every check's seed: a fresh check")
    a = p.parse_args()
    global SEED_OFFSET
    SEED_OFFSET = a.seed
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.predict:
        predict(out)
        return
    import torch

    arrays: dict[str, np.ndarray] = {}
    info: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    steps = {"flashmla": lambda: flashmla_step(a.flashmla, arrays, info),
             "flashmla-sparse-fp8": lambda: sparse_step(a.sparse, arrays, info),
             "sglang-triton": lambda: sglang_step(a.sglang, arrays, info)}
    for name in a.kernels.split(","):
        t = time.time()
        try:
            steps[name]()
        except Exception as e:  # keep what the other kernels gave
            info[f"{name}_error"] = repr(e)
            print(f"{name}: failed: {e!r}", flush=True)
        print(f"{name}: {time.time() - t:.1f} s", flush=True)
        np.savez_compressed(out / "invariance.npz", **arrays)
        (out / "invariance.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
