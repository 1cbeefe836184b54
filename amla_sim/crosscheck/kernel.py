"""What the capture and replay of one deployed kernel need, as a class each kernel's case table fills in.

A capture of a deployed kernel holds, per case ``i``, the device's arrays ``c{i}_{name}`` (raw bits) and the case's
recipe in ``meta["cases"]``: shapes, seqlens, the distribution and seed that
:func:`amla_sim.experiments.inputs.make_inputs` rebuilds the inputs from, and the inputs' CRC to prove it did.
:class:`DeployedKernel` says, for one kernel, what its recipes hold, which arrays a case has, how the simulator
makes the same stages, and how the kernel is run on a GPU; :mod:`.deployed` drives every kernel through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._validate import check_int
from ..algorithms._common import D_V
from ..algorithms.deployed.scalars import api_float, api_scale
from ..experiments.inputs import make_inputs
from ..resources import check_fits, run_bytes
from .files import CaptureError, input_crc

__all__ = ["DeployedKernel", "Stage", "stage", "case_inputs", "check_recipe", "check_fa3_options", "run_twice",
           "DEEPSEEK_SCALES", "RANDOM_SCALES", "scale_table"]

#: A stage as :func:`amla_sim.compare` takes it: its name, the device's array and the simulator's, in one format.
Stage = tuple[str, np.ndarray, np.ndarray]


#: The softmax scales every kernel's scale table holds: FlashMLA's tests' 576^-0.5, DeepSeek-V3's 192^-0.5 (no
#: YaRN) and 192^-0.5 mscale^2 with YaRN (0.1352337788608801, often written 0.1352), 0.1 and 1/16.
DEEPSEEK_SCALES = (576 ** -0.5, 192 ** -0.5, 0.1352, 0.1352337788608801, 0.1, 1 / 16)
#: The range a scale table's random scales are drawn from, uniformly.
RANDOM_SCALES = (0.03, 0.3)


def scale_table(seed: int, n: int) -> list[float]:
    """:data:`DEEPSEEK_SCALES`, then `n` scales drawn from :data:`RANDOM_SCALES` by the seed's own stream."""
    rng = np.random.default_rng([check_int(seed, "seed", lo=0), 43])
    return [*DEEPSEEK_SCALES, *rng.uniform(*RANDOM_SCALES, check_int(n, "scales", lo=0, hi=1000)).tolist()]


@dataclass(frozen=True)
class DeployedKernel:
    """One deployed kernel: its name (``crosscheck --kernel``), the upstream version its model follows, where the
    capture's meta records it, and the command-line option that says where the kernel's build or file is.

    A kernel's case table module subclasses this and fills in the methods below."""

    name: str
    summary: str  # the kernel, its upstream repository and version, as --help says it
    version_key: str  # the meta key of the version
    version: str
    source_flag: str  # e.g. "--flashmla-dir"
    source_help: str
    launch: dict[str, Any] = field(default_factory=dict)  # settings every capture of it records
    needs_source: bool = True  # False: the kernel can be found without its option (an installed package)
    empty_requests: bool = False  # True: a request (a token of a sparse call) may have no key
    #: the builds of the kernel a capture may come from besides ``upstream`` (this project's build of the upstream
    #: sources, from `source_flag`): the engines' shipped libraries (``vllm``, ``sglang``), which a recipe's
    #: ``build`` names and the model follows
    builds: tuple[str, ...] = ()

    def recipes(self, seed: int) -> list[dict]:
        """The recipes of the case table, every case's seed shifted by `seed` (no CRC yet)."""
        raise NotImplementedError

    def scale_template(self) -> dict:
        """A small recipe of the kernel (one short request that splits, 16 heads where the kernel takes them) that
        :meth:`scale_recipes` runs once per scale."""
        raise NotImplementedError

    def with_scalars(self, recipe: dict, rng: np.random.Generator) -> dict:
        """`recipe` with the kernel's other API scalars (descales, cache scales) drawn from `rng`; none here."""
        return recipe

    def scale_recipes(self, seed: int, n: int) -> list[dict]:
        """The kernel's scale table: :meth:`scale_template` under each scale of :func:`scale_table` (its other
        scalars drawn too), each case with inputs of its own (seeds shifted by `seed`)."""
        base, rng = self.scale_template(), np.random.default_rng([seed, 44])
        return [self.with_scalars({**base, "seed": base["seed"] + seed + j, "scale": s}, rng)
                for j, s in enumerate(scale_table(seed, n))]

    def outputs(self, case: dict) -> dict[str, tuple[tuple[int, ...], type, bool]]:
        """A case's arrays: name -> (shape, dtype, required)."""
        b, sq, H = case["batch"], case.get("sq", 1), case["heads"]
        return {"out": ((b, sq, H, D_V), np.uint16, True), "lse": ((b, H, sq), np.uint32, True)}

    def readbacks(self, case: dict) -> set[str]:
        """The optional arrays of :meth:`outputs` that the device gives for `case` (a capture reads them back):
        where a capture lacks one, the replay reports it as not compared."""
        return set()

    def check(self, case: dict) -> None:
        """What the model covers, beyond :func:`check_recipe` (ValueError or TypeError naming the field)."""

    def memory(self, case: dict) -> int:
        """Peak bytes of the model on `case` (checked before any work): a decode's, by default."""
        return run_bytes(batch=case["batch"], sq=case.get("sq", 1), heads=case["heads"],
                         context=max(1, *case["seqlens"]), mufu_tables=True)

    def stages(self, case: dict, i: int, arrays: dict[str, np.ndarray]) -> list[Stage]:
        """The simulator on case `i`, beside the device's arrays: the stages in pipeline order."""
        raise NotImplementedError

    def label(self, case: dict) -> str:
        """What a report line says of a case beyond its shapes (a format, a layout, splits)."""
        fmt = case.get("format") or case.get("layout")
        return f" {fmt}" if fmt else ""

    def load(self, source: str | None) -> Any:
        """The kernel on this machine's GPU, from `source` (its build folder or file)."""
        raise NotImplementedError

    def load_shipped(self, source: str, build: str) -> Any:
        """The kernel as an engine ships it (`build`, one of :attr:`builds`), from `source` (the unpacked
        package)."""
        from ..gpu.adapters.flashmla_shipped import load_shipped_flashmla

        return load_shipped_flashmla(source, build)

    def run(self, kernel: Any, i: int, recipe: dict) -> tuple[dict[str, np.ndarray], dict]:
        """Case `i` on the GPU: its arrays, and the recipe as the capture records it (with the inputs' CRC)."""
        raise NotImplementedError


