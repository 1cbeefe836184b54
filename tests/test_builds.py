"""The third-party CUDA kernels' build code (amla_sim.gpu.adapters): a folder that is not the upstream checkout is
refused before anything is compiled, with the kernel, the missing file and what the folder should be named; once
every file the build reads is there, the build goes on to the compiler (on a machine without a GPU: the GPU check).
"""

from __future__ import annotations

import re

import pytest

from amla_sim.gpu import GPUUnavailable, gpu_status
from amla_sim.gpu.adapters import fa3, flashmla, vllm

BUILDERS = [  # (builder, the kernel's name in its errors, the upstream repository the error asks for)
    (flashmla.build_flashmla, "flashmla", "deepseek-ai/FlashMLA"),
    (flashmla.build_sparse_fp8, "flashmla-sparse-fp8", "deepseek-ai/FlashMLA"),
    (flashmla.build_etap, "flashmla-etap", "pengcuo/FlashMLA-ETAP"),
    (fa3.build_fa3, "fa3-mla", "vllm-project/flash-attention"),
    (vllm.build_dense_fp8, "flashmla-dense-fp8", "vllm-project/FlashMLA"),
]
IDS = [k for _, k, _ in BUILDERS]


@pytest.mark.parametrize(("build", "kernel", "repo"), BUILDERS, ids=IDS)
def test_a_folder_that_is_not_a_checkout_is_refused_by_name(build, kernel, repo, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^{kernel}: .* is not a folder; it should be a {repo} checkout"):
        build(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=rf"^{kernel}: .* is not a {repo} checkout with CUTLASS at "
                                               r"csrc/cutlass \(git clone --recursive\) \(it has no \S+\)$"):
        build(tmp_path)


@pytest.mark.skipif(gpu_status() is None, reason="with a GPU the build would compile")
@pytest.mark.parametrize(("build", "kernel", "repo"), BUILDERS, ids=IDS)
def test_a_complete_checkout_goes_on_to_the_compiler(build, kernel, repo, tmp_path):
    """Each missing file the error names is created (empty), until the build asks for nothing more."""
    named = []
    for _ in range(40):
        try:
            build(tmp_path)
        except FileNotFoundError as e:
            missing = re.search(r"\(it has no (\S+)\)$", str(e)).group(1)
            assert missing not in named, f"{missing} named twice"
            named.append(missing)
            (tmp_path / missing).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / missing).write_text("")
        except (GPUUnavailable, ImportError):  # the checkout is complete: the next step needs torch and a GPU
            break
    else:
        pytest.fail(f"{kernel}: still asking for files after {named}")
    assert any(n.startswith("csrc/cutlass/") for n in named) and len(named) >= 3, named


def test_an_added_source_is_rewritten_only_when_its_text_changes(tmp_path, monkeypatch):
    """Bindings and stand-ins go to a folder of their own, never the checkout; the same text keeps the file (ninja
    then reuses what it built), another text replaces it whole."""
    from amla_sim.gpu.adapters._build import added_source

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = added_source("ext", "binding.cpp", "int a;\n")
    assert path == tmp_path / "amla-sim-build" / "ext" / "binding.cpp" and path.read_text() == "int a;\n"
    stamp = path.stat().st_mtime_ns
    assert added_source("ext", "binding.cpp", "int a;\n").stat().st_mtime_ns == stamp
    assert added_source("ext", "binding.cpp", "int b;\n").read_text() == "int b;\n"
    assert [p.name for p in path.parent.iterdir()] == ["binding.cpp"]  # no temporary file left behind


# FlashInfer's MLA module: compiled by commands of this project's own (no torch extension), FlashInfer's JIT flags
def _flashinfer_checkout(root):
    from amla_sim.gpu.adapters.flashinfer_build import NEEDS

    for need in NEEDS:
        (root / need).parent.mkdir(parents=True, exist_ok=True)
        (root / need).write_text("// placeholder\n")
    (root / "csrc" / "batch_mla_config.jinja").write_text(
        "using DTypeQ = {{ dtype_q }};\nusing DTypeKV = {{dtype_kv}};\nusing DTypeO = {{ dtype_o }};\n"
        "using IdType = {{ dtype_idx }};\nconstexpr int CKV = {{ head_dim_ckv }}, KPE = {{ head_dim_kpe }};\n")
    return root


