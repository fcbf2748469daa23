"""Checks of the shared float arena: stable after the closing measurement, locked, one per micro-batch."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions, aborted_before
from pytest_kvprofile.checks.freed import describe_use
from pytest_kvprofile.contract.protocol import BoundWorkspace
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.workspace import ArenaView
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.units import bytes_text, size_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.device import Allocation
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.lifecycle.record import PlanRecord


def check_arena_stable_after_closing(result: LifecycleResult, options: CheckOptions) -> list[str]:
    closing = result.phase(lc.CLOSING)
    out = []
    for phase in (lc.LEASE_RELEASE, lc.GRAPH_PROFILING, lc.KV_SIZING, lc.REBIND, lc.WARMUP, lc.CAPTURE, lc.LOCK,
                  lc.SERVING):
        rec = result.phase(phase)
        if rec is None:
            continue
        assert closing is not None, "a phase after the closing measurement ran, so the closing measurement did"
        if rec.arena != closing.arena:
            out.append(
                f"the float arena moved or resized in phase {phase!r}: {_fmt_arena(closing.arena)} at the closing "
                f"measurement, {_fmt_arena(rec.arena)} now (captured CUDA graphs hold the old pointer)"
                f"{_grown_by(result, phase)}. Declare the largest float bytes you ask for (declared_workspace), so "
                "the engine reserves them before the closing measurement, and ask no larger view after it"
            )
            break
    capture = result.phase(lc.CAPTURE)
    serving = result.phase(lc.SERVING)
    if capture is not None and serving is not None and capture.bound != serving.bound:
        moved = sorted(set(capture.bound) ^ set(serving.bound),
                       key=lambda b: (b.owner, b.workspace.ubatch, b in serving.bound, repr(b.workspace)))
        detail = "; ".join(
            f"{b.owner} {b.workspace.role} [ubatch {b.workspace.ubatch}] ptr {b.workspace.ptr:#x} "
            f"{b.workspace.nbytes} bytes{_fmt_int(b.workspace)} "
            f"({'at capture' if b in capture.bound else 'at serving'})"
            for b in moved[:4])
        out.append(f"workspace pointers bound at capture changed before replay: {detail}")
    return out


def _grown_by(result: LifecycleResult, phase: str) -> str:
    """The largest view asked in ``phase`` (what grew the arena there): who, how much, from which call and line."""
    asked = [g for g in result.grants if g.phase == phase]
    if not asked:
        return ""
    g = max(asked, key=lambda g: g.nbytes)
    where = f" at {g.site}" if g.site else ""
    return f"; {g.requester} asked for {bytes_text(g.nbytes)} from {g.method or 'a call'}(){where}"


def _fmt_arena(arena: tuple[ArenaView, ...]) -> str:
    return ", ".join(f"ubatch {v.ubatch}: ptr {v.ptr:#x} size {size_text(v.nbytes)}" for v in arena) or "none"


def _fmt_int(w: BoundWorkspace) -> str:
    """The wrapper's int workspace, when it reports one (a moved int workspace changes the binding too)."""
    return f", int workspace ptr {w.int_ptr:#x} {w.int_nbytes} bytes" if w.int_nbytes else ""


