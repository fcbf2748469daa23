"""The run's part that watches process-wide state (``module_state.py`` finds it): what state holds after a run
and after the parts' ``close()``, and a second engine of the same backend started in the same process.

The engine (``engine.py``) calls these at fixed points of its phases; each fills fields of the record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.lifecycle.module_state import (
    MemoryOf,
    Registered,
    held_after_close,
    held_in_modules,
    modules_of,
    remember,
)
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult, ProbeTarget, SecondEngine
from pytest_kvprofile.lifecycle.teardown import close_parts
from pytest_kvprofile.memory.device import SimDevice


def _part_files(result: LifecycleResult, parts: set[str]) -> set[str]:
    """The source files the parts allocated from (a closure or module function of the backend holds state too)."""
    return {a.stack.rsplit(":", 1)[0] for a in result.allocations if a.stack and a.owner in parts}


def observe(result: LifecycleResult, builders: Iterable[object], parts: set[str], memory_of: MemoryOf) -> None:
    """Device memory that process-wide state holds after the run (``result.module_held``); the modules holding
    this run's memory are looked at again before every later run."""
    result.module_held = held_in_modules(modules_of(builders, _part_files(result, parts)), memory_of)
    remember(h for h in result.module_held if h.alloc.owner in parts)


def observe_after_close(result: LifecycleResult, builders: Iterable[object], parts: set[str], memory_of: MemoryOf,
                        atexit: list[Registered]) -> None:
    """Device memory of this run's parts that a live thread or an atexit handler still holds once every part's
    ``close()`` ran (``result.after_close_held``); the handlers are then let go (atexit keeps its own)."""
    mine = {id(a) for a in result.allocations}
    before = {id(h.alloc) for h in result.module_held}
    # what close() put into process-wide state (it held none of it before): the engine's memory outlives it
    parked = [h for h in held_in_modules(modules_of(builders, _part_files(result, parts)), memory_of)
              if id(h.alloc) in mine and h.alloc.owner in parts and id(h.alloc) not in before and h.alloc.alive]
    remember(parked)  # taken back before every later run, as state found after a run is
    result.after_close_held = [
        *parked, *(h for h in held_after_close(memory_of, atexit)
                   if id(h.alloc) in mine and h.alloc.owner in parts and h.alloc.alive)]
    atexit.clear()


def second_engine(result: LifecycleResult, device: Device, parts: set[str],
                  run: Callable[[ProbeTarget], LifecycleResult]) -> SecondEngine | None:
    """A second engine of the same backend in the same process (``run``), after this one, when this run left
    memory in process-wide state: reusing it, the second makes none that the state keeps (opted-in runs on
    simulated devices only: the check that reads it judges the profiling path). None when not started."""
    mine = {id(a) for a in result.allocations}
    if result.errors or result.path != PROFILING or not isinstance(device, SimDevice) or not any(
            id(h.alloc) in mine and h.alloc.owner in parts for h in result.module_held):
        return None
    # a fresh process makes its engine config anew: the second engine gets an equal Case, not the same object
    target = dataclasses.replace(result.probe, case=dataclasses.replace(result.case))
    second = run(target)
    close_parts(second)
    made = {id(a) for a in second.allocations}
    names = set(second.builder_names())
    return SecondEngine(
        second,
        remade=[h for h in second.module_held if id(h.alloc) in made and h.alloc.owner in names],
        error=next((f"{e.who} raised {e.exc_type} in phase {e.phase!r}: {e.message}" for e in second.errors), None),
    )
