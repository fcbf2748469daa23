"""The reference engine, ``LifecycleRun``: the engine's phases (``phases.py``, docs/contract.md) driven over
a builder set.

One run takes a backend (builders + engine policy) and a case, drives the builders through
profiling, KV sizing and serving on a device, and records what the checks need: every allocation
with owner, phase and size, the arena at each phase boundary, leases, the budget, and any error
with the builder and phase that raised it. Runs never raise for a builder's fault; the checks turn
what was recorded into verdicts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import traceback
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence, TypeAlias

from pytest_kvprofile.contract.backends import EnginePolicy, engine_gate
from pytest_kvprofile.contract.budget import BudgetArithmetic, SnapshotPoint
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.contract.lease import Lease
from pytest_kvprofile.contract.protocol import (
    Batch,
    BatchKind,
    BoundWorkspace,
    Builder,
    BuilderContext,
    Hook,
    WorkspaceDeclaration,
    call_optional,
)
from pytest_kvprofile.contract.resources import ResourceAdapter
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import (
    DeclarationError,
    ProfilingSupport,
    builder_name,
    declared_support,
    resolve_support,
)
from pytest_kvprofile.contract.workspace import (
    ArenaView,
    WorkspaceLockedError,
)
from pytest_kvprofile.lifecycle import process_state
from pytest_kvprofile.lifecycle.phases import (
    BASELINE,
    CAPTURE,
    CLOSING,
    GRAPH_PROFILING,
    KV_SIZING,
    LEASE_RELEASE,
    LOCK,
    POST_KV_PHASES,
    PROFILE_REPLAY,
    PROFILE_RUN,
    PROFILE_WARMUP,
    REBIND,
    RESERVATION,
    SERVING,
    SETUP,
    TEARDOWN,
    WARMUP,
    WARMUP_REPEAT,
    Phase,
)
from pytest_kvprofile.lifecycle.record import (
    LEGACY,
    PROFILING,
    BoundRecord,
    CallRecord,
    IntPlanShare,
    LeaseRecord,
    LifecycleResult,
    MemoryUse,
    PhaseError,
    PhaseRecord,
    PlanRecord,
    ProbeTarget,
    SharedInt,
    TransientPeak,
    ViewGrant,
    ViewPlan,
)
from pytest_kvprofile.lifecycle.recording import LOCK_PROBE, _workspace_manager
from pytest_kvprofile.lifecycle.sites import _cached_blocks, _caller_site, _method_site, _raised_at
from pytest_kvprofile.lifecycle.teardown import _teardown_error
from pytest_kvprofile.lifecycle.window import WindowObserver
from pytest_kvprofile.matrix.cases import Case, DecodeCapture
from pytest_kvprofile.matrix.models import kv_bytes_per_token
from pytest_kvprofile.memory.budget import (
    Budget,
    ProfileWindow,
    available_kv_bytes,
    tokens_for,
)
from pytest_kvprofile.memory.device import Allocation, DeviceOutOfMemory, ForeignUse

if TYPE_CHECKING:
    from torch import Tensor

    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.contract.device import DeviceEvent, GraphPoolHandle
    from pytest_kvprofile.lifecycle.module_state import Registered
    from pytest_kvprofile.memory.torch_mode import SimulatedCuda


# what a builder's bound_workspaces() yields: a BoundWorkspace or any object with its fields (duck-typed), read
# field by field; a missing or wrong one is the TypeError _bound raises
ReportedRange: TypeAlias = Any




class _Abort(Exception):
    """Stops a run after a builder's error has been recorded."""



