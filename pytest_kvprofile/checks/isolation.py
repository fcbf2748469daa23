"""The check of device memory that module or class state keeps beyond its case."""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.checks.evidence import (
    alive_at_end,
    builder_names,
    site,
)
from pytest_kvprofile.lifecycle.module_state import made_by
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult
from pytest_kvprofile.units import MiB


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
    names = builder_names(result)
    used = {id(f.alloc): f for f in result.foreign_uses}
    held = {id(h.alloc): h.where for h in result.module_held}
    culprits: dict[tuple, list[str]] = {}
    mine = {id(a) for a in result.allocations}
    for h in result.module_held:
        a = h.alloc
        ours = id(a) in mine or id(a) in used or made_by(a) == result.backend
        if ours and a.owner in names and a.kind == "device" and alive_at_end(a):
            culprits.setdefault(site(a) + (a.nbytes,), []).append(h.where)
    for key, f in used.items():
        a = f.alloc
        if a.kind == "device" and alive_at_end(a) and key not in held:
            culprits.setdefault(site(a) + (a.nbytes,), []).append(f"{f.owner} ({f.tag})")
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


CHECKS: tuple[Check, ...] = (
    Check("no_state_outlives_case", "no device memory a builder makes lives on in module or class state beyond "
          "its case", PROFILING, lc.SETUP, (14,), check_no_state_outlives_case),
)
