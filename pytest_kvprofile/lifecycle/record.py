"""What one lifecycle run records: a closed, typed record that the checks read and never write.

Everything a check needs is a field here, including what a probe must re-run (``probe``: the
backend, case and device factory that produced the record); nothing travels in untyped side
channels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

from pytest_kvprofile.contract.backends import EnginePolicy, KvSizingMode, kv_sizing_mode
from pytest_kvprofile.contract.budget import EngineTerms
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.contract.lease import Lease
from pytest_kvprofile.contract.protocol import BoundWorkspace, WorkspaceDeclaration
from pytest_kvprofile.contract.support import SupportResolution, builder_name
from pytest_kvprofile.contract.workspace import ArenaView
from pytest_kvprofile.lifecycle.phases import Phase
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.memory.budget import Budget, ProfileWindow
from pytest_kvprofile.memory.device import Allocation, ForeignUse

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.contract.protocol import Builder

PROFILING = "profiling"
LEGACY = "legacy"


@dataclass(frozen=True)
class BoundRecord:
    """A float range one builder reported its wrappers point at, at a phase boundary."""

    owner: str
    workspace: BoundWorkspace


@dataclass(frozen=True)
class PhaseRecord:
    """The device and the arena at the end of one phase."""

    name: Phase
    allocated: int
    reserved: int
    arena: tuple[ArenaView, ...]
    bound: tuple[BoundRecord, ...]
    locked: bool


@dataclass(frozen=True)
class PhaseError:
    """A builder's (or the engine's) exception, with the phase it stopped."""

    phase: str
    who: str
    exc_type: str
    message: str
    traceback: str
    injected: bool = False
    out_of_memory: bool = False  # the device ran out of memory: the error, or an error in its chain (an adapter's)
    site: str = ""  # ``path:line in func``: the innermost backend frame it was raised through ("" when none)

    def describe(self) -> str:
        return f"{self.who} raised {self.exc_type} in phase {self.phase!r}: {self.message}"


@dataclass(frozen=True)
class LeaseRecord:
    """A lease a REQUIRED builder returned, and the allocations it made while reserving."""

    owner: str
    lease: Lease
    allocation_ids: tuple[int, ...]


class CallRecord(NamedTuple):
    """One call the engine made into a builder."""

    phase: str
    builder: str
    method: str


@dataclass(frozen=True)
class Refusal:
    """A growth of the locked arena the manager refused, whether or not the requester caught it."""

    phase: str
    requester: str
    method: str | None
    ubatch: int
    requested: int
    current: int
    site: str = ""  # ``path:line in func`` of the requester's code that asked ("" when unknown)

    def describe(self) -> str:
        via = f" in {self.method}()" if self.method else ""
        via += f" at {self.site}" if self.site else ""
        return (f"{self.requester}{via} asked the locked arena of ubatch {self.ubatch} for {self.requested} bytes "
                f"in phase {self.phase!r} (current size {self.current} bytes)")


@dataclass(frozen=True)
class ViewGrant:
    """An arena view the manager handed out, with the call and micro-batch it was handed for.

    ``for_ubatch`` is the micro-batch of the batch being built (``build``), else None. ``route``: the case route
    (``prefill``, ``decode``) the builder said its wrapper plans into the view (``ctx.get_workspace(route=)``);
    None when it named none, which sizes the view against every route of the case.
    """

    phase: str
    requester: str
    method: str | None
    for_ubatch: int | None
    ubatch: int
    ptr: int
    nbytes: int
    route: str | None = None
    cuda_graph: bool | None = None  # ``get_workspace(cuda_graph=)``: the route's plans only with (without) graphs
    site: str = ""  # ``path:line in func`` of the requester's code that asked ("" when unknown)


@dataclass(frozen=True)
class SharedInt:
    """Torch mode: a FlashInfer wrapper took as its int workspace an allocation another live wrapper plans into."""

    phase: str
    alloc_id: int
    wrappers: tuple[str, str]  # the class names of the wrapper holding it and of the one taking it


@dataclass(frozen=True)
class ViewPlan:
    """``ctx.plan_into(view)`` while a batch is built: the view's bytes and the route it was asked for (None: every
    route), and the kind of batch planned into it, which decides the planner's need: the part the builder names
    (``plan_into(view, part=)``), else the whole batch, unless the build split a mixed batch (it planned into
    views of both routes, or into its trtllm-gen or own float workspace too): then a view named ``decode`` got the
    decode part. Also recorded: a build's plan into a trtllm-gen or own float workspace allocation (``target``)."""

    phase: str
    builder: str
    ubatch: int
    nbytes: int
    route: str | None
    batch_kind: str
    build: int = 0  # the build call it was made in (plans of one build share it)
    part: str | None = None  # the kind of the batch part the builder said it planned there (``plan_into(part=)``)
    target: str = "view"  # "view", or the role of an allocation planned into (the trtllm-gen workspace, say)
    num_tokens: int = 0  # the part's tokens when given, else the whole batch's
    cuda_graph: bool = False  # the part, else the batch, is planned for CUDA-graph replay
    view_graph: bool | None = None  # the CUDA-graph mode the view was asked for (``get_workspace(cuda_graph=)``)
    site: str = ""  # ``path:line in func`` of the builder code that called ``ctx.plan_into``


