"""Which build of FlashMLA a model predicts: the engines ship their own, and two things they change set the bits.

- **The compiler flags.** FlashMLA's setup.py compiles with ``--use_fast_math`` (``exp2f``, ``log2f`` and ``/`` the
  MUFU approximations, ``logf`` ``lg2`` times ln 2): machine ``sm90-cuda``. vLLM 0.33 compiles its ``_flashmla_C``
  library (the dense decode, the sparse FP8 decode, the sparse prefill) without it
  (``cmake/external_projects/flashmla.cmake``: plain ``VLLM_GPU_FLAGS``): ``exp2f`` keeps subnormal results, ``/``
  is IEEE, ``logf`` and ``log2f`` are libdevice's polynomials; ``__fdividef`` stays approximate; FP32 multiplies
  keep subnormal operands and products, which fast math (``-ftz=true``) flushes to zeros: machine
  ``sm90-cuda-precise``. Its ``_flashmla_extension_C`` (the dense FP8 decode) gets the flag.
- **The scale's type at the API.** Upstream's Python binding takes ``float softmax_scale`` (rounded to FP32 before
  any constant is derived from it); vLLM's and SGLang's ops take a double (a torch schema's ``float``), from which
  ``float(softmax_scale * M_LOG2E)`` and ``sm_scale * LOG_2_E`` are computed in double, then rounded once
  (:func:`~amla_sim.algorithms.deployed.scalars.softmax_scale`). SGLang's dense FP8 decode rounds it to FP32 first.

:data:`BUILDS` holds what each build does for each kernel, measured on an H200 (``scripts/capture_builds.py``:
vLLM 0.33.0's wheel and sgl-flash-mla 1.0.0, every case and 26 scales of each kernel, 100% of the bits).
"""

from __future__ import annotations

from typing import NamedTuple

from ....machines import Machine, get_machine

__all__ = ["BUILDS", "DEFAULT_BUILD", "Build", "resolve_build"]


class Build(NamedTuple):
    """A kernel as one build compiles it: the machine it runs on, and whether its API takes the scale as a
    double."""

    machine: str
    double_scale: bool


_FAST, _PRECISE = "sm90-cuda", "sm90-cuda-precise"

#: kernel -> build -> :class:`Build`. ``upstream``: this project's build of FlashMLA's sources with FlashMLA's own
#: flags and Python binding; ``vllm``: vLLM 0.33.0's wheel; ``sglang``: sgl-flash-mla 1.0.0 (SGLang 0.5.23).
BUILDS: dict[str, dict[str, Build]] = {
    "dense": {"upstream": Build(_FAST, False), "vllm": Build(_PRECISE, True), "sglang": Build(_FAST, True)},
    "sparse_fp8": {"upstream": Build(_FAST, False), "vllm": Build(_PRECISE, True), "sglang": Build(_FAST, True)},
    "sparse_prefill": {"upstream": Build(_FAST, False), "vllm": Build(_PRECISE, True),
                       "sglang": Build(_FAST, True)},
    "dense_fp8": {"upstream": Build(_FAST, False), "vllm": Build(_FAST, True), "sglang": Build(_FAST, False)},
}
#: The build a model predicts unless told: what vLLM, the most deployed engine, ships.
DEFAULT_BUILD = "vllm"


def resolve_build(kernel: str, build: str, machine: str | Machine | None) -> tuple[Machine, bool]:
    """`kernel`'s machine under `build` (or `machine`, where given: a what-if on other arithmetic) and whether its
    scale is a double; a ValueError names ``build`` for a build with no entry."""
    table = BUILDS[kernel]
    if build not in table:
        raise ValueError(f"build: expected one of {tuple(table)}, got {build!r}")
    b = table[build]
    return get_machine(b.machine if machine is None else machine), b.double_scale
