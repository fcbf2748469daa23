"""The check of each wrapper's dedicated int workspace, judged from what the harness observes.

Why: a FlashInfer wrapper plans into its own int workspace, and a captured CUDA graph keeps that workspace's raw
pointer. One smaller than the plan overflows; one shared by two wrappers or two micro-batches is overwritten by
the other's plan; one freed, re-made or moved after capture leaves the graph's pointer dangling. None of this
shows in the memory figures, so the check reads the ledger: allocations whose role is ``Role.INT_WORKSPACE``
(``ctx.allocate(..., role=)`` in ctx mode, FlashInfer's own wrapper buffers in torch mode) and the wrappers a
builder reports in ``bound_workspaces()``, located in the ledger.
"""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.checks.evidence import fmt_alloc, grouped, resource_names
from pytest_kvprofile.contract.protocol import BoundWorkspace, WorkspaceDeclaration
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import ProfilingSupport, declared_support
from pytest_kvprofile.lifecycle.phases import Phase
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult
from pytest_kvprofile.memory.device import Allocation
from pytest_kvprofile.units import bytes_text

# Phases at whose end the serving wrappers exist and plan: from the rebind after KV sizing to the end. (Between
# the lease release and the rebind a builder may legally hold wrappers it has dropped the int workspaces of.)
SERVING_STATE: tuple[Phase, ...] = (lc.REBIND, lc.WARMUP, lc.CAPTURE, lc.LOCK, lc.SERVING, lc.WARMUP_REPEAT)
LAST = lc.PHASE_INDEX[lc.WARMUP_REPEAT]


def alive_at(result: LifecycleResult, a: Allocation, phase: str) -> bool:
    """Whether ``a`` was alive at the end of ``phase``; at the end of the run, before any ``close()`` freed it."""
    k = lc.PHASE_INDEX[phase]
    made = lc.PHASE_INDEX.get(a.phase)
    if made is None or made > k:
        return False
    return a.freed_phase is None or lc.PHASE_INDEX.get(a.freed_phase, LAST + 1) > k  # teardown comes after every phase


def held(result: LifecycleResult, a: Allocation) -> bool:
    """Alive at the end of the phase it was made in: kept, not a constructor's buffer replaced at once."""
    return alive_at(result, a, a.phase) if a.phase in lc.PHASE_INDEX else False


def _within(ptr: int, nbytes: int, start: int, size: int) -> bool:
    return start <= ptr and ptr + nbytes <= start + size


def check_int_workspace_per_wrapper(result: LifecycleResult, options: CheckOptions) -> list[str]:

    resources = resource_names(result)
    out: list[str] = []
    for b in result.builders:
        name = getattr(b, "name", "")
        decl = result.declared.get(name)
        if name in resources or decl is None or declared_support(b) is not ProfilingSupport.REQUIRED:
            continue
        need, sized = int_need(result, name)
        mine = [a for a in result.allocations if a.owner == name and a.kind == "device"]
        ints = [a for a in mine if a.role is Role.INT_WORKSPACE]
        out.extend(_sizes(result, name, decl, need, [a for a in ints if held(result, a)], sized))
        out.extend(_short_reported(result, name, mine, need, sized))
        out.extend(_short_int_plans(result, name))
        out.extend(_shared_by_plans(result, name, mine))
        # Its wrappers have int workspaces if it declares or makes any; with no memory of the builder attributed
        # (torch-mode code on a real GPU) there is nothing to count.
        if (decl.int_bytes > 0 or ints) and mine:
            out.extend(_per_wrapper(result, name, mine, ints))
        located = [a for a in located_int_workspaces(result, name, mine) if a.role is not Role.INT_WORKSPACE]
        out.extend(_after_capture(result, name, ints + located))
        out.extend(_across_ubatches(result, name, ints))
        out.extend(_held_by_two_wrappers(result, name, mine))
    return out