def _commands(root, tmp_path, **layout):
    from amla_sim.gpu.adapters.flashinfer_build import mla_build_commands

    return mla_build_commands(root, cuda_home="/cuda", tvm_ffi_includes=("/ffi/include", "/ffi/dlpack"),
                              folder=tmp_path / "build", **layout)


def test_flashinfer_a_folder_that_is_not_its_checkout_is_refused_by_name(tmp_path):
    from amla_sim.gpu.adapters.flashinfer_build import NEEDS

    with pytest.raises(FileNotFoundError, match=r"^flashinfer-mla: .* is not a folder; it should be a "
                                               r"flashinfer-ai/flashinfer checkout at v0.7.2"):
        _commands(tmp_path / "nowhere", tmp_path)
    root = _flashinfer_checkout(tmp_path / "fi")
    for need in NEEDS:  # each file the build reads is asked for by name
        (root / need).rename(root / (need + ".away"))
        with pytest.raises(FileNotFoundError, match=rf"\(it has no {re.escape(need)}\)$"):
            _commands(root, tmp_path)
        (root / (need + ".away")).rename(root / need)


@pytest.mark.parametrize(("layout", "types"), [
    ({}, ["nv_bfloat16", "nv_bfloat16", "nv_bfloat16", "512", "64"]),
    ({"kv": "e4m3", "head_dim_kpe": 0}, ["nv_bfloat16", "__nv_fp8_e4m3", "nv_bfloat16", "512", "0"]),
    ({"q": "f16", "kv": "f16"}, ["half", "half", "half", "512", "64"]),
])
def test_flashinfer_mla_is_built_from_the_checkout_with_its_jit_flags(tmp_path, layout, types):
    root = _flashinfer_checkout(tmp_path / "fi")
    build = _commands(root, tmp_path, **layout)
    q, kv, o, ckv, kpe = types
    assert build.config == (f"using DTypeQ = {q};\nusing DTypeKV = {kv};\nusing DTypeO = {o};\nusing IdType = int32_t;"
                            f"\nconstexpr int CKV = {ckv}, KPE = {kpe};\n")
    sources = [cmd[cmd.index("-c") + 1] for cmd in build.compiles]
    assert sources == [str(root.resolve() / "csrc" / f"batch_mla_sm90_{s}.cu") for s in ("plan", "run", "binding")]
    for cmd in build.compiles:
        assert cmd[0] == "/cuda/bin/nvcc" and cmd[cmd.index("-o") + 1].startswith(str(build.folder))
        flags = set(cmd)
        # what decides the kernel's arithmetic: fast math (ex2.approx, rcp.approx), sm_90a's wgmma, -O3
        assert {"-use_fast_math", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17",
                "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3"} <= flags
        # torch's extension flags are not FlashInfer's: no __CUDA_NO_* switches, no -DTORCH_EXTENSION_NAME
        assert not [f for f in cmd if "__CUDA_NO_" in f or "TORCH" in f]
        # the rendered header first, then the checkout's CCCL ahead of the toolkit's, its CUTLASS and headers
        includes = [cmd[i + 1] if f == "-isystem" else f[2:] for i, f in enumerate(cmd) if f.startswith("-I")
                    or f == "-isystem"]
        third = root.resolve() / "3rdparty"
        assert includes[:4] == [str(build.folder), *(str(third / "cccl" / d)
                                                     for d in ("cub", "libcudacxx/include", "thrust"))]
        assert includes.index(str(third / "cccl" / "cub")) < includes.index("/cuda/include")
        assert {str(root.resolve() / "include"), str(third / "cutlass" / "include")} <= set(includes)
    assert build.link[-2:] == ["-o", str(build.library)] and "-shared" in build.link
    assert [f for f in build.link if f.endswith(".o")] == [cmd[cmd.index("-o") + 1] for cmd in build.compiles]


