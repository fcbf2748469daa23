"""The check of workspace sizing against FlashInfer's planner, and the waste it reports.

The design's rule (docs/contract.md): safety failures refuse, costs are reported. A float workspace
shorter than what a route plans into it overflows FlashInfer's bump allocator, so it always fails. One
larger than the need is safe (KV sizing sees it) and only costs KV capacity: it is reported per case in bytes
and KV tokens, and fails only above the budget a user sets (``--kvprofile-max-waste``).

Which routes are sized is observed, not assumed: the routes the builder's wrappers plan into the float arena
(the arena views it asks for, each optionally naming its route; in torch mode the FlashInfer ``plan()`` calls
seen, with the buffer each planned into) and into float workspace of its own (``Role.FLOAT_WORKSPACE``).
A route the builder plans into neither goes to trtllm-gen, whose workspace (``Role.TRTLLM_WORKSPACE``) is
used only when such a route exists; made when none does, it is waste too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckDetails, CheckOptions
from pytest_kvprofile.checks.evidence import fmt_batch, grouped, method_site, resource_names
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import (
    ProfilingSupport,
    builder_name,
    declared_support,
)
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult, ViewGrant
from pytest_kvprofile.matrix.models import kv_bytes_per_token
from pytest_kvprofile.memory.budget import tokens_for
from pytest_kvprofile.memory.device import Allocation
from pytest_kvprofile.sizing.case import PlannedRoute, for_case, need_for_planned, need_for_routes, routes
from pytest_kvprofile.units import MiB, bytes_text, size_text

if TYPE_CHECKING:
    from pytest_kvprofile.checks.base import JsonObject
    from pytest_kvprofile.lifecycle.record import ViewPlan
    from pytest_kvprofile.sizing.requirement import SizingResult


@dataclass(frozen=True)
class BuilderWaste:
    """What one REQUIRED builder reserves for float workspace against what its planned routes need.

    ``native``: case routes its wrappers plan into float workspace (arena views or its own buffers);
    ``sized``: their planner sub-routes; ``trtllm``: case routes left to trtllm-gen. Bytes are per rank, summed
    over the ``ubatches`` micro-batches (each has its own arena and its own need).
    """

    builder: str
    native: tuple[str, ...]
    sized: tuple[str, ...]
    trtllm: tuple[str, ...]
    ubatches: int
    need_per_ubatch: int
    arena_bytes: int
    private: tuple[Allocation, ...]
    unused_trtllm: tuple[Allocation, ...]
    declared_bytes: int = 0  # its float declaration, aligned as the manager aligns views
    largest_view: ViewGrant | None = None

    @property
    def private_bytes(self) -> int:
        return sum(a.nbytes for a in self.private)

    @property
    def unused_trtllm_bytes(self) -> int:
        return sum(a.nbytes for a in self.unused_trtllm)

    @property
    def float_waste(self) -> int:
        """Float workspace (arena and private) beyond the need of the routes planned into it."""
        return max(0, self.arena_bytes + self.private_bytes - self.need_per_ubatch * self.ubatches)

    @property
    def waste_bytes(self) -> int:
        return self.float_waste + self.unused_trtllm_bytes


@dataclass(frozen=True)
class CaseWaste:
    """A case's workspace waste over its REQUIRED builders, in bytes, KV tokens per rank and share of the KV pool."""

    case: str
    kv_bytes_per_token: int
    kv_pool_bytes: int | None
    builders: tuple[BuilderWaste, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.waste_bytes for b in self.builders)

    @property
    def kv_tokens(self) -> int:
        return tokens_for(self.nbytes, self.kv_bytes_per_token)

    def as_dict(self) -> JsonObject:
        pool = self.kv_pool_bytes
        return {
            "case": self.case, "bytes": self.nbytes, "mib": round(self.nbytes / MiB, 2), "kv_tokens": self.kv_tokens,
            "kv_pool_percent": round(100 * self.nbytes / pool, 2) if pool else None,
            "builders": [{
                "builder": b.builder, "native_routes": list(b.native), "sized_routes": list(b.sized),
                "trtllm_routes": list(b.trtllm), "ubatches": b.ubatches, "need_bytes": b.need_per_ubatch * b.ubatches,
                "arena_bytes": b.arena_bytes, "declared_bytes": b.declared_bytes,
                "private_float_bytes": b.private_bytes,
                "unused_trtllm_bytes": b.unused_trtllm_bytes, "float_waste_bytes": b.float_waste,
                "waste_bytes": b.waste_bytes,
            } for b in self.builders],
        }


