"""The cross-check of the kernels people deploy, for every kernel that :data:`KERNELS` lists: :func:`capture` runs a
kernel's case table on a GPU and writes a capture; :func:`replay_deployed` simulates every case on the CPU and
compares bit for bit.

A kernel comes in as a :class:`.kernel.DeployedKernel` made by its family's case table module
(:mod:`~amla_sim.crosscheck.flashmla`, :mod:`~amla_sim.crosscheck.sglang`, :mod:`~amla_sim.crosscheck.fa3`,
:mod:`~amla_sim.crosscheck.vllm`) and one
entry in :data:`KERNELS`; nothing here knows one kernel from another.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .._files import atomic_savez
from ..comparison import compare
from .fa3 import FA3_MLA
from .files import CaptureError
from .flashmla import FLASHMLA, FLASHMLA_ETAP, FLASHMLA_SPARSE_FP8, FLASHMLA_SPARSE_PREFILL
from .kernel import DeployedKernel, check_recipe
from .report import ReplayReport
from .sglang import SGLANG
from .vllm import FLASHMLA_DENSE_FP8, VLLM_TRITON_MLA

__all__ = ["KERNELS", "kernel_of", "replay_deployed", "capture"]

#: The deployed kernels the cross-check covers, by the name ``crosscheck --kernel`` takes.
KERNELS: dict[str, DeployedKernel] = {k.name: k for k in (SGLANG, FLASHMLA, FLASHMLA_ETAP, FLASHMLA_SPARSE_FP8,
                                                          FA3_MLA, FLASHMLA_DENSE_FP8, VLLM_TRITON_MLA,
                                                          FLASHMLA_SPARSE_PREFILL)}
_LEGACY = {"sglang": "sglang-triton", "flashmla_commit": "flashmla"}  # captures written before meta named a kernel


def kernel_of(meta: dict) -> DeployedKernel:
    """The kernel a capture's meta names."""
    name = meta.get("kernel") or next((k for key, k in _LEGACY.items() if key in meta), None)
    if name not in KERNELS:
        raise CaptureError(f"replay: the capture names no kernel of {tuple(KERNELS)}")
    return KERNELS[name]


def replay_deployed(path: str | Path, meta: dict, arrays: dict[str, np.ndarray], *,
                    cases: list[int] | None = None) -> ReplayReport:
    """Simulate every case (or those listed) of a deployed kernel's capture (`meta` and `arrays` as
    :func:`.files.read_capture` read them); per case and stage, the bit-exact fraction."""
    spec = kernel_of(meta)
    if not isinstance(meta.get("cases"), list) or not meta["cases"]:
        raise CaptureError(f"replay: {path}: 'meta' has no list of cases")
    todo = range(len(meta["cases"])) if cases is None else cases
    for i in todo:
        if not 0 <= i < len(meta["cases"]):
            raise ValueError(f"cases: {path} has cases 0..{len(meta['cases']) - 1}, not {i}")
        check_recipe(spec, f"replay: {path}", i, meta["cases"][i], arrays)
    rows, labels = [], []
    for i in todo:
        case = meta["cases"][i]
        t0 = time.perf_counter()
        stages = spec.stages(case, i, arrays)
        seconds = round(time.perf_counter() - t0, 2)
        rows.append(compare({n: d for n, d, _ in stages}, {n: s for n, _, s in stages}, meta={
            "case": i, "batch": case["batch"], "sq": case.get("sq", 1), "heads": case["heads"],
            "seqlens": case["seqlens"], "num_kv_splits": case.get("num_kv_splits"), "dist": case["dist"],
            "format": case.get("format") or case.get("layout"), "seconds": seconds}))
        splits = f" splits={case['num_kv_splits']}" if case.get("num_kv_splits") else ""
        labels.append(f"case {i}:{spec.label(case)} b={case['batch']} s_q={case.get('sq', 1)} H={case['heads']} "
                      f"seqlens={case['seqlens']}{splits} ({seconds} s)")
    version, device = meta.get(spec.version_key), meta.get("device")
    return ReplayReport(kernel=spec.name, version=version, device=device, cases=rows, case_labels=tuple(labels),
                        title=f"{spec.name} {version or ''} on {device} against the simulator:")


def capture(kernel: str, path: str | Path, *, source: str | None = None, seed: int = 0) -> None:
    """Run `kernel`'s case table on this machine's GPU and write a capture.

    source: where the kernel is (the kernel's ``source_flag`` says what: a build folder or a kernel file).
    seed: added to every case's seed, for inputs no committed capture used."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {tuple(KERNELS)}, got {kernel!r}")
    spec = KERNELS[kernel]
    if source is None and spec.needs_source:
        raise ValueError(f"source: {spec.name} is run from {spec.source_help}; name it ({spec.source_flag})")
    import torch

    built = spec.load(source)
    arrays, recipes = {}, []
    for i, recipe in enumerate(spec.recipes(seed)):
        got, recipe = spec.run(built, i, recipe)
        arrays.update({f"c{i}_{k}": v for k, v in got.items()})
        recipes.append(recipe)
    meta = {"kernel": spec.name, spec.version_key: spec.version, **spec.launch,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": recipes}
    atomic_savez(path, meta=np.array(json.dumps(meta)), **arrays)
