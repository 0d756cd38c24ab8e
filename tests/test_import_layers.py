"""The project's modules form layers: no module imports, even inside a function, a module that imports
it back, directly or through others; nor does any package of ``repsim`` (``data``, ``methods``, the
``tasks`` and ``flows`` folders) import one that imports it back."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def module_names() -> dict[str, Path]:
    """Each module's dotted name (tasks/ and flows/ install as repsim.tasks and repsim.flows) and file."""
    names = {}
    for folder in ("repsim", "tasks", "flows"):
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            parts = ("repsim", *parts) if folder != "repsim" else parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(path: Path, names: dict[str, Path]) -> set[str]:
    """The project's modules that the module at ``path`` imports anywhere in it: ``from a.b import c``
    counts as an import of ``a.b.c`` where that is a module, else of ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in names else node.module
                      for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & names.keys()


def package(name: str) -> str:
    """The layer a module belongs to: its package below ``repsim`` (or its own name, for a top module)."""
    return name.split(".")[1] if name.count(".") else name


def import_graph(level) -> dict[str, set[str]]:
    names = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        graph.setdefault(level(name), set()).update(
            level(target) for target in imports(path, names)
            if level(target) != level(name) and not name.startswith(f"{target}."))  # a package's own __init__
    return graph


@pytest.mark.parametrize("level", [lambda name: name, package], ids=["modules", "packages"])
def test_no_import_circle(level):
    try:
        order = list(TopologicalSorter(import_graph(level)).static_order())
    except CycleError as err:
        pytest.fail(f"an import circle: {' -> '.join(err.args[1])}")
    assert len(order) > 10


def test_imports_inside_functions_count():
    names = module_names()
    assert "repsim.flows.experiment" in imports(REPO / "flows" / "cli.py", names)  # imported in a function only
    assert "repsim.data" in imports(REPO / "flows" / "cli.py", names)