def check_arena_not_grown_after_lock(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Every refusal the manager recorded fails, caught by the builder or not: the request itself is the bug."""
    out = []
    refused = {(r.phase, r.requester) for r in result.refusals}
    counts = Counter(result.refusals)
    for r, n in counts.items():
        times = f" ({n} times)" if n > 1 else ""
        out.append(f"arena_not_grown_after_lock: {r.describe()}{times}; the locked arena refused to grow (whether "
                   "or not the builder caught the WorkspaceLockedError and fell back on its own buffer). Declare "
                   "the largest float bytes any batch asks for (declared_workspace), or ask that view before lock")
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


def _several_ubatches(case: Case, parts: list[Builder]) -> bool:
    return case.envelope.num_ubatches >= 2


def check_ubatch_arenas_disjoint(result: LifecycleResult, options: CheckOptions) -> list[str]:
    out = []
    for rec in result.phases:
        arenas = {v.ubatch: (v.ptr, v.end) for v in rec.arena if v.nbytes}
        spans = sorted(arenas.items(), key=lambda kv: kv[1])
        for (u1, (_s1, e1)), (u2, (s2, _e2)) in zip(spans, spans[1:]):
            if s2 < e1:
                out.append(f"phase {rec.name!r}: the arenas of ubatch {u1} and ubatch {u2} overlap")
        private_users: dict[int, set[int]] = {}
        for bound in rec.bound:
            ub, ptr, nbytes = bound.workspace.ubatch, bound.workspace.ptr, bound.workspace.nbytes
            if ub not in arenas:
                continue
            start, end = arenas[ub]
            if not (start <= ptr and ptr + nbytes <= end):
                if _held_stale_view(result, ub, ptr, nbytes, rec.name, (start, end)):
                    continue  # a view kept from before a growth: holding is not using (no_use_after_free judges use)
                other = [u for u, (s, e) in arenas.items() if u != ub and s <= ptr < e]
                own = None if other else _private_float_buffer(result, bound.owner, ptr, nbytes, rec.name)
                if own is not None:  # float workspace of its own (a cost the sizing check counts), not aliasing
                    private_users.setdefault(own.id, set()).add(ub)
                    if len(private_users[own.id]) == 2:
                        out.append(f"phase {rec.name!r}: {bound.owner}'s own float workspace {own.tag!r} is "
                                   f"planned into by micro-batches {sorted(private_users[own.id])}: they would "
                                   "overwrite each other")
                    continue
                where = f"inside ubatch {other[0]}'s arena" if other else "outside its arena"
                out.append(
                    f"phase {rec.name!r}: {bound.owner}'s {bound.workspace.role} for ubatch {ub} points {where} "
                    f"(ptr {ptr:#x}, {size_text(nbytes)}). Bind each micro-batch's wrappers to a view of its own "
                    "arena: ctx.get_workspace(nbytes, ubatch)"
                )
        if out:
            break
    return out + _observed_ubatch_violations(result) + _planned_float_unreported(result)


def _planned_float_unreported(result: LifecycleResult) -> list[str]:
    """Torch mode: what a wrapper was built over and plans into, whatever ``bound_workspaces()`` reports. A builder
    that reports its wrappers' float ranges, while its FlashInfer wrappers ``plan()`` into float memory none of those
    ranges lies in (a private ``torch.empty`` per wrapper, the arena views reported instead), hides that memory
    from every check that reads the arena: refused with the buffer's bytes, source line and wrappers."""
    if not result.plans_observed:
        return []
    reported: dict[str, list[tuple[int, int]]] = {}
    for rec in result.phases:
        for b in rec.bound:
            if b.workspace.nbytes > 0:
                reported.setdefault(b.owner, []).append((b.workspace.ptr, b.workspace.nbytes))
    allocs = {a.id: a for a in result.allocations}
    hidden: dict[tuple[str, int], list[PlanRecord]] = {}
    for p in result.plans:
        alloc = allocs.get(p.alloc_id) if p.alloc_id is not None else None
        ranges = reported.get(p.builder or "")
        if alloc is None or not ranges or alloc.role is Role.FLOAT_ARENA:
            continue
        if not any(alloc.ptr <= ptr < alloc.ptr + alloc.nbytes for ptr, _ in ranges):
            hidden.setdefault((p.builder or "", alloc.id), []).append(p)
    out = []
    for (who, alloc_id), plans in sorted(hidden.items()):
        a = allocs[alloc_id]
        wrappers = sorted({p.wrapper or p.route for p in plans})
        arena = sorted({(ptr, n) for ptr, n in reported[who]})
        shown = ", ".join(f"{ptr:#x} ({bytes_text(n)})" for ptr, n in arena[:3]) + (" ..." if len(arena) > 3 else "")
        out.append(
            f"ubatch_arenas_disjoint: {who}'s wrapper {wrappers[0]}"
            + (f" (and {len(wrappers) - 1} more)" if len(wrappers) > 1 else "")
            + f" plan()s into {bytes_text(a.nbytes)} of float workspace {a.tag!r} made in phase {a.phase!r}"
            + (f" at {a.where}" if a.where else "")
            + f" (first plan in phase {plans[0].phase!r}), but bound_workspaces() reports none of it: it reports "
            f"{shown}. The harness judges what a wrapper is built over and plans into, not what is reported: build "
            "each wrapper over the arena view it asks for (its tensor as float_workspace_buffer), or, for a buffer "
            "of its own, allocate it with role=Role.FLOAT_WORKSPACE and report that buffer")
    return out


def _held_stale_view(result: LifecycleResult, ubatch: int, ptr: int, nbytes: int, phase: str,
                     current: tuple[int, int]) -> bool:
    """``[ptr, ptr + nbytes)`` lies in an earlier arena of ``ubatch`` (one a growth replaced by the end of ``phase``):
    a builder still holding a view it took before the growth, which it may ask for again before it plans."""
    k = lc.PHASE_INDEX.get(phase, len(lc.PHASE_ORDER))
    prefix = f"float-arena[ubatch {ubatch}]"
    return any(a.role is Role.FLOAT_ARENA and a.tag.startswith(prefix) and (a.ptr, a.ptr + a.nbytes) != current
               and a.ptr <= ptr and ptr + nbytes <= a.ptr + a.nbytes and lc.PHASE_INDEX.get(a.phase, k + 1) <= k
               for a in result.allocations)


def _private_float_buffer(result: LifecycleResult, owner: str, ptr: int, nbytes: int, phase: str) -> Allocation | None:
    """The owner's own float workspace (``Role.FLOAT_WORKSPACE``, alive at the end of ``phase``) holding the range."""
    k = lc.PHASE_INDEX.get(phase, len(lc.PHASE_ORDER))
    for a in result.allocations:
        if (a.owner == owner and a.role is Role.FLOAT_WORKSPACE and a.ptr <= ptr and ptr + nbytes <= a.ptr + a.nbytes
                and lc.PHASE_INDEX.get(a.phase, k + 1) <= k
                and (a.freed_phase is None or lc.PHASE_INDEX.get(a.freed_phase, k + 1) > k)):
            return a
    return None


def _observed_ubatch_violations(result: LifecycleResult) -> list[str]:
    """What the manager saw, whatever the builder reports: the views it handed to each builder.

    A build for micro-batch u that asks for another micro-batch's arena plans into memory the other
    micro-batch uses concurrently; a builder that asks for arena views but never for u's while the
    engine builds u's batches through it plans u into another micro-batch's arena.
    """
    out = []
    wrong: dict[tuple[str, str | None, str, int, int, int], int] = {}  # (requester, method, phase, for, got, bytes)
    asked: dict[str, set[int]] = {}
    for g in result.grants:
        asked.setdefault(g.requester, set()).add(g.ubatch)
        if g.for_ubatch is not None and g.ubatch != g.for_ubatch and not _uses_observed(result, g.requester):
            key = (g.requester, g.method, g.phase, g.for_ubatch, g.ubatch, g.nbytes)
            wrong[key] = wrong.get(key, 0) + 1
    for (who, method, phase, mine, other, nbytes), n in wrong.items():
        times = f" ({n} times)" if n > 1 else ""
        out.append(
            f"ubatch_arenas_disjoint: in phase {phase!r} {who} {method}() for micro-batch {mine} asked for "
            f"{nbytes} bytes of micro-batch {other}'s arena{times}, and the harness sees none of its builds' uses: "
            "both micro-batches may plan into the same memory. Call ctx.plan_into(view) where each build plans (a "
            "request is not a use: the uses decide), or ask only for the built micro-batch's view"
        )
    out.extend(_observed_cross_ubatch_uses(result))
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


def _uses_observed(result: LifecycleResult, who: str) -> bool:
    """Whether the harness sees what ``who``'s builds really use: every torch call in torch mode on the simulated
    device, or in ctx mode the views its builds pass to ``ctx.plan_into``. Then a view asked for another
    micro-batch is a request, not a use: the uses decide (``_observed_cross_ubatch_uses``)."""
    return result.plans_observed or any(vp.builder == who for vp in result.view_plans)


def _observed_cross_ubatch_uses(result: LifecycleResult) -> list[str]:
    """What the builds really used, whatever views they asked for: a build for micro-batch u that plans into
    (``ctx.plan_into``) or, in torch mode, reads or writes another micro-batch's arena."""
    return [
        f"ubatch_arenas_disjoint: {describe_use(u)}: micro-batch {u.for_ubatch}'s plan lands in the arena micro-batch "
        f"{u.ubatch} uses concurrently; plan each micro-batch's batches into its own arena view"
        for u in result.uses if u.for_ubatch is not None and u.ubatch is not None and u.ubatch != u.for_ubatch
    ]


CHECKS: tuple[Check, ...] = (
    Check("arena_stable_after_closing", "the arena's pointer and size never change after the closing "
          "measurement", PROFILING, lc.SERVING, (4,), check_arena_stable_after_closing),
    Check("arena_not_grown_after_lock", "growth after lock raises, naming the requester and sizes", PROFILING,
          lc.LOCK, (4,), check_arena_not_grown_after_lock),
    Check("ubatch_arenas_disjoint", "micro-batch arenas never overlap and wrappers stay in their own",
          PROFILING, lc.SERVING, (5,), check_ubatch_arenas_disjoint, _several_ubatches),
)
