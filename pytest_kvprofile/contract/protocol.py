"""The builder protocol the harness drives, and the context it hands to builders.

A third-party attention backend implements a small, duck-typed surface (named as vLLM's open pull request names
it). Only ``name`` is mandatory; every other method is optional and its absence has a defined,
conservative meaning:

``get_persistent_workspace_memory_profiling_support() -> ProfilingSupport``
    Fail-closed: a builder without it is UNSUPPORTED.
``declared_workspace(case) -> WorkspaceDeclaration``
    The float arena bytes it needs from the shared manager and the dedicated int workspace bytes it
    will hold per wrapper. The engine reserves the arena at the largest float figure of all builders.
``reserve_persistent_workspace(ctx) -> Lease``
    REQUIRED builders only: materialize every persistent resource (wrappers for every enabled route,
    their int workspaces, module-global buffers) inside the profiling window and hand back a lease.
``dummy_run(ctx)``
    What the builder's layers do in a dummy forward (profile run, graph profiling, capture).
``rebind(ctx)``
    Re-attach to the final arena after the KV cache is allocated.
``warmup(ctx)``
    Kernel warmup: runs once, idempotent, leaves nothing half-built when it raises.
``build(ctx, batch)``
    The runtime metadata build/plan: where lazy allocations happen.
``bound_workspaces() -> iterable of BoundWorkspace``
    One entry per wrapper: the float workspace range it points at and its int workspace, so aliasing and
    sharing can be checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from pytest_kvprofile.contract.lease import Lease
from pytest_kvprofile.contract.roles import Role

if TYPE_CHECKING:
    from pytest_kvprofile.contract.workspace import ArenaView, WorkspaceManager
    from pytest_kvprofile.matrix.cases import Case


ROUTES = ("prefill", "decode")  # what an arena view may name (ctx.get_workspace(route=)); MLA's decode is not sized


@dataclass(frozen=True)
class WorkspaceDeclaration:
    """What a builder says it will reserve for a case."""

    float_bytes: int
    int_bytes: int = 0


@dataclass(frozen=True)
class BoundWorkspace:
    """One wrapper's workspaces: the float range it points at and, when it has one, its dedicated int workspace
    (``int_ptr``/``int_nbytes``, 0 when it has none), so the harness can tell which ledger entry each wrapper
    plans into and see two wrappers share one."""

    ubatch: int
    role: str
    ptr: int
    nbytes: int
    int_ptr: int = 0
    int_nbytes: int = 0


@dataclass(frozen=True)
class Batch:
    """The shape of one forward step, as far as attention planning cares."""

    kind: str  # "prefill", "decode" or "mixed"
    num_reqs: int
    num_tokens: int
    cuda_graph: bool = False
    ubatch: int = 0

    @property
    def label(self) -> str:
        graph = ", cuda graph" if self.cuda_graph else ""
        return f"{self.kind} {self.num_reqs} reqs / {self.num_tokens} tokens{graph}"


class EngineRun(Protocol):
    """What a :class:`BuilderContext` reads of the engine run driving the builder (``lifecycle/driver.py``'s
    ``LifecycleRun`` is one). Why a protocol: the contract names what it needs and imports no engine."""

    @property
    def case(self) -> "Case": ...

    @property
    def device(self) -> Any: ...  # a ``memory/device.py`` ``Device``

    @property
    def manager(self) -> "WorkspaceManager": ...  # the engine's own, which also takes a view's ``route``

    @property
    def in_window(self) -> bool: ...

    @property
    def in_dummy_forward(self) -> bool: ...

    def note_plan(self, owner: str, target: Any) -> None: ...


class BuilderContext:
    """What a builder may touch: allocations are attributed to it, arena requests name it."""

    def __init__(self, run: EngineRun, owner: str):
        self._run = run
        self.owner = owner

    @property
    def case(self) -> "Case":
        return self._run.case

    @property
    def device(self) -> Any:
        return self._run.device

    @property
    def workspace(self) -> "WorkspaceManager":
        return self._run.manager

    @property
    def phase(self) -> str:
        phase: str = self._run.device.phase
        return phase

    @property
    def profiling(self) -> bool:
        """Inside the memory-profiling window (between the baseline and the closing measurement)."""
        return self._run.in_window

    @property
    def capturing(self) -> bool:
        return bool(self._run.device.capturing)

    @property
    def dummy(self) -> bool:
        """A dummy forward (profile run, graph profiling or capture) rather than real traffic."""
        return self._run.in_dummy_forward

    @property
    def num_ubatches(self) -> int:
        return self._run.manager.num_ubatches

    def allocate(self, nbytes: int, tag: str, *, pinned_host: bool = False, role: Role | str = Role.OTHER) -> Any:
        """Device (or pinned host) memory in the ledger, attributed to this builder; ``role`` says what it is for."""
        return self._run.device.allocate(int(nbytes), owner=self.owner, tag=tag, pinned_host=pinned_host, role=role)

    def free(self, alloc: Any) -> None:
        self._run.device.free(alloc)

    def get_workspace(self, nbytes: int, ubatch: int = 0, *, route: str | None = None) -> "ArenaView":
        """A view of ``ubatch``'s float arena. ``route`` (``"prefill"``, ``"decode"``): the case route whose wrapper
        plans into it, so ``workspace_covers_planner`` sizes the view for that route alone; without one the view
        is sized for every route of the case. A route sent to trtllm-gen asks for no view."""
        if route is None:
            return self._run.manager.get_workspace(self.owner, int(nbytes), ubatch)
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, not {route!r}")
        engine_manager: Any = self._run.manager  # the engine's manager takes the route (WorkspaceManager does not)
        view: ArenaView = engine_manager.get_workspace(self.owner, int(nbytes), ubatch, route=route)
        return view

    def plan_into(self, target: Any) -> None:
        """Say that the current call plans into, writes or reads ``target`` (an :class:`ArenaView` or an allocation
        of the device's ledger).

        The harness judges the use from what it knows, not from the builder: a view whose arena grew or was
        released since it was handed out, or an allocation already freed, is a use after free
        (``no_use_after_free``); a view of another micro-batch's arena while building a batch is aliasing
        (``ubatch_arenas_disjoint``). Torch mode observes tensor reads and writes without this call.
        """
        self._run.note_plan(self.owner, target)

    def lease(self, resources: Iterable[Any] = (), on_release: Callable[[], None] | None = None) -> Lease:
        return Lease(self.owner, resources, on_release)


def call_optional(builder: Any, method: str, *args: Any) -> Any:
    """Call ``builder.method(*args)`` if the builder has it; absence means 'nothing to do'."""
    fn = getattr(builder, method, None)
    if fn is None:
        return None
    return fn(*args)
