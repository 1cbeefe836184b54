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
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .._files import atomic_savez
from .._validate import check_int
from ..comparison import ComparisonReport, compare
from .fa3 import FA3_MLA, FA3_MLA_SPARSE, SGL_FA3_MLA, SGL_FA3_MLA_SPARSE
from .fa3_prefill import FA3_PREFILL
from .files import CaptureError, decode_recipe, encode_recipe, split_cases
from .flashinfer import FLASHINFER_MLA, FLASHINFER_MLA_SPARSE
from .flashmla import FLASHMLA, FLASHMLA_ETAP, FLASHMLA_SPARSE_FP8, FLASHMLA_SPARSE_PREFILL
from .kernel import DeployedKernel, check_recipe
from .report import ReplayReport
from .sglang import SGLANG
from .vllm import FLASHMLA_DENSE_FP8, VLLM_TRITON_MLA

__all__ = ["KERNELS", "HELD_NOT_COMPARED", "kernel_of", "replay_deployed", "capture"]

#: The deployed kernels the cross-check covers, by the name ``crosscheck --kernel`` takes.
KERNELS: dict[str, DeployedKernel] = {k.name: k for k in (SGLANG, FLASHMLA, FLASHMLA_ETAP, FLASHMLA_SPARSE_FP8,
                                                          FA3_MLA, FLASHMLA_DENSE_FP8, VLLM_TRITON_MLA, FA3_MLA_SPARSE,
                                                          FLASHMLA_SPARSE_PREFILL, SGL_FA3_MLA,
                                                          SGL_FA3_MLA_SPARSE, FLASHINFER_MLA,
                                                          FLASHINFER_MLA_SPARSE, FA3_PREFILL)}
_LEGACY = {"sglang": "sglang-triton", "flashmla_commit": "flashmla"}  # captures written before meta named a kernel


#: Arrays a kernel's captures hold per case that no stage of the replay compares (name -> dtype, why): the
#: replay reads them, checks their dtype and says they were not compared. Any other array is refused.
HELD_NOT_COMPARED: dict[str, dict[str, tuple[type, str]]] = {
    name: {k: (np.int32, "the kernel's split schedule: the test suite checks it against the model's scheduler, "
                         "a replay does not") for k in ("sched", "num_splits")}
    for name in ("flashmla", "flashmla-etap", "flashmla-sparse-fp8")}


def kernel_of(meta: dict, path: str | Path | None = None) -> DeployedKernel:
    """The kernel a capture's meta names (`path`: the capture, named in the error)."""
    name = meta.get("kernel") or next((k for key, k in _LEGACY.items() if key in meta), None)
    if not isinstance(name, str) or name not in KERNELS:
        where = "" if path is None else f" {path}:"
        got = "none" if name is None else repr(name)[:40]
        raise CaptureError(f"replay:{where} 'meta' names no kernel of {tuple(KERNELS)} (got {got})")
    return KERNELS[name]


def replay_deployed(path: str | Path, meta: dict, arrays: dict[str, np.ndarray], *,
                    cases: list[int] | None = None) -> ReplayReport:
    """Simulate every case (or those listed) of a deployed kernel's capture (`meta` and `arrays` as
    :func:`.files.read_capture` read them); per case and stage, the bit-exact fraction.

    Before any work, every case's recipe and every array of the capture are checked: an array that belongs to no
    case of the meta, or that is no array of its case, is refused by name; so is a capture of no case."""
    spec = kernel_of(meta, path)
    if isinstance(meta.get("cases"), list):
        meta = {**meta, "cases": [decode_recipe(c) for c in meta["cases"]]}
    by_case = split_cases(path, meta, arrays)
    held = {}
    for i, case in enumerate(meta["cases"]):
        held.update(_check_case(spec, path, i, case, arrays, by_case[i]))
    todo = _selection(path, len(by_case), cases)
    rows, labels = [], []
    for i in todo:
        row, label = _replay_case(spec, path, i, meta["cases"][i], arrays, by_case[i])
        rows.append(row)
        labels.append(label)
    version, device = meta.get(spec.version_key), meta.get("device")
    return ReplayReport(kernel=spec.name, version=version, device=device, cases=rows, case_labels=tuple(labels),
                        title=f"{spec.name} {version or ''} on {device} against the simulator:",
                        held_not_compared={k: v for k, v in held.items() if int(k[1:k.index("_")]) in todo},
                        not_replayed=tuple(i for i in range(len(by_case)) if i not in todo))


