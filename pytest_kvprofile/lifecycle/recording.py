"""The run's shared arena, recorded: every view a manager hands out and every growth it refuses
(``RecordingWorkspaceManager``, and the hooks vLLM's manager calls), for the engine in ``engine.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from pytest_kvprofile.contract.backends import EnginePolicy
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.contract.workspace import (
    ArenaManager,
    ArenaView,
    WorkspaceLockedError,
    WorkspaceManager,
)
from pytest_kvprofile.lifecycle.record import (
    LifecycleResult,
    Refusal,
    ViewGrant,
)
from pytest_kvprofile.lifecycle.sites import _author_site

LOCK_PROBE = "kvprofile-lock-probe"


class RecordedRun(Protocol):
    """What a recording manager reads and writes of the run it records for (``engine.LifecycleRun``)."""

    result: LifecycleResult
    device: Device
    policy: EnginePolicy
    _in_manager: bool
    _current_call: str | None
    _current_ubatch: int | None
    _asked_graph: bool | None
    _grant_of: dict[int, tuple[ArenaView, ViewGrant]]


class _RecordingMixin:
    """Records every view a manager hands out and every growth it refuses, for the harness's manager and vLLM's
    (``engines/vllm/workspace.py``, whose hooks ``_refused``, ``_caller``, ``_method`` and ``_building_ubatch``
    this answers from the run).

    A refusal is recorded before it is raised, so a builder that catches WorkspaceLockedError and
    falls back on its own buffer still leaves the refusal in the record (docs/contract.md, "Shared arena").
    """

    def __init__(self, run: RecordedRun, device: Device, num_ubatches: int):
        super().__init__(device, num_ubatches=num_ubatches)  # type: ignore[call-arg]
        self._run = run

    def get_workspace(self, requester: str, nbytes: int, ubatch: int = 0, route: str | None = None) -> ArenaView:
        run = self._run
        run._in_manager = True  # the manager slicing its own arena tensor is not a builder's use of it
        try:
            view: ArenaView = super().get_workspace(requester, nbytes, ubatch)  # type: ignore[misc]
        except WorkspaceLockedError as exc:
            if requester != LOCK_PROBE and not getattr(exc, "recorded", False):
                run.result.refusals.append(Refusal(
                    run.device.phase, requester, run._current_call, exc.ubatch, exc.requested, exc.current,
                    _author_site()))
            raise
        finally:
            run._in_manager = False
        grant = ViewGrant(run.device.phase, requester, run._current_call, run._current_ubatch, view.ubatch, view.ptr,
                          view.nbytes, route, run._asked_graph, _author_site() if requester != LOCK_PROBE else "")
        run.result.grants.append(grant)
        run._grant_of[id(view)] = (view, grant)  # two views of one arena may share pointer and bytes, not identity
        return view

    def _refused(self, refusal: Refusal) -> None:
        if refusal.requester != LOCK_PROBE:
            site = refusal.site or _author_site()
            self._run.result.refusals.append(dataclasses.replace(refusal, site=site) if site else refusal)

    def _caller(self) -> str:
        run = self._run
        return run.result.calls[-1].builder if run._current_call is not None and run.result.calls else "engine"

    def _method(self) -> str | None:
        return self._run._current_call

    def _building_ubatch(self) -> int | None:
        return self._run._current_ubatch



class RecordingWorkspaceManager(_RecordingMixin, WorkspaceManager):
    """The engine's manager (the harness's own), recording every view it hands out and every growth it refuses."""



def _workspace_manager(run: RecordedRun, device: Device, num_ubatches: int) -> ArenaManager:
    """The run's shared arena: the harness's manager, or the one ``EnginePolicy.manager_factory`` makes (vLLM's own,
    ``engines/vllm/workspace.py``), which has the same interface without sharing its class."""
    factory = run.policy.manager_factory
    if factory is not None:
        return factory(run, device, num_ubatches)
    return RecordingWorkspaceManager(run, device, num_ubatches)

