"""What a conformance check is: a named rule, the path and phase it needs, a function of a record.

A check is a function from a LifecycleResult and the run's options to violations. Each check names the rule it enforces and the phase it needs; a run that aborted before that phase
fails the check with the builder, phase and error that stopped it. An empty list is a pass. Every
check only reads the record, except ``warmup_retryable``, which re-runs the builders of the
record's probe target on fresh devices (the fault injection cannot happen inside the main run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.units import MiB

DEFAULT_WASTE_SLACK = 2 * MiB  # one large-block rounding of the caching allocator
BOTH = "both"


@dataclass(frozen=True)
class CheckOptions:
    """The run's settings a check reads (ini ``kvprofile_workspace_slack_mib``)."""

    waste_slack_bytes: int = DEFAULT_WASTE_SLACK


CheckFn = Callable[[LifecycleResult, CheckOptions], list[str]]


def _always(case: Any, parts: list[Any]) -> bool:
    return True


@dataclass(frozen=True)
class Check:
    name: str
    rule: str
    path: str  # which lifecycle path it applies to
    needs: str  # the last phase it reads
    bugs: tuple[int, ...]
    fn: CheckFn
    relevant: Callable[[Any, list[Any]], bool] = _always  # False: the check has nothing to look at here

    def applies(self, path: str) -> bool:
        return self.path == BOTH or self.path == path

    def run(self, result: LifecycleResult, options: CheckOptions = CheckOptions()) -> list[str]:
        abort = aborted_before(result, self.needs)
        if abort:
            return [abort]
        return self.fn(result, options)


def aborted_before(result: LifecycleResult, phase: str) -> str | None:
    """Why the phases this check needs never ran (a builder or engine error), or None."""
    if result.aborted_in is None:
        return None
    order = lc.PHASE_ORDER
    if result.aborted_in in order and phase in order and order.index(result.aborted_in) > order.index(phase):
        return None
    err = next((e for e in result.errors if not e.injected), None)
    detail = err.describe() if err else f"aborted in phase {result.aborted_in!r}"
    return f"the lifecycle stopped before phase {phase!r}: {detail}"
