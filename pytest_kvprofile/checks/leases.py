"""Checks of the lifetime of a builder's memory: what the lease keeps is seen at the closing measurement and
released before graph profiling, and the parts' teardown (``close()``) is clean."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import BOTH, Check, CheckOptions
from pytest_kvprofile.checks.evidence import (
    alive_at,
    alive_at_end,
    grouped,
    live_device_bytes,
)
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult
from pytest_kvprofile.memory.device import Allocation, own_frame
from pytest_kvprofile.units import bytes_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.lifecycle.phases import Phase
    from pytest_kvprofile.matrix.cases import Case


def check_persistent_memory_visible_at_closing(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Every builder byte alive after KV sizing was already held at the closing measurement.

    Under an engine that serves from a headroom (``post_capture`` KV sizing: SGLang), a step's own tensors come out
    of that headroom: what a source line made after KV sizing is step memory when the line also made memory that was
    freed again (a wrapper keeps its last plan's indices until its next plan), and only the rest is persistent."""
    out = []
    for owner in result.builder_names():
        held = live_device_bytes(result, owner, lc.CLOSING)
        worst: tuple[int, Phase, int, list[Allocation], list[Allocation]] | None = None
        for phase in lc.POST_KV_PHASES:
            if result.phase(phase) is None:
                continue
            live = live_device_bytes(result, owner, phase)
            if live <= held:
                continue
            late, step = made_after_closing(result, owner, phase)
            live -= sum(a.nbytes for a in step)
            if live > held and (worst is None or live - held > worst[0]):
                worst = (live - held, phase, live, late, step)
        if worst is None:
            continue
        excess, phase, live, late, step = worst  # the phase KV sizing missed most by: all of the late memory
        new, remade = _unmatched(result, owner, late)
        made = grouped(result, new) or "nothing new: the memory is re-used from earlier phases"
        context = (f". Context, made again after KV sizing at the same bytes and source line as memory the "
                   f"closing measurement saw: {grouped(result, remade)}" if remade else "")
        if step:
            context += (f". Not counted, step memory from the serving headroom (lines that also freed what "
                        f"they made after KV sizing): {grouped(result, step)}")
        made_in = sorted({a.phase for a in new}, key=lambda p: lc.PHASE_INDEX.get(p, len(lc.PHASE_ORDER)))
        where = f"made in phase {', '.join(repr(p) for p in made_in)}, " if made_in else ""
        when = "KV sizing" if all(p in lc.POST_KV_PHASES for p in made_in) else "the closing measurement"
        out.append(
            f"persistent_memory_visible_at_closing: case {result.case.id}: builder {owner!r}: "
            f"{bytes_text(excess)} invisible to KV sizing ({where}held {bytes_text(held)} at the closing "
            f"measurement, {bytes_text(live)} in phase {phase!r}). Made after {when} and still alive: {made}{context}. "
            "Make it inside the profiling window (reserve_persistent_workspace, under the lease) and reuse it, or "
            "free it before the call returns"
        )
    return out


def made_after_closing(result: LifecycleResult, owner: str,
                       phase: Phase) -> tuple[list[Allocation], list[Allocation]]:
    """``owner``'s device memory made after the closing measurement and alive at the end of ``phase``: what is
    persistent, and (under ``post_capture`` KV sizing only) step memory from the serving headroom: what a source line
    made that also made memory it freed again before the run ended."""
    late = [a for a in result.allocations
            if a.owner == owner and a.kind == "device"
            and lc.PHASE_INDEX[lc.CLOSING] < lc.PHASE_INDEX.get(a.phase, -1) <= lc.PHASE_INDEX[phase]
            and (a.freed_phase is None or lc.PHASE_INDEX[a.freed_phase] > lc.PHASE_INDEX[phase])]
    if result.budget is None or result.budget.rule != "post_capture":
        return late, []
    steps = {own_frame(a.stack or a.tag) for a in result.allocations
             if a.owner == owner and a.kind == "device" and a.phase in lc.POST_KV_PHASES and not alive_at_end(a)}
    step = [a for a in late if own_frame(a.stack or a.tag) in steps]
    stepped = {a.id for a in step}
    return [a for a in late if a.id not in stepped], step


def _unmatched(result: LifecycleResult, owner: str,
               late: list[Allocation]) -> tuple[list[Allocation], list[Allocation]]:
    """``late`` split into what the closing measurement never saw the like of (what made the bytes invisible) and
    what re-creates, at the same bytes and source line, memory it saw (a wrapper made again after the lease
    release): the first lead the message, the second are context."""
    def key(a: Allocation) -> tuple[int, str]:
        return a.nbytes, own_frame(a.stack or a.tag)

    seen = Counter(key(a) for a in result.allocations
                   if a.owner == owner and a.kind == "device" and alive_at(a, lc.CLOSING))
    new, remade = [], []
    for a in late:
        if seen[key(a)] > 0:
            seen[key(a)] -= 1
            remade.append(a)
        else:
            new.append(a)
    return new, remade


