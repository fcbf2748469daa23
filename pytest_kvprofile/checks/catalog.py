"""The conformance checks, in the order the suite runs and reports them, gathered from their families.

A check lives in the module of its family (``support``, ``leases``, ``reservation``, ``warmup``, ``arena``,
``freed``, ``capture``, ``resources``, ``isolation``, ``budget``, ``workspace``, ``int_workspace``, ``trtllm``),
which lists it in its own ``CHECKS``; adding a check to a family touches that module only. ``reservation`` judges
its retried runs with every check, so it gets the catalog from here (``reservation.checks``) instead of importing
it.
"""

from __future__ import annotations

from typing import Protocol

from pluggy import HookimplMarker

from pytest_kvprofile.checks import (
    arena,
    budget,
    capture,
    freed,
    int_workspace,
    isolation,
    leases,
    reservation,
    resources,
    support,
    trtllm,
    warmup,
    workspace,
)
from pytest_kvprofile.checks.base import Check, CheckOptions, WasteBudget, parse_waste_budget
from pytest_kvprofile.lifecycle.record import LifecycleResult

hookimpl = HookimplMarker("pytest")


def _every() -> tuple[Check, ...]:
    return CHECKS


CHECKS: tuple[Check, ...] = (
    *support.CHECKS, *leases.CHECKS, *reservation.checks(_every), *warmup.CHECKS, *arena.CHECKS, *freed.CHECKS,
    *capture.CHECKS, *resources.CHECKS, *isolation.CHECKS, *budget.CHECKS, *workspace.CHECKS, *int_workspace.CHECKS,
    *trtllm.CHECKS,
)
CHECKS_BY_NAME = {c.name: c for c in CHECKS}


def checks_for(path: str) -> list[Check]:
    return [c for c in CHECKS if c.applies(path)]


def failing_checks(result: LifecycleResult, options: CheckOptions = CheckOptions()) -> dict[str, list[str]]:
    """Run every applicable check; {check name: violations} for those that fail."""
    out = {}
    for check in checks_for(result.path):
        if not check.relevant(result.case, result.builders):
            continue
        violations = check.run(result, options)
        if violations:
            out[check.name] = violations
    return out


class _CheckRegistrar(Protocol):
    def add_checks(self, *checks: Check) -> None: ...


@hookimpl(tryfirst=True)
def pytest_kvprofile_register(registry: _CheckRegistrar) -> None:
    """The built-in checks, first and in the order the suite runs them (the plugin's ``Registry``)."""
    registry.add_checks(*CHECKS)


__all__ = ["CHECKS", "CHECKS_BY_NAME", "Check", "CheckOptions", "WasteBudget", "checks_for", "failing_checks",
           "parse_waste_budget"]
