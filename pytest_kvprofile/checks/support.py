"""Checks of the fail-closed support declaration and of the legacy path it keeps."""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import BOTH, Check, CheckDetails, CheckOptions
from pytest_kvprofile.checks.evidence import (
    alive_at_end,
    builder_names,
    grouped,
    resource_names,
)
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.lifecycle.record import LEGACY, PROFILING, LifecycleResult
from pytest_kvprofile.units import bytes_text, size_text


def check_support_declaration(result: LifecycleResult, options: CheckOptions) -> list[str]:
    if result.declaration_error:
        return [result.declaration_error]
    res = result.resolution
    assert res is not None, "no declaration error, so the declarations were resolved"
    out = []
    decls = [s for _, s in res.declarations]
    expect = all(s is not ProfilingSupport.UNSUPPORTED for s in decls) and ProfilingSupport.REQUIRED in decls
    expect = expect and not res.engine_gate  # the engine's own gate (EnginePolicy.gate) keeps the case legacy
    if res.enabled != expect:
        out.append(f"resolver answered enabled={res.enabled} for {res.declarations}; the rule says {expect}")
    if result.path != (PROFILING if res.enabled else LEGACY):
        out.append(f"the engine took the {result.path} path although the resolver said enabled={res.enabled}")
    if not res.enabled:
        calls = [(c.phase, c.builder) for c in result.calls if c.method == "reserve_persistent_workspace"]
        if calls:
            out.append(f"reserve_persistent_workspace() was called on the legacy path: {calls}")
    resources = resource_names(result)
    for name, support in res.declarations:
        if support is not ProfilingSupport.NEUTRAL or name in resources:
            continue
        kept = [a for a in result.allocations if a.owner == name and a.kind == "device" and alive_at_end(a)]
        if kept:
            out.append(
                f"builder {name!r} declares NEUTRAL (it reserves nothing of its own) but keeps "
                f"{size_text(sum(a.nbytes for a in kept))} of its own device memory: {grouped(result, kept)}. "
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
            assert result.resolution is not None, "a window phase ran, so the declarations were resolved"
            out.append(f"phase {phase!r} ran although the model is on the legacy path ({result.resolution.reason})")
    names = builder_names(result)
    kept = [
        a for a in result.allocations
        if a.owner in names and a.phase in lc.WINDOW_PHASES and a.kind == "device"
        and (a.freed_phase is None or a.freed_phase not in lc.WINDOW_PHASES)
    ]
    if kept:
        total = sum(a.nbytes for a in kept)
        out.append(
            f"builders on the legacy path kept {bytes_text(total)} from the profiling window, "
            f"which changes legacy KV sizing: {grouped(result, kept)}. Free what the window made before it closes, "
            "or declare REQUIRED and reserve it under a lease"
        )
    stopped = _stopped_after_the_window(result)
    if stopped:
        out.append(stopped)
    return out


def _stopped_after_the_window(result: LifecycleResult) -> str | None:
    """Why a legacy run that got past the closing measurement never finished serving, or None.

    Running out of device memory after KV sizing is the legacy path's own cost (memory KV sizing never saw): it is
    reported with that cost (``legacy_cost_details``), never refused. Any other error after the window (a kernel
    refusing a batch in capture, a builder raising in serving) is a broken run whose post-KV cost means nothing."""
    phase = result.aborted_in
    if phase is None or lc.PHASE_INDEX.get(phase, -1) <= lc.PHASE_INDEX[lc.CLOSING]:
        return None
    err = next((e for e in result.errors if not e.injected), None)
    if err is None or ((err.out_of_memory or err.exc_type == "DeviceOutOfMemory") and err.phase in lc.POST_KV_PHASES):
        return None
    return (f"the legacy run stopped in phase {phase!r} and never served: {err.describe()}. A model on the legacy "
            "path must run through serving as it did before the contract")


def legacy_cost_details(result: LifecycleResult) -> CheckDetails:
    """``legacy_path_unchanged``'s record carries what the legacy path's parts allocate after KV sizing and keep
    (``checks/post_kv_cost.py``), which the verdict and the summary report as information."""
    from pytest_kvprofile.checks.post_kv_cost import post_kv_cost

    cost = post_kv_cost(result) if result.path == LEGACY else None
    return CheckDetails() if cost is None else CheckDetails(legacy_cost=cost.as_dict())


CHECKS: tuple[Check, ...] = (
    Check("support_declaration", "a builder declares a ProfilingSupport member; REQUIRED+NEUTRAL enables, any "
          "UNSUPPORTED disables, all-NEUTRAL does not", BOTH, lc.SETUP, (6,), check_support_declaration),
    Check("legacy_path_unchanged", "a model off the new path runs the legacy lifecycle through serving (running "
          "out of memory after KV sizing is its reported cost) and keeps nothing from the profiling window", LEGACY,
          lc.CLOSING, (6,), check_legacy_path_unchanged, details=legacy_cost_details),
)
