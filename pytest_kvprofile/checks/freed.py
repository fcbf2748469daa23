"""Checks of memory after it is given back: nothing plans into, writes or reads what a growth, a release or a free
returned.

The harness judges each use from what it knows, never from ``bound_workspaces()``: in ctx mode an arena view carries
the generation of the arena it points into (a growth or a close retires it) and an allocation knows whether it is
alive, and ``ctx.plan_into`` says which one a call uses; in torch mode every torch call that reads or writes a
storage the ledger already freed is observed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.lifecycle.record import PROFILING, BoundRecord, LifecycleResult, MemoryUse
from pytest_kvprofile.units import bytes_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.device import Allocation


def describe_use(use: MemoryUse) -> str:
    """One observed use: who, in which call and phase, what memory (MiB and bytes), how, where, how often."""
    via = f" via {use.via}" if use.via else ""
    where = f" at {use.stack}" if use.stack else ""
    times = f" ({use.count} times)" if use.count > 1 else ""
    building = f" building micro-batch {use.for_ubatch}" if use.for_ubatch is not None else ""
    return (f"{use.owner} {use.method or '-'}(){building} in phase {use.phase!r} used {use.what}, "
            f"{bytes_text(use.nbytes)}{via}{where}{times}")


def check_no_use_after_free(result: LifecycleResult, options: CheckOptions) -> list[str]:
    freed = [u for u in result.uses if u.freed_phase is not None]
    return _bound_to_freed_arena(result) + [
        f"no_use_after_free: {describe_use(u)}, which was given back in phase {u.freed_phase!r} (an arena growth, a "
        "lease release or a free): the wrapper points at memory the allocator hands to others. Ask "
        "ctx.get_workspace() again after the arena grows (rebind), and re-create what a lease release freed "
        "instead of planning into it."
        for u in sorted(freed, key=lambda u: (lc.PHASE_INDEX.get(u.phase, -1), u.key))
    ]


_PLANNING_PHASES = (lc.CAPTURE, lc.SERVING)
"""Phases whose builds plan into every wrapper's bound float workspace: after rebind, nothing stale may stay bound."""


def _bound_to_freed_arena(result: LifecycleResult) -> list[str]:
    """A wrapper still bound, at capture or serving, to an arena a growth gave back (issue 51, item 20).

    A wrapper plans into its bound float workspace on every build, so a binding reported through
    ``bound_workspaces()`` on a given-back arena is a use after free whether or not a use was observed. A view only
    held (never reported bound after rebind) stays legal, and so does persistent memory no route uses (a cost)."""
    out: list[str] = []
    for phase in _PLANNING_PHASES:
        rec = result.phase(phase)
        if rec is None:
            continue
        current = {v.ubatch: (v.ptr, v.end, v.generation) for v in rec.arena if v.nbytes}
        seen: set[tuple[str, int, str, int]] = set()
        for bound in rec.bound:
            w = bound.workspace
            live = current.get(w.ubatch)
            if w.nbytes <= 0 or (live is not None and live[0] <= w.ptr and w.ptr + w.nbytes <= live[1]):
                continue
            old = _given_back_arena(result, w.ubatch, w.ptr, w.nbytes, phase)
            key = (bound.owner, w.ubatch, w.role, w.ptr)
            if old is None or key in seen:
                continue
            seen.add(key)
            out.append(_bound_message(result, bound, old, phase, live[2] if live else 0))
        if out:
            return out
    return out


def _given_back_arena(result: LifecycleResult, ubatch: int, ptr: int, nbytes: int, phase: str) -> Allocation | None:
    """The float arena of ``ubatch`` that holds ``[ptr, ptr + nbytes)`` and was given back by the end of ``phase``."""
    k = lc.PHASE_INDEX.get(phase, len(lc.PHASE_ORDER))
    prefix = f"float-arena[ubatch {ubatch}]"
    for a in result.allocations:
        if (a.role is Role.FLOAT_ARENA and a.tag.startswith(prefix) and a.ptr <= ptr
                and ptr + nbytes <= a.ptr + a.nbytes and a.freed_phase is not None
                and lc.PHASE_INDEX.get(a.freed_phase, k + 1) <= k):
            return a
    return None


def _generation(result: LifecycleResult, old: Allocation, ubatch: int) -> int | None:
    """The generation the phase records saw ``old`` as ``ubatch``'s arena in, if any did."""
    for rec in result.phases:
        for v in rec.arena:
            if v.ubatch == ubatch and v.ptr == old.ptr and v.nbytes == old.nbytes:
                return v.generation
    return None


def _bound_message(result: LifecycleResult, bound: BoundRecord, old: Allocation, phase: str, live: int) -> str:
    w = bound.workspace
    gen = _generation(result, old, w.ubatch)
    which = f"generation {gen} of micro-batch {w.ubatch}'s arena" if gen else f"micro-batch {w.ubatch}'s arena"
    made = f" (made in phase {old.phase!r}{' at ' + old.where if old.where else ''})"
    now = f"; the live arena is generation {live}" if live else ""
    return (f"no_use_after_free: {bound.owner}'s wrapper {w.role!r} [ubatch {w.ubatch}] is bound in phase {phase!r} "
            f"to {bytes_text(w.nbytes)} at ptr {w.ptr:#x}, inside {which}{made}, which a growth gave back in "
            f"phase {old.freed_phase!r}{now}. A wrapper plans into its bound float workspace on every build: this "
            "is a use after free even where no use was observed. Bind every wrapper again in rebind() "
            "(ctx.get_workspace(), then point the wrapper at the new view) after the arena grows.")


CHECKS: tuple[Check, ...] = (
    Check("no_use_after_free", "nothing plans into, writes or reads memory a growth, a lease release or a free "
          "gave back", PROFILING, lc.SERVING, (16,), check_no_use_after_free),
)