@dataclass(frozen=True)
class PlanRecord:
    """One FlashInfer ``plan()`` seen in torch mode: the wrapper's route and the float workspace it planned into.

    ``alloc_id``: the ledger entry behind the float workspace tensor (the arena, or a buffer of the builder's own),
    None when it is not simulated memory; ``nbytes``: the bytes of the tensor the planner was handed; ``ubatch``: the
    micro-batch whose batch was being built (None outside a build: a reservation, a warmup).
    """

    phase: str
    builder: str | None
    route: str
    alloc_id: int | None
    nbytes: int
    cuda_graph: bool
    ubatch: int | None = None
    int_alloc_id: int | None = None  # the ledger entry behind the int workspace the plan was handed
    int_nbytes: int = 0  # the bytes of that int workspace tensor (a slice of a slab: the slice's bytes)
    wrapper: str = ""  # the wrapper object whose plan() it is: its class and its number in the run


@dataclass(frozen=True)
class IntPlanShare:
    """Torch mode: a wrapper's ``plan()`` wrote into int-workspace bytes that another live wrapper, still holding
    that int workspace, planned into before: two wrappers' plans in one buffer, whatever ``bound_workspaces()``
    reports."""

    phase: str
    alloc_id: int
    holder: str  # the wrapper that planned there first (class#number, route)
    planner: str  # the wrapper whose plan() now lands there
    ubatch: int | None


@dataclass(frozen=True)
class MemoryUse:
    """A use of memory the harness observed and a check may refuse: memory a growth, a lease release or a free had
    given back (``freed_phase`` set: a use after free), or a micro-batch's arena used while the engine built another
    micro-batch's batch (``for_ubatch`` is not ``ubatch``).

    ``via`` is ``ctx.plan_into`` (ctx mode) or the torch call that read or wrote the storage (torch mode); ``what``
    names the memory; ``count`` is how often the same use was seen (one record per distinct use).
    """

    phase: str
    owner: str
    method: str | None
    for_ubatch: int | None  # the micro-batch of the batch being built (``build``), else None
    ubatch: int | None  # the micro-batch whose arena the memory is, None for other memory
    what: str
    nbytes: int
    freed_phase: str | None
    via: str
    stack: str = ""
    count: int = 1

    @property
    def key(self) -> tuple[object, ...]:
        return (self.phase, self.owner, self.method, self.for_ubatch, self.ubatch, self.what, self.freed_phase,
                self.via, self.stack)


