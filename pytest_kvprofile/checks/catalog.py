"""The conformance checks: functions from a LifecycleResult and the run's options to violations.

Each check names the rule it enforces and the phase it needs; a run that aborted before that phase
fails the check with the builder, phase and error that stopped it. An empty list is a pass. Every
check only reads the record, except ``warmup_retryable``, which re-runs the builders of the
record's probe target on fresh devices (the fault injection cannot happen inside the main run).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.contract.support import ProfilingSupport, declared_support
from pytest_kvprofile.contract.workspace import ArenaView
from pytest_kvprofile.lifecycle.module_state import made_by
from pytest_kvprofile.lifecycle.record import LEGACY, PROFILING, LifecycleResult
from pytest_kvprofile.memory.budget import tokens_for
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


def _fmt_alloc(a: Any) -> str:
    where = f" at {a.stack}" if getattr(a, "stack", None) else ""
    return f"{a.owner}: {a.tag!r} {a.nbytes / MiB:.2f} MiB ({a.nbytes} bytes) in phase {a.phase!r}{where}"


def _builder_names(result: LifecycleResult) -> set[str]:
    return set(result.builder_names())


def _live_builder_device_bytes(result: LifecycleResult, owner: str, at_phase: str) -> int:
    """Device bytes owned by ``owner`` alive at the end of ``at_phase``."""
    order = lc.PHASE_ORDER
    limit = order.index(at_phase)
    total = 0
    for a in result.allocations:
        if a.owner != owner or a.kind != "device" or a.phase not in order or order.index(a.phase) > limit:
            continue
        freed = a.freed_phase
        if freed is None or (freed in order and order.index(freed) > limit):
            total += a.nbytes
    return total


# -- support ----------------------------------------------------------------------------------
def check_support_declaration(result: LifecycleResult, options: CheckOptions) -> list[str]:
    if result.declaration_error:
        return [result.declaration_error]
    res = result.resolution
    out = []
    decls = [s for _, s in res.declarations]
    expect = all(s is not ProfilingSupport.UNSUPPORTED for s in decls) and ProfilingSupport.REQUIRED in decls
    if res.enabled != expect:
        out.append(f"resolver answered enabled={res.enabled} for {res.declarations}; the rule says {expect}")
    if result.path != (PROFILING if res.enabled else LEGACY):
        out.append(f"the engine took the {result.path} path although the resolver said enabled={res.enabled}")
    if not res.enabled:
        calls = [(c.phase, c.builder) for c in result.calls if c.method == "reserve_persistent_workspace"]
        if calls:
            out.append(f"reserve_persistent_workspace() was called on the legacy path: {calls}")
    resources = _resource_names(result)
    for name, support in res.declarations:
        if support is not ProfilingSupport.NEUTRAL or name in resources:
            continue
        kept = [a for a in result.allocations if a.owner == name and a.kind == "device" and a.freed_phase is None]
        if kept:
            out.append(
                f"builder {name!r} declares NEUTRAL (it reserves nothing of its own) but keeps "
                f"{sum(a.nbytes for a in kept) / MiB:.2f} MiB of its own device memory: {_grouped(result, kept)}. "
                "Declare REQUIRED and reserve it inside the profiling window, or plan into arena views"
            )
    return out


def check_legacy_path_unchanged(result: LifecycleResult, options: CheckOptions) -> list[str]:
    out = []
    if result.leases:
        out.append(f"leases were taken on the legacy path: {[r.owner for r in result.leases]}")
    ran = [p.name for p in result.phases]
    for phase in (lc.RESERVATION, lc.PROFILE_WARMUP, lc.PROFILE_REPLAY, lc.LEASE_RELEASE):
        if phase in ran:
            out.append(f"phase {phase!r} ran although the model is on the legacy path ({result.resolution.reason})")
    names = _builder_names(result)
    for a in result.allocations:
        if a.owner in names and a.phase in lc.WINDOW_PHASES and a.kind == "device":
            freed = a.freed_phase
            if freed is None or freed not in lc.WINDOW_PHASES:
                out.append(
                    "a builder on the legacy path kept memory from the profiling window, which changes legacy "
                    f"KV sizing: {_fmt_alloc(a)}"
                )
    return out


# -- leases ------------------------------------------------------------------------------------
def check_persistent_memory_visible(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Every builder byte alive after KV sizing was already held at the closing measurement."""
    out = []
    by_id = {a.id: a for a in result.allocations}
    for owner in result.builder_names():
        held = _live_builder_device_bytes(result, owner, lc.CLOSING)
        for phase in lc.POST_KV_PHASES:
            if result.phase(phase) is None:
                continue
            live = _live_builder_device_bytes(result, owner, phase)
            if live > held:
                late = [
                    by_id[a.id] for a in result.allocations
                    if a.owner == owner and a.kind == "device"
                    and lc.PHASE_INDEX[lc.CLOSING] < lc.PHASE_INDEX.get(a.phase, -1) <= lc.PHASE_INDEX[phase]
                    and (a.freed_phase is None or lc.PHASE_ORDER.index(a.freed_phase) > lc.PHASE_ORDER.index(phase))
                ]
                released = _lease_released_sites(result, owner)
                detail = _grouped(
                    result, late, first=lambda a, r=released: (a.owner, a.tag, a.nbytes) not in r,
                ) or "(memory re-used from earlier phases)"
                out.append(
                    f"persistent_memory_visible_at_closing: builder {owner!r} holds {live / MiB:.2f} MiB after KV "
                    f"sizing (phase {phase!r}) but held only {held / MiB:.2f} MiB at the closing measurement: "
                    f"{(live - held) / MiB:.2f} MiB invisible to KV sizing. Alive and allocated after KV sizing "
                    f"(new allocations first, then re-creations of what the lease released): {detail}"
                )
                break
    return out


