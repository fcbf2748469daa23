"""Checks of memory after it is given back: nothing plans into, writes or reads what a growth, a release or a free
returned.

The harness judges each use from what it knows, never from ``bound_workspaces()``: in ctx mode an arena view carries
the generation of the arena it points into (a growth or a close retires it) and an allocation knows whether it is
alive, and ``ctx.plan_into`` says which one a call uses; in torch mode every torch call that reads or writes a
storage the ledger already freed is observed.
"""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult, MemoryUse
from pytest_kvprofile.units import bytes_text


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
    return [
        f"no_use_after_free: {describe_use(u)}, which was given back in phase {u.freed_phase!r} (an arena growth, a "
        "lease release or a free): the wrapper points at memory the allocator hands to others. Ask "
        "ctx.get_workspace() again after the arena grows (rebind), and re-create what a lease release freed "
        "instead of planning into it."
        for u in sorted(freed, key=lambda u: (lc.PHASE_INDEX.get(u.phase, -1), u.key))
    ]


CHECKS: tuple[Check, ...] = (
    Check("no_use_after_free", "nothing plans into, writes or reads memory a growth, a lease release or a free "
          "gave back", PROFILING, lc.SERVING, (16,), check_no_use_after_free),
)