@dataclass(frozen=True)
class TransientPeak:
    """Device bytes one call made and gave back before it returned, at their highest (issue 51, item 3): a
    ``build()`` of a batch (``num_tokens``: its tokens), or a ``dummy_run`` in the profile forward (``num_tokens``:
    the forward's). One record per (phase, builder, method, tokens): the largest such call. ``tag``, ``site`` and
    ``largest`` name the largest allocation the call freed before returning (``site``: its source line in torch
    mode, else the builder's method); ``scratch`` tells the same scratch made by two calls (a dummy_run's and a
    build's)."""

    phase: str
    builder: str
    method: str
    num_tokens: int
    nbytes: int
    kind: str = ""  # the batch's kind (build)
    activations: int = 0  # the bytes of the forward's activations at these tokens, which the transient meets
    tag: str = ""
    site: str = ""
    largest: int = 0
    scratch: str = ""  # what the largest allocation is, across calls: its source line (torch mode), else its tag

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.phase, self.builder, self.method, self.num_tokens)


@dataclass(frozen=True)
class ModuleHeld:
    """A device allocation reachable from process-wide state, the first path that reaches it and its module."""

    where: str
    alloc: Allocation
    module: str = ""
    resettable: bool = True  # whether a fresh view can take it out of every place that holds it


@dataclass
class SecondEngine:
    """What a second engine of the same backend, started in the same process after the case's run, did."""

    run: LifecycleResult  # its record (its allocations' methods and phases)
    remade: list[ModuleHeld] = field(default_factory=list)  # memory it made that process-wide state keeps
    error: str | None = None  # how it failed, if it did


@dataclass(frozen=True)
class ProbeTarget:
    """What a probe needs to build the same builders again on a fresh device."""

    backend: Backend
    case: Case
    device_factory: Callable[[Case], Device]


# the faulted and retried runs a check may need (``Check.probes``), each made by ``lifecycle/probes.py``
RESERVATION_PROBE = "reservation"  # each reservation failed part-way and retried; the rest of the lifecycle run after
WARMUP_PROBE = "warmup"  # each warmup failed at each allocation and retried
CAPTURE_PROBE = "capture"  # the engine's capture failed at each builder allocation site, reset and captured again
PROBES = (RESERVATION_PROBE, WARMUP_PROBE, CAPTURE_PROBE)


@dataclass(frozen=True)
class RetriedRun:
    """The case's lifecycle after ``builder``'s reservation failed at its allocation ``fault`` (0-based) and the
    engine retried it: a closed record every check judges."""

    builder: str
    fault: int
    result: LifecycleResult


@dataclass(frozen=True)
class ProbeOutcome:
    """What one probe found on one case: refusals (``violations``), what it reports (``costs``: what failed
    reservations left held) and the runs it retried, for the checks to judge."""

    violations: tuple[str, ...] = ()
    costs: tuple[str, ...] = ()
    retried: tuple[RetriedRun, ...] = ()


NOT_PROBED = ProbeOutcome()  # a record with no prober: a probe's own run, or one built by hand

# runs a named probe for a record (``lifecycle/probes.py`` ``run_probe``, attached by ``run_lifecycle``)
Prober = Callable[["LifecycleResult", str], ProbeOutcome]


