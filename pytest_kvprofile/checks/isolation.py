"""The check of device memory that process-wide state keeps: made once, before the closing measurement, reused."""

from __future__ import annotations

from collections import Counter

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.checks.evidence import builder_names, fmt_alloc, grouped
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult, ModuleHeld

_COUNTED = lc.PHASE_INDEX[lc.CLOSING]  # made before the closing measurement: KV sizing counts it


def _held(result: LifecycleResult, held: list[ModuleHeld]) -> str:
    paths = sorted({h.where for h in held})
    return f"{grouped(result, [h.alloc for h in held])}; held by {', '.join(paths)}"


def check_no_state_outlives_case(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Process-wide state judged as the first engine of a fresh process meets it, and as a second engine does.
    Long because its messages name each way state can hold memory; each branch is one message.

    The run starts from a fresh view of the state (``module_state.fresh_view``), so a buffer kept there is made
    by this case on every case, in any order. It is safe when made before the closing measurement (KV sizing
    counts it) and reused by a later engine in the same process: ``SecondEngine`` must make none of it again.
    Memory of an earlier case that this run uses anyway (state the harness could not find or put back) fails:
    what the case's KV sizing sees then depends on what ran before it. So does this case's memory that, once every
    part's ``close()`` ran, process-wide state holds and did not hold before ``close()``, or a live thread's frames
    or an ``atexit`` handler hold (``LifecycleResult.after_close_held``): it outlives the engine.
    """
    names = builder_names(result)
    mine = {id(a) for a in result.allocations}
    ours = [h for h in result.module_held
            if id(h.alloc) in mine and h.alloc.owner in names and h.alloc.kind == "device"]
    late = [h for h in ours if lc.PHASE_INDEX.get(h.alloc.phase, len(lc.PHASE_ORDER)) > _COUNTED]
    out = []
    if late:
        out.append(
            "no_state_outlives_case: process-wide state keeps device memory made after the closing measurement, "
            "which KV sizing never counted (every engine of the process runs with less memory than it sized for): "
            f"{_held(result, late)}. Make it inside the profiling window (in reserve_persistent_workspace) or keep "
            "it on the builder under its lease."
        )
    kept = [h for h in ours if not h.resettable and h not in late]
    if kept:
        out.append(
            "no_state_outlives_case: process-wide state keeps device memory where the harness cannot put it back "
            "to a fresh process's state (a frozen object, a function's default), so a later case would reuse it "
            f"and what its KV sizing sees would depend on the order cases run in: {_held(result, kept)}. Keep it "
            "in a module global, dict, list, class attribute, cache or closure, or on the builder."
        )
    second = result.second_engine
    if second is not None and second.remade:
        out.append(
            "no_state_outlives_case: a second engine of this backend in the same process made again the device "
            "memory process-wide state keeps, instead of reusing what the first engine made (the first engine's "
            "KV sizing never saw the copy): "
            f"{_held(second.run, [h for h in second.remade if h.alloc.kind == 'device'])}. Make it once per "
            "process (look it up in the state first) or keep it on the builder."
        )
    if second is not None and second.error is not None:
        out.append(
            "no_state_outlives_case: a second engine of this backend in the same process failed on the "
            f"process-wide state the first engine left: {second.error}"
        )
    after = [h for h in result.after_close_held if h.alloc.owner in names and h.alloc.kind == "device"]
    parked = [h for h in after if h.module]
    if parked:
        out.append(
            "no_state_outlives_case: close() left device memory of this case in process-wide state that held none "
            "of it before (a module global, cache, thread-local or class attribute), so it outlives the engine and "
            f"no later engine's KV sizing counts it: {_held(result, parked)}. Free it in close(), or keep one "
            "buffer per process there, made in the first engine's profiling window and reused."
        )
    threads = [h for h in after if not h.module]
    if threads:
        out.append(
            "no_state_outlives_case: after every part's close() ran, device memory of this case is still held by "
            "a live thread or an atexit handler, which outlive every engine of the process and which no fresh "
            f"process's state resets: {_held(result, threads)}. Stop and join the thread in close() (and "
            "atexit.unregister the handler there), or keep no device memory in its frames, target or arguments."
        )
    held = {id(h.alloc) for h in result.module_held}
    foreign = [f for f in result.foreign_uses if f.alloc.kind == "device" and id(f.alloc) not in held]
    if foreign:
        made = Counter(fmt_alloc(f.alloc) for f in foreign)  # an earlier device's: its own method is not known here
        users = sorted({f"{f.owner} ({f.tag}{' at ' + f.stack if f.stack else ''})" for f in foreign})
        out.append(
            "no_state_outlives_case: this case uses device memory an earlier case made, kept where the harness "
            "could not find it or put it back to a fresh process's state, so what KV sizing sees depends on "
            f"which cases ran before: {'; '.join(f'{m} x {n}' if n > 1 else m for m, n in sorted(made.items()))}; "
            f"used by {', '.join(users)}. Keep it in a "
            "module global, class attribute, cache or closure of the backend's modules, or on the builder."
        )
    return out


CHECKS: tuple[Check, ...] = (
    Check("no_state_outlives_case", "device memory process-wide state keeps is made once per process, before the "
          "closing measurement, and reused by later engines; each case is judged from a fresh process's state",
          PROFILING, lc.SETUP, (14,), check_no_state_outlives_case),
)
