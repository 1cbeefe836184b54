"""The layer rule of docs/architecture.md: no module imports from a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "amla_sim"

LAYERS = {  # module prefix -> layer (the longest matching prefix decides)
    "amla_sim._version": 0, "amla_sim._validate": 0, "amla_sim._files": 0, "amla_sim.engine": 0,
    "amla_sim.resources": 0, "amla_sim.plots": 0, "amla_sim._blas_clock": 0, "amla_sim._seeds": 0,
    "amla_sim.formats": 1, "amla_sim.bits": 1, "amla_sim._formats_numba": 1, "amla_sim.testing": 1, "amla_sim.experiments.metrics": 1,
    "amla_sim.arith": 2,
    "amla_sim.units": 3, "amla_sim.machines": 3, "amla_sim.schedules": 3, "amla_sim.gpu": 3,
    "amla_sim.algorithms": 4, "amla_sim.experiments.inputs": 4, "amla_sim.experiments.sampling": 4,
    "amla_sim.crosscheck": 5, "amla_sim.comparison": 5,
    "amla_sim.plugins": 5,
    "amla_sim.experiments": 6, "amla_sim.pipeline": 6, "amla_sim.roofline": 6, "amla_sim.invariance": 6,
    "amla_sim.cli": 7, "amla_sim": 7,
}


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise KeyError(module)
    return LAYERS[best]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every amla_sim import in `source` (module `name`), at any depth: lazy imports count."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("amla_sim"):
                for alias in node.names:  # `from . import x` imports the submodule x
                    sub = f"{target}.{alias.name}"
                    where = PACKAGE.parent / sub.replace(".", "/")
                    found.append((node.lineno, sub if where.with_suffix(".py").exists() or where.is_dir() else target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("amla_sim")]
    return found


def upward(path: Path, source: str | None = None) -> list[str]:
    me = module_name(path)
    text = path.read_text() if source is None else source
    return [f"line {line}: {mod} (layer {layer(mod)})" for line, mod in imports(text, me, path.name == "__init__.py")
            if layer(mod) > layer(me)]


FILES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    for path in FILES:
        layer(module_name(path))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_from_a_higher_layer(path):
    up = upward(path)
    assert not up, f"{module_name(path)} (layer {layer(module_name(path))}) imports upward: " + "; ".join(up)


@pytest.mark.parametrize("line", ["from ..algorithms import base", "from amla_sim.experiments import grid",
                                  "import amla_sim.cli", "from .. import crosscheck"])
def test_the_rule_catches_an_upward_import(line):
    """The checker itself: an arithmetic unit importing from above, even inside a function, is found."""
    path = PACKAGE / "arith" / "mma.py"
    source = path.read_text() + f"\n\ndef _probe():\n    {line}\n"
    assert upward(path, source) and not upward(path)


def machine_reads(source: str) -> list[str]:
    """Where `source` reads a machine's identity (`.golden`, `.name`) or its unit choices (`.exponential`, ...)."""
    from amla_sim.machines import UNITS

    tree = ast.parse(source)
    in_messages = {id(n) for f in ast.walk(tree) if isinstance(f, ast.JoinedStr) for n in ast.walk(f)}
    return [f"line {node.lineno} .{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in ("golden", "name", *UNITS)
            and id(node) not in in_messages and isinstance(node.value, ast.Name)
            and node.value.id in ("mc", "machine", "m")]


@pytest.mark.parametrize("path", sorted((PACKAGE / "algorithms").rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_algorithm_asks_which_machine_it_runs_on(path):
    """Algorithms call the machine's operations, never read its identity or its unit choices: a what-if machine
    with one unit swapped must run every algorithm unchanged."""
    assert not machine_reads(path.read_text())


@pytest.mark.parametrize("line", ["if mc.golden: pass", "x = mc.exponential.mode", "y = machine.matrix"])
def test_the_machine_rule_catches_a_read(line):
    assert machine_reads(line) and not machine_reads('raise ValueError(f"{mc.name}")')


def public_definitions(path: Path) -> set[str]:
    """The public names a module defines itself (its ``__all__`` where it has one; re-exports do not count)."""
    tree = ast.parse(path.read_text())
    own, listed = set(), None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if "__all__" in names:
                listed = set(ast.literal_eval(node.value))
            own |= names - {"__all__"}
    public = {n for n in own if not n.startswith("_")}
    return public if listed is None else public & listed


def test_no_public_name_is_defined_twice():
    """One name for one thing: two public modules never define the same public name (private modules, such as the
    compiled twins of the NumPy units, may)."""
    homes: dict[str, list[str]] = {}
    for path in FILES:
        if any(p.startswith("_") and p != "__init__.py" for p in path.relative_to(PACKAGE).parts):
            continue
        for name in public_definitions(path):
            homes.setdefault(name, []).append(module_name(path))
    twice = {n: m for n, m in homes.items() if len(m) > 1}
    assert not twice, twice


def test_the_name_rule_catches_a_second_definition(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('__all__ = ["replay"]\nfrom x import y\n\ndef replay():\n    pass\n\ndef helper():\n    pass\n')
    assert public_definitions(path) == {"replay"}


MAX_FUNCTION_LINES = 80


def long_functions(source: str) -> list[str]:
    """Functions longer than MAX_FUNCTION_LINES whose docstring does not say why (a paragraph that begins
    "Long:")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and "Long:" not in (ast.get_docstring(node) or ""):
                found.append(f"{node.name} ({lines} lines)")
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_is_long_without_a_reason(path):
    assert not long_functions(path.read_text())


def test_the_length_rule_catches_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert not long_functions(f'def f():\n    """Long: one table."""\n{body}\n')
