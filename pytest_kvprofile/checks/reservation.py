"""Checks of the reservation itself: one that fails part-way leaks nothing, and the first error wins."""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult


def check_reservation_exception_safe(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Probed on fresh builders (``lifecycle/probes.py``) for each part whose reservation allocated in this run."""
    from pytest_kvprofile.lifecycle.probes import reservation_violations

    reserved = {a.owner for a in result.allocations if result.alloc_origin.get(a.id) == "reserve_persistent_workspace"}
    plan = tuple((i, name) for i, name in enumerate(result.builder_names()) if name in reserved)
    return reservation_violations(result.probe, plan)


CHECKS: tuple[Check, ...] = (
    Check("reservation_exception_safe", "a reservation that fails at any allocation raises that error, leaks "
          "nothing, and a second one holds exactly what a clean one holds", PROFILING, lc.RESERVATION, (17,),
          check_reservation_exception_safe),
)