def int_need(result: LifecycleResult, name: str) -> tuple[int, tuple[str, ...]]:
    """The int bytes FlashInfer's planner writes for one plan of the routes the builder plans natively (the
    sub-routes ``workspace_covers_planner`` sizes its float workspace for), with those sub-routes; a builder whose
    routes are all trtllm-gen plans none (0 bytes)."""
    from pytest_kvprofile.checks.workspace import builder_waste
    from pytest_kvprofile.sizing.case import for_case

    sized = builder_waste(result, name).sized
    routes = for_case(result.case).routes
    return max((routes[s].int_bytes for s in sized), default=0), sized


def route_int_need(result: LifecycleResult, route: str) -> tuple[int, tuple[str, ...]]:
    """The planner's int bytes for one case route's worst plan (its sub-routes', with and without CUDA graphs)."""
    from pytest_kvprofile.sizing.case import for_case, route_of

    routes = for_case(result.case).routes
    subs = tuple(s for s in routes if route_of(s) == route)
    return max((routes[s].int_bytes for s in subs), default=0), subs


def _need_text(need: int, sized: tuple[str, ...]) -> str:
    return (f"{bytes_text(need)} for one plan of {', '.join(sized) or 'no route'} "
            "(pytest_kvprofile.sizing.for_case(case).routes[...].int_bytes)")


def _sizes(result: LifecycleResult, name: str, decl: WorkspaceDeclaration, need: int,
           kept: list[Allocation], sized: tuple[str, ...] = ()) -> list[str]:
    """Each int workspace a builder keeps covers the planner's int bytes and what the builder declared."""
    out = []
    short = [a for a in kept if a.nbytes < need]
    if short:
        out.append(
            f"builder {name!r} keeps int workspaces smaller than FlashInfer's planner writes for one wrapper's plan "
            f"({_need_text(need, sized)}): {grouped(result, short)}; plan() overflows them. Give each wrapper at "
            "least that many bytes")
    under = [a for a in kept if a.nbytes < decl.int_bytes]
    if under:
        out.append(
            f"builder {name!r} declares {bytes_text(decl.int_bytes)} of int workspace "
            f"per wrapper but allocates less: {grouped(result, under)}; allocate what you declare (or declare what "
            "your wrappers really get)")
    return out


def _short_reported(result: LifecycleResult, name: str, mine: list[Allocation], need: int,
                    sized: tuple[str, ...]) -> list[str]:
    """Each wrapper's int workspace as reported (``bound_workspaces()``: ``int_ptr``, ``int_nbytes``, located in the
    builder's device memory) covers the planner's int need: a slice of a large slab is judged by the slice."""
    if not need:
        return []
    own_floats = [a for a in mine if a.role is Role.FLOAT_WORKSPACE]
    short: dict[tuple[int, int], tuple[BoundWorkspace, Allocation, Phase]] = {}
    for phase in SERVING_STATE:
        for w in _wrappers(result, name, phase, own_floats):
            if not w.int_nbytes or w.int_nbytes >= need:
                continue
            behind = _behind(w, phase, mine)
            if behind is not None and behind.nbytes >= need and (w.int_ptr, w.int_nbytes) not in short:
                short[(w.int_ptr, w.int_nbytes)] = (w, behind, phase)
    if not short:
        return []
    w, behind, phase = next(iter(short.values()))
    return [f"builder {name!r}: {len(short)} wrapper(s) plan into int workspaces smaller than FlashInfer's planner "
            f"writes ({_need_text(need, sized)}), first {w.role!r} (ubatch {w.ubatch}) with {bytes_text(w.int_nbytes)}"
            f" at the end of phase {phase!r}, inside {fmt_alloc(behind)} (bound_workspaces()); plan() overflows it. "
            "Give each wrapper at least that many bytes (FlashInfer's default is 8 MiB)"]


