"""The third-party CUDA kernels compiled from their upstream checkouts by this project's build code: which files
of a checkout a kernel needs, the sources this project adds (a pybind binding, stand-ins for kernels a dispatch
names but this build leaves out), and ``torch.utils.cpp_extension.load`` with the upstream project's own flags.

A checkout is what ``git clone --recursive`` of the upstream repository at the named commit gives (CUTLASS as the
submodule at ``csrc/cutlass``); the source archives of the device machines, unpacked into one folder in the same
layout, work the same way.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..._files import atomic_write
from .. import require_gpu

__all__ = ["checkout_files", "compile_extension", "added_source", "CUDA_COMMON", "SM90A", "FLASHMLA_NVCC"]

#: The nvcc flags every upstream project here passes (torch's common flags without the ``__CUDA_NO_*`` defines,
#: as FlashMLA's setup.py and vLLM's CMake give them).
CUDA_COMMON = ["-O3", "-DNDEBUG", "-U__CUDA_NO_HALF_OPERATORS__",
               "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
               "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math"]
#: Hopper with its wgmma instructions (the ``a`` target), the only architecture these kernels are built for here.
SM90A = ["-gencode", "arch=compute_90a,code=sm_90a"]
#: FlashMLA's setup.py nvcc flags (also FlashMLA-ETAP's and vllm-project/FlashMLA's), less the C++ standard, which
#: differs between them.
FLASHMLA_NVCC = [*CUDA_COMMON, "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations", *SM90A]


def checkout_files(checkout: str | Path, kernel: str, needs: list[str], what: str) -> Path:
    """`checkout` as a Path, after checking that it holds every file of `needs` (relative paths); otherwise a
    FileNotFoundError that names the kernel, the missing file and what the checkout should be (`what`)."""
    root = Path(checkout)
    if not root.is_dir():
        raise FileNotFoundError(f"{kernel}: {checkout} is not a folder; it should be {what}")
    for need in needs:
        if not (root / need).is_file():
            raise FileNotFoundError(f"{kernel}: {checkout} is not {what} (it has no {need})")
    return root


def added_source(name: str, filename: str, text: str) -> Path:
    """A source file this project adds to a build (never written into the checkout): in a folder of its own under
    the temporary directory, rewritten (atomically) only when its text changes, so that ninja reuses what it built."""
    folder = Path(tempfile.gettempdir()) / "amla-sim-build" / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    if not path.is_file() or path.read_text() != text:
        atomic_write(path, text)  # a second process building at once reads the old text or the new, never half
    return path


def compile_extension(name: str, sources: list[Path], includes: list[Path], cflags: list[str],
                      cuda_flags: list[str], *, verbose: bool = False):
    """``torch.utils.cpp_extension.load`` of `sources` (ninja, cached by torch under `name`), with CUDA's libcu++
    headers added to the includes (CUDA 13 keeps them under ``include/cccl``, which the host compiler needs for
    CUTLASS)."""
    require_gpu()
    from torch.utils.cpp_extension import CUDA_HOME, load

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    cccl = Path(CUDA_HOME or "/usr/local/cuda") / "include" / "cccl"
    return load(name=name, sources=[str(s) for s in sources], extra_include_paths=[str(p) for p in [*includes, cccl]],
                extra_cflags=cflags, extra_cuda_cflags=cuda_flags, verbose=verbose)
