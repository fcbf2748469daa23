"""Engine adapters: a real serving engine's own attention metadata builders, driven by the harness.

Why a separate package: these backends run an engine's released code unmodified (vLLM's
``FlashInferMetadataBuilder``), so they need the engine installed and a few stand-ins for what a CPU-only
machine lacks. What any engine's adapter needs is engine-free (``adapter.py``, ``batches.py``; docs/engines.md);
``vllm_*.py`` is vLLM's own, ``sglang_*.py`` SGLang's. Nothing here imports an engine at module import;
``make_builders`` does (docs/vllm.md, docs/sglang.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pluggy import HookimplMarker

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import BackendRegistrar
    from pytest_kvprofile.contract.device import Device
    from pytest_kvprofile.contract.workspace import ArenaManager
    from pytest_kvprofile.lifecycle.driver import LifecycleRun

hookimpl = HookimplMarker("pytest")


def _vllm_for_run(run: LifecycleRun, device: Device, num_ubatches: int) -> ArenaManager:
    from pytest_kvprofile.engines.vllm_workspace import RecordingVllmWorkspaceManager

    return RecordingVllmWorkspaceManager(run, device, num_ubatches)


# Any: vLLM's own manager as vLLM shapes it (its get_workspace takes no route), which a test's fixture asks for
def _vllm_plain(device: Device, num_ubatches: int) -> Any:
    from pytest_kvprofile.engines.vllm_workspace import VllmWorkspaceManager

    return VllmWorkspaceManager(device, num_ubatches=num_ubatches)


def _vllm_unavailable() -> str | None:
    from pytest_kvprofile.engines.vllm_workspace import vllm_workspace_unavailable

    return vllm_workspace_unavailable()


@hookimpl(tryfirst=True)
def pytest_kvprofile_register(registry: BackendRegistrar) -> None:
    """vLLM's and SGLang's own builders (each engine imported by ``make_builders`` only) and vLLM's own shared arena
    manager."""
    from pytest_kvprofile.contract.workspace import ManagerKind
    from pytest_kvprofile.engines.sglang_flashinfer import SGLANG_BACKENDS
    from pytest_kvprofile.engines.sglang_post_capture import SGLANG_POST_CAPTURE_BACKENDS
    from pytest_kvprofile.engines.sglang_trtllm_mha import SGLANG_TRTLLM_MHA_BACKENDS
    from pytest_kvprofile.engines.sglang_trtllm_mla import SGLANG_TRTLLM_MLA_BACKENDS
    from pytest_kvprofile.engines.vllm_flashinfer import VLLM_BACKENDS

    registry.add_backends(*VLLM_BACKENDS)
    registry.add_backends(*SGLANG_BACKENDS)
    registry.add_backends(*SGLANG_POST_CAPTURE_BACKENDS)
    registry.add_backends(*SGLANG_TRTLLM_MHA_BACKENDS)
    registry.add_backends(*SGLANG_TRTLLM_MLA_BACKENDS)
    registry.add_workspace_manager(ManagerKind(
        "vllm", _vllm_for_run, _vllm_plain, _vllm_unavailable,
        gpu_refusal="runs vLLM's manager on the CPU tier's simulated device; the GPU tier uses the harness's manager"))