def run_twice(run: Callable[[], dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], bool]:
    """A case run on the GPU and run again: the first run's arrays, and whether the second gave the same bytes in
    every one of them (a capture records it as ``repeat_identical``)."""
    got, again = run(), run()
    return got, got.keys() == again.keys() and all(np.array_equal(got[k], again[k]) for k in got)


def stage(name: str, device: np.ndarray, sim: np.ndarray, fmt: type) -> Stage:
    """A stage of format `fmt` from the device's raw bits and the simulator's array of that width."""
    return name, device.view(fmt), sim.view(fmt)


def case_inputs(case: dict) -> tuple[np.ndarray, np.ndarray]:
    """q (b, s_q, H, 576) and kv (b, S_max, 576) from a recipe, checked against its CRC."""
    q, kv = make_inputs(case["dist"], batch=case["batch"], heads=case["heads"], sq=case.get("sq", 1),
                        context=max(case["seqlens"]), seed=case["seed"], fmt=case.get("format", "bf16"))
    if "input_crc" in case and input_crc(q, kv) != case["input_crc"]:
        raise CaptureError(f"replay: the inputs of case {case} do not rebuild (CRC differs)")
    return q, kv


def check_fa3_options(case: dict) -> None:
    """An FA3 recipe's ``softcap`` (a finite float32 number) and ``window`` ([left, right], ints of -1 or more),
    where it has them: a ValueError naming the field."""
    if "softcap" in case and not np.isfinite(api_float(case["softcap"], "softcap")):
        raise ValueError(f"softcap: expected a finite number, got {case['softcap']!r}")
    if "window" in case:
        w = case["window"]
        if not isinstance(w, (list, tuple)) or len(w) != 2:
            raise ValueError(f"window: expected [left, right], got {w!r}")
        for x in w:
            check_int(x, "window", lo=-1)


def check_recipe(spec: DeployedKernel, where: str, i: int, case: object, arrays: dict) -> None:
    """A case's recipe and arrays against the format (before any work): its sizes, and its memory."""
    where = f"{where}: case {i}"
    if not isinstance(case, dict):
        raise CaptureError(f"{where} is not a JSON object")
    try:
        b, H = check_int(case["batch"], "batch", lo=1), check_int(case["heads"], "heads", lo=1)
        sq = check_int(case.get("sq", 1), "sq", lo=1)
        check_int(case["seed"], "seed", lo=0)
        seqlens = [check_int(n, "seqlens", lo=0 if spec.empty_requests else 1) for n in case["seqlens"]]
        if len(seqlens) != b:
            raise ValueError(f"seqlens: {len(seqlens)} lengths for batch {b}")
        if case.get("scale") is not None:
            api_scale(case["scale"], "scale")  # the model checks its own
        if not isinstance(case["dist"], str):
            raise TypeError(f"dist: expected a string, got {case['dist']!r}")
        build = case.get("build", "upstream")
        if build != "upstream" and build not in spec.builds:
            raise ValueError(f"build: {spec.name} has the builds "
                             f"{', '.join(repr(b) for b in ('upstream', *spec.builds))}, not {build!r}")
        spec.check(case)
        shapes = spec.outputs(case)
    except KeyError as e:
        raise CaptureError(f"{where} has no {e.args[0]!r}") from None
    except (ValueError, TypeError) as e:
        raise CaptureError(f"{where}: {e}") from None
    for name, (shape, dtype, required) in shapes.items():
        arr = arrays.get(f"c{i}_{name}")
        if arr is None:
            if not required:
                continue
            raise CaptureError(f"{where} has no c{i}_{name} array")
        fits = len(arr.shape) == len(shape) and all(n is None or n == m for n, m in zip(shape, arr.shape))
        if not fits or arr.dtype != dtype:
            raise CaptureError(f"{where}: c{i}_{name} should be {np.dtype(dtype)} {shape}, got {arr.dtype} {arr.shape}")
    check_fits(spec.memory(case), what=where, lower="the capture's sizes")
