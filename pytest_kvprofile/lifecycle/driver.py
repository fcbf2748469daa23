"""Running one case: ``run_lifecycle`` drives a backend's builders through the engine's phases (``engine.py``) and
attaches the lifecycle's probes (``probes.py``) to the record, so the faulted and retried runs a check declares are
made here, once per case.

One run takes a backend (builders + engine policy) and a case, drives the builders through
profiling, KV sizing and serving on a device, and records what the checks need: every allocation
with owner, phase and size, the arena at each phase boundary, leases, the budget, and any error
with the builder and phase that raised it. Runs never raise for a builder's fault; the checks turn
what was recorded into verdicts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from pytest_kvprofile.lifecycle.engine import LifecycleRun, case_parts, make_device, ran_out_of_memory
from pytest_kvprofile.lifecycle.probes import run_probe
from pytest_kvprofile.lifecycle.record import LifecycleResult, ProbeTarget
from pytest_kvprofile.lifecycle.recording import LOCK_PROBE, RecordingWorkspaceManager
from pytest_kvprofile.lifecycle.teardown import close_parts
from pytest_kvprofile.memory.host_memory import return_freed_host_memory
from pytest_kvprofile.memory.long_lived import freeze_long_lived

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.contract.device import Device
    from pytest_kvprofile.lifecycle.window import WindowObserver
    from pytest_kvprofile.matrix.cases import Case


def run_lifecycle(backend: Backend, case: Case, device_factory: Callable[[Case], Device] = make_device,
                  observers: Sequence[WindowObserver] = ()) -> LifecycleResult:
    """Build the backend's builders for ``case`` on a fresh device and drive them through every phase;
    ``observers`` (``lifecycle/window.py``) measure the profiling window beside the harness. The record carries
    the case's probes (``LifecycleResult.probed``), run on first need."""
    return_freed_host_memory()  # what earlier runs' simulated devices freed, so a long sweep does not grow
    freeze_long_lived()  # no run in flight: later full collections (vLLM's memory_profiling) skip the imports
    target = ProbeTarget(backend, case, device_factory)
    result = LifecycleRun(target, device_factory(case), observers).run()
    result.prober = run_probe
    return result


__all__ = ["LOCK_PROBE", "LifecycleRun", "RecordingWorkspaceManager", "case_parts", "close_parts", "make_device",
           "ran_out_of_memory", "run_lifecycle"]
