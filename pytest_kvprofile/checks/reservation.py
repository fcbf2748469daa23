"""Checks of the reservation itself: one that fails part-way leaks nothing, and the first error wins."""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import NO_DETAILS, Check, CheckDetails, CheckOptions
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult


def _plan(result: LifecycleResult) -> tuple[tuple[int, str], ...]:
    reserved = {a.owner for a in result.allocations if result.alloc_origin.get(a.id) == "reserve_persistent_workspace"}
    return tuple((i, name) for i, name in enumerate(result.builder_names()) if name in reserved)


def check_reservation_exception_safe(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Probed on fresh builders (``lifecycle/probes.py``) for each part whose reservation allocated in this run.

    Refused: the first error replaced, a retry that holds more than a clean reservation (a leak per attempt).
    Reported (``retry_cost``): what a failed attempt leaves held on its builder, which the retry reuses or frees:
    it was made inside the window, so KV sizing sees it."""
    from pytest_kvprofile.lifecycle.probes import reservation_outcome, run_after_failed_reservation

    outcome = reservation_outcome(result.probe, _plan(result))
    out = list(outcome.violations)
    if out:
        return out
    for name, k in outcome.last_faults:
        retried = run_after_failed_reservation(result.probe, name, k)
        for check in options.checks or _catalog():
            if check.name in _PROBED or not check.applies(retried.path):
                continue
            found = check.run(retried, options)
            if not found or check.run(result, options):  # the case's own failure, not the retry's
                continue
            for v in found[:1]:
                out.append(f"builder {name!r}: after its reservation failed at allocation #{k + 1} and the engine "
                           f"retried it, the rest of the lifecycle fails {check.name}: {v}")
    return out


# the checks that run their own probes: judged on the main run
_PROBED = frozenset({"reservation_exception_safe", "warmup_retryable", "capture_retryable"})


def _catalog() -> tuple[Check, ...]:
    """Every check, read late: the catalog lists this module's checks too."""
    from pytest_kvprofile.checks.catalog import CHECKS as ALL

    return ALL


def _retry_cost(result: LifecycleResult) -> CheckDetails:
    from pytest_kvprofile.lifecycle.probes import reservation_costs

    if result.path != PROFILING or result.probe is None or result.aborted_in is not None:
        return NO_DETAILS
    costs = reservation_costs(result.probe, _plan(result))
    return CheckDetails(retry_cost={"left_held": costs}) if costs else NO_DETAILS


CHECKS: tuple[Check, ...] = (
    Check("reservation_exception_safe", "a reservation that fails at any allocation raises that error, and a "
          "second one holds no more than a clean one (what the failed one left held is reported)", PROFILING,
          lc.RESERVATION, (17,), check_reservation_exception_safe, details=_retry_cost),
)
