"""tests/engines: vLLM is imported by the first test that needs it, once per process, not at collection (the import
costs seconds on each xdist worker, and a worker whose share holds no vLLM test never pays it). Without an
importable vLLM those tests skip with the install command."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile.engines import vllm_standins as vs
from pytest_kvprofile.engines import vllm_workspace as vw


def _skip(exc: Exception) -> None:
    pytest.skip(f"vLLM is not importable ({exc.__cause__}); install it with {vs.VLLM_INSTALL_HINT}")


@pytest.fixture(scope="session")
def vllm_flashinfer() -> Any:
    """vLLM's FlashInfer backend module, imported with its dependencies."""
    try:
        return vs.import_vllm_flashinfer()
    except vs.VllmUnavailable as exc:
        _skip(exc)


@pytest.fixture(scope="session")
def vllm_workspace() -> Any:
    """vLLM's ``vllm.v1.worker.workspace`` module and what it needs."""
    try:
        return vw.import_vllm_workspace()
    except vw.VllmWorkspaceUnavailable as exc:
        _skip(exc)
