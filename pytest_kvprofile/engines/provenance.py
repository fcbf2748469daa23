"""What a verdict names about the engine an engine backend ran on (``Backend.provenance``; issue 50, "Provenance").

Kept small and apart so an engine's package can change it with its release differences: the engine's version is read
from the installed distribution's metadata (the engine is never imported here), and the runner is the one the
backend models (vLLM 0.33: ``vllm-flashinfer`` the V1 model runner, ``vllm-flashinfer-v2`` the V2 one; SGLang's
``ModelRunner``). ``flashinfer`` stays empty: the builders run the installed FlashInfer, which the report fills in.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

from pytest_kvprofile.contract.backends import Provenance

__all__ = ["distribution_version", "sglang_provenance", "vllm_provenance", "vllm_runner"]


def distribution_version(dist: str) -> str:
    """The installed version of ``dist`` (``vllm``, ``sglang``), or empty when it is not installed."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return ""


def vllm_runner(backend_name: str) -> str:
    """The vLLM model runner a backend of that name models: ``V2`` for a ``-v2`` backend, else ``V1``."""
    return "V2" if backend_name.endswith("-v2") else "V1"


def _vllm(runner: str) -> Provenance:
    return Provenance(engine="vllm", engine_version=distribution_version("vllm"), runner=runner)


def vllm_provenance(backend_name: str) -> Callable[[], Provenance]:
    """``Backend.provenance`` of a vLLM backend: the installed vLLM and the runner :func:`vllm_runner` names."""
    return functools.partial(_vllm, vllm_runner(backend_name))


def sglang_provenance() -> Provenance:
    """``Backend.provenance`` of an SGLang backend: the installed SGLang and its ``ModelRunner``."""
    return Provenance(engine="sglang", engine_version=distribution_version("sglang"), runner="ModelRunner")
