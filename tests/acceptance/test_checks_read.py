"""Checks read; the lifecycle runs (issue 53): no module of ``checks/`` imports a module that drives a backend, and
the packages hold no import circle, counting imports inside functions and under ``TYPE_CHECKING``.

Read from the source with ``ast`` (``test_layout._all_imports``), so a lazy import is found like any other. Each rule
is also shown failing on a planted import.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_layout import MODULES, _all_imports

CHECKS = "pytest_kvprofile.checks"
LIFECYCLE = "pytest_kvprofile.lifecycle"

# what a check may read of the lifecycle: the record and the phases' names; every other lifecycle module runs
# builders (the engine, the driver, the probes and their parts, process-wide state, forked children...)
READABLE = frozenset({f"{LIFECYCLE}.record", f"{LIFECYCLE}.phases"})
# packages and modules outside lifecycle/ that build or drive a backend
DRIVING_ELSEWHERE = ("pytest_kvprofile.engines", "pytest_kvprofile.builtin", "pytest_kvprofile.gpu",
                     "pytest_kvprofile.registry", "pytest_kvprofile.plugin", "pytest_kvprofile.memory.torch_mode",
                     "pytest_kvprofile.memory.simulated_gpu")


def drives(module: str) -> bool:
    """Whether importing ``module`` gives the importer a way to drive a backend."""
    if module == LIFECYCLE or module.startswith(LIFECYCLE + "."):
        return module not in READABLE
    return any(module == d or module.startswith(d + ".") for d in DRIVING_ELSEWHERE)


def driving_imports(path: Path) -> list[str]:
    return [f"{path.name}:{line}: imports {target}" for target, line, _ in _all_imports(path) if drives(target)]


def test_checks_drive_nothing():
    """The faulted and retried runs a check needs come from the record (``LifecycleResult.probed``)."""
    found = [hit for name, path in MODULES.items() if name == CHECKS or name.startswith(CHECKS + ".")
             for hit in driving_imports(path)]
    assert not found, "a check imports a module that drives a backend (declare a probe instead):\n" + "\n".join(found)


def test_a_planted_driving_import_is_found(tmp_path: Path):
    planted = tmp_path / "planted.py"
    planted.write_text("from pytest_kvprofile.lifecycle.record import LifecycleResult\n"
                       "import pytest_kvprofile.lifecycle.driver\n"
                       "def check(result):\n"
                       "    from pytest_kvprofile.lifecycle.probes import run_probe\n"
                       "    from pytest_kvprofile.lifecycle import probe_warmup\n"
                       "    return run_probe(result, 'warmup')\n")
    found = driving_imports(planted)
    assert [hit.split(": imports ")[1] for hit in found] == [
        f"{LIFECYCLE}.driver", f"{LIFECYCLE}.probes", f"{LIFECYCLE}.probe_warmup"], found


# every subpackage is held free of circles (issue 53 removed six); a circle accepted for a while is listed here,
# and the test fails while an entry names a circle no longer there, so the list only shrinks
KNOWN_CIRCLES: dict[str, set[tuple[str, ...]]] = {}
PACKAGES = tuple(sorted(p.name for p in Path(MODULES["pytest_kvprofile"]).parent.iterdir()
                         if (p / "__init__.py").is_file()))


def circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The import circles of ``graph``: each strongly connected set of two or more modules (or one importing
    itself), sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[tuple[str, ...]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            scc = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                scc.append(top)
                if top == node:
                    break
            if len(scc) > 1 or node in graph.get(node, ()):
                out.add(tuple(sorted(scc)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def package_graph(package: str) -> dict[str, set[str]]:
    """Every import between two modules of ``package``, at module level, inside a function or under
    ``TYPE_CHECKING`` (a package's ``__init__`` counts as a module)."""
    prefix = f"pytest_kvprofile.{package}"
    inside = {name: path for name, path in MODULES.items() if name == prefix or name.startswith(prefix + ".")}
    return {name: {t for t, _, _ in _all_imports(path) if t in inside and t != name} for name, path in inside.items()}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_inside_a_package(package: str):
    found = circles(package_graph(package))
    known = KNOWN_CIRCLES.get(package, set())
    assert not found - known, f"import circles in {package}/ (lazy and TYPE_CHECKING imports count): " \
                              f"{sorted(found - known)}"
    assert not known - found, f"KNOWN_CIRCLES[{package!r}] names circles that are gone; delete them: " \
                              f"{sorted(known - found)}"


def test_a_planted_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == {("a", "b", "c"), ("e",)}
    planted = package_graph("lifecycle")
    planted[f"{LIFECYCLE}.record"].add(f"{LIFECYCLE}.module_state")  # what record.py imported before issue 53
    assert (f"{LIFECYCLE}.module_state", f"{LIFECYCLE}.record") in circles(planted)
