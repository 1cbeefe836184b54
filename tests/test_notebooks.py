"""Every notebook runs top to bottom on a CPU (nbclient, part of the test extra)."""

from pathlib import Path

import pytest
from conftest import FASTEST

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    """On the fastest engine installed (the kernel, and the workers it starts, read AMLA_SIM_ENGINE): the engines
    give the same bits, and the replays check each engine on every kernel; what the notebooks show is unchanged."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("AMLA_SIM_ENGINE", FASTEST)
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_notebooks_match_their_builder():
    nbformat = pytest.importorskip("nbformat")
    import importlib.util

    spec = importlib.util.spec_from_file_location("build", NOTEBOOKS[0].parent / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert {p.name for p in NOTEBOOKS} == set(build.NOTEBOOKS)
    for p in NOTEBOOKS:
        sources = [c.source for c in nbformat.read(p, as_version=4).cells]
        assert sources == [src for _, src in build.NOTEBOOKS[p.name]], p.name


def test_committed_notebooks_are_executed_with_their_pictures():
    """The notebooks are committed as `python notebooks/build.py` writes them: executed, no errors, and the
    pictures a reader wants (error against context; per-stage ULP distances from the device)."""
    nbformat = pytest.importorskip("nbformat")
    for p in NOTEBOOKS:
        nb = nbformat.read(p, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.execution_count is not None for c in code), p.name
        assert not [o for c in code for o in c.outputs if o.output_type == "error"], p.name
        images = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
        assert images >= (1 if p.stem in ("02_amla_vs_base", "05_simulated_vs_device") else 0), p.name