class LifecycleRun:
    """Drives one backend over one case on one device. Use ``run_lifecycle``.

    It is the :class:`~pytest_kvprofile.contract.protocol.BuilderHost` of its builders' contexts: ``case``,
    ``device``, ``manager``, ``in_window``, ``in_dummy_forward``, ``arena_view`` and ``note_plan``.
    """

    def __init__(self, target: ProbeTarget, device: Device, observers: Sequence[WindowObserver] = ()):
        self.observers = tuple(observers)
        self.backend = target.backend
        self.case = target.case
        self.device = device
        self.builders: list[Builder] = []
        self.policy: EnginePolicy = getattr(self.backend, "policy", None) or EnginePolicy()
        self.manager = _workspace_manager(self, device, self.case.envelope.num_ubatches)
        self.in_window = False
        self.in_dummy_forward = False
        self._contexts: dict[str, BuilderContext] = {}
        self._post_kv = False
        self._peak_used = 0
        self._current_call: str | None = None
        self._current_ubatch: int | None = None
        self._current_batch: Batch | None = None
        self._asked_graph: bool | None = None  # the CUDA-graph mode of the view being asked for (ctx.get_workspace)
        self._grant_of: dict[int, tuple[ArenaView, ViewGrant]] = {}  # id(view) -> the view and its grant
        self._build_serial = 0  # numbers the build calls (ViewPlan.build)
        # int workspace id -> weak references to the wrappers on it
        self._int_holders: dict[int, list[weakref.ref[object]]] = {}
        # torch mode: int workspace id -> (wrapper, its label, the bytes [start, end) its plan() wrote), and labels
        self._int_planners: dict[int, list[tuple[weakref.ref[object], str, int, int]]] = {}
        self._wrapper_labels: dict[int, tuple[weakref.ref[object], str]] = {}
        self._torch: SimulatedCuda | None = None
        # torch mode's SimulatedCuda: one per run, re-entered for the parts' close()
        self._sim: SimulatedCuda | None = None
        self._parts: dict[int, str] = {}
        self._part_modules: dict[str, str] = {}
        self._in_manager = False
        self._use_index: dict[tuple[object, ...], int] = {}  # MemoryUse.key -> its position in result.uses
        self._call_peak: int | None = None  # the device's allocated bytes at their highest in the watched call
        self._transient_index: dict[tuple[str, str, str, int], int] = {}  # TransientPeak.key -> its position
        self._atexit: list[Registered] = []  # atexit handlers the parts registered (module_state.atexit_recorded)
        # the engine's own KV budget arithmetic (EnginePolicy.budget), fed the snapshots; None: the harness's
        self._arithmetic = self._budget_arithmetic()
        self.result = LifecycleResult(
            backend=getattr(self.backend, "name", str(self.backend)), case=self.case, probe=target,
            policy=self.policy,
        )
        self.result.arena_alignment = self.manager.alignment
        self._unsubscribe = device.subscribe(self._on_event, kinds=("alloc",))

    # -- recording ---------------------------------------------------------------------------
    def _on_event(self, event: DeviceEvent) -> None:
        if event.kind == "alloc" and event.alloc is not None:
            self.result.allocations.append(event.alloc)
            if self._current_call is not None:
                self.result.alloc_origin[event.alloc.id] = self._current_call
            if self._call_peak is not None and event.alloc.kind == "device" and event.allocated > self._call_peak:
                self._call_peak = event.allocated
            if self._post_kv and event.alloc.kind == "device":
                used = event.reserved + self.device.nontorch_bytes
                if used > self._peak_used:
                    self._peak_used = used
                    self.result.post_kv_peak_live = [
                        a for a in self.result.allocations
                        if a.alive and a.kind == "device" and a.phase in POST_KV_PHASES
                    ]
                    self.result.post_kv_peak_cached = _cached_blocks(self.device)

    def _enter(self, phase: Phase) -> None:
        self.device.phase = phase

    def _record_phase(self, phase: Phase) -> None:
        bound: list[BoundRecord] = []
        for b in self.builders:
            fn = getattr(b, "bound_workspaces", None)
            if fn is not None:
                try:
                    with self._as_part(builder_name(b), "bound_workspaces"):
                        bound.extend(BoundRecord(builder_name(b), _bound(w, self._device_ptr)) for w in fn())
                except Exception as exc:  # noqa: BLE001 - recorded like any other builder failure
                    self._fail(builder_name(b), exc)
        self.result.phases.append(
            PhaseRecord(
                name=phase,
                allocated=self.device.memory_allocated(),
                reserved=self.device.memory_reserved(),
                arena=self.manager.snapshot(),
                bound=tuple(bound),
                locked=self.manager.locked,
            )
        )

    def _device_ptr(self, ptr: int, nbytes: int) -> int:
        """A reported pointer in the ledger's address space: in torch mode a tensor's ``data_ptr()`` is a host
        address inside a simulated storage, mapped to its allocation; any other pointer is already the ledger's
        (a ``ctx``/arena pointer, or on a real GPU the device pointer ``data_ptr()`` returns)."""
        if self._torch is None:
            return ptr
        mapped = self._torch.simulated_ptr(ptr, nbytes)
        return ptr if mapped is None else mapped

    def _call(self, builder: Builder, method: Hook, *args: BuilderContext | Batch) -> object:
        name = builder_name(builder)
        self.result.calls.append(CallRecord(self.device.phase, name, method))
        self._current_call = method
        batch = args[1] if method == "build" and len(args) > 1 else None
        self._build_serial += batch is not None
        self._current_ubatch = batch.ubatch if isinstance(batch, Batch) else None
        self._current_batch = batch if isinstance(batch, Batch) else None
        # a build's transient, and a dummy_run's beside the profile forward's activations (issue 51, item 3)
        watch = method == "build" or (method == "dummy_run" and self.device.phase in (PROFILE_RUN, PROFILE_REPLAY))
        start = before = 0
        if watch:
            start, before = len(self.result.allocations), self.device.memory_allocated()
            self._call_peak = before
        try:
            if self._torch is None:
                out = call_optional(builder, method, *args)
            else:
                with self._torch.owner_scope(name, method):
                    out = call_optional(builder, method, *args)
        except Exception as exc:  # noqa: BLE001 - every builder failure becomes a recorded error
            self._fail(name, exc)
        finally:
            self._current_call = None
            self._current_ubatch = None
            self._current_batch = None
            peak, self._call_peak = self._call_peak, None
        if watch and peak is not None:
            self._note_transient(builder, method, batch if isinstance(batch, Batch) else None, start,
                                 peak - max(before, self.device.memory_allocated()))
        return out

    def _note_transient(self, builder: Builder, method: str, batch: Batch | None, start: int, nbytes: int) -> None:
        """A build's (or a profile-forward ``dummy_run``'s) transient peak: what it made and gave back before it
        returned, at its highest (``TransientPeak``), with the largest allocation it freed and its source line (the
        allocation's own in torch mode, else the builder's method); the largest per (phase, builder, method,
        tokens) is kept."""
        if nbytes <= 0:
            return
        tokens = batch.num_tokens if batch is not None else self.result.profile_tokens
        freed = [a for a in self.result.allocations[start:] if a.kind == "device" and not a.alive]
        top = max(freed, key=lambda a: a.nbytes, default=None)
        site = (top.stack if top is not None else None) or _method_site(type(builder), method)
        rec = TransientPeak(self.device.phase, builder_name(builder), method, tokens, nbytes,
                            batch.kind if batch else "", self._activation_bytes(tokens), top.tag if top else "", site,
                            top.nbytes if top else 0, ((top.stack or repr(top.tag)) if top else ""))
        at = self._transient_index.get(rec.key)
        if at is None:
            self._transient_index[rec.key] = len(self.result.transients)
            self.result.transients.append(rec)
        elif self.result.transients[at].nbytes < nbytes:
            self.result.transients[at] = rec

    def _fail(self, who: str, exc: BaseException) -> NoReturn:
        self.result.errors.append(
            PhaseError(
                phase=self.device.phase, who=who, exc_type=type(exc).__name__, message=str(exc),
                traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                out_of_memory=ran_out_of_memory(exc), site=_raised_at(exc),
            )
        )
        self.result.aborted_in = self.device.phase
        raise _Abort from exc

    # -- the builders' contexts (BuilderHost) --------------------------------------------------
    def arena_view(self, owner: str, nbytes: int, ubatch: int, route: str | None,
                   cuda_graph: bool | None = None) -> ArenaView:
        """``ctx.get_workspace``: a view of ``ubatch``'s arena, recorded with its route and the CUDA-graph mode of
        its plans (``ViewGrant``)."""
        self._asked_graph = cuda_graph
        try:
            return self.manager.get_workspace(owner, nbytes, ubatch, route=route)
        finally:
            self._asked_graph = None

    # -- memory uses (no_use_after_free, ubatch_arenas_disjoint) ------------------------------------
    def note_plan(self, owner: str, target: object, part: Batch | None = None) -> None:
        """``ctx.plan_into(target, part)``: judge the use from the manager's generations and the ledger."""
        if part is not None and not isinstance(part, Batch):
            raise TypeError(f"ctx.plan_into(part=) takes the Batch part planned into the target, not "
                            f"{type(part).__name__}")
        batch = self._current_batch
        tokens = part.num_tokens if part is not None else batch.num_tokens if batch is not None else 0
        graph = part.cuda_graph if part is not None else batch.cuda_graph if batch is not None else False
        if isinstance(target, ArenaView):
            if batch is not None:
                known = self._grant_of.get(id(target))
                grant = known[1] if known is not None and known[0] is target else next(
                    (g for g in reversed(self.result.grants)
                     if g.requester == owner and g.ubatch == target.ubatch and g.ptr == target.ptr
                     and g.nbytes == target.nbytes), None)
                self.result.view_plans.append(ViewPlan(self.device.phase, owner, target.ubatch, target.nbytes,
                                                       grant.route if grant is not None else None, batch.kind,
                                                       self._build_serial, part.kind if part else None, "view",
                                                       tokens, graph, grant.cuda_graph if grant is not None else None,
                                                       _caller_site()))
            freed = None if self.manager.is_current(target) else self.manager.retired.get(
                (target.ubatch, target.generation), "?")
            self._note_use(owner, self._current_call, target.ubatch, target.nbytes, freed, "ctx.plan_into",
                           lambda: f"its view of micro-batch {target.ubatch}'s float arena (generation "
                                   f"{target.generation})", _caller_site)
        elif isinstance(target, Allocation):
            if batch is not None and target.role in (Role.TRTLLM_WORKSPACE, Role.FLOAT_WORKSPACE):
                self.result.view_plans.append(ViewPlan(self.device.phase, owner, batch.ubatch, target.nbytes, None,
                                                       batch.kind, self._build_serial, part.kind if part else None,
                                                       target.role.name, tokens, graph))
            self._note_int_use(target)
            if target.alive and self.device.capturing:
                self.result.captured_reads.add(target.id)
            freed = None if target.alive else (target.freed_phase or "?")
            ubatch = self.manager.ubatch_of(target) if target.role is Role.FLOAT_ARENA else None
            self._note_use(owner, self._current_call, ubatch, target.nbytes, freed, "ctx.plan_into",
                           lambda: f"allocation {target.tag!r}", _caller_site)
        else:
            raise TypeError(f"ctx.plan_into() takes an ArenaView or an Allocation, not {type(target).__name__}")

    def _on_int_holder(self, alloc: Allocation, wrapper: object, attr: str) -> None:
        """A FlashInfer wrapper took ``alloc`` as its int workspace: another live wrapper still planning into it
        shares it (``int_workspace_per_wrapper``), whatever ``bound_workspaces()`` says."""
        holders = self._int_holders.setdefault(alloc.id, [])
        for ref in holders:
            other = ref()
            if other is None or other is wrapper:
                continue
            held = getattr(other, attr, None)
            if held is not None and self._memory_of(held) is alloc:
                self.result.shared_ints.append(SharedInt(self.device.phase, alloc.id,
                                                         (type(other).__name__, type(wrapper).__name__)))
                break
        try:
            holders.append(weakref.ref(wrapper))
        except TypeError:  # a wrapper without weak references: nothing to compare it with later
            pass

    def _note_int_use(self, alloc: Allocation) -> None:
        """A build of one micro-batch planning into an int workspace: micro-batches run concurrently, so one int
        workspace built into by two is shared between them (``int_workspace_per_wrapper``)."""
        if alloc.role is Role.INT_WORKSPACE and self._current_ubatch is not None and alloc.alive:
            self.result.int_ubatches.setdefault(alloc.id, set()).add(self._current_ubatch)

    def _on_torch_use(self, alloc: Allocation, api: str) -> None:
        """A torch call read or wrote a freed storage, an arena or an int workspace (``SimulatedCuda.on_use``)."""
        if self._in_manager:
            return
        if alloc.alive and self.device.capturing:
            self.result.captured_reads.add(alloc.id)
        if alloc.role is Role.INT_WORKSPACE and alloc.alive:
            self._note_int_use(alloc)
            return
        ubatch = self.manager.ubatch_of(alloc)
        given_back = self.manager.stale_since(alloc) if alloc.alive else None  # an old arena a kept view keeps alive
        if alloc.alive and given_back is None and (self._current_ubatch is None
                                                   or ubatch in (None, self._current_ubatch)):
            return  # the common case, decided without attributing the call
        retired = self.manager.generation_of(alloc)
        if retired is not None:
            ubatch = retired[0]
        sim = self._torch
        owner, method, stack = sim.attribution(api) if sim is not None else ("<unknown>", None, "")

        def what() -> str:
            if retired is not None:
                return f"micro-batch {retired[0]}'s float arena (generation {retired[1]})"
            return f"allocation {alloc.tag!r} of {alloc.owner}"

        freed = given_back if given_back is not None else None if alloc.alive else (alloc.freed_phase or "?")
        self._note_use(owner, method, ubatch, alloc.nbytes, freed, api, what, lambda: stack)

    def _note_use(self, owner: str, method: str | None, ubatch: int | None, nbytes: int, freed: str | None, via: str,
                  what: Callable[[], str], site: Callable[[], str]) -> None:
        """Record a use a check refuses: of freed memory, or of another micro-batch's arena while building a batch.
        ``what`` and ``site`` are called only then (most uses are neither)."""
        cross = self._current_ubatch is not None and ubatch is not None and ubatch != self._current_ubatch
        if freed is None and not cross:
            return
        use = MemoryUse(self.device.phase, owner, method, self._current_ubatch, ubatch, what(), nbytes, freed, via,
                        site())
        at = self._use_index.get(use.key)
        if at is None:
            self._use_index[use.key] = len(self.result.uses)
            self.result.uses.append(use)
        else:
            prev = self.result.uses[at]
            self.result.uses[at] = dataclasses.replace(prev, count=prev.count + 1)

    def ctx(self, builder: Builder) -> BuilderContext:
        return self._contexts[builder_name(builder)]

    # -- the model side of a forward pass ----------------------------------------------------
    def _activation_bytes(self, num_tokens: int) -> int:
        """A transformer layer's live activations for ``num_tokens`` on one rank (bf16).

        Rounded to the allocator's 2 MiB large-block granularity so that the budget's allocated-byte
        headroom and the post-KV reserved bytes agree for a correct backend.
        """
        model = self.case.model
        raw = max(1 << 20, num_tokens * model.hidden * 2 * 12 // self.case.tp)
        return -(-raw // (2 << 20)) * (2 << 20)

    def _dummy_forward(self, num_tokens: int, batch: Batch | None) -> None:
        """A dummy forward: activations, each builder's layer hooks and, with a batch, planning."""
        self.in_dummy_forward = True
        act = self._alloc_engine(self._activation_bytes(num_tokens), "model", "activations")
        try:
            for b in self.builders:
                self._call(b, "dummy_run", self.ctx(b))
                if batch is not None:
                    self._call(b, "build", self.ctx(b), batch)
        finally:
            self.device.free(act)
            self.in_dummy_forward = False

    def _alloc_engine(self, nbytes: int, owner: str, tag: str) -> Allocation:
        try:
            return self.device.allocate(nbytes, owner=owner, tag=tag)
        except Exception as exc:  # noqa: BLE001 - an engine-side OOM is a recorded outcome
            self._fail(f"engine ({owner}: {tag})", exc)

    def _serve_step(self, batch: Batch) -> None:
        """One serving step as a runner takes it: the attention metadata is built first, then the forward runs.

        So what ``build()`` allocates and frees before it returns never coexists with the step's activations: it
        is transient, within the headroom the closing measurement kept for the profiled activation peak (vLLM's
        ``non_kv = consumed + transient peak``); what it keeps stays alive through the forward."""
        for b in self.builders:
            for ub in range(self.manager.num_ubatches):
                self._call(b, "build", self.ctx(b), _with_ubatch(batch, ub))
        act = self._alloc_engine(self._activation_bytes(batch.num_tokens), "model", "activations")
        self.device.free(act)

    # -- the phases --------------------------------------------------------------------------
    @contextlib.contextmanager
    def device_mode(self) -> Iterator[None]:
        """Serve plain ``torch`` "cuda" calls from this run's simulated device (``Backend.torch_mode``), with
        FlashInfer's device queries answering the case's GPU and its batch planners running on the host; and
        record the ``atexit`` handlers the parts register (``module_state.atexit_recorded``) for ``close()``."""
        from pytest_kvprofile.lifecycle.module_state import atexit_recorded

        with atexit_recorded(self._atexit), self._device_mode():
            yield

    @contextlib.contextmanager
    def _device_mode(self) -> Iterator[None]:
        from pytest_kvprofile.memory.device import SimDevice

        if not getattr(self.backend, "torch_mode", False) or not isinstance(self.device, SimDevice):
            yield  # on a real CUDA device plain torch calls already reach it
            return
        from pytest_kvprofile.attention.host_plan import observe_plans
        from pytest_kvprofile.memory.simulated_gpu import simulated_gpu_on
        from pytest_kvprofile.memory.torch_mode import SimulatedCuda

        if self._sim is None:
            self._sim = SimulatedCuda(self.device, self._part_owner)
        sim = self._sim
        sim.owner_resolver = self._part_owner  # leaving the mode drops it
        noted = len(sim.foreign)
        with simulated_gpu_on(self.device, self.case.gpu), sim:
            self._torch = sim
            sim.on_use = self._on_torch_use
            sim.on_int_holder = self._on_int_holder
            stop = observe_plans(self._on_plan)
            self.result.plans_observed = True
            try:
                yield
            finally:
                stop()
                sim.on_use = None  # the simulation outlives the run (it knows every simulation's tensors): let go
                sim.on_int_holder = None
                self.result.foreign_uses.extend(list(sim.foreign.values())[noted:])
                self._torch = None

    def _on_plan(self, device: object, route: str, float_ws: Tensor, cuda_graph: bool, int_ws: Tensor | None = None,
                 wrapper: object = None) -> None:
        """Record a FlashInfer ``plan()`` of this run: the route, the builder being called, the float and int buffers
        planned into and the wrapper planning; a plan into int-workspace bytes another live wrapper planned into
        is recorded too (``IntPlanShare``)."""
        if device is not self.device or self._torch is None:
            return
        alloc = self._torch.memory_of(float_ws)
        builder = self.result.calls[-1].builder if self.result.calls else None
        int_alloc = self._torch.memory_of(int_ws) if int_ws is not None else None
        int_nbytes = int(int_ws.numel()) * int(int_ws.element_size()) if int_ws is not None else 0
        label = self._wrapper_label(wrapper, route) if wrapper is not None else ""
        self.result.plans.append(PlanRecord(self.device.phase, builder, route, alloc.id if alloc else None,
                                            int(float_ws.numel()) * int(float_ws.element_size()), cuda_graph,
                                            self._current_ubatch, int_alloc.id if int_alloc else None, int_nbytes,
                                            label))
        if int_alloc is not None and wrapper is not None and int_ws is not None:
            start = self._torch.simulated_ptr(int_ws.data_ptr(), int_nbytes) or int_alloc.ptr
            self._note_int_plan(int_alloc, wrapper, label, start, start + int_nbytes)

    def _wrapper_label(self, wrapper: object, route: str) -> str:
        """``ClassName#n (route)``: the wrapper's class and its number among the wrappers that planned in this run."""
        known = self._wrapper_labels.get(id(wrapper))
        if known is not None and known[0]() is wrapper:
            return known[1]
        label = f"{type(wrapper).__name__}#{len(self._wrapper_labels) + 1} ({route})"
        try:
            self._wrapper_labels[id(wrapper)] = (weakref.ref(wrapper), label)
        except TypeError:  # no weak references: label it afresh each time
            pass
        return label

    def _note_int_plan(self, alloc: Allocation, wrapper: object, label: str, start: int, end: int) -> None:
        """A wrapper's plan() wrote ``[start, end)`` of int workspace ``alloc``: another wrapper, alive and still
        holding that int workspace, that planned into overlapping bytes shares it with this one."""
        planners = self._int_planners.setdefault(alloc.id, [])
        for ref, other_label, s, e in planners:
            other = ref()
            if other is None or other is wrapper or not (s < end and start < e):
                continue
            held = getattr(other, "_int_workspace_buffer", None)
            if held is not None and self._torch is not None and self._torch.memory_of(held) is not alloc:
                continue  # it moved to another int workspace since (a rebind): not shared any more
            if not any(x.alloc_id == alloc.id and {x.holder, x.planner} == {other_label, label}
                       for x in self.result.int_plan_shares):  # once per pair: serving re-plans every step
                self.result.int_plan_shares.append(IntPlanShare(self.device.phase, alloc.id, other_label, label,
                                                                self._current_ubatch))
            break
        planners[:] = [p for p in planners if p[0]() is not None and p[0]() is not wrapper]
        try:
            planners.append((weakref.ref(wrapper), label, start, end))
        except TypeError:
            pass

    def construct(self) -> list[Builder]:
        """The backend's parts for the case, made from a fresh view of process-wide state; raises what the
        backend's factory raises."""
        self._fresh_module_state()
        self.builders = _parts_of(self.backend, self.case)
        self._parts = {id(p): builder_name(p) for p in self.builders}
        self._parts.update((id(p.resource), builder_name(p)) for p in self.builders if isinstance(p, ResourceAdapter))
        return self.builders

    def make_builders(self) -> None:
        """Construct the backend's parts for the case, once, on this run's device (phase ``setup``)."""
        self._enter(SETUP)
        self._snapshot("device_start")
        self._snapshot("before_instance")
        try:
            self.construct()
        except Exception as exc:  # noqa: BLE001 - a raising factory is reported by every check
            self._fail(f"backend {self.result.backend!r} factory", exc)
        for alloc in self.result.allocations[self.result.snapshot_marks["before_instance"]:]:
            self.result.alloc_origin.setdefault(alloc.id, "__init__")  # what the parts' constructors made
        self._snapshot("after_init")
        modules: dict[str, set[str]] = {}
        for p in self.builders:
            modules.setdefault(type(getattr(p, "resource", p)).__module__, set()).add(builder_name(p))
        self._part_modules = {m: next(iter(names)) for m, names in modules.items() if len(names) == 1}
        self.result.builders = self.builders
        self._contexts = {builder_name(b): BuilderContext(self, builder_name(b)) for b in self.builders}

    def _part_owner(self, frame: FrameType | None, api: str) -> tuple[str, str] | None:
        """Torch-mode attribution without gaps: the part whose code is running owns what it allocates.

        Walking out from the allocation: a method of one of the run's parts (a lease's release callback,
        ``bound_workspaces()``, a resource's method, a finalizer), a part being constructed (its ``__init__``),
        or code in a module that only one part's class comes from (a closure or module function of the
        backend). Allocations the harness cannot tie to a part keep the source-line owner.
        """
        by_module = None
        while frame is not None:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                obj = frame.f_locals.get("self")
                owner = self._parts.get(id(obj))
                if owner is not None:
                    return owner, api
                if code.co_name == "__init__":
                    name = getattr(obj, "name", None)
                    if isinstance(name, str) and name and not self._parts:
                        return name, "__init__"
            if by_module is None:
                by_module = self._part_modules.get(frame.f_globals.get("__name__", ""))
            frame = frame.f_back
        return (by_module, api) if by_module is not None else None

    @contextlib.contextmanager
    def _as_part(self, owner: str, method: str) -> Iterator[None]:
        """Attribute what runs inside to ``owner`` and its ``method`` (the harness reaches the part indirectly)."""
        self._current_call = method
        try:
            if self._torch is None:
                yield
            else:
                with self._torch.owner_scope(owner, method):
                    yield
        finally:
            self._current_call = None

    def run(self) -> LifecycleResult:
        try:
            with self.device_mode():
                try:
                    self.make_builders()
                    self._run()
                finally:
                    self._observe_module_state()
        except _Abort:
            pass
        finally:
            self._teardown()
        self.result.closer = self.close
        self._start_second_engine()
        return self.result

    def close(self) -> None:
        """The parts' optional ``close()``, once, in phase ``teardown`` on the run's device (in torch mode inside
        the simulation again, so a torch call in ``close()`` reaches the simulated GPU). What it frees is marked
        freed in ``teardown``, which checks read as alive at the end; what it raises (a double free included)
        is recorded in ``result.errors`` with phase ``teardown``, for ``teardown_clean``."""
        self.result.closer = None
        self._enter(TEARDOWN)
        with self.device_mode():
            for part in self.builders:
                close = getattr(part, "close", None)
                if not callable(close):
                    continue
                try:
                    with self._as_part(builder_name(part), "close"):
                        close()
                except Exception as exc:  # noqa: BLE001 - the record is complete; the error is kept with it
                    self.result.errors.append(_teardown_error(builder_name(part), exc))
            self._observe_after_close()

    def _observe_after_close(self) -> None:
        """What process-wide state holds of this run once its parts closed (``process_state.py``)."""
        process_state.observe_after_close(self.result, self.builders, set(self._parts.values()), self._memory_of,
                                          self._atexit)

    def _fresh_module_state(self) -> None:
        """Give this run the process-wide state a fresh process starts from (``module_state.fresh_view``)."""
        from pytest_kvprofile.lifecycle.module_state import fresh_view

        fresh_view(self._memory_of)

    def _observe_module_state(self) -> None:
        """What process-wide state holds after the run (``process_state.py``)."""
        process_state.observe(self.result, self.builders, set(self._parts.values()), self._memory_of)

    def _start_second_engine(self) -> None:
        """A second engine in the same process when this run left memory in process-wide state
        (``process_state.second_engine``)."""
        second = process_state.second_engine(self.result, self.device, set(self._parts.values()), _second_run)
        if second is not None:
            self.result.second_engine = second

    def _note_foreign_resources(self, owner: str, resources: list[object]) -> None:
        """A lease that carries an allocation of an earlier device reuses an earlier case's memory (ctx mode)."""
        if not any(isinstance(r, Allocation) for r in resources):
            return
        mine = {id(a) for a in self.result.allocations}
        for res in resources:
            if isinstance(res, Allocation) and id(res) not in mine:
                self.result.foreign_uses.append(ForeignUse(owner, "lease resource", "", res))

    def _memory_of(self, value: object) -> Allocation | None:
        if isinstance(value, Allocation):
            return value
        torch = sys.modules.get("torch")
        if torch is None or self._torch is None or not isinstance(value, torch.Tensor):
            return None
        return self._torch.memory_of(value)

    def _resolve(self) -> None:
        try:
            self.result.resolution = resolve_support(self.builders, engine_gate(self.policy, self.case))
        except Exception as exc:  # noqa: BLE001 - a declaration that raises is reported like a bad answer
            self.result.declaration_error = (
                str(exc) if isinstance(exc, DeclarationError)
                else f"get_persistent_workspace_memory_profiling_support() raised {type(exc).__name__}: {exc}"
            )
            self.result.resolution = None
        for b in self.builders:
            fn = getattr(b, "declared_workspace", None)
            if fn is not None:
                try:
                    declared = fn(self.case)
                    if not isinstance(declared, WorkspaceDeclaration):
                        raise TypeError(
                            f"declared_workspace() returned {type(declared).__name__}, not a WorkspaceDeclaration"
                        )
                    self.result.declared[builder_name(b)] = declared
                except Exception as exc:  # noqa: BLE001
                    self._enter(SETUP)
                    self._fail(builder_name(b), exc)
        enabled = self.result.resolution is not None and self.result.resolution.enabled
        self.result.path = PROFILING if enabled else LEGACY

    def _budget_arithmetic(self) -> BudgetArithmetic | None:
        """The engine's own KV budget arithmetic for this run (``EnginePolicy.budget``); None: the harness's."""
        return self.policy.budget() if self.policy.budget is not None else None

    def _snapshot(self, point: SnapshotPoint) -> None:
        """The lifecycle reached ``point``: mark the ledger there, and let the engine's arithmetic measure."""
        self.result.snapshot_marks[point] = len(self.result.allocations)
        if point == "device_start":  # what an earlier run left reserved (a real GPU), which no term of this run owes
            self.result.reserved_at_start = self.device.memory_reserved()
        if self._arithmetic is None:
            return
        try:
            self._arithmetic.snapshot(point, self.device)
        except Exception as exc:  # noqa: BLE001 - the engine's arithmetic failing is a recorded outcome
            self._fail(f"engine (budget arithmetic {self._arithmetic.name})", exc)

    def _warmed_in_window(self) -> list[Builder]:
        """The parts the engine warms up inside the profiling window: each part where its engine warms it (its
        ``warmup_materializes_persistent``), so a part whose engine first warms it after KV sizing is warmed there
        even when another part is warmed in the window; every part, or none, where the policy says so
        (``EnginePolicy.warmup_in_window``)."""
        if self.policy.warmup_in_window is not None:
            return list(self.builders) if self.policy.warmup_in_window else []
        return [b for b in self.builders if getattr(b, "warmup_materializes_persistent", False)]

    def _run(self) -> None:
        """The engine's phases in order (``phases.py``), each step a call to a part or a helper method.

        Long on purpose: it is the one place a reader sees the whole order of the phases, top to bottom, and
        splitting it would scatter that order across functions."""
        case, dev = self.case, self.device
        self._enter(SETUP)
        self._resolve()
        profiling = self.result.path == PROFILING
        for observer in self.observers:
            observer.before_instance(dev)
        with self._max_split():
            self._alloc_engine(case.weights_bytes, "model", "weights")
        self._snapshot("after_weights")
        self._record_phase(SETUP)

        self._enter(BASELINE)
        dev.empty_cache()
        dev.reset_peak_memory_stats()
        baseline_reserved = dev.memory_reserved()
        self._baseline_allocated = dev.memory_allocated()
        self.in_window = True
        self._snapshot("baseline")
        for observer in self.observers:
            observer.window_opens(dev)
        self._record_phase(BASELINE)

        if profiling:
            self._enter(RESERVATION)
            arena = max((d.float_bytes for d in self.result.declared.values()), default=0)
            if arena:
                try:
                    self.manager.reserve("engine", arena)
                except Exception as exc:  # noqa: BLE001
                    self._fail("engine (float arena reservation)", exc)
            for b in self.builders:
                if declared_support(b) is ProfilingSupport.REQUIRED:
                    before = len(self.result.allocations)
                    lease = self._call(b, "reserve_persistent_workspace", self.ctx(b))
                    if not isinstance(lease, Lease):
                        self._fail(
                            builder_name(b),
                            TypeError(f"reserve_persistent_workspace() returned {type(lease).__name__}, not a Lease"),
                        )
                    ids = tuple(  # what the reservation made and still holds: its own transients are not leased
                        a.id for a in self.result.allocations[before:] if a.owner == builder_name(b) and a.alive
                    )
                    if not lease.released:
                        self._note_foreign_resources(builder_name(b), lease.resources)
                    self.result.leases.append(LeaseRecord(builder_name(b), lease, ids))
            self._record_phase(RESERVATION)

        self._enter(PROFILE_RUN)
        # vLLM's profile run: ``_dummy_run(self.max_num_tokens, is_profile=True)`` (v1/worker/gpu_model_runner.py:6132),
        # which builds no attention metadata (force_attention is False: :5637), so a GDN layer warms its chunked
        # scan at T = FLA_CHUNK_SIZE = 64 tokens instead (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:1350,
        # from its forward's early return at :1522): the activations are max_num_batched_tokens', a layer's own
        # scratch is the shape its dummy_run warms (issue 51, item 3)
        self.result.profile_tokens = case.envelope.max_num_batched_tokens
        with self._max_split():
            self._dummy_forward(case.envelope.max_num_batched_tokens, None)
        self._record_phase(PROFILE_RUN)

        in_window = self._warmed_in_window() if profiling else []
        if in_window:
            self._enter(PROFILE_WARMUP)
            for b in in_window:
                self._call(b, "warmup", self.ctx(b))
            self._record_phase(PROFILE_WARMUP)
            if self.policy.replay_after_warmup:
                self._enter(PROFILE_REPLAY)
                with self._max_split():
                    self._dummy_forward(case.envelope.max_num_batched_tokens, None)
                self._record_phase(PROFILE_REPLAY)

        self._enter(CLOSING)
        for observer in self.observers:
            self.result.observed_non_kv[observer.name] = observer.window_closes(dev)
        peak_allocated = dev.max_memory_allocated()
        self._snapshot("closing")
        dev.empty_cache()
        self.result.window = ProfileWindow(
            weights=case.weights_bytes,
            nontorch=dev.nontorch_bytes,
            baseline_reserved=baseline_reserved,
            closing_reserved=dev.memory_reserved(),
            closing_allocated=dev.memory_allocated(),
            peak_allocated=peak_allocated,
        )
        self._engine_terms()
        self.in_window = False
        self.result.released_before_closing = tuple(r.owner for r in self.result.leases if r.lease.released)
        self._record_phase(CLOSING)

        if profiling:
            self._enter(LEASE_RELEASE)
            # the engine's release, then its ``finally`` releasing again: release must be idempotent
            for rec in [*self.result.leases, *self.result.leases]:
                try:
                    with self._as_part(rec.owner, "lease.release"):
                        rec.lease.release()
                except Exception as exc:  # noqa: BLE001
                    self._fail(rec.owner, exc)
            self._record_phase(LEASE_RELEASE)

        self._enter(GRAPH_PROFILING)
        pool = self._graph_profile()
        self._record_phase(GRAPH_PROFILING)

        self._enter(KV_SIZING)
        self._size_kv()
        self._record_phase(KV_SIZING)

        self._enter(REBIND)
        for b in self.builders:
            self._call(b, "rebind", self.ctx(b))
        self._record_phase(REBIND)

        self._enter(WARMUP)
        for b in self.builders:
            self._call(b, "warmup", self.ctx(b))
        self._record_phase(WARMUP)

        self._enter(CAPTURE)
        self._capture(pool)
        self._record_phase(CAPTURE)

        self._enter(LOCK)
        self.manager.lock()
        try:
            self.manager.get_workspace(LOCK_PROBE, self.manager.size(0) + self.manager.alignment, 0)
        except WorkspaceLockedError as exc:
            self.result.lock_probe_error = str(exc)
        self._record_phase(LOCK)

        self._enter(SERVING)
        for batch in self._serving_batches():
            self._serve_step(batch)
        self._record_phase(SERVING)

        self._enter(WARMUP_REPEAT)
        for b in self.builders:
            self._call(b, "warmup", self.ctx(b))
        self._record_phase(WARMUP_REPEAT)

    @contextlib.contextmanager
    def _max_split(self) -> Iterator[None]:
        """The allocator's split limit where the engine scopes it (``EnginePolicy.profile_max_split_mib``); a device
        without the caching-allocator model (the GPU tier's) keeps its own configuration."""
        # Any: SimDevice's CachingAllocator or a device's own (not part of Device), used where it has the method
        allocator: Any = getattr(self.device, "allocator", None)
        limit = self.policy.profile_max_split_mib
        if limit is None or not hasattr(allocator, "set_max_split_size"):
            yield
            return
        previous = allocator.max_split_size
        allocator.set_max_split_size(limit << 20)
        try:
            yield
        finally:
            allocator.set_max_split_size(previous)

    def _captures(self) -> tuple[DecodeCapture, ...]:
        """The decode steps captured in CUDA graphs, largest first (capture sizes are tokens)."""
        return self.case.envelope.decode_captures(self.case.mtp)

    def _graph_profile(self) -> GraphPoolHandle:
        """Capture dummy graphs in a private pool and estimate the pool's footprint."""
        pool = None
        for capture in self._captures():
            with self.device.graph_capture(pool) as pool:
                self._graph_forward(capture, plan=False)
        if pool is not None:
            self.result.graph_pool_high_water = pool.high_water_reserved
            self.result.graph_pool_retained = pool.reserved
        return pool

    def _graph_forward(self, capture: DecodeCapture, plan: bool) -> None:
        """One captured decode step: the same allocations in graph profiling and in the real capture."""
        batch = _graph_batch(capture)
        self.in_dummy_forward = True
        act = self._alloc_engine(self._activation_bytes(batch.num_tokens), "model", "activations")
        try:
            for b in self.builders:
                self._call(b, "dummy_run", self.ctx(b))
                if plan:
                    for ub in range(self.manager.num_ubatches):
                        self._call(b, "build", self.ctx(b), _with_ubatch(batch, ub))
            out = self._alloc_engine(batch.num_tokens * self.case.model.hidden * 2, "model",
                                     f"graph output bs={capture.num_reqs}")
        finally:
            self.device.free(act)
            self.in_dummy_forward = False
        self.device.free(out)

    def _engine_terms(self) -> None:
        """The engine's budget as terms (``result.engine_terms``): its own arithmetic's, else the harness's."""
        assert self.result.window is not None
        if self._arithmetic is None:
            self.result.engine_terms = self.result.window.terms()
            return
        try:
            self.result.engine_terms = self._arithmetic.terms()
        except Exception as exc:  # noqa: BLE001
            self._fail(f"engine (budget arithmetic {self._arithmetic.name})", exc)

    def _size_kv(self) -> None:
        case, dev, window = self.case, self.device, self.result.window
        assert window is not None
        if self.policy.graph_estimate == "gross_minus_retained":
            estimate = self.result.graph_pool_high_water - self.result.graph_pool_retained
        elif self.policy.graph_estimate == "none":  # CUDA graphs not accounted at all
            estimate = 0
        else:
            estimate = self.result.graph_pool_high_water
        per_token = kv_bytes_per_token(case.model, case.tp, case.dcp)
        rule = self.result.kv_sizing.rule
        available = available_kv_bytes(dev.total_memory, case.gmu, window.non_kv, estimate)
        persistent = window.consumed
        self.result.budget = Budget(
            total=dev.total_memory, gmu=case.gmu, weights=window.weights, nontorch=window.nontorch,
            persistent_workspace=window.persistent_allocated(self._baseline_allocated),
            persistent_reserved=persistent, peak_activation=window.transient_headroom, non_kv=window.non_kv,
            graph_pool_estimate=estimate, graph_pool_high_water=self.result.graph_pool_high_water,
            available_kv=available, kv_bytes_per_token=per_token, kv_tokens=available // per_token,
            reservation_kv_tokens=tokens_for(persistent, per_token), rule=rule,
        )
        dev.empty_cache()
        dev.reset_peak_memory_stats()
        self._post_kv = True
        self._peak_used = dev.memory_reserved() + dev.nontorch_bytes
        if available > 0:
            self.result.kv_allocation = self._alloc_engine(available, "kv-cache", "kv cache")

    def _capture(self, pool: GraphPoolHandle) -> None:
        """The real capture; in torch mode every storage its calls touch is noted (what the graphs read)."""
        sim = self._torch
        if sim is not None:
            sim.watch_all = True
        try:
            for capture in self._captures():
                with self.device.graph_capture(pool) as pool:
                    self._graph_forward(capture, plan=True)
        finally:
            if sim is not None:
                sim.watch_all = False

    def _serving_batches(self) -> list[Batch]:
        """A deterministic sweep of the envelope, so that a lazily created wrapper meets its shape.

        Every captured decode step; 1, 2, 4, ... up to ``max_num_seqs`` requests in prefill, mixed and
        decode batches (decode carries ``1 + mtp`` tokens per request: the MTP verify shape); the
        longest prefill and a chunked one; the planner's worst batch per route. ``_serve_step`` builds
        each for every micro-batch. Largest first: the engine's activations then reuse the first step's
        cached block instead of fragmenting the caching allocator ahead of a larger step.
        """
        env = self.case.envelope
        q = 1 + self.case.mtp
        budget = env.max_num_batched_tokens
        batches = [_graph_batch(c) for c in self._captures()]
        n = 1
        while n <= env.max_num_seqs and n <= budget:
            batches.append(Batch("prefill", n, budget))
            batches.append(Batch("mixed", n, budget))
            if n * q <= budget:
                batches.append(Batch("decode", n, n * q))
            n *= 2
        batches.append(Batch("prefill", 1, max(1, min(env.max_model_len, budget))))
        batches.append(Batch("prefill", 1, max(1, budget // 2)))
        batches.extend(self._worst_batches())
        return sorted(dict.fromkeys(batches), key=lambda b: -b.num_tokens)

    def _worst_batches(self) -> list[Batch]:
        """The sizing module's worst batch per route, within the envelope."""
        from pytest_kvprofile.sizing.case import for_case

        env = self.case.envelope
        try:
            need = for_case(self.case)
        except Exception:  # noqa: BLE001 - a case the sizing cannot model is swept without its worst batches
            return []
        out = []
        for route, sizing in need.routes.items():
            if not sizing.worst_batch:
                continue
            qo, _kv, graph = sizing.worst_batch
            reqs, tokens = len(qo), sum(qo)
            if 0 < reqs <= env.max_num_seqs and reqs <= tokens <= env.max_num_batched_tokens:
                # routes: decode_tc, decode_cc_cuda_graph, ...
                kind: BatchKind = "decode" if route.startswith("decode") else "prefill"
                out.append(Batch(kind, reqs, tokens, cuda_graph=bool(graph)))
        return out

    def _teardown(self) -> None:
        self.manager.release()  # vLLM's manager: its module global put back
        self._post_kv = False
        self.result.post_kv_peak_used = self._peak_used
        self._unsubscribe()



def _graph_batch(capture: DecodeCapture) -> Batch:
    return Batch("decode", capture.num_reqs, capture.num_tokens, cuda_graph=True)



def _bound(w: ReportedRange, device_ptr: Callable[[int, int], int]) -> BoundWorkspace:
    """A reported range as a BoundWorkspace in the ledger's addresses (duck-typed ones with the same fields are
    accepted; ``device_ptr`` maps a host ``data_ptr()`` of a simulated tensor to its simulated address)."""
    try:
        ub, role, ptr, nbytes = int(w.ubatch), str(w.role), int(w.ptr), int(w.nbytes)
        int_ptr, int_nbytes = int(getattr(w, "int_ptr", 0)), int(getattr(w, "int_nbytes", 0))
    except (AttributeError, TypeError, ValueError):
        raise TypeError(f"bound_workspaces() yielded {type(w).__name__}, not a BoundWorkspace") from None
    mapped = device_ptr(ptr, nbytes)
    int_mapped = device_ptr(int_ptr, int_nbytes) if int_ptr else 0
    if isinstance(w, BoundWorkspace) and (mapped, int_mapped) == (ptr, int_ptr):
        return w
    return BoundWorkspace(ub, role, mapped, nbytes, int_mapped, int_nbytes)



def _with_ubatch(batch: Batch, ubatch: int) -> Batch:
    return Batch(batch.kind, batch.num_reqs, batch.num_tokens, batch.cuda_graph, ubatch)



def ran_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised ``from`` (its explicit cause, as the first-error rule reads a chain), the
    device running out of memory without an injected fault: an engine adapter that names the case and batch wraps the
    engine's own out-of-memory error (vLLM's build raising torch's OOM becomes ``VllmBuildError``)."""
    seen: BaseException | None = exc
    for _ in range(16):  # a chain, never a cycle the loop could follow forever
        if seen is None:
            return False
        if isinstance(seen, DeviceOutOfMemory):
            return not seen.injected
        seen = seen.__cause__
    return False



def make_device(case: Case) -> Device:
    """The CPU tier's device for a case: a simulated GPU of the case's memory, SMs and non-torch bytes."""
    from pytest_kvprofile.memory.device import SimDevice

    return SimDevice(
        name=case.gpu.name, total_memory=case.gpu.memory_bytes, num_sm=case.gpu.num_sm,
        nontorch_bytes=case.nontorch_bytes,
    )



def _second_run(target: ProbeTarget) -> LifecycleResult:
    return _SecondEngineRun(target, target.device_factory(target.case)).run()


class _SecondEngineRun(LifecycleRun):
    """A later engine in the same process: it finds the state the case's run left, and starts no third."""

    def _fresh_module_state(self) -> None:
        pass

    def _start_second_engine(self) -> None:
        pass



@contextlib.contextmanager
def case_parts(backend: Backend, case: Case, device_factory: Callable[[Case], Device] = make_device,
               ) -> Iterator[Callable[[], list[Builder]]]:
    """Construct a backend's parts for ``case`` on the case's device, as the lifecycle constructs them.

    Yields the constructor: what it raises is the backend factory's; what entering or leaving the device
    (torch mode on the simulated GPU) raises is the harness's and propagates as such. The parts are meant to be
    dropped inside the block (collection and inspection only ask their declarations). Construction starts from a
    fresh view of process-wide state, and what it leaves there (a buffer a constructor makes once per process) is
    remembered, so the case's own run makes it again instead of meeting this one's.
    """
    run = LifecycleRun(ProbeTarget(backend, case, device_factory), device_factory(case))
    try:
        with run.device_mode():
            try:
                yield run.construct
            finally:
                if run.result.allocations:  # what construction left in process-wide state: a later run's fresh view
                    run._observe_module_state()
    finally:
        run._teardown()



def _parts_of(backend: Backend, case: Case) -> list[Builder]:
    from pytest_kvprofile.lifecycle.parts import model_parts

    return model_parts(backend, case)

