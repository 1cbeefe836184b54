"""The documentation site: built with warnings as errors, every internal link and anchor resolves, every public
name is documented, and (where Debian's chromium is installed) the pages render in a real browser."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _needs_sphinx() -> None:
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_nb") is None:
        if os.environ.get("CI"):
            pytest.fail('CI builds the site: install the docs extra (pip install ".[test,docs]")')
        pytest.skip('the docs toolchain is not installed (pip install ".[docs]")')


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    _needs_sphinx()
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, f"sphinx-build -W failed:\n{r.stdout}\n{r.stderr}"
    return out


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key) and (tag in ("a", "img") or (tag == "link" and key == "href")):
                self.links.append(a[key])


def _pages(site: Path) -> dict[Path, _Page]:
    pages = {}
    for path in site.rglob("*.html"):
        if "_static" in path.parts:  # the theme's template macros, not pages
            continue
        p = _Page()
        p.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = p
    return pages


def test_every_internal_link_and_anchor_resolves(site):
    pages = _pages(site)
    broken = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site)}: {link} (no such file)")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in pages[target].ids:
                broken.append(f"{path.relative_to(site)}: {link} (no such anchor)")
    assert len(pages) > 15 and not broken, "\n".join(broken[:40]) + f"\n({len(broken)} in all)"


def test_every_public_name_is_documented(site):
    sys.path.insert(0, str(DOCS))
    try:
        import conf  # the site's own list of public modules
    finally:
        sys.path.remove(str(DOCS))
    api = _pages(site)[(site / "_generated" / "api.html").resolve()]
    modules = conf.public_modules()
    assert {"amla_sim.comparison", "amla_sim.plugins", "amla_sim.formats", "amla_sim.algorithms"} <= set(modules)
    missing = [m for m in modules if f"module-{m}" not in api.ids]
    for mod in modules:
        for name in conf._all_of(mod):
            if f"{mod}.{name}" not in api.ids and f"{mod}.{name}" not in modules:
                missing.append(f"{mod}.{name}")
    import amla_sim

    for name in amla_sim.__all__:  # the root's re-exports: each documented in its home module
        obj = getattr(amla_sim, name)
        where = conf._home_of(obj) or (obj.__name__ if isinstance(obj, type(amla_sim)) else
                                       f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")
        if name != "__version__" and f"module-{where}" not in api.ids and where not in api.ids:
            missing.append(f"amla_sim.{name} (as {where})")
    assert not missing, missing


def test_the_cli_reference_has_every_command(site):
    from amla_sim.cli import build_parser

    text = (site / "_generated" / "cli.html").read_text()
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert all(f"amla-sim {name}" in text for name in sub.choices)
    assert "--algorithms" in text and "STAGE=FORMAT" in text


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
@pytest.mark.parametrize(("page", "expect"), [
    ("index.html", ["What low-precision MLA attention kernels compute", "Bring your own kernel"]),
    ("_generated/api.html", ["amla_sim.comparison", "ComparisonReport", "get_algorithm"]),
    ("_generated/notebooks/06_bring_your_own_kernel.html", ["every stage bit-identical", "split_kernel"]),
    ("reproductions.html", ["AMLA Tables 3 and 4"]),
])
def test_pages_render_in_a_real_browser(site, tmp_path, page, expect):
    """Headless chromium loads the page from disk: its DOM after scripts ran holds the text, and a screenshot is
    a real picture (kept in AMLA_SIM_SCREENSHOTS, when set, to be looked at)."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]
    url = (site / page).as_uri()
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for text in expect:
        assert text in dom.stdout, f"{page}: {text!r} not rendered"
    shot = Path(os.environ.get("AMLA_SIM_SCREENSHOTS", tmp_path)) / (page.replace("/", "_") + ".png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(flags + [f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a page, not a blank image
