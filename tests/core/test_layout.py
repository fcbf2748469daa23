"""The package's shape: no import cycle, one definition per concept, units in one module.

Read from the source with ``ast``, so a cycle hidden behind import order (one that only works
because some module happens to be imported first) is found too. Imports inside functions are lazy
on purpose (heavy or optional modules) and do not count.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest_kvprofile

PACKAGE = Path(pytest_kvprofile.__file__).resolve().parent
UNIT_NAMES = {"KiB", "MiB", "GiB", "GB", "MIB", "GIB", "KIB"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _target(name: str, attr: str | None) -> str | None:
    if attr and f"{name}.{attr}" in MODULES:
        return f"{name}.{attr}"
    return name if name in MODULES else None


def _top_level_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out.update(t for a in node.names if (t := _target(a.name, None)))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if t := _target(node.module, alias.name):
                    out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        deps = _top_level_imports(path)
        parts = name.split(".")
        # importing a.b.c runs a/__init__ and a/b/__init__ first
        deps |= {".".join(parts[:i]) for i in range(1, len(parts))}
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def test_module_level_imports_form_no_cycle():
    graph, state, stack = _graph(), {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_importing_the_package_alone_works_in_a_fresh_interpreter():
    for name in ("pytest_kvprofile", "pytest_kvprofile.plugin", "pytest_kvprofile.sizing", "pytest_kvprofile.cli"):
        subprocess.run([sys.executable, "-c", f"import {name}"], check=True, capture_output=True)


def test_every_public_class_is_defined_once():
    where = defaultdict(list)
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(name)
    twice = {cls: mods for cls, mods in where.items() if len(mods) > 1}
    assert not twice, f"one concept, two definitions: {twice}"


def test_units_are_defined_only_in_units():
    for name, path in MODULES.items():
        if name == "pytest_kvprofile.units":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                assert not names & UNIT_NAMES, f"{name} defines {names & UNIT_NAMES}: import them from units"


def test_docstrings_point_inside_the_repository():
    """Design notes the code relies on live in docs/; no reference to files outside the repo."""
    root = PACKAGE.parent
    for name, path in MODULES.items():
        text = path.read_text()
        assert "DESIGN.md" not in text, name
        for ref in {w.strip("`'\"(),.:;") for w in text.split() if w.strip("`'\"(),.:;").startswith("docs/")}:
            assert (root / ref).exists(), f"{name} points to {ref}, which does not exist"
