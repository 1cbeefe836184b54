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
    pages = _pages(site)
    modules = conf.public_modules()
    api = _Page()  # the ids of the API reference's pages together: one page per module
    for mod in modules:
        api.ids |= pages[(site / "_generated" / "api" / f"{mod}.html").resolve()].ids
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


class _Nav(HTMLParser):
    """The left column's entries: (title, href, li current, link current), and which lists are current."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.entries, self.lists, self._li = False, [], [], None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "nav" and a.get("aria-label") == "Site":
            self.inside = True
        elif self.inside and tag == "ul":
            self.lists.append("current" in (a.get("class") or "").split())
        elif self.inside and tag == "li":
            self._li = "current" in a["class"].split()
        elif self.inside and tag == "a":
            self.entries.append([None, a["href"], self._li, "current" in a["class"].split()])

    def handle_endtag(self, tag):
        self.inside = self.inside and tag != "nav"

    def handle_data(self, data):
        if self.inside and self.entries and self.entries[-1][0] is None:
            self.entries[-1][0] = data


@pytest.mark.parametrize(("page", "current", "under"), [
    ("usage.html", "Usage", 0),  # the page itself: its entry and link current, its section's list current
    ("_generated/api/amla_sim.bits.html", "API", 1),  # a page under an entry: the entry current, not its link
    ("_generated/notebooks/06_bring_your_own_kernel.html", "Tutorial", 0),
    ("index.html", None, None),  # the root: in no toctree, nothing current
])
def test_every_page_lists_the_whole_site_with_itself_marked(site, page, current, under):
    nav = _Nav()
    nav.feed((site / page).read_text(encoding="utf-8"))
    titles = [e[0] for e in nav.entries]
    assert len(titles) == 15 and {"Tutorial", "API", "CLI", "Lemma 3.1", "Why did my output change?"} <= set(titles)
    marked = [(e[0], e[3]) for e in nav.entries if e[2]]
    assert marked == ([] if current is None else [(current, under == 0)])
    assert nav.lists == [False, False, False] if current is None else nav.lists.count(True) == 1
    for title, href, _, _ in nav.entries:  # every link reaches its page from this one
        assert href == "#" or (site / page).parent.joinpath(href).resolve().is_file(), (title, href)


def test_the_cli_reference_has_every_command(site):
    from amla_sim.cli import build_parser

    text = (site / "_generated" / "cli.html").read_text()
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert all(f"amla-sim {name}" in text for name in sub.choices)
    assert "--algorithms" in text and "STAGE=FORMAT" in text


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Rendered(HTMLParser):
    """What a page's DOM holds after its scripts ran: math spans and MathJax's output, tables and their rows,
    images, and the text."""

    def __init__(self) -> None:
        super().__init__()
        self.math = self.typeset = self.tables = 0
        self.rows: list[int] = []
        self.images: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and "math" in (a.get("class") or "").split():
            self.math += 1
        elif tag == "mjx-container":
            self.typeset += 1
        elif tag == "table":
            self.tables += 1
            self.rows.append(0)
        elif tag == "tr" and self.rows:
            self.rows[-1] += 1
        elif tag == "img" and a.get("src"):
            self.images.append(a["src"])

    def handle_data(self, data):
        self.text.append(data)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# page -> (texts it must show, math typeset, tables at least, images at least)
RENDERED = [
    ("index.html", ["What low-precision MLA attention kernels compute", "Headline results", "Tutorial"], False, 1, 0),
    ("_generated/api/index.html", ["amla_sim.comparison", "ComparisonReport"], False, 1, 0),
    ("_generated/api/amla_sim.plugins.html", ["get_algorithm", "PluginError"], False, 0, 0),
    ("_generated/notebooks/06_bring_your_own_kernel.html", ["every stage bit-identical", "split_kernel",
                                                           "capture.py", "replay.py"], False, 1, 1),
    ("_generated/notebooks/01_lemma_3_1.html", ["Lemma 3.1"], True, 0, 0),
    ("reproductions.html", ["AMLA Tables 3 and 4"], False, 5, 7),
    ("crosscheck.html", ["What each model takes", "a causal step longer than its request", "The merges of a chunked "
                         "prefill", "FA3\u2019s MHA form and vLLM\u2019s chain", "a k of no row",
                         "accumulates in two levels on 128 x 96 tiles", "DeepGEMM\u2019s FP8 block GEMM",
                         "The absorbed projections"], False, 3, 0),
    ("why-changed.html", ["row ulp", "NaN against NaN", "Which kernel computes my token\u2019s prefill?",
                          "its batchmates change its chunks and the kernel"], False, 1, 0),
]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
@pytest.mark.parametrize(("page", "texts", "math", "tables", "images"), RENDERED, ids=[r[0] for r in RENDERED])
def test_pages_render_in_a_real_browser(site, tmp_path, page, texts, math, tables, images):
    """Headless chromium loads the page from disk, with no network, and runs its scripts: the DOM then holds the
    text, every math span typeset by the site's own MathJax, the tables with their rows, and images that are real
    pictures; the screenshot (kept in AMLA_SIM_SCREENSHOTS, when set, to be looked at) is not blank."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--proxy-server=127.0.0.1:9", "--virtual-time-budget=20000",  # no network: MathJax must be the site's
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]
    path = site / page
    dom = subprocess.run(flags + ["--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=180,
                         check=False)
    assert dom.returncode == 0, dom.stderr[-2000:]
    got = _Rendered()
    got.feed(dom.stdout)
    text = " ".join(" ".join(got.text).split())
    for t in texts:
        assert t in text, f"{page}: {t!r} not rendered"
    if math:
        assert got.math > 0 and got.typeset >= got.math, f"{page}: {got.typeset} of {got.math} math spans typeset"
        assert "\\(" not in text, f"{page}: raw TeX left on the page"
    assert got.tables >= tables and all(n >= 2 for n in got.rows), f"{page}: tables {got.tables}, rows {got.rows}"
    pictures = [path.parent / unquote(src) for src in got.images if not src.startswith(("data:", "http"))]
    assert len(pictures) >= images, f"{page}: {len(pictures)} images"
    for pic in pictures:
        w, h = _png_size(pic) if pic.suffix == ".png" else (1, 1)
        assert pic.is_file() and w > 100 and h > 100, f"{page}: image {pic.name} is {w} x {h}"
    shot = Path(os.environ.get("AMLA_SIM_SCREENSHOTS", tmp_path)) / (page.replace("/", "_") + ".png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(flags + [f"--screenshot={shot}", path.as_uri()], capture_output=True, text=True, timeout=180,
                       check=False)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    colours = _colours(shot)
    assert colours > 50, f"{page}: the screenshot has {colours} colours (blank?)"


def _colours(png: Path) -> int:
    """How many distinct colours a screenshot holds (a blank page has one or two); Pillow comes with matplotlib."""
    from PIL import Image

    with Image.open(png) as im:
        return len(im.convert("RGB").getcolors(maxcolors=1 << 20) or [])