def _lease_released_sites(result: LifecycleResult, owner: str) -> set[tuple[str, str, int]]:
    """(owner, tag, bytes) of the owner's leased allocations freed at lease release: what rebind may re-create."""
    ids = {aid for rec in result.leases if rec.owner == owner for aid in rec.allocation_ids}
    return {(a.owner, a.tag, a.nbytes) for a in result.allocations
            if a.id in ids and a.freed_phase == lc.LEASE_RELEASE}


def check_lease_outlives_closing(result: LifecycleResult, options: CheckOptions) -> list[str]:
    out = []
    for owner in result.released_before_closing:
        out.append(f"the lease of {owner!r} was released before the closing measurement")
    by_id = {a.id: a for a in result.allocations}
    for rec in result.leases:
        for aid in rec.allocation_ids:
            a = by_id[aid]
            if a.kind == "device" and a.freed_phase in lc.WINDOW_PHASES + (lc.BASELINE,):
                out.append(
                    f"memory under the lease of {rec.owner!r} was freed in phase {a.freed_phase!r}, before the "
                    f"closing measurement could see it: {_fmt_alloc(a)}"
                )
    return out


def check_lease_released_before_graph_profiling(result: LifecycleResult, options: CheckOptions) -> list[str]:
    out = []
    by_id = {a.id: a for a in result.allocations}
    for rec in result.leases:
        if not rec.lease.released:
            out.append(f"the lease of {rec.owner!r} was never released")
        recreated = {
            a.tag for a in result.allocations
            if a.owner == rec.owner and a.phase in (lc.GRAPH_PROFILING,) + lc.POST_KV_PHASES
        }
        leaked = [
            by_id[aid] for aid in rec.allocation_ids
            if by_id[aid].freed_phase not in lc.WINDOW_PHASES + (lc.CLOSING, lc.LEASE_RELEASE)
            and by_id[aid].tag in recreated
        ]
        if leaked:
            total = sum(a.nbytes for a in leaked)
            out.append(
                f"{total / MiB:.2f} MiB leased by {rec.owner!r} is still alive after lease release and leaks into "
                f"CUDA-graph profiling (counted twice): " + "; ".join(_fmt_alloc(a) for a in leaked[:6])
            )
    return out


