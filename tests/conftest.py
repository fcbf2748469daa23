"""Project-test conftest: ``slow`` tests (the full default-matrix sweeps) stay out of a plain run.

A plain ``pytest`` deselects them (and says how many); any explicit ``-m`` expression decides on
its own (``pytest -m slow`` runs only them, ``pytest -m "slow or not slow"`` everything), and a
slow test named by node id (``path::test[...]``) runs. A hook rather than ``addopts = -m 'not slow'``
so that a plain ``pytest --pyargs pytest_kvprofile.suite`` from the repository root keeps no
project-test option.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest

if importlib.util.find_spec("flashinfer") is not None:
    # Imported once for the whole session: an in-process ``pytester`` run restores ``sys.modules`` when it
    # ends, and a FlashInfer first imported inside one would be unloaded there, its CUTLASS DSL objects
    # garbage-collected later at random, which crashes the interpreter.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # its CUTLASS DSL's own deprecations
        import flashinfer  # noqa: F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.markexpr:
        return
    named = {arg for arg in config.args if "::" in arg}
    slow = [i for i in items if i.get_closest_marker("slow") and not any(i.nodeid.startswith(n) for n in named)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        dropped = set(slow)
        items[:] = [i for i in items if i not in dropped]