def _short_int_plans(result: LifecycleResult, name: str) -> list[str]:
    """Torch mode: a FlashInfer ``plan()`` of the builder handed an int workspace below its route's int need."""
    short: dict[tuple[str, int], list[str]] = {}
    needs: dict[str, tuple[int, tuple[str, ...]]] = {}
    for p in result.plans:
        if p.builder != name or not p.int_nbytes:
            continue
        if p.route not in needs:
            needs[p.route] = route_int_need(result, p.route)
        if p.int_nbytes < needs[p.route][0]:
            short.setdefault((p.route, p.int_nbytes), []).append(p.phase)
    allocs = {a.id: a for a in result.allocations} if short else {}
    out = []
    for (route, nbytes), phases in sorted(short.items()):
        plan = next(p for p in result.plans if p.builder == name and p.route == route and p.int_nbytes == nbytes)
        alloc = allocs.get(plan.int_alloc_id) if plan.int_alloc_id is not None else None
        into = f" of {fmt_alloc(alloc)}" if alloc is not None else ""
        out.append(
            f"builder {name!r}: its {route} wrapper {plan.wrapper or ''} plan()s into {bytes_text(nbytes)} of int "
            f"workspace{into} x {len(phases)}, first in phase {phases[0]!r}, but FlashInfer's planner writes "
            f"{_need_text(*needs[route])}: plan() overflows it. Give each wrapper at least that many bytes")
    return out


def _shared_by_plans(result: LifecycleResult, name: str, mine: list[Allocation]) -> list[str]:
    """Torch mode: two live wrappers whose ``plan()`` calls wrote overlapping bytes of one int workspace (observed
    plans, whatever ``bound_workspaces()`` reports)."""
    by_id = {a.id: a for a in mine}
    shares = [s for s in result.int_plan_shares if s.alloc_id in by_id]
    if not shares:
        return []
    s = shares[0]
    return [f"builder {name!r}: wrapper {s.planner} plan()s into the int workspace wrapper {s.holder} planned into "
            f"and still holds, {fmt_alloc(by_id[s.alloc_id])}, in phase {s.phase!r} ("
            f"{'' if s.ubatch is None else f'building ubatch {s.ubatch}; '}{len(shares)} such pair(s); seen from "
            "the plans, whatever bound_workspaces() reports): each plan "
            "overwrites the other's plan info. Give every wrapper its own int workspace"]


def _wrappers(result: LifecycleResult, name: str, phase: Phase, own_floats: list[Allocation]) -> list[BoundWorkspace]:
    """The wrappers a builder reports at the end of ``phase`` that plan into the float arena or into a float
    workspace of its own: each one needs its own int workspace."""
    rec = result.phase(phase)
    if rec is None:
        return []
    floats = [(v.ptr, v.nbytes) for v in rec.arena if v.nbytes]
    floats += [(a.ptr, a.nbytes) for a in own_floats if alive_at(result, a, phase)]
    return [r.workspace for r in rec.bound if r.owner == name and r.workspace.nbytes > 0
            and any(_within(r.workspace.ptr, r.workspace.nbytes, p, n) for p, n in floats)]


