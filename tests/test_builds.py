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
