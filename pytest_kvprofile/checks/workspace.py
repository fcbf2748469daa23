"""The check of workspace sizing against FlashInfer's planner."""

from __future__ import annotations

from typing import Any

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.checks.evidence import (
    fmt_batch,
    resource_names,
)
from pytest_kvprofile.contract.support import ProfilingSupport, declared_support
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult
from pytest_kvprofile.memory.budget import tokens_for
from pytest_kvprofile.units import MiB


def check_workspace_covers_planner(result: LifecycleResult, options: CheckOptions) -> list[str]:
    from pytest_kvprofile.sizing.case import for_case

    need = for_case(result.case)
    out = []
    per_token = result.budget.kv_bytes_per_token if result.budget else 1
    resources = resource_names(result)
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
                f"{result.case.gpu.num_sm} SMs for worst batch {fmt_batch(need.worst_batch)}: short by "
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
                f"{need.flashinfer_version}'s planner carves for worst batch {fmt_batch(need.worst_batch)} (Buffer "
                "overflow ... Increase the workspace buffer size)"]
    if used - need.float_bytes > slack:
        wasted = used - need.float_bytes
        return [f"{where}, where the planner needs at most {need.float_bytes / MiB:.2f} MiB: {wasted / MiB:.2f} MiB "
                f"wasted, {tokens_for(wasted, per_token)} KV tokens per rank (allowed slack {slack / MiB:.2f} MiB)"]
    return [f"{where}: the declaration the engine sizes the arena from differs from what the wrappers use"]


CHECKS: tuple[Check, ...] = (
    Check("workspace_covers_planner", "the declared float/int workspace covers what FlashInfer's planner "
          "carves for the worst batch, without wasting KV capacity", PROFILING, lc.SETUP, (11, 12),
          check_workspace_covers_planner),
)
