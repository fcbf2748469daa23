"""The state of one engine run and how it is recorded: the ledger's events, the phase records, each call to a
part (its transient, its error), the attribution of what runs to a part, and the engine's own budget snapshots.

``RunState`` is the base of ``LifecycleRun`` (``engine.py``); ``UseTracking`` (``run_uses.py``) and ``EngineSteps``
(``run_steps.py``) build on it, one concern each.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence, TypeAlias

from pytest_kvprofile.contract.backends import EnginePolicy
from pytest_kvprofile.contract.budget import BudgetArithmetic, SnapshotPoint
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.contract.protocol import (
    Batch,
    BoundWorkspace,
    Builder,
    BuilderContext,
    Hook,
    call_optional,
)
from pytest_kvprofile.contract.support import (
    builder_name,
)
from pytest_kvprofile.contract.workspace import (
    ArenaView,
)
from pytest_kvprofile.lifecycle.phases import (
    POST_KV_PHASES,
    PROFILE_REPLAY,
    PROFILE_RUN,
    Phase,
)
from pytest_kvprofile.lifecycle.record import (
    BoundRecord,
    CallRecord,
    LifecycleResult,
    PhaseError,
    PhaseRecord,
    ProbeTarget,
    TransientPeak,
    ViewGrant,
)
from pytest_kvprofile.lifecycle.recording import _workspace_manager
from pytest_kvprofile.lifecycle.sites import _cached_blocks, _method_site, _raised_at
from pytest_kvprofile.lifecycle.window import WindowObserver
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.memory.device import Allocation, DeviceOutOfMemory, ForeignUse

if TYPE_CHECKING:

    from pytest_kvprofile.contract.device import DeviceEvent
    from pytest_kvprofile.lifecycle.module_state import Registered
    from pytest_kvprofile.memory.torch_mode import SimulatedCuda


# what a builder's bound_workspaces() yields: a BoundWorkspace or any object with its fields (duck-typed), read
# field by field; a missing or wrong one is the TypeError _bound raises
ReportedRange: TypeAlias = Any





class _Abort(Exception):
    """Stops a run after a builder's error has been recorded."""



class RunState:
    """What one run holds and records (the fields its parts and checks read), and the calls into the parts."""

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
        self._baseline_allocated = 0  # the device's allocated bytes when the baseline was taken (the engine's _run)
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

    def arena_view(self, owner: str, nbytes: int, ubatch: int, route: str | None,
                   cuda_graph: bool | None = None) -> ArenaView:
        """``ctx.get_workspace``: a view of ``ubatch``'s arena, recorded with its route and the CUDA-graph mode of
        its plans (``ViewGrant``)."""
        self._asked_graph = cuda_graph
        try:
            return self.manager.get_workspace(owner, nbytes, ubatch, route=route)
        finally:
            self._asked_graph = None

    def ctx(self, builder: Builder) -> BuilderContext:
        return self._contexts[builder_name(builder)]

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

    def _memory_of(self, value: object) -> Allocation | None:
        if isinstance(value, Allocation):
            return value
        torch = sys.modules.get("torch")
        if torch is None or self._torch is None or not isinstance(value, torch.Tensor):
            return None
        return self._torch.memory_of(value)

    def _note_foreign_resources(self, owner: str, resources: list[object]) -> None:
        """A lease that carries an allocation of an earlier device reuses an earlier case's memory (ctx mode)."""
        if not any(isinstance(r, Allocation) for r in resources):
            return
        mine = {id(a) for a in self.result.allocations}
        for res in resources:
            if isinstance(res, Allocation) and id(res) not in mine:
                self.result.foreign_uses.append(ForeignUse(owner, "lease resource", "", res))

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

    def _activation_bytes(self, num_tokens: int) -> int:
        """A transformer layer's live activations for ``num_tokens`` on one rank (bf16).

        Rounded to the allocator's 2 MiB large-block granularity so that the budget's allocated-byte
        headroom and the post-KV reserved bytes agree for a correct backend.
        """
        model = self.case.model
        raw = max(1 << 20, num_tokens * model.hidden * 2 * 12 // self.case.tp)
        return -(-raw // (2 << 20)) * (2 << 20)


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

