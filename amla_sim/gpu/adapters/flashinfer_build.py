"""FlashInfer's sm90 MLA module (``BatchMLAPagedAttentionWrapper``'s fa3 kernel) compiled from a
flashinfer-ai/flashinfer checkout by this project's build code, with the flags FlashInfer's JIT gives that module.

A checkout is ``git clone --recursive`` of flashinfer-ai/flashinfer at v0.7.2 (CUTLASS and CCCL as the submodules
under ``3rdparty/``), or the package's source distribution unpacked (the same files in the same layout). The build
compiles the three sources FlashInfer's JIT compiles for the module (``csrc/batch_mla_sm90_{plan,run,binding}.cu``,
upstream's own binding, a TVM-FFI module), against the checkout's ``include/``, with the configuration header
rendered from the checkout's ``csrc/batch_mla_config.jinja``, and links them as FlashInfer links a JIT module. The
flags follow flashinfer 0.7.2's ``jit/core.py`` (``gen_jit_spec``: ``-std=c++17 -use_fast_math``, the
``FLASHINFER_ENABLE_*`` switches, ``-DNDEBUG -O3``; ``sm90a_nvcc_flags``) and ``jit/cpp_ext.py``
(``build_common_cflags``, ``build_cuda_cflags``, the link line of ``generate_ninja_build_for_op``), the module's own
flags from ``jit/attention/modules.py`` (``gen_batch_mla_module``, backend fa3).

Nothing here needs a GPU until the module is loaded: :func:`mla_build_commands` only writes out the commands.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .. import GPUUnavailable
from ._build import checkout_files

__all__ = ["FLASHINFER_CHECKOUT", "FlashInferBuild", "checkout_version", "mla_build_commands", "build_mla_module",
           "render_mla_config"]

#: What a folder given as FlashInfer's checkout should be.
FLASHINFER_CHECKOUT = ("a flashinfer-ai/flashinfer checkout at v0.7.2 (git clone --recursive: CUTLASS and CCCL under "
                       "3rdparty/) or flashinfer-python 0.7.2's source distribution unpacked")
#: The module's sources (``gen_batch_mla_module``, backend fa3: ``jit/attention/modules.py:322-328``).
SOURCES = ("batch_mla_sm90_plan.cu", "batch_mla_sm90_run.cu", "batch_mla_sm90_binding.cu")
#: Files a checkout must hold: the module's sources and template, the kernel's headers, CUTLASS, CCCL, the wrapper.
NEEDS = [*(f"csrc/{s}" for s in SOURCES), "csrc/batch_mla_config.jinja", "csrc/tvm_ffi_utils.h",
         "include/flashinfer/attention/mla_hopper.cuh", "include/flashinfer/attention/scheduler.cuh",
         "3rdparty/cutlass/include/cute/tensor.hpp", "3rdparty/cccl/libcudacxx/include/cuda/std/version",
         "flashinfer/mla/_batch_mla/_backends/fa3_backend.py"]

#: ``gen_jit_spec`` (``jit/core.py:733-770``), not in debug mode; ``-use_fast_math`` is its default.
_JIT_CUDA = ["-std=c++17", "-use_fast_math", "-Xfatbin=-compress-all", "--compress-mode=size",
             "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3",
             "-DFLASHINFER_ENABLE_FP8_E5M2", "-DNDEBUG", "-O3"]
#: ``sm90a_nvcc_flags`` (``jit/core.py:160-163``, with ``common_nvcc_flags`` at 152-155), the module's extra flags.
_SM90A = ["-gencode=arch=compute_90a,code=sm_90a", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
          "-DFLASHINFER_ENABLE_FP8_E8M0", "-DFLASHINFER_ENABLE_FP4_E2M1"]
#: ``build_cuda_cflags`` (``jit/cpp_ext.py:210-220``; the stub flag from CUDA 12.8 on).
_CUDA_RULE = ["--compiler-options=-fPIC", "--expt-relaxed-constexpr", "-static-global-template-stub=false"]
#: The link line (``jit/cpp_ext.py:273-279``, rule ``link``: the host compiler, no device link).
_LDFLAGS = ["-shared", "-L{cuda}/lib64", "-L{cuda}/lib64/stubs", "-lcudart", "-lcuda"]

#: The C++ types the template takes (``jit/utils.py``: ``dtype_map``, ``dtype_map_kv``), by the names the model uses.
CXX_TYPES = {"bf16": "nv_bfloat16", "f16": "half", "e4m3": "__nv_fp8_e4m3", "int32": "int32_t"}
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass(frozen=True)
class FlashInferBuild:
    """What one build compiles: its folder, the configuration header, one nvcc command a source and the link."""

    folder: Path
    config: str
    compiles: list[list[str]]
    link: list[str]
    library: Path


def render_mla_config(template: str, values: dict[str, str | int]) -> str:
    """The checkout's ``batch_mla_config.jinja`` with its ``{{ name }}`` placeholders filled from `values`; a
    template with any other Jinja construct, or a placeholder `values` lacks, is refused (the build would not be
    FlashInfer's)."""
    if "{%" in template or "{#" in template:
        raise ValueError("flashinfer-mla: batch_mla_config.jinja holds Jinja statements this build does not render")
    missing = sorted({m.group(1) for m in _PLACEHOLDER.finditer(template)} - set(values))
    if missing:
        raise ValueError(f"flashinfer-mla: batch_mla_config.jinja needs {', '.join(missing)}, which the build lacks")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def checkout_version(checkout: str | Path) -> str:
    """The FlashInfer version a checkout holds: its source distribution's ``flashinfer/_build_meta.py`` (written by
    FlashInfer's build backend from ``version.txt``), else a git checkout's ``version.txt``; an error naming both
    files where neither says."""
    root = Path(checkout)
    meta = root / "flashinfer" / "_build_meta.py"
    if meta.is_file():
        found = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', meta.read_text(), re.M)
        if found:
            return found.group(1)
    if (root / "version.txt").is_file():
        return (root / "version.txt").read_text().strip()
    raise FileNotFoundError(f"flashinfer-mla: {checkout} says no version (no flashinfer/_build_meta.py with "
                            f"__version__, no version.txt); it should be {FLASHINFER_CHECKOUT}")


def _cuda_home() -> Path:
    """The toolkit as FlashInfer's ``get_cuda_path`` finds it (``jit/cpp_ext.py:47-64``): CUDA_HOME, CUDA_PATH,
    the folder above the nvcc on PATH (not following a link), else /usr/local/cuda if it is there."""
    found = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if found is not None:
        return Path(found)
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        return Path(os.path.dirname(os.path.dirname(nvcc)))
    if Path("/usr/local/cuda").exists():
        return Path("/usr/local/cuda")
    raise GPUUnavailable("flashinfer-mla: no nvcc: the build needs a CUDA toolkit (set CUDA_HOME or put nvcc on "
                         "PATH) and the GPU extra (pip install 'amla-sim[gpu]')")


def mla_build_commands(checkout: str | Path, *, kv: str = "bf16", q: str = "bf16", head_dim_ckv: int = 512,
                       head_dim_kpe: int = 64, cuda_home: str | Path | None = None,
                       tvm_ffi_includes: tuple[str, str] | None = None, cxx11_abi: int = 1,
                       folder: str | Path | None = None) -> FlashInferBuild:
    """The commands that build the fa3 MLA module for one (q, kv) format pair and head layout from `checkout`
    (nothing is run): the output is `q`'s format, indices int32, as SGLang and vLLM plan them. `tvm_ffi_includes`
    defaults to the installed apache-tvm-ffi's headers; `cxx11_abi` is torch's ``_GLIBCXX_USE_CXX11_ABI``."""
    root = checkout_files(checkout, "flashinfer-mla", NEEDS, FLASHINFER_CHECKOUT).resolve()
    for name, fmt in (("q", q), ("kv", kv)):
        if fmt not in CXX_TYPES or fmt == "int32" or (name == "q" and fmt == "e4m3"):
            raise ValueError(f"{name}: expected one of bf16, f16{', e4m3' if name == 'kv' else ''}, got {fmt!r}")
    values = {"dtype_q": CXX_TYPES[q], "dtype_kv": CXX_TYPES[kv], "dtype_o": CXX_TYPES[q],
              "dtype_idx": CXX_TYPES["int32"], "head_dim_ckv": int(head_dim_ckv), "head_dim_kpe": int(head_dim_kpe)}
    config = render_mla_config((root / "csrc" / "batch_mla_config.jinja").read_text(), values)
    cuda = Path(cuda_home) if cuda_home is not None else _cuda_home()
    if tvm_ffi_includes is None:
        try:
            import tvm_ffi
        except ImportError:
            raise GPUUnavailable("flashinfer-mla: the build needs apache-tvm-ffi's headers: pip install "
                                 "'amla-sim[gpu]' apache-tvm-ffi (or pass tvm_ffi_includes)") from None
        tvm_ffi_includes = (tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_dlpack_include_path())
    uri = f"q_{q}_kv_{kv}_ckv_{head_dim_ckv}_kpe_{head_dim_kpe}"
    # a folder of its own for each checkout, sources, header, toolkit and flag set: a library is never reused
    # across any of them
    digest = hashlib.sha256("\0".join([str(root), config, str(cuda), str(cxx11_abi), *map(str, tvm_ffi_includes),
                                        *_JIT_CUDA, *_SM90A, *_CUDA_RULE, *_LDFLAGS,
                                        *((root / "csrc" / s).read_text() for s in SOURCES)]).encode()).hexdigest()[:12]
    out = Path(folder) if folder is not None else (
        Path(tempfile.gettempdir()) / "amla-sim-build" / f"flashinfer_mla_{uri}_{digest}")
    third = root / "3rdparty"
    # build_common_cflags (jit/cpp_ext.py:156-179): the generated folder (extra_include_dirs), CCCL by -I (ahead of
    # the toolkit's copy), then the system includes of get_system_includes (:136-150)
    common = ["-DPy_LIMITED_API=0x03090000", f"-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}", f"-I{out}",
              *(f"-I{third / 'cccl' / d}" for d in ("cub", "libcudacxx/include", "thrust")),
              *(f for d in (sysconfig.get_path("include"), cuda / "include", *tvm_ffi_includes, root / "include",
                            root / "csrc", third / "cutlass" / "include",
                            third / "cutlass" / "tools" / "util" / "include", third / "spdlog" / "include")
                for f in ("-isystem", str(d)))]
    nvcc = str(cuda / "bin" / "nvcc")
    compiles = [[nvcc, *common, *_CUDA_RULE, *_JIT_CUDA, *_SM90A, "-c", str(root / "csrc" / s),
                 "-o", str(out / (s + ".o"))] for s in SOURCES]
    library = out / f"flashinfer_mla_{uri}.so"
    link = [os.environ.get("CXX", "c++"), *(str(out / (s + ".o")) for s in SOURCES),
            *(f.format(cuda=cuda) for f in _LDFLAGS), "-o", str(library)]
    return FlashInferBuild(out, config, compiles, link, library)


def build_mla_module(checkout: str | Path, *, verbose: bool = False, cxx11_abi: int | None = None,
                     **layout) -> tuple[Path, float]:
    """Build the module of :func:`mla_build_commands` (the three sources compiled at once) unless its library is
    already there; the library's path and the seconds the build took (0 when it was reused). `cxx11_abi`: torch's
    (None: read from the installed torch).

    Each build runs in a folder of its own and moves the library into place whole: a second process building the
    same module at once, or a build killed half way, never leaves a torn object or library to be loaded."""
    if cxx11_abi is None:
        try:
            import torch
        except ImportError:
            raise GPUUnavailable("flashinfer-mla: the build takes torch's C++ ABI: pip install 'amla-sim[gpu]' "
                                 "(or pass cxx11_abi)") from None
        cxx11_abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    final = mla_build_commands(checkout, cxx11_abi=cxx11_abi, **layout)
    if final.library.is_file():
        return final.library, 0.0
    nvcc = Path(final.compiles[0][0])
    if not nvcc.is_file():
        raise GPUUnavailable(f"flashinfer-mla: no nvcc at {nvcc}: the build needs a CUDA toolkit (set CUDA_HOME) and "
                             "the GPU extra (pip install 'amla-sim[gpu]')")
    final.folder.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="work.", dir=final.folder))
    try:
        build = mla_build_commands(checkout, cxx11_abi=cxx11_abi, folder=work, **layout)
        (work / "batch_mla_sm90_config.inc").write_text(build.config)
        start = time.perf_counter()
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for cmd in build.compiles]
        logs = [p.communicate()[0] for p in procs]
        for cmd, proc, log in zip(build.compiles, procs, logs):
            if verbose or proc.returncode:
                print(" ".join(cmd), log, sep="\n", file=sys.stderr)
            if proc.returncode:
                raise RuntimeError(f"flashinfer-mla: nvcc failed on {Path(cmd[cmd.index('-c') + 1]).name} "
                                   f"(exit {proc.returncode})")
        done = subprocess.run(build.link, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if verbose or done.returncode:
            print(" ".join(build.link), done.stdout, sep="\n", file=sys.stderr)
        if done.returncode:
            raise RuntimeError(f"flashinfer-mla: the link failed (exit {done.returncode})")
        os.replace(build.library, final.library)  # whole or not at all
        return final.library, time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
