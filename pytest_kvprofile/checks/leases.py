"""Checks of lease ordering: what the lease keeps is seen at the closing measurement and released before graph profiling."""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.checks.evidence import (
    fmt_alloc,
    grouped,
    lease_released_sites,
    live_device_bytes,
)
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult
from pytest_kvprofile.units import MiB


def check_persistent_memory_visible_at_closing(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Every builder byte alive after KV sizing was already held at the closing measurement."""
    out = []
    by_id = {a.id: a for a in result.allocations}
    for owner in result.builder_names():
        held = live_device_bytes(result, owner, lc.CLOSING)
        for phase in lc.POST_KV_PHASES:
            if result.phase(phase) is None:
                continue
            live = live_device_bytes(result, owner, phase)
            if live > held:
                late = [
                    by_id[a.id] for a in result.allocations
                    if a.owner == owner and a.kind == "device"
                    and lc.PHASE_INDEX[lc.CLOSING] < lc.PHASE_INDEX.get(a.phase, -1) <= lc.PHASE_INDEX[phase]
                    and (a.freed_phase is None or lc.PHASE_ORDER.index(a.freed_phase) > lc.PHASE_ORDER.index(phase))
                ]
                released = lease_released_sites(result, owner)
                detail = grouped(
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


def check_lease_outlives_closing_measurement(result: LifecycleResult, options: CheckOptions) -> list[str]:
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
                    f"closing measurement could see it: {fmt_alloc(a)}"
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
                f"CUDA-graph profiling (counted twice): " + "; ".join(fmt_alloc(a) for a in leaked[:6])
            )
    return out


CHECKS: tuple[Check, ...] = (
    Check("persistent_memory_visible_at_closing", "every builder byte alive after KV sizing was held at the "
          "closing measurement", PROFILING, lc.WARMUP_REPEAT, (1, 2, 3, 7, 13), check_persistent_memory_visible_at_closing),
    Check("lease_outlives_closing_measurement", "nothing under a lease is freed before the closing measurement",
          PROFILING, lc.CLOSING, (2,), check_lease_outlives_closing_measurement),
    Check("lease_released_before_graph_profiling", "leases are released after the closing measurement and "
          "before CUDA-graph profiling", PROFILING, lc.LEASE_RELEASE, (3,), check_lease_released_before_graph_profiling),
)
