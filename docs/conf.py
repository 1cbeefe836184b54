"""Sphinx configuration: ``pip install ".[docs]"`` then ``python -m sphinx -W -b html docs docs/_build/html``.

Pages are Markdown (MyST); the notebooks are rendered with the outputs they are committed with (the tests execute
them); the API reference is read from the docstrings and the CLI reference from the argument parsers, both at
build time, so neither can drift from the code.
"""

from __future__ import annotations

import os
import sys
from functools import cache
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

import amla_sim  # noqa: E402

project = "amla-sim"
author = "the amla-sim developers"
copyright = "2026, the amla-sim developers"
release = version = amla_sim.__version__

# sphinx-mathjax-offline: MathJax copied into the site (a page's math renders without a network)
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx-mathjax-offline"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # tests/test_notebooks.py executes them; the site shows the committed outputs
nb_render_markdown_format = "myst"  # a cell's Markdown output (a sweep's table) rendered with tables
autodoc_mock_imports = ["torch", "triton"]  # the GPU modules are documented without a GPU stack
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# annotations as written (``from __future__ import annotations``), not numpy's expansion of ArrayLike
autodoc_type_aliases = {"npt.ArrayLike": "npt.ArrayLike", "npt.NDArray": "npt.NDArray", "ArrayLike": "ArrayLike"}
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": False}
exclude_patterns = ["_build", "reproductions/**/*.md", "**/.ipynb_checkpoints"]
suppress_warnings = ["myst.header"]  # notebooks of the repo start at h1 and go to h2 as they please

html_theme = "pydata_sphinx_theme"
html_title = "amla-sim"
html_theme_options = {
    "navbar_align": "left",
    "header_links_before_dropdown": 5,  # the guide in the top bar; the rest one click away in the left column
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "navigation_with_keys": False,
}
html_static_path = ["_static"]
html_css_files = ["amla.css"]
templates_path = ["_templates"]
html_sidebars = {"**": ["sitenav.html"]}  # every section, by its caption, on every page


