"""FlashMLA-ETAP's two races, measured on an H100/H200.

    python scripts/etap_race.py OUT --etap DIR [--seeds 0,1000] [--repeats 30] [--patch epilogue|both]

The kernel's ``store`` writes the accumulator to shared memory (``sOaccumTranspose``) and every thread then reads
other threads' entries back to transpose them, with no barrier between the write and the read
(``flash_fwd_mla_kernel.h``, ``store``: ``cute::copy(...)`` then the ``sOaccum(j, i) = sOaccumTranspose(i, j)``
loop). A thread that reads before the owner wrote takes whatever the shared memory held: the previous tile's
output, or keys. This script runs every case of ``amla_sim.crosscheck.flashmla.ETAP_CASES`` (seeds + each of --seeds)
`repeats` times and keeps, per case, the distinct outputs and LSEs and how many runs gave each
(``s{seed}_c{case}_out{j}``, ``..._out_count``). A second race: the consumer warpgroup stores P^T to shared memory
with generic stores and only *arrives* at the named barrier before its own wgmma (and the producer's) reads it,
with no ``fence.proxy.async`` between the stores and the tensor cores' reads.

--patch builds the same sources with the missing synchronisation inserted (in a copy of the checkout: the checkout
is left as it is): ``epilogue``, one ``__syncthreads()`` between the epilogue's write and its read; ``both``,
that and, after the P^T stores, ``fence_view_async_shared()`` and a barrier of the consumer warpgroup's 128
threads. Writes OUT/etap_race[_PATCH].npz.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from amla_sim.crosscheck.flashmla import ETAP_CASES
from amla_sim.experiments.inputs import make_inputs

_WRITE = "    cute::copy(smem_tiled_copy_Oaccum, taccOrOaccum, taccOsOaccum);\n"
_P_STORE = "            cute::copy(scale_o, tScale_osScale_o);\n"
_MARK = "// amla-sim: the missing"
PATCHES = {
    "epilogue": [(_WRITE, "    __syncthreads();  " + _MARK + " barrier\n")],
    "both": [(_WRITE, "    __syncthreads();  " + _MARK + " barrier\n"),
             (_P_STORE, "            cutlass::arch::fence_view_async_shared();  " + _MARK + " proxy fence\n"
                        "            cutlass::arch::NamedBarrier::sync(128, 3);  " + _MARK
                        + " barrier of the consumers\n")],
}


def patched_build(checkout: str, patch: str):
    """The ETAP extension with the missing synchronisation of `patch` inserted after each anchor line, compiled from
    a copy of `checkout` (CUTLASS linked, not copied) under its own extension name."""
    from amla_sim.gpu.adapters.flashmla import build_etap

    work = Path(f"/tmp/flashmla-etap-{patch}")
    if not work.is_dir():
        shutil.copytree(checkout, work, ignore=shutil.ignore_patterns("cutlass", ".git"))
        (work / "csrc" / "cutlass").symlink_to(Path(checkout, "csrc", "cutlass").resolve())
    kernel = work / "csrc" / "flash_fwd_mla_kernel.h"
    text = kernel.read_text()
    if _MARK not in text:
        for anchor, insert in PATCHES[patch]:
            assert text.count(anchor) == 1, f"{anchor.strip()!r} is not where commit 39e6160 has it"
            text = text.replace(anchor, anchor + insert)
        kernel.write_text(text)
    return build_etap(work, name=f"amla_flashmla_etap_{patch}")


def case_inputs(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [make_inputs(dist, batch=b, heads=H, sq=sq, context=max(seqlens), seed=case_seed + seed, fmt=fmt)
            for b, sq, H, seqlens, fmt, dist, case_seed, _ in ETAP_CASES]


def run_cases(mod, inputs: list[tuple[np.ndarray, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    from amla_sim.gpu.adapters import flashmla as adapters

    outs = []
    for (q, kv), (_, sq, _, seqlens, fmt, _, _, scale) in zip(inputs, ETAP_CASES):
        outs.append(adapters.run_etap(mod, q.view(np.uint16), kv.view(np.uint16), list(seqlens),
                                      576**-0.5 if scale is None else scale, sq > 1, fmt))
    return outs


def pack(out: Path, sources: list[str], cases: list[int]) -> None:
    arrays, summary = {}, {}
    for source in sources:
        gpu, unpatched_path, patched_path = source.split(":")
        with np.load(unpatched_path) as u, np.load(patched_path) as f:
            meta_u, meta_f = json.loads(str(u["meta"])), json.loads(str(f["meta"]))
            assert meta_u["seeds"] == meta_f["seeds"] and meta_f["patch"] == "both" and not meta_u.get("patch")
            summary[gpu] = {"device": meta_u["device"], "repeats": meta_u["repeats"], "seeds": meta_u["seeds"],
                            "unpatched": meta_u["summary"], "patched": meta_f["summary"]}
            for seed in meta_u["seeds"]:
                for i in cases:
                    key = f"{gpu}_s{seed}_c{i}"
                    for k in ("out", "lse"):
                        assert f[f"s{seed}_c{i}_{k}_count"].tolist() == [meta_f["repeats"]]  # the fix is stable
                        fixed = f[f"s{seed}_c{i}_{k}0"]
                        arrays[f"{key}_{k}"] = fixed
                        counts = u[f"s{seed}_c{i}_{k}_count"]
                        arrays[f"{key}_{k}_count"] = counts
                        for j in range(len(counts)):  # each distinct unpatched result: where it differs, its bits
                            got = u[f"s{seed}_c{i}_{k}{j}"]
                            where = np.flatnonzero(got != fixed)
                            arrays[f"{key}_{k}{j}_at"] = where.astype(np.int32)
                            arrays[f"{key}_{k}{j}_bits"] = got.ravel()[where]
    meta = {"cases": cases, "gpus": summary, "script": "scripts/etap_race.py"}
    np.savez_compressed(out / "flashmla_etap_races.npz", meta=np.array(json.dumps(meta)), **arrays)


def pack_one_fix(out: Path, source: str, races: Path, cases: list[int]) -> None:
    """The runs of a build with only the epilogue's barrier (``--patch epilogue``): per distinct output, where it
    differs from the fixed build's bits in `races` (the file :func:`pack` wrote), and those bits."""
    gpu, path = source.split(":")
    arrays = {}
    with np.load(path) as e, np.load(races) as r:
        meta = json.loads(str(e["meta"]))
        assert meta["patch"] == "epilogue"
        for seed in meta["seeds"]:
            for i in cases:
                key = f"{gpu}_s{seed}_c{i}"
                fixed = r[f"{key}_out"]
                counts = e[f"s{seed}_c{i}_out_count"]
                assert e[f"s{seed}_c{i}_lse_count"].tolist() == [meta["repeats"]]
                assert np.array_equal(e[f"s{seed}_c{i}_lse0"], r[f"{key}_lse"])  # the LSE never races
                arrays[f"{key}_out_count"] = counts
                for j in range(len(counts)):
                    got = e[f"s{seed}_c{i}_out{j}"]
                    where = np.flatnonzero(got != fixed)
                    arrays[f"{key}_out{j}_at"] = where.astype(np.int32)
                    arrays[f"{key}_out{j}_bits"] = got.ravel()[where]
    summary = {gpu: {"device": meta["device"], "repeats": meta["repeats"], "seeds": meta["seeds"],
                     "epilogue_fixed": meta["summary"]}}
    info = {"cases": cases, "gpus": summary, "script": "scripts/etap_race.py", "patch": "epilogue"}
    np.savez_compressed(out / "flashmla_etap_races_epilogue.npz", meta=np.array(json.dumps(info)), **arrays)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--etap", default=".third_party/FlashMLA-ETAP", help="a FlashMLA-ETAP checkout")
    p.add_argument("--seeds", default="0,1000")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--patch", choices=sorted(PATCHES))
    p.add_argument("--pack", nargs="+", metavar="GPU:UNPATCHED:PATCHED")
    p.add_argument("--pack-epilogue", metavar="GPU:EPILOGUE_NPZ",
                   help="pack an --patch epilogue run against the fixed bits in OUT/flashmla_etap_races.npz")
    p.add_argument("--cases", default="4,5", help="--pack: the cases to keep (the others never varied)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.pack:
        return pack(out, a.pack, [int(c) for c in a.cases.split(",")])
    if a.pack_epilogue:
        return pack_one_fix(out, a.pack_epilogue, out / "flashmla_etap_races.npz", [int(c) for c in a.cases.split(",")])
    seeds = [int(s) for s in a.seeds.split(",")]
    import torch

    from amla_sim.gpu.adapters import flashmla as adapters

    mod = patched_build(a.etap, a.patch) if a.patch else adapters.build_etap(a.etap)
    arrays, summary = {}, []
    for seed in seeds:
        inputs = case_inputs(seed)
        seen: list[dict[str, list]] = [{"out": [], "out_count": [], "lse": [], "lse_count": []} for _ in inputs]
        for _ in range(a.repeats):
            for i, r in enumerate(run_cases(mod, inputs)):
                for k in ("out", "lse"):  # the distinct results of the runs, and how many runs gave each
                    same = [j for j, x in enumerate(seen[i][k]) if np.array_equal(x, r[k])]
                    if same:
                        seen[i][f"{k}_count"][same[0]] += 1
                    else:
                        seen[i][k].append(r[k])
                        seen[i][f"{k}_count"].append(1)
        for i, d in enumerate(seen):
            for k in ("out", "lse"):
                for j, x in enumerate(d[k]):
                    arrays[f"s{seed}_c{i}_{k}{j}"] = x
                arrays[f"s{seed}_c{i}_{k}_count"] = np.array(d[f"{k}_count"])
            varying = np.zeros(d["out"][0].shape, bool)
            for x in d["out"][1:]:
                varying |= x != d["out"][0]
            summary.append({"seed": seed, "case": i, "distinct_out": d["out_count"], "distinct_lse": d["lse_count"],
                            "out_elements_varying": int(varying.sum())})
            print(summary[-1], flush=True)
    meta = {"device": torch.cuda.get_device_name(), "repeats": a.repeats, "patch": a.patch, "seeds": seeds,
            "summary": summary}
    name = f"etap_race_{a.patch}.npz" if a.patch else "etap_race.npz"
    np.savez_compressed(out / name, meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    main()