def _per_wrapper(result: LifecycleResult, name: str, mine: list[Allocation], ints: list[Allocation]) -> list[str]:
    """One int workspace per wrapper, alive while it plans, judged by the bytes each uses.

    A wrapper's int workspace is the live allocation of the builder's that its reported ``int_ptr`` locates
    (whatever its role), or else one of the builder's ``INT_WORKSPACE`` allocations no reporting wrapper claims.
    Two wrappers whose reported ranges overlap share one (disjoint slices of one slab are each their own)."""
    found: dict[str, str] = {}
    own_floats = [a for a in mine if a.role is Role.FLOAT_WORKSPACE]
    by_ptr: dict[int, list[Allocation]] = {}
    for a in mine:
        by_ptr.setdefault(a.ptr, []).append(a)
    for phase in SERVING_STATE:
        wrappers = _wrappers(result, name, phase, own_floats)
        live = [a for a in ints if alive_at(result, a, phase)]
        located: list[tuple[BoundWorkspace, Allocation]] = []
        unlocated: list[BoundWorkspace] = []
        for w in wrappers:
            behind = (_behind(w, phase, by_ptr.get(w.int_ptr, [])) or _behind(w, phase, mine)) if w.int_nbytes else None
            if behind is None:
                unlocated.append(w)
            elif alive_at(result, behind, phase):
                located.append((w, behind))
            elif "freed" not in found:
                found["freed"] = (
                    f"builder {name!r}'s wrapper {w.role!r} (ubatch {w.ubatch}) plans into an int workspace that is "
                    f"gone at the end of phase {phase!r}: {fmt_alloc(behind)}, freed in phase {behind.freed_phase!r}. "
                    "Keep each wrapper's int workspace alive as long as the wrapper plans")
        claimed = {a.id for _, a in located}
        spare = [a for a in live if a.id not in claimed]
        if len(unlocated) > len(spare) and "count" not in found:
            found["count"] = (
                f"builder {name!r} has {len(wrappers)} wrappers planning into its float workspace at the end of phase "
                f"{phase!r} (bound_workspaces()), and {len(unlocated)} of them have no int workspace the harness can "
                f"find: {len(located)} report an int_ptr locating a live allocation of the builder's, and it holds "
                f"{len(spare)} other int workspace(s) with role INT_WORKSPACE: "
                f"{grouped(result, spare) if spare else 'none'}. Give every wrapper its own int workspace, alive to "
                "the end: allocate it with role=Role.INT_WORKSPACE, or report it in bound_workspaces() (int_ptr, "
                "int_nbytes)")
        shared = _overlapping(located)
        if shared is not None and "shared" not in found:
            alloc, users = shared
            names = ", ".join(f"{w.role!r} (ubatch {w.ubatch})" for w in users)
            found["shared"] = (
                f"builder {name!r}'s wrappers {names} plan into overlapping bytes of one int workspace at the end of "
                f"phase {phase!r}: {fmt_alloc(alloc)}. Each plan overwrites the other's; give every wrapper its own "
                "(or its own disjoint slice)")
    return list(found.values())


def _overlapping(located: list[tuple[BoundWorkspace, Allocation]]) -> tuple[Allocation, list[BoundWorkspace]] | None:
    """The first allocation two wrappers use overlapping byte ranges of, with those wrappers."""
    by_alloc: dict[int, list[tuple[BoundWorkspace, Allocation]]] = {}
    for w, a in located:
        by_alloc.setdefault(a.id, []).append((w, a))
    for pairs in by_alloc.values():
        spans = sorted(pairs, key=lambda p: (p[0].int_ptr, p[0].int_ptr + p[0].int_nbytes))
        for (w1, a), (w2, _) in zip(spans, spans[1:]):
            if w2.int_ptr < w1.int_ptr + w1.int_nbytes:
                return a, [w1, w2]
    return None


def located_int_workspaces(result: LifecycleResult, name: str, mine: list[Allocation]) -> list[Allocation]:
    """The builder's allocations some wrapper's reported ``int_ptr`` locates at the end of a serving phase."""
    own_floats = [a for a in mine if a.role is Role.FLOAT_WORKSPACE]
    out: dict[int, Allocation] = {}
    for phase in SERVING_STATE:
        for w in _wrappers(result, name, phase, own_floats):
            behind = _behind(w, phase, mine) if w.int_nbytes else None
            if behind is not None:
                out[behind.id] = behind
    return list(out.values())


def _behind(w: BoundWorkspace, phase: Phase, candidates: list[Allocation]) -> Allocation | None:
    """Of the builder's ``candidates``, the latest made by the end of ``phase`` whose range holds the int workspace
    ``w`` reports (the ledger reuses a freed address, so the latest is the one the wrapper took); None when the
    address is none of the builder's (a host address, say: nothing to judge)."""
    k = lc.PHASE_INDEX[phase]
    return max((a for a in candidates if lc.PHASE_INDEX.get(a.phase, LAST + 1) <= k
                and _within(w.int_ptr, w.int_nbytes, a.ptr, a.nbytes)), key=lambda a: a.id, default=None)


