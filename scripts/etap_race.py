"""FlashMLA-ETAP's epilogue race, measured on an H100/H200 (issue 20).

    python scripts/etap_race.py OUT --etap DIR [--seeds 0,1000] [--repeats 30] [--patched]

The kernel's ``store`` writes the accumulator to shared memory (``sOaccumTranspose``) and every thread then reads
other threads' entries back to transpose them, with no barrier between the write and the read
(``flash_fwd_mla_kernel.h``, ``store``: ``cute::copy(...)`` then the ``sOaccum(j, i) = sOaccumTranspose(i, j)``
loop). A thread that reads before the owner wrote takes whatever the shared memory held: the previous tile's
output, or keys. This script runs every case of ``amla_sim.thirdparty.ETAP_CASES`` (seeds + each of --seeds)
`repeats` times and records which output elements ever change between runs; with --patched it builds the same
sources with one ``__syncthreads()`` inserted between the write and the read (in the build folder only: nothing of
the kernel is kept) and records that build's outputs once, for the simulator to be compared against.
Writes OUT/etap_race[_patched].npz.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch

from amla_sim import thirdparty
from amla_sim.experiments.inputs import make_inputs
from amla_sim.gpu import thirdparty as adapters

_WRITE = "    cute::copy(smem_tiled_copy_Oaccum, taccOrOaccum, taccOsOaccum);\n"


def patched_build(folder: str):
    """The ETAP extension with a barrier between the epilogue's shared-memory write and its transposing read."""
    sys.path.insert(0, folder)
    import build_etap

    work = "/tmp/flashmla-etap-build-patched"
    os.environ["TORCH_EXTENSIONS_DIR"] = "/tmp/torch-ext-patched"  # not the unpatched build's cache
    src = os.path.join(work, "src")  # build() extracts only into an empty folder: extract and patch first
    if not os.path.isdir(os.path.join(src, "csrc")):
        os.makedirs(os.path.join(src, "csrc", "cutlass"), exist_ok=True)
        with tarfile.open(os.path.join(folder, "flashmla-etap-src.tar.xz")) as t:
            t.extractall(src)
        with tarfile.open(os.path.join(folder, "cutlass-3.9.0-include.tar.xz")) as t:
            t.extractall(os.path.join(src, "csrc", "cutlass"))
    kernel = Path(src, "csrc", "flash_fwd_mla_kernel.h")
    text = kernel.read_text()
    if "__syncthreads();  // amla-sim: the missing barrier" not in text:
        assert text.count(_WRITE) == 1, "the epilogue's write is not where commit 39e6160 has it"
        kernel.write_text(text.replace(_WRITE, _WRITE + "    __syncthreads();  // amla-sim: the missing barrier\n"))
    return build_etap.build(work)


def case_inputs(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [make_inputs(dist, batch=b, heads=H, sq=sq, context=max(seqlens), seed=case_seed + seed, fmt=fmt)
            for b, sq, H, seqlens, fmt, dist, case_seed, _ in thirdparty.ETAP_CASES]


def run_cases(mod, inputs: list[tuple[np.ndarray, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    outs = []
    for (q, kv), (_, sq, _, seqlens, fmt, _, _, scale) in zip(inputs, thirdparty.ETAP_CASES):
        outs.append(adapters.run_etap(mod, q.view(np.uint16), kv.view(np.uint16), list(seqlens),
                                      576**-0.5 if scale is None else scale, sq > 1, fmt))
    return outs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--etap", default=".third_party/flashmla-etap")
    p.add_argument("--seeds", default="0,1000")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--patched", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    mod = patched_build(a.etap) if a.patched else adapters.load_etap(a.etap)
    arrays, summary = {}, []
    for seed in seeds:
        inputs = case_inputs(seed)
        first = run_cases(mod, inputs)
        varies = [np.zeros(r["out"].shape, bool) for r in first]
        lse_varies = [np.zeros(r["lse"].shape, bool) for r in first]
        for _ in range(a.repeats - 1):
            for i, r in enumerate(run_cases(mod, inputs)):
                varies[i] |= r["out"] != first[i]["out"]
                lse_varies[i] |= r["lse"] != first[i]["lse"]
        for i, r in enumerate(first):
            arrays[f"s{seed}_c{i}_out"], arrays[f"s{seed}_c{i}_lse"] = r["out"], r["lse"]
            arrays[f"s{seed}_c{i}_varies"] = varies[i]
            summary.append({"seed": seed, "case": i, "out_elements_varying": int(varies[i].sum()),
                            "lse_elements_varying": int(lse_varies[i].sum())})
            print(summary[-1], flush=True)
    meta = {"device": torch.cuda.get_device_name(), "repeats": a.repeats, "patched": a.patched, "seeds": seeds,
            "summary": summary}
    name = "etap_race_patched.npz" if a.patched else "etap_race.npz"
    np.savez_compressed(out / name, meta=np.array(json.dumps(meta)), **arrays)


if __name__ == "__main__":
    main()
