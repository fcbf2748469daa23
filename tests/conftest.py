"""Project-test conftest: FlashInfer imported once, and the ``slow`` marker's hooks (``slow_sweeps.py``)."""

from __future__ import annotations

import importlib.util
import warnings

if importlib.util.find_spec("flashinfer") is not None:
    # Imported once for the whole session: an in-process ``pytester`` run restores ``sys.modules`` when it
    # ends, and a FlashInfer first imported inside one would be unloaded there, its CUTLASS DSL objects
    # garbage-collected later at random, which crashes the interpreter.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # its CUTLASS DSL's own deprecations
        import flashinfer  # noqa: F401

from slow_sweeps import (  # noqa: E402 - after FlashInfer's import, on purpose
    pytest_collection_modifyitems,  # noqa: F401 - a hook
    pytest_terminal_summary,  # noqa: F401 - a hook
    pytest_testnodedown,  # noqa: F401 - a hook
)