def _held_by_two_wrappers(result: LifecycleResult, name: str, mine: list[Allocation]) -> list[str]:
    """Torch mode: FlashInfer wrapper objects that take one int workspace while another live wrapper plans into it
    (found from the wrappers themselves, so a builder that reports no wrapper is judged too)."""
    by_id = {a.id: a for a in mine}
    shared = [s for s in result.shared_ints if s.alloc_id in by_id]
    if not shared:
        return []
    first = shared[0]
    return [f"builder {name!r}: a FlashInfer {first.wrappers[1]} took as its int workspace the one a live "
            f"{first.wrappers[0]} plans into, {fmt_alloc(by_id[first.alloc_id])}, in phase {first.phase!r} "
            f"({len(shared)} such handover(s) in the run; seen from the wrappers, whatever bound_workspaces() says): "
            "each plan overwrites the other's. Give every wrapper its own"]


def _across_ubatches(result: LifecycleResult, name: str, ints: list[Allocation]) -> list[str]:
    """An int workspace the builds of two micro-batches plan into (observed: ``ctx.plan_into`` and torch writes),
    unless the wrappers report disjoint slices of it, one per micro-batch."""
    sliced = _sliced_per_ubatch(result, name)
    shared = [(a, sorted(result.int_ubatches[a.id])) for a in ints
              if len(result.int_ubatches.get(a.id, ())) > 1 and a.id not in sliced]
    if not shared:
        return []
    a, ubs = shared[0]
    return [f"builder {name!r}: the builds of micro-batches {ubs} plan into one int workspace, {fmt_alloc(a)}"
            f"{f' (and {len(shared) - 1} more)' if len(shared) > 1 else ''}: micro-batches run concurrently, so "
            "each plan overwrites the other's. Give each micro-batch's wrappers their own"]


def _sliced_per_ubatch(result: LifecycleResult, name: str) -> set[int]:
    """Int workspaces whose reporting wrappers hold disjoint slices of them (a slab, legal)."""
    mine = [a for a in result.allocations if a.owner == name and a.kind == "device"]
    out: set[int] = set()
    for phase in SERVING_STATE:
        own_floats = [a for a in mine if a.role is Role.FLOAT_WORKSPACE]
        located = [(w, b) for w in _wrappers(result, name, phase, own_floats)
                   if w.int_nbytes and (b := _behind(w, phase, mine)) is not None]
        by_alloc: dict[int, list[tuple[BoundWorkspace, Allocation]]] = {}
        for w, b in located:
            by_alloc.setdefault(b.id, []).append((w, b))
        for aid, pairs in by_alloc.items():
            if len(pairs) > 1 and _overlapping(pairs) is None:
                out.add(aid)
    return out


def _after_capture(result: LifecycleResult, name: str, ints: list[Allocation]) -> list[str]:
    """A captured graph keeps its wrapper's int workspace pointer: nothing held when capture began is freed
    before the end, and no int workspace is made from capture on (a re-make, same size or not, moves it)."""
    out = []
    freed = [a for a in ints if alive_at(result, a, lc.WARMUP) and not alive_at(result, a, lc.WARMUP_REPEAT)]
    if freed:
        out.append(
            f"builder {name!r} frees int workspaces its wrappers held when CUDA-graph capture began, before the "
            f"end: {grouped(result, freed)}, freed in phase "
            f"{', '.join(sorted({repr(a.freed_phase) for a in freed}))}; the captured graphs keep their pointers. "
            "Keep every wrapper's int workspace to the end")
    capture = lc.PHASE_INDEX[lc.CAPTURE]
    remade = [a for a in ints if lc.PHASE_INDEX.get(a.phase, -1) >= capture]
    if remade:
        out.append(
            f"builder {name!r} makes int workspaces from CUDA-graph capture on: {grouped(result, remade)}; a graph "
            "captured on the old one keeps a dangling pointer (a same-size re-make moves it too). Make each "
            "wrapper's int workspace once, inside the profiling window, and keep it")
    return out


CHECKS: tuple[Check, ...] = (
    Check("int_workspace_per_wrapper", "each wrapper has its own int workspace, at least the planner's int bytes "
          "and what the builder declares, never shared across wrappers or micro-batches, alive while it plans, "
          "and never freed, re-made or moved after CUDA-graph capture", PROFILING, lc.WARMUP_REPEAT, (15,),
          check_int_workspace_per_wrapper),
)
