"""The reservation probe: a reservation that fails part-way raises its first error, leaks nothing per attempt,
and reports what a failed attempt leaves held; each part's last fault point names the retried run every check
judges (``probe_runs.run_after_failed_reservation``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections import Counter
from typing import TYPE_CHECKING, Sequence

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.contract.protocol import (
    Builder,
    call_optional,
)
from pytest_kvprofile.contract.support import builder_name
from pytest_kvprofile.lifecycle.engine import make_device
from pytest_kvprofile.lifecycle.probe_runs import (
    _UNREACHED,
    Held,
    _allocations_of,
    _first_error_wins,
    _fmt_held,
    _held,
    _prefix,
    _ProbeRun,
    _process_wide,
    _Site,
    _total,
)
from pytest_kvprofile.lifecycle.record import ProbeTarget
from pytest_kvprofile.lifecycle.sites import _raised_at
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.units import bytes_text, size_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.contract.device import DeviceEvent


def reservation_violations(target: ProbeTarget, plan: tuple[tuple[int, str], ...]) -> list[str]:
    """For each ``(builder index, name)`` of ``plan`` (the parts whose reservation allocated in the main run), fail
    its reservation at each fault point and retry. Memoized per case without its gmu, like the warmup probe."""
    return list(reservation_outcome(target, plan).violations)



def reservation_costs(target: ProbeTarget, plan: tuple[tuple[int, str], ...]) -> list[str]:
    """What the failed attempts left held on their builders (inside the window, so KV sizing sees it): reported."""
    return list(reservation_outcome(target, plan).costs)



@dataclasses.dataclass(frozen=True)
class ReservationOutcome:
    """The reservation probe's answer: what it refuses, what it reports, and per builder the fault point the rest
    of the lifecycle is judged after (its last: the one with the most made before it)."""

    violations: tuple[str, ...] = ()
    costs: tuple[str, ...] = ()
    last_faults: tuple[tuple[str, int], ...] = ()



def reservation_outcome(target: ProbeTarget, plan: tuple[tuple[int, str], ...]) -> ReservationOutcome:
    """The reservation probe, memoized per case without its gmu on the simulated device."""
    if not plan:
        return ReservationOutcome()
    if target.device_factory is make_device:
        try:
            return _reservation_simulated(target.backend, dataclasses.replace(target.case, id="", gmu=0.0), plan)
        except TypeError:  # an unhashable backend: probe without the memo
            pass
    return _outcome(target, plan)



def _outcome(target: ProbeTarget, plan: tuple[tuple[int, str], ...]) -> ReservationOutcome:
    notes: list[str] = []
    last: list[tuple[str, int]] = []
    found = _probe_reservations(target, plan, notes, last)
    return ReservationOutcome(tuple(found), tuple(notes), tuple(last))



@functools.lru_cache(maxsize=256)
def _reservation_simulated(backend: Backend, case: Case, plan: tuple[tuple[int, str], ...]) -> ReservationOutcome:
    return _outcome(ProbeTarget(backend, case, make_device), plan)



def _reserve(run: _ProbeRun, builder: Builder) -> object:
    """Call the reservation as the engine does: attributed to the builder (in torch mode too), never recorded."""
    with run._as_part(builder_name(builder), "reserve_persistent_workspace"):
        return call_optional(builder, "reserve_persistent_workspace", run.ctx(builder))



MAX_FAULT_POINTS = 12  # per builder: each fault re-runs fresh builders up to their reservation



def _fault_points(allocs: Sequence[_Site]) -> list[int]:
    """Indices of the first and the second allocation of each distinct site (the second: a retry that makes a
    repeated wrapper again beside the one the failed attempt kept shows only past the first), and of the last
    allocation; at most ``MAX_FAULT_POINTS``, spread evenly over them (the first and the last always among them)."""
    seen: Counter[tuple[object, ...]] = Counter()
    points = []
    for i, a in enumerate(allocs):
        key = (a.owner, a.kind, a.role, a.stack or a.nbytes)  # the source line; in ctx mode, role and bytes
        seen[key] += 1
        if seen[key] <= 2:
            points.append(i)
    if allocs and points[-1] != len(allocs) - 1:
        points.append(len(allocs) - 1)
    if len(points) > MAX_FAULT_POINTS:
        step = (len(points) - 1) / (MAX_FAULT_POINTS - 1)
        points = [points[round(j * step)] for j in range(MAX_FAULT_POINTS)]
    return points



def _probe_reservations(target: ProbeTarget, plan: tuple[tuple[int, str], ...],
                        notes: list[str] | None = None, last: list[tuple[str, int]] | None = None) -> list[str]:
    out: list[str] = []
    notes = [] if notes is None else notes
    last = [] if last is None else last
    for index, name in plan:
        with _prefix(target, lc.RESERVATION, reserving=name) as step:
            try:
                clean = step(functools.partial(_clean_reservation, index, name))
            except Exception as exc:  # noqa: BLE001 - the builder cannot even reserve once
                cause = exc.__cause__ or exc
                return [f"the reservation probe could not run: {name} failed before or during its reservation: "
                        f"{type(cause).__name__}: {cause}"]
            if clean is _UNREACHED:
                continue
            allocs, expected, clean_wide = clean  # type: ignore[misc]
            points = _fault_points(allocs)
            if points:
                last.append((name, points[-1]))
            for k in points:
                found = step(functools.partial(_failed_reservation, index, name, k, allocs[k], expected, clean_wide))
                assert found is not _UNREACHED
                violations, noted = found  # type: ignore[misc]
                out.extend(violations)
                notes.extend(noted)
        if out:
            return out
    return out



def _clean_reservation(index: int, name: str, run: _ProbeRun) -> tuple[list[_Site], Held, bool]:
    """A reservation that never fails: the allocations it makes, in order, what it leaves held, and whether it left
    anything in process-wide state."""
    before = {a.id for a in run.device.live_allocations()}
    allocs = _allocations_of(run.device, functools.partial(_reserve, run, run.builders[index]))
    wide = _process_wide(run)
    sites = [_Site(a.owner, a.kind, a.role, a.stack, a.nbytes, a.tag, a.where) for a in allocs]
    return sites, _held(run.device, name, before, frozenset(wide)), bool(wide)



def _failed_reservation(index: int, name: str, k: int, site: _Site, expected: Held, look_wide: bool,
                        run: _ProbeRun) -> tuple[list[str], list[str]]:
    """:func:`_fail_reservation` with a retry, as a probe step: what it refuses and what it reports."""
    notes: list[str] = []
    return _fail_reservation(run, index, name, k, site, expected, retry=True, look_wide=look_wide, notes=notes), notes



def _fail_reservation(run: _ProbeRun, index: int, name: str, k: int, site: _Site, expected: Held,
                      retry: bool, look_wide: bool = True, notes: list[str] | None = None) -> list[str]:
    """Fail ``name``'s reservation at its allocation ``k`` and, with ``retry``, reserve again; report what breaks the
    rule. Long because each rule it reports (first error, leak, retry held) reads the same fault's state in turn.
    The second reservation follows the last fault point only (the one with the most made before it): a real
    builder's reservation costs as much as its lifecycle, and a leak or a wrong error shows at every point.
    ``look_wide`` False: a clean reservation from the same fresh view left nothing in process-wide state, so none of
    what this one leaves is exempt as such (and the module walk is skipped)."""
    notes = [] if notes is None else notes  # what a failed attempt left held: reported, never refused
    b, dev = run.builders[index], run.device
    what = f"its reservation failed at allocation #{k + 1} ({site.tag!r}, {size_text(site.nbytes)})"
    before = {a.id for a in dev.live_allocations()}
    ooms: list[DeviceEvent] = []
    unsubscribe = dev.subscribe(ooms.append, kinds=("oom",))
    dev.fail_after(k)
    raised: str | None = None
    try:
        _reserve(run, b)
    except Exception as exc:  # noqa: BLE001 - the injected failure, or what the builder made of it
        if not _first_error_wins(exc):
            raised_site = _raised_at(exc)
            raised = f"{type(exc).__name__}: {exc}" + (f" (raised at {raised_site})" if raised_site else "")
    else:
        if ooms:
            return [f"builder {name!r}: {what}, and it returned a lease instead of raising: a failed reservation "
                    "raises its first error, so the engine falls back instead of running with half a reservation"]
    finally:
        unsubscribe()
    if not ooms:
        return []  # the fault point was never reached (a reservation that allocates differently each time)
    out = []
    if raised is not None:
        out.append(f"builder {name!r}: {what}, and it raised {raised} instead of the out-of-memory error: the first "
                   "error wins (an error in the cleanup must not replace it; chain it with `raise ... from`)")
    leaked = _held(dev, name, before)
    process_wide = _process_wide(run) if look_wide and (leaked or retry) else {}
    leaked = _held(dev, name, before, frozenset(process_wide)) if leaked and process_wide else leaked
    if leaked and getattr(run.backend, "torch_mode", False):
        # tensors a reference cycle still holds are not leaks the builder made; collected only when something
        # process-wide state does not explain is left (a full collection costs 0.2 s with FlashInfer imported)
        gc.collect()
        leaked = _held(dev, name, before, frozenset(process_wide))
    # What the failed attempt leaves held was made inside the window, so KV sizing sees it: a cost, not a safety
    # failure, as long as the retry reuses or frees it (judged below); kept for the report.
    if leaked:
        notes.append(f"builder {name!r}: {what}; the failed attempt left {bytes_text(_total(leaked))} held "
                     f"({_fmt_held(leaked)})")
    if not retry:
        return out
    kept = {a.id for a in dev.live_allocations()} - before  # what the failed attempt left: process-wide state only
    filled = {where for i, where in process_wide.items() if i in kept}  # the places the failed attempt filled
    try:
        _reserve(run, b)
    except Exception as exc:  # noqa: BLE001
        out.append(f"builder {name!r}: after {what}, a second reservation raised {type(exc).__name__}: {exc}")
        return out
    # process-wide memory is not the retry's to hold, as it is not a clean reservation's, unless the retry made it
    # again where the failed attempt had already put it (made per reservation, not reused: bug 14 seen on a retry);
    # what the failed attempt made that the state no longer holds, still allocated, counts too
    process_wide = _process_wide(run) if look_wide else {}
    exempt = frozenset(i for i, where in process_wide.items() if i in kept or where not in filled)
    got = _held(dev, name, before, exempt)
    if _total(got) > _total(expected):
        parts = ["extra " + _fmt_held(got - expected)]
        if expected - got:
            parts.append("missing " + _fmt_held(expected - got))
        out.append(f"builder {name!r}: after {what}, a second reservation holds {bytes_text(_total(got))} "
                   f"against {bytes_text(_total(expected))} of a clean one ({'; '.join(parts)}): each failed attempt "
                   "leaks what the retry makes again beside it. Reuse or free what the failed attempt kept")
    return out

