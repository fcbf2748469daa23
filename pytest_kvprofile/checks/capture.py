"""The check of what is allocated while a CUDA graph is captured."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.checks.evidence import (
    builder_names,
    grouped,
    resource_names,
    site,
)
from pytest_kvprofile.lifecycle.record import CAPTURE_PROBE, PROFILING, LifecycleResult
from pytest_kvprofile.memory.device import own_frame

if TYPE_CHECKING:
    from pytest_kvprofile.contract.device import Allocation


def check_no_synthetic_workspace_in_capture(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Judge every allocation made while a graph is captured by the method it came from, not by its tag.

    Resources allocate nothing in capture (docs/protocol.md); a builder's ``dummy_run``, ``warmup`` or any other
    method allocates nothing in capture either. ``build`` plans the captured batch, so a transient it
    also makes for real traffic (the same owner, tag and source line when serving) is plan scratch;
    one it makes only in dummy forwards is synthetic profiling workspace.
    """
    resources = resource_names(result)
    names = builder_names(result)
    captured = [
        a for a in result.allocations
        if a.phase in (lc.GRAPH_PROFILING, lc.CAPTURE) and a.pool != "default" and a.owner in names
    ]
    if not captured:
        return []
    served = {
        site(a) for a in result.allocations
        if a.phase in (lc.SERVING, lc.WARMUP_REPEAT) and result.alloc_origin.get(a.id) == "build"
    }
    bad = []
    for a in captured:
        method = result.alloc_origin.get(a.id)
        transient = a.freed_phase == a.phase
        if a.owner in resources or method != "build" or (transient and site(a) not in served
                                                         and not _flashinfer_plan(a)):
            bad.append(a)
    if bad:
        return [
            "no_synthetic_workspace_in_capture: builder or resource memory that real traffic never needs was "
            "allocated while a CUDA graph was being captured: " + grouped(result, bad)
            + ". Skip synthetic profiling work while ctx.capturing, and make what a captured step needs before "
            "capture"
        ]
    return []


@functools.cache
def flashinfer_dir() -> str:
    """Where the installed FlashInfer's Python code lives ("" without one), found without importing it."""
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return ""
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.join(os.path.realpath(locations[0]), "") if locations else ""


def _flashinfer_plan(a: Allocation) -> bool:
    """Made by FlashInfer's own code (a wrapper's ``plan()``): it plans a captured size the same way whenever it
    first meets it, in capture or in serving, so what it makes is real traffic, never synthetic profile workspace
    (vLLM plans a CUDA-graph wrapper in full on its first call, then ``fast_plan_decode``s it before each replay)."""
    root = flashinfer_dir()
    if not root or not a.stack:
        return False
    path = own_frame(a.stack).rsplit(":", 1)[0]  # "file:line in function"
    return bool(os.path.realpath(path).startswith(root))


def check_captured_memory_stays(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """What a captured graph reads stays where it is: every builder allocation a capture read or wrote (torch mode:
    every storage its calls touched; ctx mode: ``ctx.plan_into``) and that was alive when capture ended is alive to
    the end. A re-make after capture, at the same size or not, moves it under the graph's raw pointer."""
    names = builder_names(result)
    capture_end = lc.PHASE_INDEX[lc.CAPTURE]
    moved = [a for a in result.allocations
             if a.id in result.captured_reads and a.owner in names and a.kind == "device"
             and lc.PHASE_INDEX.get(a.phase, capture_end + 1) <= capture_end and a.freed_phase != lc.CAPTURE
             and a.freed_phase in (lc.LOCK, lc.SERVING, lc.WARMUP_REPEAT)]
    if not moved:
        return []
    phases = ", ".join(sorted({repr(a.freed_phase) for a in moved}))
    return [f"captured_memory_stays: memory the CUDA-graph capture read or wrote is freed after capture (in phase "
            f"{phases}): {grouped(result, moved)}. A captured graph keeps its raw pointers; keep what a captured "
            "wrapper plans into (its fixed index buffers, its int workspace) alive to the end, and refill it in "
            "place instead of making it again"]


def check_capture_retryable(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """What the lifecycle's ``capture`` probe found (``lifecycle/probe_capture.py``): on fresh builders, the engine's
    capture fails at each distinct allocation site a builder has in it, the engine resets the failed graphs and
    captures again. Nothing the failed attempt made stays (no allocation, so nothing keeps the graph pool's segments
    reserved), its error is the one raised, and the retried capture leaves each builder holding what a clean capture
    does."""
    return list(result.probed(CAPTURE_PROBE).violations)


CHECKS: tuple[Check, ...] = (
    Check("no_synthetic_workspace_in_capture", "nothing allocates synthetic profiling workspace (or resource "
          "memory) during graph capture", PROFILING, lc.CAPTURE, (9, 13), check_no_synthetic_workspace_in_capture),
    Check("captured_memory_stays", "memory a CUDA-graph capture reads or writes stays alive, where it is, to the end",
          PROFILING, lc.CAPTURE, (4,), check_captured_memory_stays),
    # needs the warmup after KV sizing: the probe drives its own capture from there; the run's own capture only
    # names the builders that allocate in it (a run that stopped in capture is refused by the checks of capture)
    Check("capture_retryable", "a CUDA-graph capture that fails at any builder allocation leaves nothing behind, "
          "and the engine's second capture holds what a clean one holds", PROFILING, lc.WARMUP, (7,),
          check_capture_retryable, probes=(CAPTURE_PROBE,)),
)