def _check_case(spec: DeployedKernel, path: str | Path, i: int, case: dict, arrays: dict[str, np.ndarray],
                held: dict[str, np.ndarray]) -> dict[str, str]:
    """Case `i`'s recipe and arrays against the format; the arrays it holds that no stage compares -> why."""
    where = f"replay: {path}"
    try:
        check_recipe(spec, where, i, case, arrays)
    except OverflowError as e:  # an integer of the recipe past any float
        raise CaptureError(f"{where}: case {i}: a number of its recipe is out of range ({e})") from None
    _check_record(where, i, case)
    declared, extra = spec.outputs(case), HELD_NOT_COMPARED.get(spec.name, {})
    out = {}
    for name, arr in held.items():
        if name in declared:
            continue
        if name not in extra:
            raise CaptureError(f"{where}: case {i}: member 'c{i}_{name}' is no array of a {spec.name} case "
                               f"({', '.join(f'c{i}_{n}' for n in (*declared, *extra))}): nothing would compare it")
        dtype, why = extra[name]
        if arr.dtype != dtype:
            raise CaptureError(f"{where}: case {i}: c{i}_{name} should be {np.dtype(dtype)}, got {arr.dtype}")
        out[f"c{i}_{name}"] = why
    return out


def _check_record(where: str, i: int, case: dict) -> None:
    """What the capture recorded of case `i`'s run: the inputs' CRC (without it, nothing proves the replay rebuilt
    the device's inputs) and, where recorded, whether a second run gave the same bytes (true or false)."""
    crc = case.get("input_crc")
    if isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 2**32:
        raise CaptureError(f"{where}: case {i}: 'input_crc' should be the CRC-32 of its inputs, got "
                           f"{'none' if crc is None else repr(crc)[:40]}: nothing proves the replay rebuilds them")
    for flag in ("repeat_identical", "quant_identical"):
        if case.get(flag) is not None and not isinstance(case[flag], bool):
            raise CaptureError(f"{where}: case {i}: {flag!r} should be true or false, got {repr(case[flag])[:40]}")


def _selection(path: str | Path, n: int, cases: object) -> list[int]:
    """The cases to replay: all, or those listed (each once, each one of the capture's)."""
    if cases is None:
        return list(range(n))
    if isinstance(cases, (str, bytes)) or not isinstance(cases, (list, tuple, range)) or not cases:
        raise ValueError(f"cases: a non-empty list of case numbers, got {cases!r}")
    todo = [check_int(i, "cases") for i in cases]
    for i in todo:
        if not 0 <= i < n:
            raise ValueError(f"cases: {path} has cases 0..{n - 1}, not {i}")
        if todo.count(i) > 1:
            raise ValueError(f"cases: case {i} is listed twice")
    return todo