def test_flashinfer_builds_of_other_layouts_or_sources_do_not_share_a_folder(tmp_path):
    from amla_sim.gpu.adapters.flashinfer_build import mla_build_commands

    root = _flashinfer_checkout(tmp_path / "fi")

    def folder(**layout):
        return mla_build_commands(root, cuda_home="/cuda", tvm_ffi_includes=("/a", "/b"), **layout).folder

    first = folder()
    assert folder() == first and folder(kv="e4m3") != first and folder(head_dim_kpe=0) != first
    (root / "csrc" / "batch_mla_sm90_run.cu").write_text("// another commit\n")
    assert folder() != first  # a changed source is rebuilt, never served from an old library


@pytest.mark.parametrize(("template", "values", "error"), [
    ("{% if x %}a{% endif %}", {}, "Jinja statements"),
    ("{{ dtype_q }} {{ head_dim_nope }}", {"dtype_q": "half"}, "needs head_dim_nope"),
])
def test_flashinfer_a_template_this_build_cannot_render_is_refused(template, values, error):
    from amla_sim.gpu.adapters.flashinfer_build import render_mla_config

    with pytest.raises(ValueError, match=error):
        render_mla_config(template, values)


@pytest.mark.parametrize(("layout", "name"), [({"q": "e4m3"}, "q"), ({"kv": "fp4"}, "kv"), ({"q": "int32"}, "q")])
def test_flashinfer_a_format_the_module_has_no_build_for_is_refused_by_name(tmp_path, layout, name):
    with pytest.raises(ValueError, match=f"^{name}: expected one of"):
        _commands(_flashinfer_checkout(tmp_path / "fi"), tmp_path, **layout)


@pytest.mark.parametrize(("files", "version"), [
    ({"flashinfer/_build_meta.py": '"""Build metadata."""\n__version__ = "0.7.2"\n__git_commit__ = "x"\n'}, "0.7.2"),
    ({"version.txt": "0.7.2\n"}, "0.7.2"),  # a git checkout: _build_meta.py is written by a pip build only
    ({"flashinfer/_build_meta.py": "__version__ = '0.7.1'\n", "version.txt": "0.7.2\n"}, "0.7.1"),
    ({}, None),
])
def test_flashinfer_the_checkouts_version_is_read_from_its_files(tmp_path, files, version):
    from amla_sim.gpu.adapters.flashinfer_build import checkout_version

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    if version is None:
        with pytest.raises(FileNotFoundError, match=r"says no version .*_build_meta.py.*version.txt"):
            checkout_version(tmp_path)
    else:
        assert checkout_version(tmp_path) == version


def _fake_toolchain(tmp_path, monkeypatch, compiles=3):
    """A toolkit whose nvcc starts writing no object before `compiles` compiles have started (two builds at once
    then overlap, whatever the machine's load) and writes it in pieces, and a host compiler that links by
    concatenating the objects."""
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    starts = tmp_path / "starts"
    starts.mkdir()
    # each compile waits (up to 20 s) until `compiles` of them have started, then writes its object in pieces
    nvcc.write_text(f'#!/bin/sh\ntouch {starts}/$$\nn=0\nwhile [ $(ls {starts} | wc -l) -lt {compiles} ] && '
                    f'[ $n -lt 400 ]; do sleep 0.05; n=$((n+1)); done\n'
                    'while [ "$1" != "-c" ]; do shift; done\nsrc=$2; out=$4\n'
                    'for i in 1 2 3; do printf "%s part $i\\n" "$src" >> "$out"; sleep 0.05; done\n')
    linker = tmp_path / "cxx"
    linker.write_text('#!/bin/sh\nout=""; objs=""\nwhile [ $# -gt 0 ]; do case "$1" in -o) out=$2; shift;; '
                      '*.o) objs="$objs $1";; esac; shift; done\ncat $objs > "$out"\n')
    for tool in (nvcc, linker):
        tool.chmod(0o755)
    monkeypatch.setenv("CXX", str(linker))
    return cuda


