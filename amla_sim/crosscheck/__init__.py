"""Simulator against device: capture a kernel's stages on a GPU, replay them on any CPU, bit for bit.

- :mod:`.files`: the capture file, one format for every kernel (raw bits, a JSON meta, the inputs' CRC);
- :mod:`.own`: this project's Triton kernels, every per-block stage;
- :mod:`.kernel`, :mod:`.deployed`: the kernels people deploy, each described by a case table module
  (:mod:`~amla_sim.crosscheck.flashmla`, :mod:`~amla_sim.crosscheck.sglang`, :mod:`~amla_sim.crosscheck.fa3`,
  :mod:`~amla_sim.crosscheck.vllm`);
- :mod:`.report`: what a replay says (:class:`ReplayReport`, per case :class:`amla_sim.ComparisonReport`);
- :mod:`.tensor_cores`: the inputs of the tensor-core captures.

:func:`replay` replays any capture.
"""

from __future__ import annotations

from pathlib import Path

from .deployed import replay_deployed
from .files import CaptureError, read_capture
from .own import replay_own
from .prefill_chain import CHAIN_KERNELS, replay_chain
from .report import ReplayReport

__all__ = ["replay", "ReplayReport", "CaptureError"]

OWN = "amla-sim"  # the name of this project's kernels where a deployed kernel's name would stand


def replay(path: str | Path, *, kernel: str | None = None, cases: list[int] | None = None) -> ReplayReport:
    """Replay a capture of any kernel on the CPU: per case and stage, which bits the simulator predicted.

    kernel: the kernel the caller expects the capture to hold (``"amla-sim"`` for this project's kernels;
    checked before any work). cases: the cases to replay (a deployed kernel's capture; default all)."""
    meta, arrays = read_capture(path)
    found = OWN if "algorithm" in meta else None
    if meta.get("kernel") in CHAIN_KERNELS:
        if kernel not in (None, meta["kernel"]) or cases is not None:
            raise ValueError(f"--kernel, cases: the capture holds {meta['kernel']}, every case replayed")
        return replay_chain(path, meta, arrays)
    if found is None:
        from .deployed import kernel_of

        found = kernel_of(meta).name
    if kernel is not None and kernel != found:
        raise ValueError(f"--kernel: the capture holds {found}, not {kernel}")
    if found == OWN:
        if cases not in (None, [0]):
            raise ValueError(f"cases: a capture of this project's kernels has one case, not {cases}")
        return replay_own(path, read=(meta, arrays))
    return replay_deployed(path, meta, arrays, cases=cases)
