"""tests/engines: vLLM and SGLang are each imported by the first test that needs it, once per process, not at collection
(the import costs seconds on each xdist worker, and a worker whose share holds no such test never pays it). Without
an importable engine those tests skip with its install command."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from pytest_kvprofile.engines.sglang import standins as ss
from pytest_kvprofile.engines.vllm import standins as vs
from pytest_kvprofile.engines.vllm import workspace as vw


def _import_or_skip(importer: Callable[[], Any], unavailable: type[Exception], engine: str = "vLLM",
                    hint: str = vs.VLLM_INSTALL_HINT) -> Any:
    try:
        return importer()
    except unavailable as exc:
        pytest.skip(f"{engine} is not importable ({exc.__cause__}); install it with {hint}")


@pytest.fixture(scope="session")
def vllm_flashinfer() -> Any:
    """vLLM's FlashInfer backend module, imported with its dependencies."""
    return _import_or_skip(vs.import_vllm_flashinfer, vs.VllmUnavailable)


@pytest.fixture(scope="session")
def vllm_workspace() -> Any:
    """vLLM's ``vllm.v1.worker.workspace`` module and what it needs."""
    return _import_or_skip(vw.import_vllm_workspace, vw.VllmWorkspaceUnavailable)


@pytest.fixture(scope="session")
def sglang_flashinfer() -> Any:
    """SGLang's FlashInfer backend module, imported with its stand-ins."""
    return _import_or_skip(ss.import_sglang_flashinfer, ss.SglangUnavailable, "SGLang", ss.SGLANG_INSTALL_HINT)


@pytest.fixture
def v1_runner(vllm_flashinfer: Any) -> None:
    """The installed vLLM ships the V1 model runner (0.33 and older); 0.34 removed it, and its V2 runner's tests run."""
    from pytest_kvprofile.engines.vllm.release import has_v1_runner, vllm_version

    if not has_v1_runner():
        pytest.skip(f"vLLM {vllm_version()} has no V1 model runner (removed in 0.34); the V2 runner's tests cover it")


@pytest.fixture
def profile_window_vllm(vllm_flashinfer: Any) -> None:
    """The pull request targets vLLM 0.33's runner, which sizes KV from the profiling window; vLLM 0.34 sizes after
    warmup and capture by default (its extensible KV cache), where the pull request's reservation is not driven
    (test_vllm_releases.py judges 0.34's path). The 0.33 venv runs these tests."""
    from pytest_kvprofile.engines.vllm.release import has_extensible_kv_cache, vllm_version

    if has_extensible_kv_cache():
        pytest.skip(f"vLLM {vllm_version()} sizes KV after warmup and capture: the pull request's profile-window "
                    "path is judged on vLLM 0.33 (the main venv)")