def _generate() -> None:
    """The notebooks (copied: Sphinx reads sources under docs/ only) and the CLI reference, into _generated/.

    Each file is written whole and renamed into place, and only where it changed; files no longer generated are
    removed: builds that run at once (the tests' workers) write the same bytes, and none sees a half-made tree."""
    out = DOCS / "_generated"
    files = {f"notebooks/{nb.name}": nb.read_bytes() for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))}
    from amla_sim.cli import build_parser

    parser = build_parser()
    parser.prog = "amla-sim"
    text = ["# CLI reference", "",
            "Generated from the argument parsers of `amla_sim.cli` when this site was built. Exit codes: 0 done, "
            "2 a usage error (the message names the argument), 1 a failure (a damaged or locked folder, an "
            "unreadable capture, no GPU, out of memory), 3 `compare`: the files differ, 130 interrupted.", "",
            "```text", parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        p.prog = f"amla-sim {name}"
        text += [f"## amla-sim {name}", "", "```text", p.format_help().rstrip(), "```", ""]
    files["cli.md"] = "\n".join(text).encode()
    files.update({f"api/{name}": text.encode() for name, text in api_pages().items()})
    for rel, data in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file() and path.read_bytes() == data:
            continue
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    for path in out.rglob("*"):
        if path.is_file() and not path.name.startswith(".") and path.relative_to(out).as_posix() not in files:
            path.unlink(missing_ok=True)


@cache
def public_modules() -> list[str]:
    """Every module of the package that declares ``__all__``, found in the sources (not imported: the GPU ones
    need torch and Triton), private ones (``_x``) left out."""
    import ast

    found = []
    for path in sorted((ROOT / "amla_sim").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if len(parts) == 1 or any(p.startswith("_") for p in parts):
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
               for n in tree.body):
            found.append(".".join(parts))
    return found


@cache
def _all_of(mod: str) -> list[str]:
    import ast

    path = ROOT / Path(*mod.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


@cache
def _data_of(mod: str) -> dict[str, bool]:
    """The names of `mod`'s ``__all__`` that are data (not functions, classes or modules): name -> whether its
    value is too long to print. Modules that need the GPU stack to import hold none."""
    import importlib
    import inspect

    try:
        m = importlib.import_module(mod)
    except ImportError:
        return {}
    out = {}
    for name in _all_of(mod):
        obj = getattr(m, name)
        if not (inspect.isroutine(obj) or inspect.isclass(obj) or inspect.ismodule(obj)):
            out[name] = len(repr(obj)) > 100
    return out


def _home_of(obj: object) -> str | None:
    """Where a data object of the root's ``__all__`` is documented: the first public module that lists it."""
    import importlib

    for mod in public_modules():
        for name in _data_of(mod):
            if getattr(importlib.import_module(mod), name) is obj:
                return f"{mod}.{name}"
    return None


def _summary(mod: str) -> str:
    """The first sentence of `mod`'s docstring (read from the source), on one line."""
    import ast

    path = ROOT / Path(*mod.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".:") if first else ""


def api_pages() -> dict[str, str]:
    """The API reference: an index (what ``import amla_sim`` re-exports, then every public module with its first
    sentence) and one page per module of its ``__all__``. File name (under _generated/api/) -> Markdown."""
    import inspect

    modules = public_modules()
    lines = ["# API reference", "",
             "Every name a module lists in `__all__`, documented from its docstring, one page per module. "
             "`npt.ArrayLike` in a signature is NumPy's `numpy.typing.ArrayLike`: an array or anything "
             "`numpy.asarray` takes.", "",
             "## `import amla_sim`", "", "The package root re-exports these, each documented in its own module:", ""]
    for name in amla_sim.__all__:
        obj = getattr(amla_sim, name)
        if inspect.ismodule(obj):
            lines.append(f"- `amla_sim.{name}`: {{py:mod}}`{obj.__name__}`")
        elif hasattr(obj, "__qualname__") and hasattr(obj, "__module__"):
            lines.append(f"- `amla_sim.{name}`: {{py:obj}}`{obj.__module__}.{obj.__qualname__}`")
        elif home := _home_of(obj):
            lines.append(f"- `amla_sim.{name}`: {{py:data}}`{home}`")
        else:
            lines.append(f"- `amla_sim.{name}` = `{obj!r}`")
    lines += ["", "## Modules", "", "| module | what it holds |", "|---|---|"]
    lines += [f"| [`{mod}`]({mod}.md) | {_summary(mod)} |" for mod in modules]
    lines += ["", "```{toctree}", ":hidden:", "", *modules, "```", ""]
    pages = {"index.md": "\n".join(lines)}
    for mod in modules:
        # a package's name that is also a submodule's (amla_sim.algorithms.flashmla) is documented there
        shadowed = [n for n in _all_of(mod) if f"{mod}.{n}" in modules]
        data = _data_of(mod)  # autodoc passes over data without a docstring: each gets its own directive
        text = [f"# `{mod}`", "", "```{eval-rst}", f".. automodule:: {mod}"]
        if shadowed or data:
            text.append(f"   :exclude-members: {', '.join(shadowed + list(data))}")
        for name, long in data.items():
            text += ["", f".. autodata:: {mod}.{name}"] + (["   :no-value:"] if long else [])
        text += ["```", ""]
        pages[f"{mod}.md"] = "\n".join(text)
    return pages


_generate()


def _no_type_docstring(app, what, name, obj, options, lines):
    """Data without a doc comment of its own (a re-export) would show its type's docstring (dict's, float's):
    show none."""
    import inspect

    if what == "data" and lines and "\n".join(lines).strip() == (inspect.getdoc(type(obj)) or "").strip():
        lines[:] = []


def _link_code_names(app, doctree, docname):
    """Inline code that is exactly a documented name (``amla_sim.compare``, ``amla_sim.algorithms.flashmla``,
    with or without ``()``) becomes a link to its entry in the API reference, on every page and notebook."""
    import inspect

    from docutils import nodes

    py = app.env.get_domain("py")
    targets = {name: (entry.docname, entry.node_id) for name, entry in py.objects.items()}
    targets.update({name: (entry.docname, entry.node_id) for name, entry in py.modules.items()})
    for name in amla_sim.__all__:  # the root's re-exports (amla_sim.compare) link to their home
        obj = getattr(amla_sim, name)
        home = obj.__name__ if inspect.ismodule(obj) else f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        if home in targets:
            targets.setdefault(f"amla_sim.{name}", targets[home])
    for literal in list(doctree.findall(nodes.literal)):
        if isinstance(literal.parent, (nodes.reference, nodes.literal_block)) or "xref" in literal["classes"]:
            continue
        text = literal.astext()
        hit = targets.get(text.removesuffix("()"))
        if hit is None or not text.startswith("amla_sim."):
            continue
        target_doc, anchor = hit
        uri = app.builder.get_relative_uri(docname, target_doc) + "#" + anchor
        ref = nodes.reference("", "", internal=True, refuri=uri, reftitle=text)
        literal.replace_self(ref)
        ref.append(literal)


def _site_sections(app) -> list[tuple[str, list[tuple[str, str, set[str]]]]]:
    """The root page's toctrees: (caption, [(page, title, every page under it)]), read once a build (kept on the
    application, not the environment, which Sphinx pickles into the next, incremental, build)."""
    from sphinx import addnodes
    from sphinx.util.nodes import clean_astext

    env = app.env
    if getattr(app, "_amla_site_sections", None) is None:
        sections = []
        for toctree in env.get_doctree(env.config.root_doc).findall(addnodes.toctree):
            entries = []
            for title, page in toctree["entries"]:
                below, todo = {page}, [page]
                while todo:  # the pages its own toctrees reach, at any depth
                    for child in env.toctree_includes.get(todo.pop(), []):
                        if child not in below:
                            below.add(child)
                            todo.append(child)
                entries.append((page, title or clean_astext(env.titles[page]), below))
            sections.append((toctree.get("caption", ""), entries))
        app._amla_site_sections = sections
    return app._amla_site_sections


def _site_nav(app, pagename, templatename, context, doctree):
    """The left column (``sitenav.html``): every caption of the root's toctrees with its pages, the page shown and
    the entry it sits under marked current, as Sphinx's ``toctree(maxdepth=1, titles_only=True)`` marks them. Built
    from the toctrees read once, not by resolving the whole site's tables of contents again on every page."""
    from html import escape

    from markupsafe import Markup

    parts = []
    for caption, entries in _site_sections(app):
        here = ' class="current"' if any(pagename in below for _, _, below in entries) else ""
        parts.append(f'<p aria-level="2" class="caption" role="heading"><span class="caption-text">'
                     f'{escape(caption, quote=False)}</span></p>\n<ul{here}>\n')
        for page, title, below in entries:
            li = "toctree-l1 current" if pagename in below else "toctree-l1"
            if page == pagename:
                link = f'<a class="current reference internal" href="#">{escape(title, quote=False)}</a>'
            else:
                href = escape(app.builder.get_relative_uri(pagename, page))
                link = f'<a class="reference internal" href="{href}">{escape(title, quote=False)}</a>'
            parts.append(f'<li class="{li}">{link}</li>\n')
        parts.append("</ul>\n")
    context["site_nav"] = Markup("".join(parts))


def setup(app):
    app.connect("html-page-context", _site_nav)
    app.connect("autodoc-process-docstring", _no_type_docstring)
    app.connect("doctree-resolved", _link_code_names)
