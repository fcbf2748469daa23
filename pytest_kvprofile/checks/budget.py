"""Checks of the engine's budget: every byte alive at the closing measurement in a term, the overrun after KV sizing,
and the graph pool's accounting."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import BOTH, Check, CheckDetails, CheckOptions, JsonObject
from pytest_kvprofile.checks.evidence import (
    alive_at,
    alive_at_end,
    builder_names,
    grouped,
)
from pytest_kvprofile.contract.budget import POINT_TEXT, SNAPSHOT_POINTS, SnapshotPoint
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult, TransientPeak
from pytest_kvprofile.matrix.models import kv_bytes_per_token
from pytest_kvprofile.memory.budget import Budget, tokens_for
from pytest_kvprofile.memory.device import Allocation, own_frame
from pytest_kvprofile.units import KiB, MiB, bytes_text, size_text


@dataclass(frozen=True)
class Uncounted:
    """What the engine's budget leaves out at the closing measurement: ``reserved``, the bytes this run reserved by
    then that its persistent terms do not add up to (its own figures); ``alive``, the allocations alive then that no
    persistent term counts, by the snapshot point they were made before (the earliest a term counts from)."""

    reserved: int
    alive: dict[SnapshotPoint, list[Allocation]]

    @property
    def alive_bytes(self) -> int:
        return sum(a.nbytes for allocs in self.alive.values() for a in allocs)


def uncounted_at_closing(result: LifecycleResult) -> Uncounted:
    """Device memory at the closing measurement that the engine's budget (``result.engine_terms``) does not count."""
    terms, marks, window = result.engine_terms, result.snapshot_marks, result.window
    if terms is None or window is None or "closing" not in marks:
        return Uncounted(0, {})
    persistent = [t for t in terms.terms if t.since is not None and t.until is not None]
    spans = [(marks[t.since], marks[t.until]) for t in persistent if t.since in marks and t.until in marks]
    starts = sorted(persistent, key=lambda t: SNAPSHOT_POINTS.index(t.since or "closing"))
    alive: dict[SnapshotPoint, list[Allocation]] = {}
    for i, a in enumerate(result.allocations[:marks["closing"]]):
        if a.kind != "device" or not alive_at(a, lc.CLOSING) or any(lo <= i < hi for lo, hi in spans):
            continue
        missed_by: SnapshotPoint = next(
            (t.since for t in starts if t.since is not None and i < marks[t.since]), "closing")
        alive.setdefault(missed_by, []).append(a)
    made = window.closing_reserved - result.reserved_at_start  # what this run reserved: an earlier run's is not owed
    return Uncounted(made - sum(t.nbytes for t in persistent), alive)


