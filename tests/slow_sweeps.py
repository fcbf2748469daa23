"""The project tests' ``slow`` marker: the full default-matrix sweeps stay out of a plain run, which says how many.

A plain ``pytest`` deselects them (and says how many, under ``-n`` too); any explicit ``-m`` expression decides on
its own (``pytest -m slow`` runs only them, ``pytest -m "slow or not slow"`` everything), and a slow test named by
node id (``path::test[...]``) runs. A hook rather than ``addopts = -m 'not slow'`` so that a plain
``pytest --pyargs pytest_kvprofile.suite`` from the repository root keeps no project-test option. Loaded by
``tests/conftest.py``; a module of its own so that ``tests/acceptance/test_slow_count.py`` can load it alone.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.markexpr:
        return
    named = {arg for arg in config.args if "::" in arg}
    slow = [i for i in items if i.get_closest_marker("slow") and not any(i.nodeid.startswith(n) for n in named)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        dropped = set(slow)
        items[:] = [i for i in items if i not in dropped]
    config.stash[_SLOW_DESELECTED] = len(slow)
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller collects nothing and prints the line
        config.workeroutput[_SLOW_KEY] = len(slow)


_SLOW_DESELECTED = pytest.StashKey[int]()
_SLOW_KEY = "kvprofile_slow_deselected"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """xdist's controller: every worker collected the same tests, so any one's count is the run's."""
    output = getattr(node, "workeroutput", None) or {}
    if _SLOW_KEY in output:
        node.config.stash[_SLOW_DESELECTED] = output[_SLOW_KEY]  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say how many slow tests a plain run left out, and how to run them."""
    count = config.stash.get(_SLOW_DESELECTED, 0)
    if count and not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"{count} slow tests deselected (the full sweeps): run them with `pytest -m slow`")