def test_flashinfer_builds_at_once_each_leave_the_whole_library(tmp_path, monkeypatch):
    """Two processes building the same module at once (and a third after them) get one library, whole: every
    object of one build, each written once; no work folder is left behind."""
    import threading

    from amla_sim.gpu.adapters.flashinfer_build import SOURCES, build_mla_module

    root = _flashinfer_checkout(tmp_path / "fi")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    kw = {"cuda_home": _fake_toolchain(tmp_path, monkeypatch, compiles=2 * len(SOURCES)),
          "tvm_ffi_includes": ("/a", "/b"), "cxx11_abi": 1}
    results = []
    threads = [threading.Thread(target=lambda: results.append(build_mla_module(root, **kw))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0][0] == results[1][0] and all(s > 0 for _, s in results)
    library = results[0][0]
    want = "".join(f"{root.resolve() / 'csrc' / s} part {i}\n" for s in SOURCES for i in (1, 2, 3))
    assert library.read_text() == want
    assert build_mla_module(root, **kw) == (library, 0.0)  # built: reused
    assert [p.name for p in library.parent.iterdir()] == [library.name]


def test_flashinfer_a_failed_compile_names_its_source_and_leaves_nothing(tmp_path, monkeypatch):
    from amla_sim.gpu.adapters.flashinfer_build import build_mla_module

    root = _flashinfer_checkout(tmp_path / "fi")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cuda = _fake_toolchain(tmp_path, monkeypatch)
    (cuda / "bin" / "nvcc").write_text('#!/bin/sh\ncase "$*" in *run.cu*) echo "error: boom"; exit 2;; esac\n')
    with pytest.raises(RuntimeError, match=r"nvcc failed on batch_mla_sm90_run\.cu \(exit 2\)"):
        build_mla_module(root, cuda_home=cuda, tvm_ffi_includes=("/a", "/b"), cxx11_abi=1)
    assert not [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()]


@pytest.mark.parametrize("missing, kwargs, says", [
    ("tvm_ffi", {"cuda_home": "/cuda", "cxx11_abi": 1}, r"apache-tvm-ffi's headers: pip install 'amla-sim\[gpu\]'"),
    ("torch", {"cuda_home": "/cuda", "tvm_ffi_includes": ("/a", "/b")}, r"torch's C\+\+ ABI: pip install 'amla-sim\[gpu\]'"),
    (None, {"cuda_home": "/nowhere/cuda", "tvm_ffi_includes": ("/a", "/b"), "cxx11_abi": 1},
     r"no nvcc at /nowhere/cuda/bin/nvcc: the build needs a CUDA toolkit .*pip install 'amla-sim\[gpu\]'"),
])
def test_flashinfer_build_without_its_tools_names_the_extra(missing, kwargs, says, tmp_path, monkeypatch):
    """Without apache-tvm-ffi, torch or a toolkit, FlashInfer's build says what to install, as FA3's does (not an
    ImportError or an errno)."""
    import sys

    from amla_sim.gpu.adapters.flashinfer_build import build_mla_module

    if missing is not None:
        monkeypatch.setitem(sys.modules, missing, None)  # import fails
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(GPUUnavailable, match=says):
        build_mla_module(_flashinfer_checkout(tmp_path / "fi"), **kwargs)


def test_the_shipped_fa3_folder_is_checked_before_the_gpu(tmp_path):
    """vLLM's FA3 library named as the folder its wheel unpacks to: a folder without it is refused by name."""
    from amla_sim.gpu.adapters.fa3 import SHIPPED_FA3, load_shipped_fa3

    with pytest.raises(FileNotFoundError, match=f"^build vllm: .* has no {SHIPPED_FA3}; it should be the folder"):
        load_shipped_fa3(tmp_path)
