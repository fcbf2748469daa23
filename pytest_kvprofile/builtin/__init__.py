"""The built-in backends: correct CPU stubs (``stubs``), one mutant per bug class (``mutants``), the backend made of
real FlashInfer wrappers with its mutants, and the DMA output workspace resource with its buggy variants
(``resources``). They register through the plugin's own hook, as a third party's plugin would."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pluggy import HookimplMarker

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import BackendRegistrar
    from pytest_kvprofile.contract.device import Device
    from pytest_kvprofile.contract.workspace import WorkspaceManager

hookimpl = HookimplMarker("pytest")


def _harness_manager(device: Device, num_ubatches: int) -> WorkspaceManager:
    from pytest_kvprofile.contract.workspace import WorkspaceManager

    return WorkspaceManager(device, num_ubatches=num_ubatches)


@hookimpl(tryfirst=True)
def pytest_kvprofile_register(registry: BackendRegistrar) -> None:
    """The stubs (the default group), the torch-mode and route stubs, the mutants (a group), the real-FlashInfer
    backend and its mutants; and the harness's own shared arena manager, every engine's default."""
    from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS, REAL_FLASHINFER_MUTANTS
    from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
    from pytest_kvprofile.builtin.stubs import ROUTE_STUB_BACKENDS, STUB_BACKENDS, TORCH_STUB_BACKENDS
    from pytest_kvprofile.contract.workspace import ManagerKind

    registry.add_backends(*STUB_BACKENDS, group="stubs", default=True)
    registry.add_backends(*TORCH_STUB_BACKENDS, *ROUTE_STUB_BACKENDS)
    registry.add_backends(*MUTANT_BACKENDS, group="mutants")
    registry.add_backends(*REAL_FLASHINFER_BACKENDS, *REAL_FLASHINFER_MUTANTS)
    registry.add_workspace_manager(ManagerKind("harness", None, _harness_manager))
