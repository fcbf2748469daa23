"""What every probe shares: the engine's lifecycle driven on fresh builders up to a phase (``_ProbeRun``,
``_prefix``, forked children when ``KVPROFILE_PROBE_FORK`` asks), the retried reservation's whole run
(``run_after_failed_reservation``), and how a probe reads a device (what a part holds, graph pools, sites).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.contract.protocol import (
    Batch,
    Builder,
    BuilderContext,
    Hook,
)
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import builder_name
from pytest_kvprofile.lifecycle.engine import LifecycleRun, _SecondEngineRun, make_device
from pytest_kvprofile.lifecycle.forked import ChildFailed, can_fork, in_child, worth_forking
from pytest_kvprofile.lifecycle.record import LifecycleResult, ProbeTarget
from pytest_kvprofile.lifecycle.run_state import _Abort
from pytest_kvprofile.lifecycle.sites import _raised_at
from pytest_kvprofile.lifecycle.teardown import close_parts
from pytest_kvprofile.memory.device import DeviceOutOfMemory
from pytest_kvprofile.units import bytes_text, size_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.budget import BudgetArithmetic
    from pytest_kvprofile.contract.device import Allocation, Device, GraphPoolHandle


T = TypeVar("T")



class _Stop(Exception):
    """Stops a probe run as it enters the phase whose warmup is probed."""



class _ProbeRun(LifecycleRun):
    """The engine's lifecycle up to a phase in which it calls warmup (the state a warmup starts from there), or up
    to the moment it asks one builder to reserve (``stop_before_reserving``: the arena and the earlier builders'
    leases are in place)."""

    stop_at: lc.Phase = lc.PROFILE_WARMUP
    stop_before_reserving: str | None = None
    reached = False

    def _enter(self, phase: lc.Phase) -> None:
        super()._enter(phase)
        if lc.PHASE_INDEX[phase] >= lc.PHASE_INDEX[self.stop_at]:
            self.reached = phase == self.stop_at and self.stop_before_reserving is None
            raise _Stop

    def _budget_arithmetic(self) -> BudgetArithmetic | None:
        """A probe judges a warmup, never the budget: the engine's own arithmetic is not run (the harness's terms
        are recorded as in any run)."""
        return None

    def _call(self, builder: Builder, method: Hook, *args: BuilderContext | Batch) -> object:
        if method == "reserve_persistent_workspace" and builder_name(builder) == self.stop_before_reserving:
            self.reached = True
            raise _Stop
        return super()._call(builder, method, *args)

    graph_pool: GraphPoolHandle = None  # the private pool graph profiling captured into: the capture's

    def _graph_profile(self) -> GraphPoolHandle:
        self.graph_pool = super()._graph_profile()
        return self.graph_pool



class _RetriedRun(_SecondEngineRun):
    """A whole lifecycle in which one builder's reservation fails at its allocation ``fail_at`` and the engine
    retries it at once; every later phase runs as usual, so the checks judge what the retry left (its fresh view of
    process-wide state is the case's own: it starts no second engine)."""

    def __init__(self, target: ProbeTarget, fail_builder: str, fail_at: int) -> None:
        super().__init__(target, target.device_factory(target.case))
        self.fail_builder, self.fail_at, self.failed = fail_builder, fail_at, False

    def _fresh_module_state(self) -> None:
        LifecycleRun._fresh_module_state(self)

    def _call(self, builder: Builder, method: Hook, *args: BuilderContext | Batch) -> object:
        if method != "reserve_persistent_workspace" or builder_name(builder) != self.fail_builder or self.failed:
            return super()._call(builder, method, *args)
        self.failed = True
        self.device.fail_after(self.fail_at)
        errors = len(self.result.errors)
        try:
            return super()._call(builder, method, *args)  # the fault never met: the reservation as it is
        except _Abort:
            del self.result.errors[errors:]  # the injected failure; the probe judges how it was raised
            self.result.aborted_in = None
        finally:
            self.device.fail_after(None)
        return super()._call(builder, method, *args)



def run_after_failed_reservation(target: ProbeTarget, fail_builder: str, fail_at: int) -> LifecycleResult:
    """The case's lifecycle with ``fail_builder``'s reservation failed at its allocation ``fail_at`` and retried,
    for every check to judge (``reservation_exception_safe``); its parts are closed."""
    result = _RetriedRun(target, fail_builder, fail_at).run()
    close_parts(result)
    return result



@contextlib.contextmanager
def _fresh(target: ProbeTarget, state: lc.Phase, reserving: str | None = None) -> Iterator[_ProbeRun | None]:
    """New builders on a new device, driven up to ``state`` (or to ``reserving``'s reservation); None when the
    engine never reaches it (no warmup inside the window, a builder it never asks to reserve). The backend's
    device mode stays active for the block."""
    run = _ProbeRun(target, target.device_factory(target.case))
    run.stop_at = lc.PROFILE_RUN if reserving is not None else state
    run.stop_before_reserving = reserving
    try:
        with run.device_mode():
            run.make_builders()
            try:
                run._run()
            except _Stop:
                pass
            yield run if run.reached else None
    finally:
        run._teardown()



_UNREACHED = object()  # a step of a prefix the engine never reaches



Step = Callable[[Callable[[_ProbeRun], T]], "T | object"]



# a step returns its fn's result, a different type per call (the caller unpacks it), which one Step[T] cannot say
AnyStep = Step[Any]



@contextlib.contextmanager
def _prefix(target: ProbeTarget, state: lc.Phase, reserving: str | None = None) -> Iterator[AnyStep]:
    """Steps that each start from the state :func:`_fresh` reaches: ``step(fn)`` is ``fn(run)`` on that state, or
    ``_UNREACHED``. On the simulated device, when ``KVPROFILE_PROBE_FORK`` opts in for this backend
    (``forked.worth_forking``), the state is built once and each step runs in a child forked from it
    (``lifecycle/forked.py``): every fault point starts where a fresh run would, for the price of a fork. Elsewhere
    (the default, the GPU tier, no ``fork``) each step drives its own fresh builders, as a forked child failing
    does."""

    def fresh_step(fn: Callable[[_ProbeRun], T]) -> T | object:
        with _fresh(target, state, reserving) as run:
            return _UNREACHED if run is None else fn(run)

    fork = worth_forking(bool(getattr(target.backend, "torch_mode", False)), bool(getattr(target.backend, "requires",
                                                                                             ())))
    if not (target.device_factory is make_device and fork and can_fork()):
        yield fresh_step
        return
    with _fresh(target, state, reserving) as shared:

        def forked_step(fn: Callable[[_ProbeRun], T]) -> T | object:
            if shared is None:
                return _UNREACHED
            try:
                return in_child(functools.partial(fn, shared))
            except ChildFailed:
                return fresh_step(fn)

        yield forked_step



def _persistent(device: Device, owner: str) -> Counter[tuple[str, int]]:
    return Counter((a.tag, a.nbytes) for a in device.live_allocations() if a.owner == owner and a.kind == "device")



def _graph_pools(device: Device) -> dict[str, int]:
    """The CUDA-graph private pools a graph still uses (``use_count`` above 0), by id, with their reserved bytes:
    a captured graph keeps its pool's segments reserved until the graph is reset or dropped (``SimDevice`` only;
    another device answers none)."""
    pools = getattr(device, "graph_pools", None)
    if not callable(pools):
        return {}
    return {p.id: p.reserved for p in pools() if p.use_count > 0 and p.reserved}



def _new_pool_bytes(device: Device, before: dict[str, int]) -> int:
    """Bytes reserved by the graph pools in use now that were not in use in ``before``."""
    return sum(n for pid, n in _graph_pools(device).items() if pid not in before)



Held = Counter[tuple[str, int, str]]  # (tag, bytes, source line) -> count, of live device allocations



def _held(device: Device, owner: str, before: set[int], process_wide: frozenset[int] = frozenset()) -> Held:
    """The device memory ``owner`` made since ``before`` (live allocation ids) and still holds: what KV sizing sees
    (pinned host memory is not judged, as in the warmup probe; process-wide host caches such as FlashInfer's pinned
    range buffer outlive any one reservation). ``process_wide`` are allocations process-wide state keeps (a module
    global made once per process): a failed reservation may leave those, the retry reuses them, and
    ``no_state_outlives_case`` judges them."""
    return Counter((a.tag, a.nbytes, a.where or "") for a in device.live_allocations()
                   if a.owner == owner and a.kind == "device" and a.id not in before and a.id not in process_wide)



def _process_wide(run: _ProbeRun) -> dict[int, str]:
    """This run's device allocations that process-wide state (module globals, class attributes, caches) holds now:
    allocation id -> the first path that reaches it. Ids count per device, so memory an earlier device's allocations
    left in some module (a test's, a library's) is matched by identity, never by id: another device's allocation #5
    is not this one's; and only the files where the parts allocated are looked at, as the driver does (the engine's
    own allocations name its caller)."""
    from pytest_kvprofile.lifecycle.module_state import held_in_modules, modules_of

    parts = set(run._parts.values())
    files = {a.stack.rsplit(":", 1)[0] for a in run.result.allocations if a.stack and a.owner in parts}
    live = {id(a): a.id for a in run.device.live_allocations()}
    return {live[id(h.alloc)]: h.where for h in held_in_modules(modules_of(run.builders, files), run._memory_of)
            if id(h.alloc) in live}



@dataclasses.dataclass(frozen=True)
class _Site:
    """What the probe reads of an allocation a clean reservation made (a ledger entry does not cross a fork)."""

    owner: str
    kind: str
    role: Role
    stack: str | None
    nbytes: int
    tag: str
    where: str | None = None  # the source line a message names (``Allocation.where``: in ctx mode the builder's)



def _allocations_of(device: Device, fn: Callable[[], object]) -> list[Allocation]:
    """The allocations (ledger entries) made while ``fn`` runs, in order."""
    seen: list[Any] = []  # Any: an "alloc" event's allocation, never None (DeviceEvent's is for all kinds)
    unsubscribe = device.subscribe(lambda e: seen.append(e.alloc), kinds=("alloc",))
    try:
        fn()
    finally:
        unsubscribe()
    return seen



def _first_error_wins(exc: BaseException) -> bool:
    """Whether the raised error is the injected out-of-memory error or names it as its explicit cause."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, DeviceOutOfMemory) and seen.injected:
            return True
        seen = seen.__cause__
    return False



def _fmt_held(held: Held) -> str:
    parts = []
    for (tag, nbytes, stack), n in sorted(held.items(), key=lambda kv: (-kv[0][1] * kv[1], kv[0])):
        times = f" x {n} = {size_text(nbytes * n)}" if n > 1 else ""
        where = f" at {stack}" if stack else ""
        parts.append(f"{tag!r} {bytes_text(nbytes)}{times}{where}")
    return "; ".join(parts)



def _total(held: Held) -> int:
    return sum(nbytes * n for (_tag, nbytes, _stack), n in held.items())



def _replaced_error(exc: BaseException) -> str | None:
    """What a failed capture raised in place of the injected out-of-memory error (``_Abort`` is the driver's wrapping
    of a builder's error), or None when the first error won."""
    cause = exc.__cause__ if isinstance(exc, _Abort) and exc.__cause__ is not None else exc
    if _first_error_wins(cause):
        return None
    site = _raised_at(cause)
    return f"{type(cause).__name__}: {cause}" + (f" (raised at {site})" if site else "")