# -- warmup and replay -------------------------------------------------------------------------
def check_profile_replayed(result: LifecycleResult, options: CheckOptions) -> list[str]:
    warmed = [
        a for a in result.allocations
        if a.phase == lc.PROFILE_WARMUP and a.kind == "device" and a.freed_phase not in lc.WINDOW_PHASES
    ]
    if warmed and result.phase(lc.PROFILE_REPLAY) is None:
        total = sum(a.nbytes for a in warmed)
        return [
            f"warmup inside the window made {total / MiB:.2f} MiB persistent but the profile was not replayed, so "
            "the closing measurement never saw the persistent baseline and the activation peak together: "
            + "; ".join(_fmt_alloc(a) for a in warmed[:6])
        ]
    return []


def check_warmup_idempotent(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """A second warmup allocates nothing at all: transient re-tuning scratch counts, not only what it keeps."""
    names = _builder_names(result)
    repeat = [a for a in result.allocations if a.phase == lc.WARMUP_REPEAT and a.owner in names]
    if not repeat:
        return []
    kept = [a for a in repeat if a.freed_phase is None]
    what = "new persistent memory" if kept else "transient memory (it re-tunes or re-creates scratch on every call)"
    return [
        f"warmup_idempotent: a repeated warmup (phase {lc.WARMUP_REPEAT!r}) allocated {what}; warmup runs once "
        "and a second call allocates nothing: " + _grouped(result, repeat, first=lambda a: a.freed_phase is None)
    ]


def check_warmup_retryable(result: LifecycleResult, options: CheckOptions) -> list[str]:
    from pytest_kvprofile.lifecycle.probes import warmup_retry_violations

    names = result.builder_names()
    allocated = {(a.phase, a.owner) for a in result.allocations if result.alloc_origin.get(a.id) == "warmup"}
    plan = tuple((state, i, name) for state in (lc.PROFILE_WARMUP, lc.WARMUP) for i, name in enumerate(names)
                 if (state, name) in allocated)
    return warmup_retry_violations(result.probe, plan)


# -- arena -------------------------------------------------------------------------------------
def check_arena_stable(result: LifecycleResult, options: CheckOptions) -> list[str]:
    closing = result.phase(lc.CLOSING)
    out = []
    for phase in (lc.LEASE_RELEASE, lc.GRAPH_PROFILING, lc.KV_SIZING, lc.REBIND, lc.WARMUP, lc.CAPTURE, lc.LOCK,
                  lc.SERVING):
        rec = result.phase(phase)
        if rec is None:
            continue
        if rec.arena != closing.arena:
            out.append(
                f"the float arena moved or resized in phase {phase!r}: {_fmt_arena(closing.arena)} at the closing "
                f"measurement, {_fmt_arena(rec.arena)} now (captured CUDA graphs hold the old pointer)"
            )
            break
    capture = result.phase(lc.CAPTURE)
    serving = result.phase(lc.SERVING)
    if capture is not None and serving is not None and capture.bound != serving.bound:
        moved = sorted(set(capture.bound) ^ set(serving.bound), key=lambda b: (b.owner, b.workspace.ubatch))
        detail = "; ".join(
            f"{b.owner} {b.workspace.role} [ubatch {b.workspace.ubatch}] ptr {b.workspace.ptr:#x} "
            f"{b.workspace.nbytes} bytes ({'at capture' if b in capture.bound else 'at serving'})"
            for b in moved[:4])
        out.append(f"workspace pointers bound at capture changed before replay: {detail}")
    return out


def _fmt_arena(arena: tuple[ArenaView, ...]) -> str:
    return ", ".join(f"ubatch {v.ubatch}: ptr {v.ptr:#x} size {v.nbytes / MiB:.2f} MiB" for v in arena) or "none"


def check_arena_not_grown_after_lock(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Every refusal the manager recorded fails, caught by the builder or not: the request itself is the bug."""
    out = []
    refused = {(r.phase, r.requester) for r in result.refusals}
    counts = Counter(result.refusals)
    for r, n in counts.items():
        times = f" ({n} times)" if n > 1 else ""
        out.append(f"arena_not_grown_after_lock: {r.describe()}{times}; the locked arena refused to grow (whether "
                   "or not the builder caught the WorkspaceLockedError and fell back on its own buffer)")
    for err in result.errors:
        if err.exc_type == "WorkspaceLockedError" and (err.phase, err.who) not in refused:
            out.append(f"{err.who} asked the locked arena to grow in phase {err.phase!r}: {err.message}")
    if result.phase(lc.LOCK) is not None:
        probe = result.lock_probe_error
        if probe is None:
            out.append("the workspace manager let the arena grow after lock()")
        elif "kvprofile-lock-probe" not in probe or "bytes" not in probe:
            out.append(f"the growth-after-lock error does not name the requester and sizes: {probe!r}")
    if out:
        return out
    aborted = aborted_before(result, lc.SERVING)
    return [aborted] if aborted else []


def _several_ubatches(case: Any, parts: list[Any]) -> bool:
    return case.envelope.num_ubatches >= 2


def _has_capacity_resource(case: Any, parts: list[Any]) -> bool:
    from pytest_kvprofile.contract.resources import is_resource

    return any(is_resource(p) and getattr(p, "capacity_bytes", None) is not None for p in parts)


def check_ubatch_arenas_disjoint(result: LifecycleResult, options: CheckOptions) -> list[str]:
    out = []
    for rec in result.phases:
        arenas = {v.ubatch: (v.ptr, v.end) for v in rec.arena if v.nbytes}
        spans = sorted(arenas.items(), key=lambda kv: kv[1])
        for (u1, (_s1, e1)), (u2, (s2, _e2)) in zip(spans, spans[1:]):
            if s2 < e1:
                out.append(f"phase {rec.name!r}: the arenas of ubatch {u1} and ubatch {u2} overlap")
        for bound in rec.bound:
            ub, ptr, nbytes = bound.workspace.ubatch, bound.workspace.ptr, bound.workspace.nbytes
            if ub not in arenas:
                continue
            start, end = arenas[ub]
            if not (start <= ptr and ptr + nbytes <= end):
                other = [u for u, (s, e) in arenas.items() if u != ub and s <= ptr < e]
                where = f"inside ubatch {other[0]}'s arena" if other else "outside its arena"
                out.append(
                    f"phase {rec.name!r}: {bound.owner}'s {bound.workspace.role} for ubatch {ub} points {where} "
                    f"(ptr {ptr:#x}, {nbytes / MiB:.2f} MiB)"
                )
        if out:
            break
    return out + _observed_ubatch_violations(result)


def _observed_ubatch_violations(result: LifecycleResult) -> list[str]:
    """What the manager saw, whatever the builder reports: the views it handed to each builder.

    A build for micro-batch u that asks for another micro-batch's arena plans into memory the other
    micro-batch uses concurrently; a builder that asks for arena views but never for u's while the
    engine builds u's batches through it plans u into another micro-batch's arena.
    """
    out = []
    wrong: dict[tuple, int] = {}
    asked: dict[str, set[int]] = {}
    for g in result.grants:
        asked.setdefault(g.requester, set()).add(g.ubatch)
        if g.for_ubatch is not None and g.ubatch != g.for_ubatch:
            key = (g.requester, g.method, g.phase, g.for_ubatch, g.ubatch, g.nbytes)
            wrong[key] = wrong.get(key, 0) + 1
    for (who, method, phase, mine, other, nbytes), n in wrong.items():
        times = f" ({n} times)" if n > 1 else ""
        out.append(
            f"ubatch_arenas_disjoint: in phase {phase!r} {who} {method}() for micro-batch {mine} asked for "
            f"{nbytes} bytes of micro-batch {other}'s arena{times}: both micro-batches would plan into the same memory"
        )
    built = {c.builder for c in result.calls if c.method == "build"}
    count = result.case.envelope.num_ubatches
    for who in sorted(asked.keys() & built):
        missing = sorted(set(range(count)) - asked[who])
        if missing:
            out.append(
                f"ubatch_arenas_disjoint: {who} asked only for the arenas of micro-batch(es) {sorted(asked[who])} but "
                f"the engine builds micro-batch(es) {missing} through it: their plans use another micro-batch's arena"
            )
    return out


# -- capture -----------------------------------------------------------------------------------
def check_no_synthetic_in_capture(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Judge every allocation made while a graph is captured by the method it came from, not by its tag.

    Resources allocate nothing in capture (README); a builder's ``dummy_run``, ``warmup`` or any other
    method allocates nothing in capture either. ``build`` plans the captured batch, so a transient it
    also makes for real traffic (the same owner, tag and source line when serving) is plan scratch;
    one it makes only in dummy forwards is synthetic profiling workspace.
    """
    resources = _resource_names(result)
    names = _builder_names(result)
    captured = [
        a for a in result.allocations
        if a.phase in (lc.GRAPH_PROFILING, lc.CAPTURE) and a.pool != "default" and a.owner in names
    ]
    if not captured:
        return []
    served = {
        _site(a) for a in result.allocations
        if a.phase in (lc.SERVING, lc.WARMUP_REPEAT) and result.alloc_origin.get(a.id) == "build"
    }
    bad = []
    for a in captured:
        method = result.alloc_origin.get(a.id)
        transient = a.freed_phase == a.phase
        if a.owner in resources or method != "build" or (transient and _site(a) not in served):
            bad.append(a)
    if bad:
        return [
            "no_synthetic_workspace_in_capture: builder or resource memory that real traffic never needs was "
            "allocated while a CUDA graph was being captured: " + _grouped(result, bad)
        ]
    return []


def _site(a: Any) -> tuple[str, str, str | None]:
    """Where an allocation comes from: owner, tag and (torch mode) source line."""
    return (a.owner, a.tag, getattr(a, "stack", None))


_RESOURCE_METHODS = {"build": "use", "reserve_persistent_workspace": "materialize"}


def _grouped(result: LifecycleResult, allocs: list[Any], first: Callable[[Any], bool] | None = None) -> str:
    """Allocations grouped by (owner, tag, bytes, method, phase, source line), each with its count and total.

    Groups for which ``first`` holds come first, then the largest totals. Every group is shown.
    """
    resources = _resource_names(result)
    groups: dict[tuple, list[Any]] = {}
    for a in allocs:
        method = result.alloc_origin.get(a.id) or "-"
        if a.owner in resources:
            method = _RESOURCE_METHODS.get(method, method)
        key = (a.owner, a.tag, a.nbytes, method, a.phase, getattr(a, "stack", None) or "")
        groups.setdefault(key, []).append(a)

    def order(item: tuple[tuple, list[Any]]) -> tuple:
        key, members = item
        lead = 0 if first is None or first(members[0]) else 1
        return (lead, -key[2] * len(members), key)

    parts = []
    for (owner, tag, nbytes, method, phase, stack), members in sorted(groups.items(), key=order):
        times = f" x {len(members)} = {nbytes * len(members) / MiB:.2f} MiB" if len(members) > 1 else ""
        where = f" at {stack}" if stack else ""
        parts.append(f"{owner}: {tag!r} {nbytes / MiB:.2f} MiB ({nbytes} bytes){times} from {method}() in phase "
                     f"{phase!r}{where}")
    return "; ".join(parts)


def _resource_names(result: LifecycleResult) -> set[str]:
    from pytest_kvprofile.contract.resources import is_resource

    return {b.name for b in result.builders if is_resource(b)}


def check_resource_capacity(result: LifecycleResult, options: CheckOptions) -> list[str]:
    from pytest_kvprofile.contract.resources import is_resource

    out = []
    for part in result.builders:
        capacity = getattr(part, "capacity_bytes", None) if is_resource(part) else None
        if capacity is None:
            continue
        for rec in result.phases:
            live = _live_builder_device_bytes(result, part.name, rec.name)
            if live > capacity:
                mine = [a for a in result.allocations if a.owner == part.name and a.kind == "device"]
                out.append(
                    f"resource {part.name!r} declared an exact capacity of {capacity / MiB:.2f} MiB ({capacity} bytes) "
                    f"but holds {live / MiB:.2f} MiB ({live} bytes) in phase {rec.name!r}: "
                    + "; ".join(_fmt_alloc(a) for a in mine[:4])
                )
                break
    return out


# -- isolation ---------------------------------------------------------------------------------
def check_no_state_outlives_case(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Device memory a builder keeps in module or class state, allocated by this case or reused from an earlier one.

    The first case a process runs creates the buffer (module state holds it past the case); every later one of
    the same backend finds it there (the harness remembers which backend's run made it), and in torch mode is
    seen using it (the simulated device knows
    another case's storage), where it would otherwise allocate nothing KV sizing could see. So a buffer the
    builder keeps on every case fails every case, in any order, under ``-n`` and ``-k``. What the harness cannot
    tell apart: on a case whose code path would not create the buffer, one an earlier case left behind is still
    reported (the state is there either way).
    """
    names = _builder_names(result)
    used = {id(f.alloc): f for f in result.foreign_uses}
    held = {id(h.alloc): h.where for h in result.module_held}
    culprits: dict[tuple, list[str]] = {}
    mine = {id(a) for a in result.allocations}
    for h in result.module_held:
        a = h.alloc
        ours = id(a) in mine or id(a) in used or made_by(a) == result.backend
        if ours and a.owner in names and a.kind == "device" and a.alive:
            culprits.setdefault(_site(a) + (a.nbytes,), []).append(h.where)
    for key, f in used.items():
        a = f.alloc
        if a.kind == "device" and a.alive and key not in held:
            culprits.setdefault(_site(a) + (a.nbytes,), []).append(f"{f.owner} ({f.tag})")
    if not culprits:
        return []
    parts = []
    for (owner, tag, stack, nbytes), where in sorted(culprits.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3])):
        at = f" allocated at {stack}" if stack else ""
        parts.append(f"{owner}: {tag!r} {nbytes / MiB:.2f} MiB ({nbytes} bytes){at}, held by {', '.join(sorted(where))}")
    return [
        "no_state_outlives_case: device memory kept in module or class state outlives the case that made it; a "
        "later case in the same process reuses it and allocates nothing, so its KV sizing never sees it (and "
        "which case shows the memory depends on the order cases run in): " + "; ".join(parts)
    ]


# -- budget ------------------------------------------------------------------------------------
def check_no_post_kv_overrun(result: LifecycleResult, options: CheckOptions) -> list[str]:
    budget = result.budget
    out = []
    oom = [e for e in result.errors if e.exc_type == "DeviceOutOfMemory" and e.phase in lc.POST_KV_PHASES]
    overrun = result.post_kv_overrun
    if overrun > 0 or oom:
        names = _builder_names(result) | {"workspace-manager"}
        culprits = [a for a in result.post_kv_peak_live if a.owner in names]
        culprits.sort(key=lambda a: -a.nbytes)
        tokens = tokens_for(max(overrun, 0), budget.kv_bytes_per_token)
        head = (
            f"after KV sizing the device peaked at {result.post_kv_peak_used / MiB:.1f} MiB, "
            f"{max(overrun, 0) / MiB:.2f} MiB ({max(overrun, 0)} bytes) over total x gmu = {budget.limit / MiB:.1f} MiB"
        )
        if oom:
            head += f"; out of memory: {oom[0].message}"
        released = set().union(*(_lease_released_sites(result, o) for o in names))
        detail = _grouped(result, culprits, first=lambda a: (a.owner, a.tag, a.nbytes) not in released)
        cached = _cached_left_behind(result, names)
        if cached:
            cached = f"reserved but free at the peak (cached segments a freed allocation left behind): {cached}"
            detail = f"{cached}; alive: {detail}" if detail else cached
        detail = detail or "no builder allocation (engine accounting)"
        out.append(
            f"{head}. Responsible allocations: {detail}. The case would have to give up {tokens} KV tokens. "
            f"Budget: {' | '.join(budget.lines())}"
        )
    return out


def _cached_left_behind(result: LifecycleResult, names: set[str]) -> str:
    """Cached free blocks at the post-KV peak, each named by the post-KV builder allocations that last used it."""
    freed = [a for a in result.allocations
             if a.owner in names and a.kind == "device" and a.phase in lc.POST_KV_PHASES and not a.alive]
    parts = []
    for ptr, size in sorted(result.post_kv_peak_cached, key=lambda b: (-b[1], b[0])):
        users = [a for a in freed if a.ptr < ptr + size and ptr < a.ptr + a.size]
        if users:
            parts.append(f"{size / MiB:.2f} MiB cached after " + _grouped(result, users))
    return "; ".join(parts)


def check_graph_pool_full_high_water(result: LifecycleResult, options: CheckOptions) -> list[str]:
    budget = result.budget
    if budget.graph_pool_estimate < result.graph_pool_high_water:
        missing = result.graph_pool_high_water - budget.graph_pool_estimate
        return [
            f"the CUDA-graph pool was estimated at {budget.graph_pool_estimate / MiB:.2f} MiB but its high-water mark "
            f"is {result.graph_pool_high_water / MiB:.2f} MiB ({result.graph_pool_retained / MiB:.2f} MiB retained): "
            f"{missing / MiB:.2f} MiB of live reserved pages omitted (gross - retained accounting)"
        ]
    return []


def check_workspace_covers_planner(result: LifecycleResult, options: CheckOptions) -> list[str]:
    from pytest_kvprofile.sizing.case import for_case

    need = for_case(result.case)
    out = []
    per_token = result.budget.kv_bytes_per_token if result.budget else 1
    resources = _resource_names(result)
    for b in result.builders:
        if b.name in resources or declared_support(b) is not ProfilingSupport.REQUIRED:
            continue
        decl = result.declared.get(b.name)
        if decl is None:
            out.append(f"builder {b.name!r} is REQUIRED but has no declared_workspace(case)")
            continue
        if decl.float_bytes < need.float_bytes:
            short = need.float_bytes - decl.float_bytes
            out.append(
                f"builder {b.name!r} reserves {decl.float_bytes / MiB:.2f} MiB of float workspace but FlashInfer "
                f"{need.flashinfer_version}'s planner carves {need.float_bytes / MiB:.2f} MiB ({need.method}) on "
                f"{result.case.gpu.num_sm} SMs for worst batch {_fmt_batch(need.worst_batch)}: short by "
                f"{short / MiB:.2f} MiB (Buffer overflow ... Increase the workspace buffer size)"
            )
        if decl.int_bytes < need.int_bytes:
            out.append(
                f"builder {b.name!r} reserves {decl.int_bytes} bytes of int workspace per wrapper but the planner "
                f"needs {need.int_bytes}"
            )
        excess = decl.float_bytes - need.float_bytes
        slack = options.waste_slack_bytes
        out.extend(_used_against_need(result, b.name, decl.float_bytes, need, slack, per_token))
        if excess > slack:
            out.append(
                f"builder {b.name!r} reserves {decl.float_bytes / MiB:.2f} MiB of float workspace where FlashInfer "
                f"{need.flashinfer_version}'s planner needs at most {need.float_bytes / MiB:.2f} MiB ({need.method}) on "
                f"{result.case.gpu.num_sm} SMs: {excess / MiB:.2f} MiB wasted, {tokens_for(excess, per_token)} KV "
                f"tokens per rank (allowed slack {slack / MiB:.2f} MiB, ini kvprofile_workspace_slack_mib)"
            )
    return out


def _used_against_need(result: LifecycleResult, name: str, declared: int, need: Any, slack: int,
                       per_token: int) -> list[str]:
    """What the builder's wrappers plan into (the largest arena view it asked for), observed, against the
    planner's need and its own declaration: a right declaration does not excuse views of another size."""
    views = [g for g in result.grants if g.requester == name]
    if not views:
        return []
    biggest = max(views, key=lambda g: (g.nbytes, -lc.PHASE_INDEX.get(g.phase, 0)))
    used, align = biggest.nbytes, result.arena_alignment
    if used == -(-declared // align) * align:
        return []
    via = f"{biggest.method}()" if biggest.method else "a call"
    where = (f"builder {name!r} declares {declared / MiB:.2f} MiB of float workspace but asks the arena for views of "
             f"up to {used / MiB:.2f} MiB ({used} bytes, from {via} in phase {biggest.phase!r})")
    if used < need.float_bytes:
        return [f"{where}: its wrappers plan into {(need.float_bytes - used) / MiB:.2f} MiB less than FlashInfer "
                f"{need.flashinfer_version}'s planner carves for worst batch {_fmt_batch(need.worst_batch)} (Buffer "
                "overflow ... Increase the workspace buffer size)"]
    if used - need.float_bytes > slack:
        wasted = used - need.float_bytes
        return [f"{where}, where the planner needs at most {need.float_bytes / MiB:.2f} MiB: {wasted / MiB:.2f} MiB "
                f"wasted, {tokens_for(wasted, per_token)} KV tokens per rank (allowed slack {slack / MiB:.2f} MiB)"]
    return [f"{where}: the declaration the engine sizes the arena from differs from what the wrappers use"]


def _fmt_batch(batch: Any) -> str:
    try:
        qo, kv, graph = batch
        return f"({len(qo)} requests, {sum(qo)} q tokens, max kv {max(kv) if kv else 0}, cuda_graph={graph})"
    except (TypeError, ValueError):
        return repr(batch)


CHECKS: tuple[Check, ...] = (
    Check("support_declaration", "a builder declares a ProfilingSupport member; REQUIRED+NEUTRAL enables, any "
          "UNSUPPORTED disables, all-NEUTRAL does not", BOTH, lc.SETUP, (6,), check_support_declaration),
    Check("legacy_path_unchanged", "a model off the new path runs the legacy lifecycle and keeps nothing from "
          "the profiling window", LEGACY, lc.CLOSING, (6,), check_legacy_path_unchanged),
    Check("persistent_memory_visible_at_closing", "every builder byte alive after KV sizing was held at the "
          "closing measurement", PROFILING, lc.WARMUP_REPEAT, (1, 2, 3, 7, 13), check_persistent_memory_visible),
    Check("lease_outlives_closing_measurement", "nothing under a lease is freed before the closing measurement",
          PROFILING, lc.CLOSING, (2,), check_lease_outlives_closing),
    Check("lease_released_before_graph_profiling", "leases are released after the closing measurement and "
          "before CUDA-graph profiling", PROFILING, lc.LEASE_RELEASE, (3,), check_lease_released_before_graph_profiling),
    Check("profile_replayed_after_warmup", "persistent memory made by in-window warmup is measured together "
          "with the activation peak (profile replay)", PROFILING, lc.CLOSING, (8,), check_profile_replayed),
    Check("warmup_idempotent", "a second warmup allocates nothing", PROFILING, lc.WARMUP_REPEAT, (7,),
          check_warmup_idempotent),
    Check("warmup_retryable", "a warmup that fails part-way leaks nothing and the retry completes it",
          PROFILING, lc.WARMUP, (7,), check_warmup_retryable),
    Check("arena_stable_after_closing", "the arena's pointer and size never change after the closing "
          "measurement", PROFILING, lc.SERVING, (4,), check_arena_stable),
    Check("arena_not_grown_after_lock", "growth after lock raises, naming the requester and sizes", PROFILING,
          lc.LOCK, (4,), check_arena_not_grown_after_lock),
    Check("ubatch_arenas_disjoint", "micro-batch arenas never overlap and wrappers stay in their own",
          PROFILING, lc.SERVING, (5,), check_ubatch_arenas_disjoint, _several_ubatches),
    Check("no_synthetic_workspace_in_capture", "nothing allocates synthetic profiling workspace (or resource "
          "memory) during graph capture", PROFILING, lc.CAPTURE, (9, 13), check_no_synthetic_in_capture),
    Check("resource_capacity_honoured", "a resource never holds more device memory than the exact capacity "
          "it declared", PROFILING, lc.WARMUP_REPEAT, (13,), check_resource_capacity, _has_capacity_resource),
    Check("no_state_outlives_case", "no device memory a builder makes lives on in module or class state beyond "
          "its case", PROFILING, lc.SETUP, (14,), check_no_state_outlives_case),
    Check("no_post_kv_overrun", "peak usage after KV allocation stays within total x gmu", PROFILING,
          lc.WARMUP_REPEAT, (1, 2, 3, 4, 7, 8, 10), check_no_post_kv_overrun),
    Check("graph_pool_full_high_water", "the CUDA-graph pool is accounted at its full high-water mark",
          PROFILING, lc.KV_SIZING, (10,), check_graph_pool_full_high_water),
    Check("workspace_covers_planner", "the declared float/int workspace covers what FlashInfer's planner "
          "carves for the worst batch, without wasting KV capacity", PROFILING, lc.SETUP, (11, 12),
          check_workspace_covers_planner),
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

