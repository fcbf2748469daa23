"""How checks read and describe a record: live bytes, sites, allocations grouped for a message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.lifecycle.phases import Phase
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.units import bytes_text, size_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.device import Allocation


def fmt_alloc(a: Allocation) -> str:
    where = f" at {a.where}" if a.where else ""
    return f"{a.owner}: {a.tag!r} {bytes_text(a.nbytes)} in phase {a.phase!r}{where}"


def builder_names(result: LifecycleResult) -> set[str]:
    return set(result.builder_names())


def alive_at_end(a: Allocation) -> bool:
    """Alive when the run ended: not freed, or freed only by the parts' ``close()`` (phase ``teardown``), which
    runs after every phase a check reads and must not hide what a builder kept."""
    return a.freed_phase is None or a.freed_phase == lc.TEARDOWN


def alive_at(a: Allocation, phase: Phase) -> bool:
    """Alive at the end of ``phase``: made in it or before, freed after it or never (``teardown`` is after all)."""
    made, limit = lc.PHASE_INDEX.get(a.phase, -1), lc.PHASE_INDEX[phase]
    return 0 <= made <= limit and (a.freed_phase is None or lc.PHASE_INDEX.get(a.freed_phase, -1) > limit)


def live_device_bytes(result: LifecycleResult, owner: str, at_phase: Phase) -> int:
    """Device bytes owned by ``owner`` alive at the end of ``at_phase``."""
    return sum(a.nbytes for a in result.allocations
               if a.owner == owner and a.kind == "device" and alive_at(a, at_phase))


def site(a: Allocation) -> tuple[str, str, str | None]:
    """Where an allocation comes from: owner, tag and (torch mode) source line."""
    return (a.owner, a.tag, getattr(a, "stack", None))


_RESOURCE_METHODS = {"build": "use", "reserve_persistent_workspace": "materialize"}

_GroupKey = tuple[str, str, int, str, str, str]  # owner, tag, bytes, method, phase, source line ("" when none)


def grouped(result: LifecycleResult, allocs: list[Allocation],
            first: Callable[[Allocation], bool] | None = None) -> str:
    """Allocations grouped by (owner, tag, bytes, method, phase, source line), each with its count and total.

    Groups for which ``first`` holds come first, then the largest totals. Every group is shown.
    """
    resources = resource_names(result)
    groups: dict[_GroupKey, list[Allocation]] = {}
    for a in allocs:
        method = result.alloc_origin.get(a.id) or "-"
        if a.owner in resources:
            method = _RESOURCE_METHODS.get(method, method)
        key: _GroupKey = (a.owner, a.tag, a.nbytes, method, a.phase, a.where or "")
        groups.setdefault(key, []).append(a)

    def order(item: tuple[_GroupKey, list[Allocation]]) -> tuple[int, int, _GroupKey]:
        key, members = item
        lead = 0 if first is None or first(members[0]) else 1
        return (lead, -key[2] * len(members), key)

    parts = []
    for (owner, tag, nbytes, method, phase, stack), members in sorted(groups.items(), key=order):
        times = f" x {len(members)} = {size_text(nbytes * len(members))}" if len(members) > 1 else ""
        where = f" at {stack}" if stack else ""
        parts.append(f"{owner}: {tag!r} {bytes_text(nbytes)}{times} from {method}() in phase "
                     f"{phase!r}{where}")
    return "; ".join(parts)


def method_site(result: LifecycleResult, name: str, method: str) -> str:
    """`` at path:line`` of the method ``name``'s part defines (where its author changes it), "" when unknown."""
    part = next((b for b in result.builders if getattr(b, "name", None) == name), None)
    part = getattr(part, "resource", part)  # a resource's own method, not its adapter's
    code = getattr(getattr(getattr(type(part), method, None), "__func__", getattr(type(part), method, None)),
                   "__code__", None)
    return f" at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def resource_names(result: LifecycleResult) -> set[str]:
    from pytest_kvprofile.contract.resources import is_resource

    return {b.name for b in result.builders if is_resource(b)}


def fmt_batch(batch: Any) -> str:  # Any: a worst batch (qo, kv, graph) or None, shown by repr
    try:
        qo, kv, graph = batch
        return f"({len(qo)} requests, {sum(qo)} q tokens, max kv {max(kv) if kv else 0}, cuda_graph={graph})"
    except (TypeError, ValueError):
        return repr(batch)
