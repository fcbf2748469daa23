"""Fault-injection probes that need fresh builders (not the main lifecycle run): warmup retries, reservations that
fail part-way, and CUDA-graph captures the engine retries (at the end of the module).

The retry probe drives fresh builders on a fresh device up to each phase the engine calls warmup in
(inside the profiling window when it warms up there, and after KV sizing), fails the warmup at each of its
allocations in turn, and checks that nothing of the failed attempt stays alive and that a retry ends with
the same persistent memory as a warmup that never failed. Every allocation is a fault point; the probe's
answer is memoized per case without its gmu, which the simulated device's probe never reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.contract.protocol import (
    Batch,
    Builder,
    BuilderContext,
    Hook,
    call_optional,
)
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import builder_name
from pytest_kvprofile.lifecycle.driver import LifecycleRun, _Abort, _SecondEngineRun, close_parts, make_device
from pytest_kvprofile.lifecycle.forked import ChildFailed, can_fork, in_child, worth_forking
from pytest_kvprofile.lifecycle.record import LifecycleResult, ProbeTarget
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.memory.device import DeviceOutOfMemory
from pytest_kvprofile.units import bytes_text, size_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.contract.budget import BudgetArithmetic
    from pytest_kvprofile.contract.device import Allocation, Device, DeviceEvent, GraphPoolHandle

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


def _warmup(run: _ProbeRun, builder: Builder) -> None:
    """Call warmup as the engine does: attributed to the builder (in torch mode too), never recorded."""
    with run._as_part(builder_name(builder), "warmup"):
        call_optional(builder, "warmup", run.ctx(builder))


def _persistent(device: Device, owner: str) -> Counter[tuple[str, int]]:
    return Counter((a.tag, a.nbytes) for a in device.live_allocations() if a.owner == owner and a.kind == "device")


def warmup_retry_violations(target: ProbeTarget, plan: tuple[tuple[lc.Phase, int, str], ...]) -> list[str]:
    """For each ``(state, builder index, name)`` of ``plan``, fail that builder's warmup in that state at every
    allocation and retry. The plan lists the states in which the main run saw the builder's warmup allocate (a
    warmup that allocates nothing there has no fault point to inject).

    The probe never reads gpu_memory_utilization, so cases that differ only in it share one answer
    on the simulated device.
    """
    if not plan:
        return []
    if target.device_factory is make_device:
        try:
            return list(_probe_simulated(target.backend, dataclasses.replace(target.case, id="", gmu=0.0), plan))
        except TypeError:  # an unhashable backend: probe without the memo
            pass
    return _probe(target, plan)


@functools.lru_cache(maxsize=256)
def _probe_simulated(backend: Backend, case: Case, plan: tuple[tuple[lc.Phase, int, str], ...]) -> tuple[str, ...]:
    return tuple(_probe(ProbeTarget(backend, case, make_device), plan))


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


def _clean_warmup(index: int, name: str, run: _ProbeRun) -> tuple[int, Counter[tuple[str, int]], int]:
    """How many allocations a warmup that never fails makes, the persistent memory it leaves, and the bytes the
    private graph pools it captured into keep reserved."""
    pools = _graph_pools(run.device)
    count = len(_allocations_of(run.device, functools.partial(_warmup, run, run.builders[index])))
    return count, _persistent(run.device, name), _new_pool_bytes(run.device, pools)


def _probe(target: ProbeTarget, plan: tuple[tuple[lc.Phase, int, str], ...]) -> list[str]:
    out: list[str] = []
    for state, index, name in plan:
        with _prefix(target, state) as step:
            try:
                clean = step(functools.partial(_clean_warmup, index, name))
            except Exception as exc:  # noqa: BLE001 - the builder cannot even be warmed up once
                cause = exc.__cause__ or exc  # a builder error the run recorded and aborted on
                return [f"the warmup retry probe could not run: {name} failed before or during its warmup in phase "
                        f"{state!r}: {type(cause).__name__}: {cause}"]
            if clean is _UNREACHED:
                continue
            count, expected, pool_bytes = clean  # type: ignore[misc]
            for k in range(count):
                found = step(functools.partial(_warmup_fault, index, name, k, expected, state, pool_bytes))
                assert found is not _UNREACHED
                out.extend(found)  # type: ignore[arg-type]
        if out:
            return out
    return out


def _warmup_fault(index: int, name: str, k: int, expected: Counter[tuple[str, int]], state: lc.Phase,
                  pool_bytes: int, run: _ProbeRun) -> list[str]:
    """:func:`_fail_and_retry` as a probe step."""
    return _fail_and_retry(run, index, name, k, expected, state, pool_bytes)


def _fail_and_retry(run: _ProbeRun, index: int, name: str, k: int, expected: Counter[tuple[str, int]],
                    state: lc.Phase, pool_bytes: int = 0) -> list[str]:
    """Fail warmup at its allocation ``k`` in ``state``, then retry; report leaks, a half-built result, and private
    graph pools a failed CUDA-graph capture kept (``pool_bytes``: what a clean warmup's pools keep reserved)."""
    b, dev = run.builders[index], run.device
    where = "inside the profiling window" if state == lc.PROFILE_WARMUP else "after KV sizing"
    live_before = {a.id for a in dev.live_allocations()}
    pools_before = _graph_pools(dev)
    failed: list[Allocation] = []
    unsubscribe = dev.subscribe(lambda e: failed.append(e.alloc) if e.alloc is not None else None, kinds=("alloc",))
    dev.fail_after(k)
    try:
        _warmup(run, b)
    except Exception:  # noqa: BLE001 - the injected failure (or what the builder made of it)
        pass
    else:
        return [f"builder {name!r}: warmup {where} swallowed an out-of-memory error at its allocation #{k + 1}"]
    finally:
        unsubscribe()
        dev.fail_after(None)
    kept_pools = {pid: n for pid, n in _graph_pools(dev).items() if pid not in pools_before}
    out = []
    leaked = [
        a for a in dev.live_allocations()
        if a.id not in live_before and a.owner == name and a.kind == "device" and (a.tag, a.nbytes) not in expected
    ]
    if leaked:
        out.append(
            f"builder {name!r}: a warmup {where} that failed at its allocation #{k + 1} leaked "
            + "; ".join(f"{a.tag!r} {size_text(a.nbytes)}" + (f" at {a.where}" if a.where else "") for a in leaked[:4])
            + ". Free what a failed warmup made before it raises (try/finally), or reuse it on the retry"
        )
    try:
        _warmup(run, b)
    except Exception as exc:  # noqa: BLE001
        out.append(f"builder {name!r}: the retry {where} after a failure at allocation #{k + 1} raised "
                   f"{type(exc).__name__}: {exc}")
        return out
    retried = _new_pool_bytes(dev, pools_before)
    if retried > pool_bytes and kept_pools:
        out.append(_kept_pool_message(name, where, state, k, kept_pools, failed, retried, pool_bytes))
    got = _persistent(dev, name)
    if got != expected:
        parts = []
        if expected - got:
            parts.append("missing " + ", ".join(f"{t!r} ({n} bytes)" for (t, n) in expected - got))
        if got - expected:
            parts.append("extra " + ", ".join(f"{t!r} ({n} bytes)" for (t, n) in got - expected))
        out.append(
            f"builder {name!r}: after a warmup {where} failed at allocation #{k + 1} and was retried, its persistent "
            f"memory differs from a clean warmup's ({'; '.join(parts)}): the warmup was left half-built. Mark it "
            "warmed only once it completed, and undo (or finish) a failed attempt's partial work on the retry"
        )
    return out




def _kept_pool_message(name: str, where: str, state: lc.Phase, k: int, kept: dict[str, int],
                       failed: list[Allocation], retried: int, clean: int) -> str:
    """A failed CUDA-graph capture's private pool, still held after the retry: bytes, phase and source line."""
    pools = []
    for pid, nbytes in sorted(kept.items()):
        lines = sorted({a.stack for a in failed if a.pool == pid and a.stack})
        made = f", captured at {lines[0]}" if lines else ""
        pools.append(f"{pid} {bytes_text(nbytes)}{made}")
    return (f"builder {name!r}: a warmup {where} (phase {state!r}) that failed at its allocation #{k + 1} inside a "
            f"CUDA-graph capture and was retried keeps {bytes_text(retried)} reserved in private graph pools against "
            f"{bytes_text(clean)} of a clean warmup: the failed capture's pool stays ({'; '.join(pools)}). A failed "
            "capture's graph still holds its pool: reset or drop the graph when capture raises (keep a graph only "
            "once its capture succeeded)")


# -- reservation ---------------------------------------------------------------------------------------------------
# A reservation that fails leaks nothing, and the first error wins (the open vLLM pull request's rule). The probe
# stops fresh builders where the engine asks one of them to reserve (``reserve_persistent_workspace``, a resource's
# ``materialize``), fails that reservation at an allocation, and checks: the injected error is what it raises (or
# the explicit cause of it), nothing it made stays allocated, and a second reservation holds exactly what a clean one
# holds. The fault points are the first allocation of each distinct site (owner, kind, role and source line; bytes
# in ctx mode, which has no source line) and the last allocation, at most MAX_FAULT_POINTS of them, so the cost per
# builder is bounded, not proportional to its wrappers (the last one fails with the most made before it).

Held = Counter[tuple[str, int, str]]  # (tag, bytes, source line) -> count, of live device allocations


def reservation_violations(target: ProbeTarget, plan: tuple[tuple[int, str], ...]) -> list[str]:
    """For each ``(builder index, name)`` of ``plan`` (the parts whose reservation allocated in the main run), fail
    its reservation at each fault point and retry. Memoized per case without its gmu, like the warmup probe."""
    return list(reservation_outcome(target, plan).violations)


def reservation_costs(target: ProbeTarget, plan: tuple[tuple[int, str], ...]) -> list[str]:
    """What the failed attempts left held on their builders (inside the window, so KV sizing sees it): reported."""
    return list(reservation_outcome(target, plan).costs)


@dataclasses.dataclass(frozen=True)
class ReservationOutcome:
    """The reservation probe's answer: what it refuses, what it reports, and per builder the fault point the rest
    of the lifecycle is judged after (its last: the one with the most made before it)."""

    violations: tuple[str, ...] = ()
    costs: tuple[str, ...] = ()
    last_faults: tuple[tuple[str, int], ...] = ()


def reservation_outcome(target: ProbeTarget, plan: tuple[tuple[int, str], ...]) -> ReservationOutcome:
    """The reservation probe, memoized per case without its gmu on the simulated device."""
    if not plan:
        return ReservationOutcome()
    if target.device_factory is make_device:
        try:
            return _reservation_simulated(target.backend, dataclasses.replace(target.case, id="", gmu=0.0), plan)
        except TypeError:  # an unhashable backend: probe without the memo
            pass
    return _outcome(target, plan)


def _outcome(target: ProbeTarget, plan: tuple[tuple[int, str], ...]) -> ReservationOutcome:
    notes: list[str] = []
    last: list[tuple[str, int]] = []
    found = _probe_reservations(target, plan, notes, last)
    return ReservationOutcome(tuple(found), tuple(notes), tuple(last))


@functools.lru_cache(maxsize=256)
def _reservation_simulated(backend: Backend, case: Case, plan: tuple[tuple[int, str], ...]) -> ReservationOutcome:
    return _outcome(ProbeTarget(backend, case, make_device), plan)


def _reserve(run: _ProbeRun, builder: Builder) -> object:
    """Call the reservation as the engine does: attributed to the builder (in torch mode too), never recorded."""
    with run._as_part(builder_name(builder), "reserve_persistent_workspace"):
        return call_optional(builder, "reserve_persistent_workspace", run.ctx(builder))


def _held(device: Device, owner: str, before: set[int], process_wide: frozenset[int] = frozenset()) -> Held:
    """The device memory ``owner`` made since ``before`` (live allocation ids) and still holds: what KV sizing sees
    (pinned host memory is not judged, as in the warmup probe; process-wide host caches such as FlashInfer's pinned
    range buffer outlive any one reservation). ``process_wide`` are allocations process-wide state keeps (a module
    global made once per process): a failed reservation may leave those, the retry reuses them, and
    ``no_state_outlives_case`` judges them."""
    return Counter((a.tag, a.nbytes, a.stack or "") for a in device.live_allocations()
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


MAX_FAULT_POINTS = 12  # per builder: each fault re-runs fresh builders up to their reservation


def _fault_points(allocs: Sequence[_Site]) -> list[int]:
    """Indices of the first and the second allocation of each distinct site (the second: a retry that makes a
    repeated wrapper again beside the one the failed attempt kept shows only past the first), and of the last
    allocation; at most ``MAX_FAULT_POINTS``, spread evenly over them (the first and the last always among them)."""
    seen: Counter[tuple[object, ...]] = Counter()
    points = []
    for i, a in enumerate(allocs):
        key = (a.owner, a.kind, a.role, a.stack or a.nbytes)  # the source line; in ctx mode, role and bytes
        seen[key] += 1
        if seen[key] <= 2:
            points.append(i)
    if allocs and points[-1] != len(allocs) - 1:
        points.append(len(allocs) - 1)
    if len(points) > MAX_FAULT_POINTS:
        step = (len(points) - 1) / (MAX_FAULT_POINTS - 1)
        points = [points[round(j * step)] for j in range(MAX_FAULT_POINTS)]
    return points


def _probe_reservations(target: ProbeTarget, plan: tuple[tuple[int, str], ...],
                        notes: list[str] | None = None, last: list[tuple[str, int]] | None = None) -> list[str]:
    out: list[str] = []
    notes = [] if notes is None else notes
    last = [] if last is None else last
    for index, name in plan:
        with _prefix(target, lc.RESERVATION, reserving=name) as step:
            try:
                clean = step(functools.partial(_clean_reservation, index, name))
            except Exception as exc:  # noqa: BLE001 - the builder cannot even reserve once
                cause = exc.__cause__ or exc
                return [f"the reservation probe could not run: {name} failed before or during its reservation: "
                        f"{type(cause).__name__}: {cause}"]
            if clean is _UNREACHED:
                continue
            allocs, expected, clean_wide = clean  # type: ignore[misc]
            points = _fault_points(allocs)
            if points:
                last.append((name, points[-1]))
            for k in points:
                found = step(functools.partial(_failed_reservation, index, name, k, allocs[k], expected, clean_wide))
                assert found is not _UNREACHED
                violations, noted = found  # type: ignore[misc]
                out.extend(violations)
                notes.extend(noted)
        if out:
            return out
    return out


@dataclasses.dataclass(frozen=True)
class _Site:
    """What the probe reads of an allocation a clean reservation made (a ledger entry does not cross a fork)."""

    owner: str
    kind: str
    role: Role
    stack: str | None
    nbytes: int
    tag: str


def _clean_reservation(index: int, name: str, run: _ProbeRun) -> tuple[list[_Site], Held, bool]:
    """A reservation that never fails: the allocations it makes, in order, what it leaves held, and whether it left
    anything in process-wide state."""
    before = {a.id for a in run.device.live_allocations()}
    allocs = _allocations_of(run.device, functools.partial(_reserve, run, run.builders[index]))
    wide = _process_wide(run)
    sites = [_Site(a.owner, a.kind, a.role, a.stack, a.nbytes, a.tag) for a in allocs]
    return sites, _held(run.device, name, before, frozenset(wide)), bool(wide)


def _failed_reservation(index: int, name: str, k: int, site: _Site, expected: Held, look_wide: bool,
                        run: _ProbeRun) -> tuple[list[str], list[str]]:
    """:func:`_fail_reservation` with a retry, as a probe step: what it refuses and what it reports."""
    notes: list[str] = []
    return _fail_reservation(run, index, name, k, site, expected, retry=True, look_wide=look_wide, notes=notes), notes


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


def _fail_reservation(run: _ProbeRun, index: int, name: str, k: int, site: _Site, expected: Held,
                      retry: bool, look_wide: bool = True, notes: list[str] | None = None) -> list[str]:
    """Fail ``name``'s reservation at its allocation ``k`` and, with ``retry``, reserve again; report what breaks the
    rule. The second reservation follows the last fault point only (the one with the most made before it): a real
    builder's reservation costs as much as its lifecycle, and a leak or a wrong error shows at every point.
    ``look_wide`` False: a clean reservation from the same fresh view left nothing in process-wide state, so none of
    what this one leaves is exempt as such (and the module walk is skipped)."""
    notes = [] if notes is None else notes  # what a failed attempt left held: reported, never refused
    b, dev = run.builders[index], run.device
    what = f"its reservation failed at allocation #{k + 1} ({site.tag!r}, {size_text(site.nbytes)})"
    before = {a.id for a in dev.live_allocations()}
    ooms: list[DeviceEvent] = []
    unsubscribe = dev.subscribe(ooms.append, kinds=("oom",))
    dev.fail_after(k)
    raised: str | None = None
    try:
        _reserve(run, b)
    except Exception as exc:  # noqa: BLE001 - the injected failure, or what the builder made of it
        if not _first_error_wins(exc):
            raised = f"{type(exc).__name__}: {exc}"
    else:
        if ooms:
            return [f"builder {name!r}: {what}, and it returned a lease instead of raising: a failed reservation "
                    "raises its first error, so the engine falls back instead of running with half a reservation"]
    finally:
        unsubscribe()
    if not ooms:
        return []  # the fault point was never reached (a reservation that allocates differently each time)
    out = []
    if raised is not None:
        out.append(f"builder {name!r}: {what}, and it raised {raised} instead of the out-of-memory error: the first "
                   "error wins (an error in the cleanup must not replace it; chain it with `raise ... from`)")
    leaked = _held(dev, name, before)
    process_wide = _process_wide(run) if look_wide and (leaked or retry) else {}
    leaked = _held(dev, name, before, frozenset(process_wide)) if leaked and process_wide else leaked
    if leaked and getattr(run.backend, "torch_mode", False):
        # tensors a reference cycle still holds are not leaks the builder made; collected only when something
        # process-wide state does not explain is left (a full collection costs 0.2 s with FlashInfer imported)
        gc.collect()
        leaked = _held(dev, name, before, frozenset(process_wide))
    # What the failed attempt leaves held was made inside the window, so KV sizing sees it: a cost, not a safety
    # failure, as long as the retry reuses or frees it (judged below); kept for the report.
    if leaked:
        notes.append(f"builder {name!r}: {what}; the failed attempt left {bytes_text(_total(leaked))} held "
                     f"({_fmt_held(leaked)})")
    if not retry:
        return out
    kept = {a.id for a in dev.live_allocations()} - before  # what the failed attempt left: process-wide state only
    filled = {where for i, where in process_wide.items() if i in kept}  # the places the failed attempt filled
    try:
        _reserve(run, b)
    except Exception as exc:  # noqa: BLE001
        out.append(f"builder {name!r}: after {what}, a second reservation raised {type(exc).__name__}: {exc}")
        return out
    # process-wide memory is not the retry's to hold, as it is not a clean reservation's, unless the retry made it
    # again where the failed attempt had already put it (made per reservation, not reused: bug 14 seen on a retry);
    # what the failed attempt made that the state no longer holds, still allocated, counts too
    process_wide = _process_wide(run) if look_wide else {}
    exempt = frozenset(i for i, where in process_wide.items() if i in kept or where not in filled)
    got = _held(dev, name, before, exempt)
    if _total(got) > _total(expected):
        parts = ["extra " + _fmt_held(got - expected)]
        if expected - got:
            parts.append("missing " + _fmt_held(expected - got))
        out.append(f"builder {name!r}: after {what}, a second reservation holds {bytes_text(_total(got))} "
                   f"against {bytes_text(_total(expected))} of a clean one ({'; '.join(parts)}): each failed attempt "
                   "leaks what the retry makes again beside it. Reuse or free what the failed attempt kept")
    return out



# -- capture -------------------------------------------------------------------------------------------------------
# A CUDA-graph capture that the engine retries after an out-of-memory error leaves nothing behind. The probe stops
# fresh builders where the engine enters capture (rebind and warmup done, graph profiling's pool in hand), captures
# once cleanly, then fails the capture at each fault point: the first allocation of each distinct site a builder made
# while capturing, and the last (``_capture_fault_points``). The engine resets the failed attempt's graphs and
# captures again. Refused: the error swallowed (a graph captured over a half-built step), another error raised in its
# place, and a retried capture whose builders hold more or less than after a clean one. What a failed attempt keeps
# lives in the engine's graph pool, whose segments then stay reserved after the graph is gone.

CapturePlan = tuple[str, ...]  # the builders that allocated device memory while the main run captured


def capture_retry_violations(target: ProbeTarget, plan: CapturePlan) -> list[str]:
    """Fail the engine's capture at each fault point of ``plan``'s builders and capture again (``capture_retryable``).
    Memoized per case without its gmu on the simulated device, like the warmup probe."""
    if not plan:
        return []
    if target.device_factory is make_device:
        try:
            return list(_capture_simulated(target.backend, dataclasses.replace(target.case, id="", gmu=0.0), plan))
        except TypeError:  # an unhashable backend: probe without the memo
            pass
    return _probe_capture(target, plan)


@functools.lru_cache(maxsize=256)
def _capture_simulated(backend: Backend, case: Case, plan: CapturePlan) -> tuple[str, ...]:
    return tuple(_probe_capture(ProbeTarget(backend, case, make_device), plan))


def _engine_capture(run: _ProbeRun) -> None:
    """The engine's capture phase as the lifecycle runs it: every captured decode step, into graph profiling's pool."""
    run._capture(run.graph_pool)


def _pool_reserved(device: Device) -> int:
    """Bytes the CUDA-graph private pools in use keep reserved (``SimDevice`` only; another device answers 0)."""
    return sum(_graph_pools(device).values())


@dataclasses.dataclass(frozen=True)
class _CleanCapture:
    """What a capture that never fails makes (every allocation, in order) and leaves: per builder of the plan, the
    device memory it holds; the bytes the graph pools in use keep reserved."""

    sites: tuple[_Site, ...]
    held: tuple[tuple[str, Held], ...]
    pool_bytes: int


def _clean_capture(plan: CapturePlan, run: _ProbeRun) -> _CleanCapture:
    dev = run.device
    before = {a.id for a in dev.live_allocations()}
    allocs = _allocations_of(dev, functools.partial(_engine_capture, run))
    sites = tuple(_Site(a.owner, a.kind, a.role, a.stack, a.nbytes, a.tag) for a in allocs)
    return _CleanCapture(sites, tuple((name, _held(dev, name, before)) for name in plan), _pool_reserved(dev))


def _capture_fault_points(sites: Sequence[_Site], plan: CapturePlan) -> list[int]:
    """The first allocation of each distinct site a builder of ``plan`` has in the capture, and its last, as indices
    among all of the capture's allocations (the engine's own count for ``fail_after``); at most
    ``MAX_FAULT_POINTS``. The engine captures every step again on a retry, so a site's later allocations (the same
    line for the next captured size) add nothing a first one does not show, and each point costs a lifecycle."""
    seen: set[tuple[object, ...]] = set()
    points = []
    for i, a in enumerate(sites):
        if a.owner not in plan or a.kind != "device":
            continue
        key = (a.owner, a.role, a.stack or a.nbytes)
        if key not in seen:
            seen.add(key)
            points.append(i)
        last = i
    if points and points[-1] != last:
        points.append(last)
    if len(points) > MAX_FAULT_POINTS:
        step = (len(points) - 1) / (MAX_FAULT_POINTS - 1)
        points = [points[round(j * step)] for j in range(MAX_FAULT_POINTS)]
    return points


def _probe_capture(target: ProbeTarget, plan: CapturePlan) -> list[str]:
    with _prefix(target, lc.CAPTURE) as step:
        try:
            clean = step(functools.partial(_clean_capture, plan))
        except Exception as exc:  # noqa: BLE001 - the builders cannot even be captured once
            cause = exc.__cause__ or exc
            return [f"the capture retry probe could not run: the engine's CUDA-graph capture (phase "
                    f"{lc.CAPTURE!r}) failed on fresh builders: {type(cause).__name__}: {cause}"]
        if not isinstance(clean, _CleanCapture):
            return []  # the engine never reaches capture
        out: list[str] = []
        for k in _capture_fault_points(clean.sites, plan):
            found = step(functools.partial(_failed_capture, plan, k, clean))
            assert isinstance(found, list)
            out.extend(found)
            if out:
                return out  # one fault point shows the rule broken: the rest costs a lifecycle each
        return out


def _failed_capture(plan: CapturePlan, k: int, clean: _CleanCapture, run: _ProbeRun) -> list[str]:
    """Fail the capture at its allocation ``k``; the engine resets the failed attempt's graphs and captures again.
    Report what breaks the rule, per builder of ``plan``."""
    dev, site = run.device, clean.sites[k]
    where = f" at {site.stack}" if site.stack else ""
    by = f", by builder {site.owner!r}" if len(plan) > 1 else ""
    what = (f"a CUDA-graph capture (phase {lc.CAPTURE!r}) that failed at its allocation #{k + 1} ({site.tag!r}, "
            f"{size_text(site.nbytes)}{where}{by})")
    before = {a.id for a in dev.live_allocations()}
    pool = run.graph_pool
    graphs = getattr(pool, "use_count", 0)
    ooms: list[DeviceEvent] = []
    unsubscribe = dev.subscribe(ooms.append, kinds=("oom",))
    errors = len(run.result.errors)
    raised: str | None = None
    dev.fail_after(k)
    try:
        _engine_capture(run)
    except Exception as exc:  # noqa: BLE001 - the injected failure, or what a builder made of it
        raised = _replaced_error(exc)  # no local keeps the error: its traceback's frames hold what the step made
    else:
        if ooms:
            return [f"builder {site.owner!r}: {what} went on capturing: the out-of-memory error was swallowed, so "
                    "the graph holds a half-built step. Let the error reach the engine"]
    finally:
        unsubscribe()
        dev.fail_after(None)
        del run.result.errors[errors:]  # the injected failure; the probe judges how it was raised
        run.result.aborted_in = None
    if not ooms:
        return []  # the fault point was never reached (a capture that allocates differently each time)
    out = []
    if raised is not None:
        out.append(f"builder {site.owner!r}: {what} raised {raised} instead of the out-of-memory error: the first "
                   "error wins (an error in the cleanup must not replace it; chain it with `raise ... from`)")
    failed = getattr(pool, "use_count", 0) - graphs
    release = getattr(dev, "release_graph_pool", None)  # SimDevice's; a real device's graphs are torch's own
    if failed > 0 and callable(release):  # the engine drops the failed attempt's graphs (PyTorch's fix resets them)
        release(pool, lazy=True, graphs=failed)
    try:
        _engine_capture(run)
    except Exception as exc:  # noqa: BLE001
        cause = exc.__cause__ or exc
        out.append(f"after {what}, the engine's second capture raised {type(cause).__name__}: {cause}")
        return out
    got = {name: _held(dev, name, before) for name in plan}
    if getattr(run.backend, "torch_mode", False) and any(_total(got[n]) != _total(h) for n, h in clean.held):
        gc.collect()  # tensors a reference cycle still holds (a traceback's frames) are not what a builder keeps
        got = {name: _held(dev, name, before) for name in plan}
    for name, expected in clean.held:
        out.extend(_capture_difference(dev, name, what, before, got[name], expected, clean.pool_bytes))
    return out


def _replaced_error(exc: BaseException) -> str | None:
    """What a failed capture raised in place of the injected out-of-memory error (``_Abort`` is the driver's wrapping
    of a builder's error), or None when the first error won."""
    cause = exc.__cause__ if isinstance(exc, _Abort) and exc.__cause__ is not None else exc
    return None if _first_error_wins(cause) else f"{type(cause).__name__}: {cause}"


def _capture_difference(device: Device, name: str, what: str, before: set[int], got: Held, expected: Held,
                        clean_pool_bytes: int) -> list[str]:
    """A retried capture's builder memory against a clean capture's: more is what the failed attempt kept (its graph
    pool's segments stay reserved), less is a step the retry left half-built."""
    if _total(got) == _total(expected):
        return []
    if _total(got) < _total(expected):
        return [f"builder {name!r}: after {what}, the retried capture holds {bytes_text(_total(got))} against "
                f"{bytes_text(_total(expected))} of a clean capture (missing {_fmt_held(expected - got)}): the retry "
                "skipped what the failed attempt had begun, so a graph was captured over a half-built step. Build "
                "each step whole again when its capture is retried"]
    extra = got - expected
    pools = sorted({a.pool for a in device.live_allocations() if a.owner == name and a.id not in before
                    and a.kind == "device" and a.pool != "default" and (a.tag, a.nbytes, a.stack or "") in extra})
    in_pools = ""
    if pools:
        reserved = _pool_reserved(device)
        grown = (f"; the graph pools in use reserve {bytes_text(reserved)} against {bytes_text(clean_pool_bytes)} "
                 "after a clean capture" if reserved > clean_pool_bytes else "")
        in_pools = (f", in the engine's CUDA-graph pool {', '.join(pools)}: it keeps its segment reserved after the "
                    f"failed graph is reset{grown}")
    return [f"builder {name!r}: after {what}, the engine captured again and the builder holds "
            f"{bytes_text(_total(got))} against {bytes_text(_total(expected))} of a clean capture (extra "
            f"{_fmt_held(extra)}{in_pools}). Memory a failed capture made and kept outlives the graph the engine "
            "reset, once per retry and after KV sizing: free what build() made when it raises, and keep a step's "
            "tensors on the builder only once the step is built"]