def check_budget_counts_every_byte(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Every device byte alive at the closing measurement is in a term of the engine's own KV budget."""
    missed = uncounted_at_closing(result)
    if missed.reserved <= 0 and not missed.alive:
        return []
    terms, window = result.engine_terms, result.window
    assert terms is not None and window is not None, "uncounted memory is read against the engine's terms"
    case = result.case
    per_token = kv_bytes_per_token(case.model, case.tp, case.dcp)
    worst = max(missed.reserved, missed.alive_bytes)
    described = "; ".join(
        f"{t.name} {size_text(t.nbytes)}" + (
            f" (what was made after the snapshot {POINT_TEXT[t.since]} and is alive {POINT_TEXT[t.until]})"
            if t.since is not None and t.until is not None else " (no persistent memory)") for t in terms.terms)
    made = "; ".join(f"before the snapshot {POINT_TEXT[point]} ({point!r}): {grouped(result, allocs)}"
                     for point, allocs in missed.alive.items()) or "none alive (freed memory its snapshot saw)"
    return [
        f"budget_counts_every_byte: case {case.id}: {bytes_text(missed.alive_bytes)} alive at the closing "
        f"measurement is in no term of the engine's KV budget; its terms leave {bytes_text(missed.reserved)} of the "
        f"{size_text(window.closing_reserved)} reserved there uncounted. Sized by these terms, the KV cache is "
        f"{tokens_for(worst, per_token)} tokens per rank too large ({per_token} B/token), and the first full step runs "
        f"past total x gmu. Engine: {terms.engine}. Its terms: {described}. Made {made}. Take the engine's snapshot "
        f"before this memory is made (vLLM's init_device takes its MemorySnapshot before it makes the model "
        f"runner), or count it in a term"
    ]


def check_no_post_kv_overrun(result: LifecycleResult, options: CheckOptions) -> list[str]:
    budget = result.budget
    out = []
    oom = [e for e in result.errors if e.exc_type == "DeviceOutOfMemory" and e.phase in lc.POST_KV_PHASES]
    overrun = result.post_kv_overrun
    if overrun > 0 or oom:
        assert budget is not None, "a post-KV phase ran, so KV sizing made the budget"
        names = builder_names(result) | {"workspace-manager"}
        culprits = [a for a in result.post_kv_peak_live if a.owner in names]
        culprits.sort(key=lambda a: -a.nbytes)
        tokens = tokens_for(max(overrun, 0), budget.kv_bytes_per_token)
        head = (
            f"after KV sizing the device peaked at {result.post_kv_peak_used / MiB:.1f} MiB, "
            f"{bytes_text(max(overrun, 0))} over {budget.limit_text}"
        )
        if oom:
            head += f"; out of memory: {oom[0].message}"
        culprits, rebound = _split_rebound(result, culprits)
        detail = grouped(result, culprits)
        cached = _cached_left_behind(result, names)
        if cached:
            cached = f"reserved but free at the peak (cached segments a freed allocation left behind): {cached}"
            detail = f"{cached}; alive: {detail}" if detail else cached
        remedy = ("Make what you keep inside the profiling window (under the lease), and let transient scratch come "
                  "from the arena or free it before the call returns")
        if not detail:
            detail = "no builder allocation (engine accounting)"
            remedy = "The builders' memory was counted: the engine's budget misses the rest (see its other checks)"
        context = (f". Not responsible, made again in rebind() for what the lease release freed (the closing "
                   f"measurement counted it): {grouped(result, rebound)}" if rebound else "")
        out.append(
            f"{head}. Responsible allocations: {detail}{context}. The case would have to give up {tokens} KV tokens. "
            f"{remedy}. Budget: {' | '.join(budget.lines())}"
        )
    return out


def _split_rebound(result: LifecycleResult, live: list[Allocation]) -> tuple[list[Allocation], list[Allocation]]:
    """``live`` split into the rest and what ``rebind()`` made again for leased memory the lease release freed (the
    same owner, bytes and source line, or tag in ctx mode, as many times as the release freed it): legitimate, since
    the closing measurement counted what it replaces."""
    def key(a: Allocation) -> tuple[str, int, str]:
        return a.owner, a.nbytes, own_frame(a.stack) if a.stack else a.tag

    leased = {aid for rec in result.leases for aid in rec.allocation_ids}
    freed = Counter(key(a) for a in result.allocations if a.id in leased and a.freed_phase == lc.LEASE_RELEASE)
    rest, rebound = [], []
    for a in live:
        if a.phase == lc.REBIND and freed[key(a)] > 0:
            freed[key(a)] -= 1
            rebound.append(a)
        else:
            rest.append(a)
    return rest, rebound


def _cached_left_behind(result: LifecycleResult, names: set[str]) -> str:
    """Cached free blocks at the post-KV peak, each named by the post-KV builder allocations that last used it."""
    freed = [a for a in result.allocations
             if a.owner in names and a.kind == "device" and a.phase in lc.POST_KV_PHASES and not alive_at_end(a)]
    parts = []
    for ptr, size in sorted(result.post_kv_peak_cached, key=lambda b: (-b[1], b[0])):
        users = [a for a in freed if a.ptr < ptr + size and ptr < a.ptr + a.size]
        if users:
            parts.append(f"{size_text(size)} cached after " + grouped(result, users))
    return "; ".join(parts)


def check_graph_pool_full_high_water(result: LifecycleResult, options: CheckOptions) -> list[str]:
    budget = result.budget
    assert budget is not None, "the check needs KV sizing, which makes the budget"
    if budget.graph_pool_estimate < result.graph_pool_high_water:
        missing = result.graph_pool_high_water - budget.graph_pool_estimate
        if result.policy.graph_estimate == "none":
            return [
                f"the engine does not account CUDA graphs in KV sizing (EnginePolicy(graph_estimate='none'), an old "
                f"vLLM default): the graph pool's high-water mark, {size_text(missing)}, is invisible to KV "
                f"sizing, which overstates the KV cache by {tokens_for(missing, budget.kv_bytes_per_token)} tokens "
                "per rank; the pool is made after KV allocation and runs past total x gmu. Account it at its full "
                "high-water mark (graph_estimate='high_water')"]
        return [
            f"the CUDA-graph pool was estimated at {size_text(budget.graph_pool_estimate)} but its high-water mark "
            f"is {size_text(result.graph_pool_high_water)} ({size_text(result.graph_pool_retained)} retained): "
            f"{size_text(missing)} of live reserved pages omitted (gross - retained accounting). Account the pool "
            "at its full high-water mark (EnginePolicy(graph_estimate='high_water'))"
        ]
    return []


_PROFILE_FORWARD = (lc.PROFILE_RUN, lc.PROFILE_REPLAY)


def check_transient_peak_profiled(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """Issue 51, item 3: a layer's scratch that ``build()`` makes and gives back (GDN/FLA's chunked scan) meets the
    step's activations. A scratch the profile forward warmed beside its activations (a ``dummy_run`` transient)
    and a serving build makes again (the same source line in torch mode, the same tag in ctx mode) is a forward
    scratch: the serving step's peak, its activations plus that build's transient, must stay within what the
    profile saw, the peak headroom KV sizing kept free. Other build transients are metadata the runner builds
    before the forward (docs/checks.md, "After KV sizing"), judged as before."""
    budget = result.budget
    assert budget is not None, "the check needs KV sizing, which makes the budget"
    # what KV sizing kept free for a step: the profiled peak, and the device beyond the static share (post_capture)
    headroom = budget.peak_activation + max(0, budget.limit - int(budget.total * budget.gmu))
    profiled: dict[tuple[str, str], TransientPeak] = {}  # (builder, scratch) -> the profile forward's largest
    for t in result.transients:
        best = profiled.get((t.builder, t.scratch))
        if t.method == "dummy_run" and t.phase in _PROFILE_FORWARD and (best is None or t.nbytes > best.nbytes):
            profiled[(t.builder, t.scratch)] = t
    out = []
    for (name, scratch), seen in profiled.items():
        serving = [t for t in result.transients if t.builder == name and t.scratch == scratch
                   and t.method == "build" and t.phase == lc.SERVING]
        worst = max(serving, key=lambda t: (t.activations + t.nbytes, t.num_tokens), default=None)
        if worst is None or worst.activations + worst.nbytes <= headroom:
            continue
        out.append(_transient_message(result, budget, headroom, seen, worst))
    return out


def _where(t: TransientPeak) -> str:
    """The largest allocation of the transient and its source line."""
    what = f"; its largest, {t.tag!r}, {size_text(t.largest)}" if t.tag else ""
    return f"{what} at {t.site}" if t.site else what


def _transient_message(result: LifecycleResult, budget: Budget, headroom: int, seen: TransientPeak,
                       worst: TransientPeak) -> str:
    peak = worst.activations + worst.nbytes
    excess = peak - headroom
    per_token = worst.nbytes / max(1, worst.num_tokens) / KiB
    largest = result.case.envelope.max_num_batched_tokens
    return (
        f"transient_peak_profiled: {worst.builder} build() of a {worst.kind or 'batch'} of {worst.num_tokens} tokens "
        f"in phase {worst.phase!r} made and gave back {bytes_text(worst.nbytes)} ({per_token:.2f} KiB per "
        f"token{_where(worst)}). A layer's scratch meets the step's activations ({bytes_text(worst.activations)}): "
        f"the step peaks {bytes_text(peak)} above what stays allocated. The profile run saw "
        f"{bytes_text(headroom)}: its forward's activations at {result.profile_tokens} tokens beside "
        f"{seen.builder}'s dummy_run transient of {bytes_text(seen.nbytes)} in phase {seen.phase!r}{_where(seen)}. "
        f"KV sizing kept {bytes_text(excess)} too little free ({tokens_for(excess, budget.kv_bytes_per_token)} KV "
        f"tokens): the step runs out of memory. Warm the scratch at the serving shape in dummy_run "
        f"(max_num_batched_tokens = {largest} tokens), or carve it from the reserved workspace (ctx.get_workspace)."
    )


def budget_record(budget: Budget, case_id: str) -> JsonObject:
    """The budget as the report keeps it: its fields, the case, the limit and the KV pool in MiB."""
    d: JsonObject = budget.as_dict()
    d["case"] = case_id
    d["limit"] = budget.limit
    d["available_kv_mib"] = round(budget.available_kv / MiB, 2)
    return d


def budget_details(result: LifecycleResult) -> CheckDetails:
    """``no_post_kv_overrun``'s record carries the run's budget (the summary's fewest KV tokens)."""
    if result.budget is None:
        return CheckDetails()
    return CheckDetails(budget=budget_record(result.budget, result.case.id))


CHECKS: tuple[Check, ...] = (
    Check("budget_counts_every_byte", "every device byte alive at the closing measurement is in a term of the engine's "
          "KV budget", BOTH, lc.CLOSING, (10,), check_budget_counts_every_byte),
    Check("no_post_kv_overrun", "peak usage after KV allocation stays within total x gmu", PROFILING,
          lc.WARMUP_REPEAT, (1, 2, 3, 4, 7, 8, 10), check_no_post_kv_overrun, details=budget_details),
    # needs KV sizing (the budget) only: it judges the serving builds that ran, so a run stopped in serving by another
    # bug is judged on what it recorded, not failed for stopping
    Check("transient_peak_profiled", "a forward scratch build() gives back meets the step's activations within the "
          "peak the profile run saw", PROFILING, lc.KV_SIZING, (8,), check_transient_peak_profiled),
    Check("graph_pool_full_high_water", "the CUDA-graph pool is accounted at its full high-water mark",
          PROFILING, lc.KV_SIZING, (10,), check_graph_pool_full_high_water),
)