_WASTE_ROLES = (Role.FLOAT_WORKSPACE, Role.TRTLLM_WORKSPACE)  # what a builder reserves beside the arena


def _alive_at_closing(a: Allocation) -> bool:
    """Made before the closing measurement and not freed by then: what KV sizing counted."""
    closing = lc.PHASE_INDEX[lc.CLOSING]
    made = lc.PHASE_INDEX.get(a.phase, len(lc.PHASE_ORDER))
    freed = lc.PHASE_INDEX.get(a.freed_phase, len(lc.PHASE_ORDER)) if a.freed_phase is not None else None
    return a.kind == "device" and made <= closing and (freed is None or freed > closing)


def _aligned(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def _required_builders(result: LifecycleResult) -> list[str]:
    resources = resource_names(result)
    return [builder_name(b) for b in result.builders
            if builder_name(b) not in resources and declared_support(b) is ProfilingSupport.REQUIRED]


_FLASHINFER_ROLES = (Role.INT_WORKSPACE, Role.PINNED_MIRROR, Role.FLOAT_WORKSPACE, Role.TRTLLM_WORKSPACE)


def shows_flashinfer(result: LifecycleResult, name: str) -> bool:
    """Whether anything of ``name`` is FlashInfer's: a view naming its route, a plan (``ctx.plan_into``, a FlashInfer
    ``plan()`` seen in torch mode), an int workspace declared or made, a wrapper's workspace role, a bound workspace
    reported. A builder with none of them (a quantized-KV kernel taking scratch from the arena) is no FlashInfer user:
    the planner's need does not size its views or its declaration."""
    decl = result.declared.get(name)
    return bool(
        (decl is not None and decl.int_bytes)
        or any(g.requester == name and g.route is not None for g in result.grants)
        or any(p.builder == name for p in result.plans)
        or any(vp.builder == name for vp in result.view_plans)
        or any(a.owner == name and a.role in _FLASHINFER_ROLES for a in result.allocations)
        or any(b.owner == name for rec in result.phases for b in rec.bound))


def flashinfer_views(result: LifecycleResult, name: str) -> list[ViewGrant]:
    """The arena views of ``name`` that FlashInfer plans into, which the planner's need sizes: every view of a builder
    that shows FlashInfer (``shows_flashinfer``), but where its builds tell their plans (``ctx.plan_into(view)``), only
    the views named for a route and those plans go into; another kernel's view beside them is not FlashInfer's."""
    views = [g for g in result.grants if g.requester == name]
    if not views or not shows_flashinfer(result, name):
        return []
    told = {(vp.ubatch, vp.nbytes) for vp in result.view_plans if vp.builder == name and vp.target == "view"}
    if not told:
        return views
    return [g for g in views if g.route is not None or (g.ubatch, g.nbytes) in told]


def _native_routes(result: LifecycleResult, name: str, views: list[ViewGrant],
                   private: tuple[Allocation, ...]) -> tuple[str, ...]:
    """The case routes the builder's wrappers plan into float workspace, as observed: the routes of FlashInfer
    ``plan()`` calls seen in torch mode and the routes its arena views name; without plans, a view that names no
    route or a float buffer of its own stands for every route, unless the run observed every plan (torch mode on
    the simulated GPU) and the builder asked for no view: then it planned none (SGLang's trtllm_mha backend carries
    FlashInfer's float workspace and never plans into it)."""
    case_routes = routes(result.case)
    named = {g.route for g in views}
    planned = {p.route for p in result.plans if p.builder == name}
    if planned or (result.plans_observed and not views):
        return tuple(r for r in case_routes if r in planned or r in named)
    if None in named or private:
        return case_routes
    return tuple(r for r in case_routes if r in named)


def _graph_modes(result: LifecycleResult, name: str, views: list[ViewGrant]) -> dict[str, set[bool | None]]:
    """The CUDA-graph modes the builder plans each route in, where it is known: observed in torch mode (the
    ``plan()`` calls seen, each with its wrapper's ``use_cuda_graph``), declared in ctx mode (``get_workspace(route=,
    cuda_graph=)``) together with the graph mode of what its builds plan into those views. A route missing here is
    sized with and without graphs."""
    modes: dict[str, set[bool | None]] = {}
    for p in result.plans:
        if p.builder == name:
            modes.setdefault(p.route, set()).add(p.cuda_graph)
    declared = {g.route for g in views if g.route is not None and g.route not in modes}
    for g in views:
        if g.route in declared:
            modes.setdefault(g.route, set()).add(g.cuda_graph)
    split = _split_builds([vp for vp in result.view_plans if vp.builder == name])
    for vp in result.view_plans:
        if (vp.builder == name and vp.target == "view" and vp.route in declared and vp.view_graph is not None
                and planned_kind(vp, split) == vp.route):
            modes.setdefault(vp.route, set()).add(vp.cuda_graph)
    return modes


def _planned(native: tuple[str, ...], modes: dict[str, set[bool | None]]) -> list[PlannedRoute]:
    """Each native route with the graph modes it is planned in (both where unknown, or where any view says both)."""
    out: list[PlannedRoute] = []
    for r in native:
        known = modes.get(r, {None})
        out.extend([(r, None)] if None in known else [(r, m) for m in sorted(known, key=bool)])
    return out


def builder_waste(result: LifecycleResult, name: str) -> BuilderWaste:
    """What ``name`` reserves (the arena it declares or asks for on each micro-batch, its own float workspace,
    its trtllm-gen workspace) against the need of the routes it was observed to plan. Its own float workspace
    is what carries ``Role.FLOAT_WORKSPACE`` and, in torch mode, any buffer of its own a ``plan()`` was seen
    planning into (the arena belongs to the engine's manager, not to the builder)."""
    case = result.case
    views = flashinfer_views(result, name)
    planned_into = {p.alloc_id for p in result.plans if p.builder == name}
    mine = [a for a in result.allocations
            if a.owner == name and (a.role in _WASTE_ROLES or a.id in planned_into) and _alive_at_closing(a)]
    private = tuple(a for a in mine if a.role is Role.FLOAT_WORKSPACE or a.id in planned_into)
    native = _native_routes(result, name, views, private)
    need, sized = need_for_planned(case, _planned(native, _graph_modes(result, name, views)))
    decl = result.declared.get(name) if shows_flashinfer(result, name) else None
    declared = _aligned(decl.float_bytes, result.arena_alignment) if decl is not None and decl.float_bytes else 0
    ubatches = _planned_ubatches(result, name, views, declared)
    arena = sum(max([declared, *(g.nbytes for g in views if g.ubatch == u)]) for u in range(ubatches))
    trtllm = tuple(r for r in routes(case) if r not in native)
    unused = () if trtllm else tuple(a for a in mine if a.role is Role.TRTLLM_WORKSPACE)
    largest = max(views, key=lambda g: (g.nbytes, -lc.PHASE_INDEX.get(g.phase, 0)), default=None)
    return BuilderWaste(name, native, sized, trtllm, ubatches, need, arena, private, unused, declared, largest)


def _planned_ubatches(result: LifecycleResult, name: str, views: list[ViewGrant], declared: int) -> int:
    """How many micro-batches' need the builder's float workspace must cover: the envelope's, unless it declares no
    arena, asks for no view, and its own buffers were planned in fewer (SGLang's runner has one attention backend)."""
    built = {p.ubatch for p in result.plans if p.builder == name and p.ubatch is not None}
    return len(built) if built and not views and not declared else result.case.envelope.num_ubatches


def case_waste(result: LifecycleResult) -> CaseWaste | None:
    """The case's waste over its REQUIRED builders, or None off the profiling path."""
    if result.path != PROFILING:
        return None
    case = result.case
    per_token = (result.budget.kv_bytes_per_token if result.budget
                 else kv_bytes_per_token(case.model, case.tp, case.dcp))
    pool = result.budget.available_kv if result.budget else None
    names = [n for n in _required_builders(result) if n in result.declared]
    return CaseWaste(case.id, per_token, pool, tuple(builder_waste(result, n) for n in names))


def check_workspace_covers_planner(result: LifecycleResult, options: CheckOptions) -> list[str]:
    need = for_case(result.case)
    cost = case_waste(result)
    sized = {b.builder: b.sized for b in cost.builders} if cost is not None else {}
    out: list[str] = []
    for name in _required_builders(result):
        decl = result.declared.get(name)
        if decl is None:
            out.append(f"builder {name!r} is REQUIRED but has no declared_workspace(case)")
            continue
        out.extend(_short(result, name, decl.float_bytes))
        int_need = max((need.routes[r].int_bytes for r in sized[name]), default=0)
        if decl.int_bytes < int_need:
            out.append(f"builder {name!r} reserves {decl.int_bytes} bytes of int workspace per wrapper "
                       f"(declared_workspace(){method_site(result, name, 'declared_workspace')}) but the planner "
                       f"needs {int_need} for routes {', '.join(sized[name])}; declare at least that (FlashInfer's "
                       "default is 8 MiB)")
    if options.max_waste is not None and cost is not None:
        limit = options.max_waste.limit_bytes(cost.kv_bytes_per_token, cost.kv_pool_bytes)
        if limit is not None and cost.nbytes > limit:
            out.append(f"{describe_waste(result, cost)}: over the waste budget of {options.max_waste.describe()}, "
                       f"{bytes_text(limit)} on this case; size the workspace from "
                       "`kvprofile size` for the routes the builder plans, or raise the budget")
    return out


def _routes_text(sized: tuple[str, ...]) -> str:
    return ", ".join(sized) if sized else "no native route (all trtllm-gen)"


def _short(result: LifecycleResult, name: str, declared: int) -> list[str]:
    """A declaration, or an arena view, shorter than the planner's need for the routes planned into it."""
    need = for_case(result.case)
    case, out = result.case, _graph_mode_mismatches(result, name)
    views = flashinfer_views(result, name)
    modes = _graph_modes(result, name, views)
    arena_need, subs = need_for_planned(case, _planned(_native_routes(result, name, views, ()), modes))
    declared_short = bool(views) and declared < arena_need
    if declared_short:
        out.append(
            f"builder {name!r} declares {bytes_text(declared)} of float workspace "
            f"(declared_workspace(){method_site(result, name, 'declared_workspace')}) but FlashInfer "
            f"{need.flashinfer_version}'s planner carves {size_text(arena_need)} ({need.method}) on "
            f"{case.gpu.num_sm} SMs for routes {_routes_text(subs)} ({_deciding_text(need, subs)}): "
            f"short by {size_text((arena_need - declared))} (Buffer overflow ... Increase the workspace "
            "buffer size); declare what `kvprofile size` says for those routes")
    by_route: dict[str | None, ViewGrant] = {}
    for g in views:
        best = by_route.get(g.route)
        if best is None or ((g.nbytes, -lc.PHASE_INDEX.get(g.phase, 0))
                            > (best.nbytes, -lc.PHASE_INDEX.get(best.phase, 0))):
            by_route[g.route] = g
    out.extend(_short_plans(result, name))
    out.extend(_short_for_what_is_planned(result, name))
    planned = any(p.builder == name for p in result.plans)
    for route, g in sorted(by_route.items(), key=lambda kv: kv[0] or ""):
        if route is None and planned:
            continue  # the plan() calls observed into it are judged one by one
        route_need, subs = (need_for_routes(case, None) if route is None
                            else need_for_planned(case, _planned((route,), modes)))
        if g.nbytes >= route_need or (declared_short and g.nbytes == _aligned(declared, result.arena_alignment)):
            continue  # covered, or the declaration's shortfall already says it
        via = (f"{g.method}()" if g.method else "a call") + (f" at {g.site}" if g.site else "")
        what = f"route {route!r}" if route else "every route of the case (the views name none)"
        out.append(
            f"builder {name!r} plans {what} into arena views of at most {size_text(g.nbytes)} ({g.nbytes} bytes, "
            f"from {via} in phase {g.phase!r}, ubatch {g.ubatch}) but FlashInfer {need.flashinfer_version}'s planner "
            f"carves {size_text(route_need)} for {', '.join(subs)} ({_deciding_text(need, subs)}): "
            f"short by {size_text((route_need - g.nbytes))} "
            "(Buffer overflow ... Increase the workspace buffer size); ask views of what `kvprofile size` says for "
            "that route")
    return out


def _deciding_text(need: SizingResult, subs: tuple[str, ...]) -> str:
    """The sub-route whose need decides among ``subs`` and its worst batch (not the case's overall worst batch)."""
    decides = max(subs, key=lambda r: need.routes[r].float_bytes, default=None)
    if decides is None:
        return "no route planned"
    return f"decided by {decides}, worst batch {fmt_batch(need.routes[decides].worst_batch)}"


def _split_builds(plans: list[ViewPlan]) -> set[int]:
    """The builds that split their batch: they planned into views named for both routes, or into a view and their
    trtllm-gen or own float workspace (the prefill part of a mixed batch on trtllm-gen, say)."""
    by_build: dict[int, set[str]] = {}
    for vp in plans:
        by_build.setdefault(vp.build, set()).add(vp.target if vp.target != "view" else f"view:{vp.route}")
    return {b for b, targets in by_build.items()
            if "view:decode" in targets and len(targets) > 1}


def planned_kind(vp: ViewPlan, split: set[int]) -> str:
    """The case route whose need a view plan is judged by: the part the builder named, else the decode part of a
    split mixed batch in a view named ``decode``, else the whole batch (a mixed batch plans prefill)."""
    if vp.part is not None:
        return "decode" if vp.part == "decode" else "prefill"
    if vp.batch_kind == "mixed" and vp.route == "decode" and vp.build in split:
        return "decode"
    return "decode" if vp.batch_kind == "decode" else "prefill"


def _short_for_what_is_planned(result: LifecycleResult, name: str) -> list[str]:
    """Ctx mode: a view named for one route that a build plans a batch (part) of the other route into (a prefill
    fallback into a view named ``route="decode"``), sized by what is planned, not by the name nor by the kind of
    the whole batch: a build that splits a mixed batch plans its decode part into the decode view."""
    case_routes = routes(result.case)
    worst: dict[tuple[str, str], ViewPlan] = {}
    mine = [vp for vp in result.view_plans if vp.builder == name]
    split = _split_builds(mine)
    for vp in mine:
        if vp.target != "view":
            continue
        planned = planned_kind(vp, split)
        if vp.route is None or vp.route == planned or planned not in case_routes:
            continue
        key = (vp.route, planned)
        if key not in worst or vp.nbytes < worst[key].nbytes:
            worst[key] = vp

    def what(vp: ViewPlan) -> str:
        return f"the {vp.part} part of {vp.batch_kind} batches" if vp.part else f"{vp.batch_kind} batches"

    out = []
    for (named, planned), vp in sorted(worst.items()):
        need, subs = need_for_routes(result.case, (planned,))
        if vp.nbytes < need:
            out.append(
                f"builder {name!r} plans {what(vp)} ({planned}) into an arena view named "
                f"route={named!r} of {bytes_text(vp.nbytes)} (phase {vp.phase!r}, ubatch {vp.ubatch}"
                + (f", at {vp.site}" if vp.site else "") + "), but "
                f"FlashInfer's planner carves {bytes_text(need)} for {', '.join(subs)} "
                f"({_deciding_text(for_case(result.case), subs)}): short by "
                f"{bytes_text(need - vp.nbytes)} (Buffer overflow ... Increase the workspace buffer size). A view is "
                "sized for what is planned into it; ask for one per route. If the build splits a mixed batch, say "
                "which part goes where: ctx.plan_into(view, part=Batch('decode', ...))")
    return out


def _graph_mode_mismatches(result: LifecycleResult, name: str) -> list[str]:
    """Ctx mode: a view asked for one CUDA-graph mode of its route (``get_workspace(route=, cuda_graph=)``) that a
    build plans a batch (part) of the other mode into, judged by the need of what is planned."""
    mine = [vp for vp in result.view_plans if vp.builder == name]
    split = _split_builds(mine)
    graphs: dict[str, ViewPlan] = {}
    for vp in mine:
        if (vp.target == "view" and vp.route is not None and vp.view_graph is not None
                and vp.cuda_graph != vp.view_graph and planned_kind(vp, split) == vp.route):
            if vp.route not in graphs or vp.nbytes < graphs[vp.route].nbytes:
                graphs[vp.route] = vp
    out = []
    for named, vp in sorted(graphs.items()):
        need, subs = need_for_planned(result.case, [(named, vp.cuda_graph)])
        if vp.nbytes < need:
            asked, got = ("with", "without") if vp.view_graph else ("without", "with")
            out.append(
                f"builder {name!r} asked for an arena view for {named} planned {asked} CUDA graphs "
                f"(get_workspace(route={named!r}, cuda_graph={vp.view_graph})) of {bytes_text(vp.nbytes)}, but plans "
                f"{vp.batch_kind} batches {got} them into it (phase {vp.phase!r}, ubatch {vp.ubatch}"
                + (f", at {vp.site}" if vp.site else "") + "): FlashInfer's "
                f"planner carves {bytes_text(need)} for {', '.join(subs)} "
                f"({_deciding_text(for_case(result.case), subs)}): short by {bytes_text(need - vp.nbytes)} (Buffer "
                "overflow ... Increase the workspace buffer size). Size the view for every graph mode the route "
                "plans (cuda_graph=None), or say what the build really plans: ctx.plan_into(view, part=Batch(..., "
                f"cuda_graph={vp.view_graph}))")
    return out


def _short_plans(result: LifecycleResult, name: str) -> list[str]:
    """Torch mode: a FlashInfer ``plan()`` of the builder into a float workspace below its route's need."""
    if not result.plans:
        return []
    need, case_routes = for_case(result.case), routes(result.case)
    needs = {(r, g): need_for_planned(result.case, [(r, g)]) for r in case_routes for g in (False, True)}
    short: dict[tuple[str, int, int | None, bool], list[str]] = {}
    for p in result.plans:
        key = (p.route, p.cuda_graph)
        if p.builder == name and key in needs and p.nbytes < needs[key][0]:
            short.setdefault((p.route, p.nbytes, p.alloc_id, p.cuda_graph), []).append(p.phase)
    allocs = {a.id: a for a in result.allocations} if short else {}
    out = []
    for (route, nbytes, alloc_id, graph), phases in sorted(short.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        alloc = allocs.get(alloc_id) if alloc_id is not None else None
        into = (f"{alloc.role} {alloc.tag!r} of {alloc.owner}" + (f" at {alloc.where}" if alloc.where else "")
                if alloc else "memory outside the simulated device")
        route_need, subs = needs[(route, graph)]
        out.append(
            f"builder {name!r}: its {route} wrappers ({'with' if graph else 'without'} CUDA graphs) plan() into "
            f"{bytes_text(nbytes)} of float workspace ({into}) x {len(phases)}, first in phase {phases[0]!r}, "
            f"but FlashInfer {need.flashinfer_version}'s planner carves {size_text(route_need)} for the worst batch of "
            f"{', '.join(subs)} ({_deciding_text(need, subs)}): short by {size_text((route_need - nbytes))} "
            "(Buffer overflow ... Increase the workspace buffer size); build the wrapper over a float workspace of "
            "what `kvprofile size` says for that route")
    return out


def describe_waste(result: LifecycleResult, cost: CaseWaste) -> str:
    """One line per case: the waste in MiB, exact bytes and KV tokens, and what it is made of, per builder."""
    parts = []
    for b in cost.builders:
        if not b.waste_bytes:
            continue
        bits = []
        if b.float_waste:
            view = b.largest_view
            via = (f"; largest view {bytes_text(view.nbytes)} from "
                   f"{view.method or 'a call'}() in phase {view.phase!r}" if view else "")
            bits.append(
                f"float workspace {size_text((b.arena_bytes + b.private_bytes))} over {b.ubatches} micro-batch(es) "
                f"(arena {size_text(b.arena_bytes)}: declared {size_text(b.declared_bytes)} per micro-batch"
                f"{via}; own buffers {size_text(b.private_bytes)}) where routes "
                f"{_routes_text(b.sized)} need {size_text(b.need_per_ubatch)} per micro-batch: "
                f"{bytes_text(b.float_waste)} beyond the need"
                + (f" [own buffers: {grouped(result, list(b.private))}]" if b.private else ""))
        if b.unused_trtllm:
            bits.append(f"a trtllm-gen workspace no route uses (every route plans natively: {', '.join(b.native)}): "
                        f"{grouped(result, list(b.unused_trtllm))}")
        parts.append(f"builder {b.builder!r}: " + "; ".join(bits))
    pool = f", {100 * cost.nbytes / cost.kv_pool_bytes:.2f}% of the KV pool" if cost.kv_pool_bytes else ""
    return (f"{bytes_text(cost.nbytes)} of workspace wasted on {cost.case}, "
            f"{cost.kv_tokens} KV tokens per rank{pool}: " + "; ".join(parts))


def waste_details(result: LifecycleResult) -> CheckDetails:
    """``workspace_covers_planner``'s record carries the case's waste (``case_waste``) for the report."""
    waste = case_waste(result)
    return CheckDetails() if waste is None else CheckDetails(waste=waste.as_dict())


CHECKS: tuple[Check, ...] = (
    Check("workspace_covers_planner", "the float/int workspace covers what FlashInfer's planner carves for the "
          "worst batch of every route the builder plans into it; waste is reported, and fails only over "
          "--kvprofile-max-waste", PROFILING, lc.SETUP, (11, 12, 19), check_workspace_covers_planner,
          details=waste_details),
)
