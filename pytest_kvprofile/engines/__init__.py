"""Engine adapters: a real serving engine's own attention metadata builders, driven by the harness.

Why a separate package: these backends run an engine's released code unmodified (vLLM's
``FlashInferMetadataBuilder``), so they need the engine installed and a few stand-ins for what a CPU-only
machine lacks. What any engine's adapter needs is engine-free (``adapter.py``, ``batches.py``, ``model_config.py``;
docs/engines.md). Each engine is a package of its own (``vllm/``, ``sglang/``) that owns its facts and release
differences and registers through the plugin's hook (its ``pytest_kvprofile_register``): a third engine is one more
folder, found by :func:`engine_plugins`. Nothing here imports an engine at module import; ``make_builders`` does
(docs/vllm.md, docs/sglang.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from pluggy import HookimplMarker

hookimpl = HookimplMarker("pytest")


def engine_plugins() -> tuple[ModuleType, ...]:
    """Every engine package under ``engines/`` (a subpackage implementing ``pytest_kvprofile_register``), by name."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.ispkg:
            module = importlib.import_module(f"{__name__}.{info.name}")
            if callable(getattr(module, "pytest_kvprofile_register", None)):
                found.append(module)
    return tuple(found)
