"""Project-test conftest: FlashInfer and the plugin's own modules imported once, and the ``slow`` marker's hooks
(``slow_sweeps.py``)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import warnings
from typing import Any

from slow_sweeps import (
    pytest_collection_modifyitems,  # noqa: F401 - a hook
    pytest_terminal_summary,  # noqa: F401 - a hook
    pytest_testnodedown,  # noqa: F401 - a hook
)

import pytest_kvprofile


def pytest_configure(config: Any) -> None:
    """An in-process ``pytester`` run restores ``sys.modules`` when it ends: what it imported first is unloaded there
    and imported (and assertion-rewritten) again by the next run. Imported once per test process instead:
    FlashInfer (unloaded, its CUTLASS DSL objects are garbage-collected later at random, which crashes the
    interpreter), the plugin's lazily imported modules and Hypothesis (its pytest plugin imports it in every run's
    summary): about half a second per in-process run. Not in an xdist controller, which runs no test."""
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        return
    if importlib.util.find_spec("flashinfer") is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # its CUTLASS DSL's own deprecations
            import flashinfer  # noqa: F401
    if importlib.util.find_spec("hypothesis") is not None:
        import hypothesis  # noqa: F401
    for module in pkgutil.walk_packages(pytest_kvprofile.__path__, "pytest_kvprofile."):
        if module.name.rsplit(".", 1)[-1].startswith("test_"):
            continue  # a packaged suite's tests are made from the run's registry (a plugin's checks): each run's own
        importlib.import_module(module.name)  # each imports its heavy dependencies lazily (tests/acceptance)

