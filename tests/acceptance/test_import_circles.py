"""No import circle inside ``contract/`` or ``memory/``: every import counts, ``TYPE_CHECKING`` and function-level ones
included, since each is a dependency that runs back up.

A string lookup (``sys.modules.get``) is not an import: ``SimDevice.active_simulation`` reads torch mode only when
something else loaded it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_kvprofile"
CHECKED = ("contract", "memory")


def _module_name(path: Path, root: Path, prefix: str) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((prefix, *parts))


def import_graph(folder: Path, prefix: str) -> dict[str, set[str]]:
    """Module -> the modules of ``folder`` it imports anywhere in its body (``prefix`` is the folder's dotted name)."""
    modules = {_module_name(p, folder, prefix): p for p in sorted(folder.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[module] |= {n for n in names if n in modules and n != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", CHECKED)
def test_no_import_circle_inside_the_package(package):
    graph = import_graph(PACKAGE / package, f"pytest_kvprofile.{package}")
    assert len(graph) > 3, f"{package}/ looks empty: the walk found {sorted(graph)}"
    assert not circles(graph), f"import circles in {package}/ (break each; TYPE_CHECKING imports count too)"


def test_a_planted_circle_is_found(tmp_path):
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg import a\n")
    (tmp_path / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert circles(graph) == [["pkg.a", "pkg.b"]]
