"""Checks of the reservation itself: one that fails part-way leaks nothing, and the first error wins.

The lifecycle makes the faulted runs (``lifecycle/probes.py``, the ``reservation`` probe); this module only reads
their outcome from the record. The retried runs are judged by every check of the run, so the catalog hands the
check its list (:func:`checks`): the built-in catalog, or the run's ``CheckOptions.checks``.
"""

from __future__ import annotations

from typing import Callable

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import NO_DETAILS, Check, CheckDetails, CheckFn, CheckOptions
from pytest_kvprofile.lifecycle.record import PROFILING, RESERVATION_PROBE, LifecycleResult


def reservation_exception_safe(every: Callable[[], tuple[Check, ...]]) -> CheckFn:
    """The check, judging retried runs with ``options.checks`` or, when empty, ``every()`` (the built-in catalog)."""

    def check_reservation_exception_safe(result: LifecycleResult, options: CheckOptions) -> list[str]:
        """Probed on fresh builders by the lifecycle for each part whose reservation allocated in this run.

        Refused: the first error replaced, a retry that holds more than a clean reservation (a leak per attempt),
        and a retried run that fails a check the case's own run passes. Reported (``retry_cost``): what a failed
        attempt leaves held on its builder, which the retry reuses or frees: it was made inside the window, so KV
        sizing sees it."""
        outcome = result.probed(RESERVATION_PROBE)
        out = list(outcome.violations)
        if out:
            return out
        for retried in outcome.retried:
            for check in options.checks or every():
                if check.probes or not check.applies(retried.result.path):
                    continue  # a probed check is judged on the case's own run
                found = check.run(retried.result, options)
                if not found or check.run(result, options):  # the case's own failure, not the retry's
                    continue
                for v in found[:1]:
                    out.append(f"builder {retried.builder!r}: after its reservation failed at allocation "
                               f"#{retried.fault + 1} and the engine retried it, the rest of the lifecycle fails "
                               f"{check.name}: {v}")
        return out

    return check_reservation_exception_safe


def _retry_cost(result: LifecycleResult) -> CheckDetails:
    if result.path != PROFILING or result.aborted_in is not None:
        return NO_DETAILS
    costs = list(result.probed(RESERVATION_PROBE).costs)
    return CheckDetails(retry_cost={"left_held": costs}) if costs else NO_DETAILS


def checks(every: Callable[[], tuple[Check, ...]]) -> tuple[Check, ...]:
    """The family's checks; ``every`` answers the built-in catalog, read when a retried run is judged."""
    return (
        Check("reservation_exception_safe", "a reservation that fails at any allocation raises that error, and a "
              "second one holds no more than a clean one (what the failed one left held is reported)", PROFILING,
              lc.RESERVATION, (17,), reservation_exception_safe(every), details=_retry_cost,
              probes=(RESERVATION_PROBE,)),
    )
