"""vLLM's own builders under the harness: its facts, its release differences (``release.py``) and its registration.

``flashinfer.py`` drives vLLM's ``FlashInferMetadataBuilder`` as its runners integrate it; ``config.py`` makes a
case vLLM's config; ``release.py`` asks the installed wheel what differs between releases; ``workspace.py`` is vLLM's
own ``WorkspaceManager`` as the run's arena; ``memory.py`` vLLM's ``memory_profiling``; ``gdn.py`` its GDN builder;
``pull_request.py`` the open pull request's API; ``facts.py`` its workspaces, KV-dtype names, route policy and
FlashInfer pins; ``standins.py`` what a CPU-only machine lacks (docs/vllm.md).
vLLM is imported by ``make_builders`` only, never here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_kvprofile.engines import hookimpl

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import BackendRegistrar
    from pytest_kvprofile.contract.device import Device
    from pytest_kvprofile.contract.workspace import ArenaManager
    from pytest_kvprofile.lifecycle.driver import LifecycleRun


def _vllm_for_run(run: LifecycleRun, device: Device, num_ubatches: int) -> ArenaManager:
    from pytest_kvprofile.engines.vllm.workspace import recording_manager

    return recording_manager(run, device, num_ubatches)


# Any: vLLM's own manager as vLLM shapes it (its get_workspace takes no route), which a test's fixture asks for
def _vllm_plain(device: Device, num_ubatches: int) -> Any:
    from pytest_kvprofile.engines.vllm.workspace import VllmWorkspaceManager

    return VllmWorkspaceManager(device, num_ubatches=num_ubatches)


def _vllm_unavailable() -> str | None:
    from pytest_kvprofile.engines.vllm.workspace import vllm_workspace_unavailable

    return vllm_workspace_unavailable()


@hookimpl(tryfirst=True)
def pytest_kvprofile_register(registry: BackendRegistrar) -> None:
    """vLLM's facts, its own builders (vLLM imported by ``make_builders`` only) and its own shared arena manager."""
    from pytest_kvprofile.contract.workspace import ManagerKind
    from pytest_kvprofile.engines.vllm.facts import VLLM_FACTS
    from pytest_kvprofile.engines.vllm.flashinfer import VLLM_BACKENDS

    registry.add_engine_facts(VLLM_FACTS)
    registry.add_backends(*VLLM_BACKENDS)
    registry.add_workspace_manager(ManagerKind(
        "vllm", _vllm_for_run, _vllm_plain, _vllm_unavailable,
        gpu_refusal="runs vLLM's manager on the CPU tier's simulated device; the GPU tier uses the harness's manager"))