class _Reads(dict):
    """A capture's arrays, remembering which ones a model's stages read."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        super().__init__(arrays)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> np.ndarray:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            self.read.add(key)
        return super().get(key, default)


def _replay_case(spec: DeployedKernel, path: str | Path, i: int, case: dict, arrays: dict[str, np.ndarray],
                 held: dict[str, np.ndarray]) -> tuple[ComparisonReport, str]:
    """Case `i` simulated and compared stage by stage, and its report line. A declared array of the case that no
    stage of the model read is reported as not compared (the report is then not bit-exact)."""
    reads = _Reads(arrays)
    t0 = time.perf_counter()
    try:
        stages = spec.stages(case, i, reads)
    except KeyError as e:
        raise CaptureError(f"replay: {path}: case {i}: its recipe has no {e}") from None
    except (ValueError, TypeError, OverflowError) as e:  # a recipe the checks let through, refused by the model
        raise CaptureError(f"replay: {path}: case {i}: {str(e).removeprefix('replay: ')}") from None
    seconds = round(time.perf_counter() - t0, 2)
    names = [n for n, _, _ in stages]
    if len(set(names)) != len(names) or not names:
        raise RuntimeError(f"replay: the model of {spec.name} gave case {i} the stages {names}: none, or one twice")
    # a stage whose length follows the kernel's plan (a work list) cannot be compared where the plans differ
    misfit = {n: f"the device holds shape {d.shape}, the model {s.shape} (their plans differ)"
              for n, d, s in stages if np.shape(d) != np.shape(s)}
    stages = [st for st in stages if st[0] not in misfit]
    if not stages:
        raise CaptureError(f"replay: {path}: case {i}: no stage has the model's shape ({misfit})")
    row = compare({n: d for n, d, _ in stages}, {n: s for n, _, s in stages}, meta={
        "case": i, "batch": case["batch"], "sq": case.get("sq", 1), "heads": case["heads"],
        "seqlens": case["seqlens"], "num_kv_splits": case.get("num_kv_splits"), "dist": case["dist"],
        "format": case.get("format") or case.get("layout"), "seconds": seconds})
    declared = spec.outputs(case)
    unread = [f"c{i}_{n}" for n in declared if n in held and f"c{i}_{n}" not in reads.read]
    absent = [f"c{i}_{n}" for n in spec.readbacks(case) if n not in held]  # the device gives it; the file lacks it
    if unread or misfit or absent:
        row = replace(row, skipped={**row.skipped, **misfit,
                                    **dict.fromkeys(unread, "held, but no stage of the model read it"),
                                    **dict.fromkeys(absent, "not in the capture (the device's readback of it "
                                                            "is missing)")})
    splits = f" splits={case['num_kv_splits']}" if case.get("num_kv_splits") else ""
    label = (f"case {i}:{spec.label(case)} b={case['batch']} s_q={case.get('sq', 1)} H={case['heads']} "
             f"seqlens={case['seqlens']}{splits} ({seconds} s)")
    return row, label


def capture(kernel: str, path: str | Path, *, source: str | None = None, seed: int = 0,
            scales: int | None = None, build: str = "upstream", cases: list[dict] | None = None) -> None:
    """Run `kernel`'s case table on this machine's GPU and write a capture.

    source: where the kernel is (the kernel's ``source_flag`` says what: a build folder or a kernel file).
    seed: added to every case's seed, for inputs no committed capture used.
    scales: run the kernel's scale table instead (:meth:`.kernel.DeployedKernel.scale_recipes`): DeepSeek's
    softmax scales and this many random ones, each a small launch.
    build: ``upstream`` (this project's build of the upstream sources at `source`) or one of the kernel's
    :attr:`~.kernel.DeployedKernel.builds` (an engine's shipped library, unpacked at `source`); every recipe
    records it. cases: these recipes (as :meth:`.kernel.DeployedKernel.recipes` gives them) in place of the
    table."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {tuple(KERNELS)}, got {kernel!r}")
    spec = KERNELS[kernel]
    if build != "upstream" and build not in spec.builds:
        raise ValueError(f"build: {spec.name} is captured from "
                         f"{' or '.join(repr(b) for b in ('upstream', *spec.builds))}, not {build!r}")
    todo = list(cases) if cases is not None else spec.recipes(seed) if scales is None else \
        spec.scale_recipes(seed, scales)
    if spec.builds:
        todo = [{**r, "build": build} for r in todo]
    if source is None and (spec.needs_source or build != "upstream"):
        raise ValueError(f"source: {spec.name} is run from {spec.source_help}; name it ({spec.source_flag})")
    import torch

    built = spec.load(source) if build == "upstream" else spec.load_shipped(source, build)
    arrays, recipes = {}, []
    for i, recipe in enumerate(todo):
        got, recipe = spec.run(built, i, recipe)
        arrays.update({f"c{i}_{k}": v for k, v in got.items()})
        recipes.append(recipe)
    meta = {"kernel": spec.name, spec.version_key: spec.version, **spec.launch,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cases": [encode_recipe(r) for r in recipes]}
    atomic_savez(path, meta=np.array(json.dumps(meta)), **arrays)