@dataclass
class LifecycleResult:
    """Everything one run recorded; checks read it, nothing here is a verdict."""

    backend: str
    case: Case
    probe: ProbeTarget
    policy: EnginePolicy
    builders: list[Builder] = field(default_factory=list)
    resolution: SupportResolution | None = None
    declaration_error: str | None = None
    path: str = LEGACY
    declared: dict[str, WorkspaceDeclaration] = field(default_factory=dict)
    allocations: list[Allocation] = field(default_factory=list)
    alloc_origin: dict[int, str] = field(default_factory=dict)  # allocation id -> builder method
    phases: list[PhaseRecord] = field(default_factory=list)
    errors: list[PhaseError] = field(default_factory=list)
    leases: list[LeaseRecord] = field(default_factory=list)
    released_before_closing: tuple[str, ...] = ()
    calls: list[CallRecord] = field(default_factory=list)
    window: ProfileWindow | None = None
    budget: Budget | None = None
    graph_pool_high_water: int = 0
    graph_pool_retained: int = 0
    kv_allocation: Allocation | None = None
    post_kv_peak_used: int = 0
    post_kv_peak_live: list[Allocation] = field(default_factory=list)
    post_kv_peak_cached: tuple[tuple[int, int], ...] = ()  # (ptr, size) of cached free blocks at that peak
    lock_probe_error: str | None = None
    refusals: list[Refusal] = field(default_factory=list)
    grants: list[ViewGrant] = field(default_factory=list)
    plans: list[PlanRecord] = field(default_factory=list)  # torch mode: every FlashInfer plan() and where it planned
    plans_observed: bool = False  # torch mode on the simulated GPU: every FlashInfer plan() of the run is in ``plans``
    view_plans: list[ViewPlan] = field(default_factory=list)  # ctx mode: plan_into(view) in a build, by batch kind
    int_ubatches: dict[int, set[int]] = field(default_factory=dict)  # int workspace id -> micro-batches built into it
    shared_ints: list[SharedInt] = field(default_factory=list)  # torch mode: live wrappers on one int workspace
    int_plan_shares: list[IntPlanShare] = field(default_factory=list)  # torch mode: two wrappers planned into one
    captured_reads: set[int] = field(default_factory=set)  # ids of live memory read or written while capturing
    arena_alignment: int = 256  # the manager rounds every view up to it
    foreign_uses: list[ForeignUse] = field(default_factory=list)  # memory of earlier cases this run used
    uses: list[MemoryUse] = field(default_factory=list)  # freed memory used, other micro-batches' arenas used
    module_held: list[ModuleHeld] = field(default_factory=list)  # device memory reachable from module state
    # device memory a live thread or an atexit handler still held after the parts' close() (``held_after_close``)
    after_close_held: list[ModuleHeld] = field(default_factory=list)
    second_engine: SecondEngine | None = None  # a second engine in the same process, when state held memory
    aborted_in: str | None = None
    # every build()'s transient peak per batch tokens, and each dummy_run's in the profile forward (issue 51, item 3)
    transients: list[TransientPeak] = field(default_factory=list)
    profile_tokens: int = 0  # the tokens of the profile forward the engine runs (its activations' shape)
    observed_non_kv: dict[str, int] = field(default_factory=dict)  # an engine's own profiler's non-KV bytes, by name
    # the ledger's length at each snapshot point the run reached (contract/budget.py: SNAPSHOT_POINTS)
    snapshot_marks: dict[str, int] = field(default_factory=dict)
    engine_terms: EngineTerms | None = None  # the engine's KV budget as terms, at the closing measurement
    reserved_at_start: int = 0  # the device's reserved bytes before the run made anything (snapshot device_start)
    # the run's teardown (``driver.close_parts`` calls it once): the parts' close() on the run's device
    closer: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    # the lifecycle's probes for this case (``run_lifecycle`` attaches them); each runs once, on first need
    prober: Prober | None = field(default=None, repr=False, compare=False)
    probe_outcomes: dict[str, ProbeOutcome] = field(default_factory=dict, repr=False, compare=False)

    def phase(self, name: str) -> PhaseRecord | None:
        for rec in self.phases:
            if rec.name == name:
                return rec
        return None

    @functools.cached_property
    def kv_sizing(self) -> KvSizingMode:
        """Where the engine sizes the KV cache on this case (``EnginePolicy.kv_sizing_for``), and why there."""
        return kv_sizing_mode(self.policy, self.case)

    @property
    def post_kv_overrun(self) -> int:
        """Bytes the device peaked at after KV sizing beyond total x gmu (negative: headroom; 0 without a budget)."""
        return self.post_kv_peak_used - self.budget.limit if self.budget is not None else 0

    def probed(self, probe: str) -> ProbeOutcome:
        """What the lifecycle's ``probe`` (one of ``PROBES``) found on this case: run by the lifecycle once, when a
        check that declares it first reads it, then shared by every check; ``NOT_PROBED`` without a prober."""
        if probe not in PROBES:
            raise ValueError(f"unknown probe {probe!r}: one of {PROBES}")
        if probe not in self.probe_outcomes:
            self.probe_outcomes[probe] = NOT_PROBED if self.prober is None else self.prober(self, probe)
        return self.probe_outcomes[probe]

    def builder_names(self) -> list[str]:
        return [builder_name(b) for b in self.builders]
