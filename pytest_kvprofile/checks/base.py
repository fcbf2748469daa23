"""What a conformance check is: a named rule, the path and phase it needs, a function of a record.

A check is a function from a LifecycleResult and the run's options to violations. Each check names the
rule it enforces and the phase it needs; a run that aborted before that phase fails the check with the
builder, phase and error that stopped it. An empty list is a pass. Every check only reads the record. A check
that needs faulted or retried runs (the fault cannot be injected inside the main run) names them in ``probes``;
the lifecycle makes them once per case and the check reads their outcome (``LifecycleResult.probed``).

What one check concluded about one (backend, case) is a :class:`CheckOutcome`: the packaged suite writes it,
xdist carries it to the controller (as JSON, in ``user_properties``), and the JSON report, the verdict and the
terminal summary read it. What a check adds to it for the report (the budget, the workspace waste, the legacy
path's cost) is the check's own ``details``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeAlias

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.lifecycle.phases import Phase
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.matrix.cases import Case

BOTH = "both"


@dataclass(frozen=True)
class WasteBudget:
    """How much workspace waste a run tolerates per case before ``workspace_covers_planner`` fails.

    Waste is a cost, not a safety failure (KV sizing sees it), so there is no budget unless the user sets one
    (``--kvprofile-max-waste``): ``amount`` MiB, KV tokens per rank (``tok``) or percent of the case's KV pool.
    ``source`` names the option the budget came from, for messages.
    """

    amount: float
    unit: str = "MiB"
    source: str = "--kvprofile-max-waste"

    def limit_bytes(self, kv_bytes_per_token: int, kv_pool_bytes: int | None) -> int | None:
        """The budget in bytes for one case; None when it is a share of a KV pool the run never sized."""
        if self.unit == "MiB":
            return int(self.amount * MiB)
        if self.unit == "tok":
            return int(self.amount * kv_bytes_per_token)
        return None if kv_pool_bytes is None else int(kv_pool_bytes * self.amount / 100)

    def describe(self) -> str:
        amount = f"{self.amount:g}"
        text = {"MiB": f"{amount} MiB", "tok": f"{amount} KV tokens per rank", "%": f"{amount}% of the KV pool"}
        return f"{text[self.unit]} ({self.source})"


def parse_waste_budget(text: str, source: str = "--kvprofile-max-waste") -> WasteBudget:
    """``64`` (MiB), ``64 MiB``, ``2000 tok`` or ``1.5%``; a ValueError that names ``source`` otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(mib|tok|tokens|%)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"{source}: expected MiB (64), KV tokens per rank (2000 tok) or a share of the KV pool "
                         f"(1.5%), got {text!r}")
    unit = (m.group(2) or "mib").lower()
    return WasteBudget(float(m.group(1)), {"mib": "MiB", "tok": "tok", "tokens": "tok", "%": "%"}[unit], source)


@dataclass(frozen=True)
class CheckOptions:
    """The run's settings a check reads: the waste budget (``--kvprofile-max-waste``; None: waste reported only),
    and the run's checks, registered ones included (empty: the built-in catalog), which a check that judges a
    retried run (``reservation_exception_safe``) runs on that run too."""

    max_waste: WasteBudget | None = None
    checks: tuple[Check, ...] = ()


CheckFn = Callable[[LifecycleResult, CheckOptions], list[str]]

# a value of a JSON object the report writes and reads back: each key has its own type, read by key
JsonValue: TypeAlias = Any
JsonObject = dict[str, JsonValue]
"""A JSON object as the report writes it."""


@dataclass(frozen=True)
class CheckDetails:
    """What a check's record carries for the report beside its outcome, each a JSON object or None: the run's
    budget (``budget``, the summary's fewest KV tokens), the case's workspace waste (``waste``) and the legacy
    path's post-KV cost (``legacy_cost``) and what a failed reservation left held (``retry_cost``)."""

    budget: JsonObject | None = None
    waste: JsonObject | None = None
    legacy_cost: JsonObject | None = None
    retry_cost: JsonObject | None = None  # what failed reservations left held, which their retries reused or freed


NO_DETAILS = CheckDetails()

_DETAIL_KEYS = ("budget", "waste", "legacy_cost", "retry_cost")


@dataclass(frozen=True)
class CheckOutcome:
    """One check on one (backend, case): written by the packaged suite's test, completed by the controller's
    recorder (``nodeid``, the pytest ``outcome``: passed, failed, skipped, xfailed or xpassed, and a failure's
    ``message``), read by the JSON report, the verdict and the summary.

    ``to_json``/``from_json`` are what crosses xdist (``user_properties``) and what the JSON report's
    ``results`` hold: a flat object whose absent fields are left out.

    ``kv_sizing``: where the engine sized the KV cache on the case (``LifecycleResult.kv_sizing`` as
    ``{name, rule, reason}``), which the verdict aggregates per backend; None when the worker could not tell.
    """

    check: str
    backend: str
    case: str
    details: CheckDetails = NO_DETAILS
    message: str | None = None
    nodeid: str | None = None
    outcome: str | None = None
    kv_sizing: JsonObject | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {"check": self.check, "backend": self.backend, "case": self.case}
        fields = [(key, getattr(self.details, key)) for key in _DETAIL_KEYS]
        fields += [("message", self.message), ("nodeid", self.nodeid), ("outcome", self.outcome),
                   ("kv_sizing", self.kv_sizing)]
        out.update((key, value) for key, value in fields if value is not None)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, JsonValue]) -> CheckOutcome:
        return cls(
            check=data["check"], backend=data["backend"], case=data["case"],
            details=CheckDetails(**{key: data[key] for key in _DETAIL_KEYS if data.get(key) is not None}),
            message=data.get("message"), nodeid=data.get("nodeid"), outcome=data.get("outcome"),
            kv_sizing=data.get("kv_sizing") if isinstance(data.get("kv_sizing"), dict) else None,
        )


def _always(case: Case, parts: list[Builder]) -> bool:
    return True


def _no_details(result: LifecycleResult) -> CheckDetails:
    return NO_DETAILS


@dataclass(frozen=True)
class Check:
    name: str
    rule: str
    path: str  # which lifecycle path it applies to
    needs: Phase  # the last phase it reads
    bugs: tuple[int, ...]
    fn: CheckFn
    relevant: Callable[[Case, list[Builder]], bool] = _always  # False: the check has nothing to look at here
    details: Callable[[LifecycleResult], CheckDetails] = _no_details  # what its record carries for the report
    # the lifecycle's probes it reads (``lifecycle/record.py`` PROBES): made once per case, shared; a check that
    # names one is judged on the case's own run only, not on the runs a probe retried
    probes: tuple[str, ...] = ()

    def applies(self, path: str) -> bool:
        return self.path == BOTH or self.path == path

    def run(self, result: LifecycleResult, options: CheckOptions = CheckOptions()) -> list[str]:
        abort = aborted_before(result, self.needs)
        if abort:
            return [abort]
        return self.fn(result, options)


def aborted_before(result: LifecycleResult, phase: Phase) -> str | None:
    """Why the phases this check needs never ran (a builder or engine error), or None."""
    if result.aborted_in is None:
        return None
    order = lc.PHASE_ORDER
    if result.aborted_in in order and phase in order and order.index(result.aborted_in) > order.index(phase):
        return None
    err = next((e for e in result.errors if not e.injected), None)
    detail = err.describe() if err else f"aborted in phase {result.aborted_in!r}"
    return f"the lifecycle stopped before phase {phase!r}: {detail}"