def check_lease_outlives_closing_measurement(result: LifecycleResult, options: CheckOptions) -> list[str]:
    out = []
    by_id = {a.id: a for a in result.allocations}
    for owner in result.released_before_closing:
        held = [by_id[aid] for rec in result.leases if rec.owner == owner for aid in rec.allocation_ids
                if by_id[aid].kind == "device"]
        what = f": {grouped(result, held)}" if held else ""
        out.append(f"the lease of {owner!r} was released before the closing measurement, so KV sizing never saw "
                   f"what it held{what}. Do not release it yourself: the engine releases it after the closing "
                   "measurement")
    for rec in result.leases:
        early = [by_id[aid] for aid in rec.allocation_ids
                 if by_id[aid].kind == "device" and by_id[aid].freed_phase in lc.WINDOW_PHASES + (lc.BASELINE,)]
        vouched = sum(by_id[aid].nbytes for aid in rec.allocation_ids if by_id[aid].kind == "device")
        if early and live_device_bytes(result, rec.owner, lc.CLOSING) >= vouched:
            continue  # replaced inside the window (a larger int workspace handed to the lease): KV sizing sees it
        if early:
            phases = ", ".join(sorted({str(a.freed_phase) for a in early}))
            out.append(
                f"memory under the lease of {rec.owner!r} was freed in phase(s) {phases}, before the closing "
                f"measurement could see it: {grouped(result, early)}. Keep it alive under the lease until the engine "
                "releases the lease"
            )
    return out


def check_lease_released_before_graph_profiling(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """The lease is released, and nothing the engine counted is counted twice, judged by bytes.

    The engine counted a builder's bytes alive at the closing measurement. Leased memory still alive after the
    release is fine on its own (the builder keeps and reuses it), and so is making memory again after the
    release (the wrappers it freed with the lease); both together beyond what was counted is memory that exists
    twice while KV sizing saw it once. Tags are not compared: a re-made wrapper may share a tag with a kept one.
    """
    out = []
    by_id = {a.id: a for a in result.allocations}
    released_at = lc.PHASE_INDEX[lc.LEASE_RELEASE]
    for rec in result.leases:
        if not rec.lease.released:
            out.append(f"the lease of {rec.owner!r} was never released: release it after the closing measurement "
                       "and before CUDA-graph profiling")
        leased = {aid for aid in rec.allocation_ids if by_id[aid].kind == "device"}
        counted = live_device_bytes(result, rec.owner, lc.CLOSING)
        for phase in lc.PHASE_ORDER[lc.PHASE_INDEX[lc.GRAPH_PROFILING]:lc.PHASE_INDEX[lc.WARMUP_REPEAT] + 1]:
            if result.phase(phase) is None:
                continue
            kept = [by_id[aid] for aid in sorted(leased) if alive_at(by_id[aid], phase)]
            remade = [a for a in result.allocations
                      if a.owner == rec.owner and a.kind == "device" and a.id not in leased
                      and lc.PHASE_INDEX.get(a.phase, -1) >= released_at and alive_at(a, phase)]
            live = live_device_bytes(result, rec.owner, phase)
            if not kept or not remade or live <= counted:
                continue
            # memory of a kind the closing measurement never saw is invisible, not counted twice (the visibility
            # check names it): what is counted twice is the rest of the excess
            unseen = sum(a.nbytes for a in _unmatched(result, rec.owner, remade)[0])
            if live - counted - unseen <= 0:
                continue
            kept_bytes, remade_bytes = sum(a.nbytes for a in kept), sum(a.nbytes for a in remade)
            out.append(
                f"lease_released_before_graph_profiling: builder {rec.owner!r} still holds {bytes_text(kept_bytes)} "
                f"of its leased memory in phase {phase!r} and has made {bytes_text(remade_bytes)} again since the "
                f"lease release: it holds {bytes_text(live)} where the engine counted {bytes_text(counted)} at the "
                f"closing measurement, {bytes_text(live - counted - unseen)} counted twice. Free what the lease "
                f"held when it is released, or reuse it instead of making it again. Kept: {grouped(result, kept)}. "
                "Made again: "
                f"{grouped(result, remade)}"
            )
            break
    return out


def check_teardown_clean(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """The parts' ``close()`` neither raises nor frees anything twice (a double free raises on the device)."""
    errors = Counter((e.who, e.exc_type, e.message, e.site) for e in result.errors if e.phase == lc.TEARDOWN)
    return [
        f"teardown_clean: {who}.close() raised {exc_type} in phase {lc.TEARDOWN!r}: {message}"
        f"{f' ({n} times)' if n > 1 else ''}{f' (raised at {site})' if site else ''}. An engine closes its builders "
        "on shutdown and on every elastic restart: close() must free each allocation exactly once and return; "
        "drop each allocation from the builder as you free it"
        for (who, exc_type, message, site), n in sorted(errors.items())
    ]


def _closes(case: Case, parts: list[Builder]) -> bool:
    return any(callable(getattr(p, "close", None)) for p in parts)


CHECKS: tuple[Check, ...] = (
    Check("persistent_memory_visible_at_closing", "every builder byte alive after KV sizing was held at the "
          "closing measurement", PROFILING, lc.WARMUP_REPEAT, (1, 2, 3, 7, 13),
          check_persistent_memory_visible_at_closing),
    Check("lease_outlives_closing_measurement", "nothing under a lease is freed before the closing measurement",
          PROFILING, lc.CLOSING, (2,), check_lease_outlives_closing_measurement),
    Check("lease_released_before_graph_profiling", "leases are released after the closing measurement and "
          "before CUDA-graph profiling; leased memory kept after it is never made again", PROFILING, lc.LEASE_RELEASE,
          (3,), check_lease_released_before_graph_profiling),  # reads the later phases that ran
    Check("teardown_clean", "a part's close() frees each allocation once and does not raise", BOTH, lc.SETUP,
          (18,), check_teardown_clean, _closes),  # close() runs however far the run went
)
