"""The lifecycle's probes: the faulted and retried runs a check declares (``Check.probes``), made here, not in
``checks/``.

Each probe drives fresh builders of the record's case (``LifecycleResult.probe``) on fresh devices:

| probe | module | what it fails and retries |
|---|---|---|
| ``reservation`` | ``probe_reservation.py`` | each reservation at each site, then the rest of the lifecycle |
| ``warmup`` | ``probe_warmup.py`` | each warmup, at each allocation, in each phase the engine warms up in |
| ``capture`` | ``probe_capture.py`` | the engine's capture, at each distinct site a builder allocates at in it |

``run_lifecycle`` attaches :func:`run_probe` to the record; ``LifecycleResult.probed`` runs a probe once per record,
on first need, and keeps its outcome for every check. The fault points come from the record itself (the plans
below): a part is probed where the main run saw it allocate.
"""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.lifecycle.probe_capture import CapturePlan, capture_retry_violations
from pytest_kvprofile.lifecycle.probe_reservation import reservation_outcome
from pytest_kvprofile.lifecycle.probe_runs import run_after_failed_reservation
from pytest_kvprofile.lifecycle.probe_warmup import warmup_retry_violations
from pytest_kvprofile.lifecycle.record import (
    CAPTURE_PROBE,
    PROFILING,
    RESERVATION_PROBE,
    WARMUP_PROBE,
    LifecycleResult,
    ProbeOutcome,
    RetriedRun,
)


def reservation_plan(result: LifecycleResult) -> tuple[tuple[int, str], ...]:
    """``(builder index, name)`` of each part whose reservation allocated in the main run."""
    reserved = {a.owner for a in result.allocations if result.alloc_origin.get(a.id) == "reserve_persistent_workspace"}
    return tuple((i, name) for i, name in enumerate(result.builder_names()) if name in reserved)


def warmup_plan(result: LifecycleResult) -> tuple[tuple[lc.Phase, int, str], ...]:
    """``(phase, builder index, name)`` of each warmup the main run saw allocate, in each phase it warmed up in."""
    names = result.builder_names()
    allocated = {(a.phase, a.owner) for a in result.allocations if result.alloc_origin.get(a.id) == "warmup"}
    warmups: tuple[lc.Phase, ...] = (lc.PROFILE_WARMUP, lc.WARMUP)
    return tuple((state, i, name) for state in warmups for i, name in enumerate(names) if (state, name) in allocated)


def capture_plan(result: LifecycleResult) -> CapturePlan:
    """The builders that allocated device memory while the engine captured (the capture probe's fault sites)."""
    names = set(result.builder_names())
    made = {a.owner for a in result.allocations if a.phase == lc.CAPTURE and a.kind == "device" and a.owner in names}
    return tuple(name for name in result.builder_names() if name in made)


def _reservation(result: LifecycleResult) -> ProbeOutcome:
    """Refusals, the costs reported, and the case's lifecycle after each part's last fault point (its retried run,
    closed), which every check judges. A run that did not finish its profiling path reports no costs."""
    outcome = reservation_outcome(result.probe, reservation_plan(result))
    costs = outcome.costs if result.path == PROFILING and result.aborted_in is None else ()
    if outcome.violations:
        return ProbeOutcome(violations=outcome.violations, costs=costs)
    retried = tuple(RetriedRun(name, k, run_after_failed_reservation(result.probe, name, k))
                    for name, k in outcome.last_faults)
    return ProbeOutcome(costs=costs, retried=retried)


def run_probe(result: LifecycleResult, probe: str) -> ProbeOutcome:
    """Run ``probe`` for the case ``result`` recorded (``LifecycleResult.probed`` calls it once per probe)."""
    if probe == RESERVATION_PROBE:
        return _reservation(result)
    if probe == WARMUP_PROBE:
        return ProbeOutcome(violations=tuple(warmup_retry_violations(result.probe, warmup_plan(result))))
    if probe == CAPTURE_PROBE:
        return ProbeOutcome(violations=tuple(capture_retry_violations(result.probe, capture_plan(result))))
    raise ValueError(f"unknown probe {probe!r}")
