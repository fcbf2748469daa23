"""The builder protocol the harness drives, and the context it hands to builders.

A third-party attention backend implements a small, duck-typed surface (named as vLLM's open pull request names
it); it inherits nothing. Only ``name`` is mandatory (:class:`Builder`); every other method is optional and its
absence has a defined, conservative meaning (:class:`ProfilingBuilder` spells out every hook's signature):

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
``close()``
    After the run: drop the builder's device memory.
``warmup_materializes_persistent`` (class attribute)
    True: the engine warms the builder up inside the window and replays the profile.

The context (:class:`BuilderContext`) reaches the engine only through :class:`BuilderHost`, which the
lifecycle driver implements.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable, Literal, Protocol

from pytest_kvprofile.contract.lease import Lease
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import ProfilingSupport

if TYPE_CHECKING:
    from types import FrameType

    from pytest_kvprofile.contract.device import Allocation, Device
    from pytest_kvprofile.contract.workspace import ArenaManager, ArenaView
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


BatchKind = Literal["prefill", "decode", "mixed"]  # what a forward step carries


@dataclass(frozen=True)
class Batch:
    """The shape of one forward step, as far as attention planning cares."""

    kind: BatchKind
    num_reqs: int
    num_tokens: int
    cuda_graph: bool = False
    ubatch: int = 0

    @property
    def label(self) -> str:
        graph = ", cuda graph" if self.cuda_graph else ""
        return f"{self.kind} {self.num_reqs} reqs / {self.num_tokens} tokens{graph}"


class Builder(Protocol):
    """The required part of the builder protocol: a name (an attribute or a property), unique within the backend;
    allocations and messages are attributed to it. Every other hook is optional (:class:`ProfilingBuilder`);
    the harness looks each one up on the builder and treats a missing one as "nothing to do"."""

    @property
    def name(self) -> str: ...


class ProfilingBuilder(Builder, Protocol):
    """A builder with every optional hook, for annotating a complete builder (``builder: ProfilingBuilder``).

    Not a base class: a builder inherits nothing, and one that leaves a hook out (no
    ``get_persistent_workspace_memory_profiling_support``: UNSUPPORTED; no ``bound_workspaces``: nothing to
    compare) is driven the same way, each absent hook keeping the meaning the module docstring gives it.
    """

    warmup_materializes_persistent: ClassVar[bool]

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport: ...
    def declared_workspace(self, case: Case) -> WorkspaceDeclaration: ...
    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease: ...
    def dummy_run(self, ctx: BuilderContext) -> None: ...
    def rebind(self, ctx: BuilderContext) -> None: ...
    def warmup(self, ctx: BuilderContext) -> None: ...
    def build(self, ctx: BuilderContext, batch: Batch) -> None: ...
    def bound_workspaces(self) -> Iterable[BoundWorkspace]: ...
    def close(self) -> None: ...


Hook = Literal["reserve_persistent_workspace", "dummy_run", "rebind", "warmup", "build"]
"""The optional hooks the engine calls with a context (``call_optional``)."""


class BuilderHost(Protocol):
    """What a :class:`BuilderContext` needs from the engine running its builder (the lifecycle driver's run):
    the case, the device it allocates on, the shared arena manager and its views, where the run is, and a place
    to note uses."""

    @property
    def case(self) -> Case: ...
    @property
    def device(self) -> Device: ...
    @property
    def manager(self) -> ArenaManager: ...
    def arena_view(self, owner: str, nbytes: int, ubatch: int, route: str | None,
                   cuda_graph: bool | None = None) -> ArenaView:
        """A view of ``ubatch``'s float arena for ``owner``, recorded with the route that plans into it and the
        CUDA-graph mode of its plans (None: both)."""
    @property
    def in_window(self) -> bool:
        """Inside the memory-profiling window (between the baseline and the closing measurement)."""
    @property
    def in_dummy_forward(self) -> bool:
        """A dummy forward (profile run, graph profiling or capture) rather than real traffic."""
    def note_plan(self, owner: str, target: ArenaView | Allocation, part: Batch | None = None) -> None:
        """The builder ``owner`` plans into, writes or reads ``target`` now (``ctx.plan_into``)."""


class BuilderContext:
    """What a builder may touch: allocations are attributed to it, arena requests name it."""

    def __init__(self, run: BuilderHost, owner: str):
        self._run = run
        self.owner = owner

    @property
    def case(self) -> Case:
        return self._run.case

    @property
    def device(self) -> Device:
        return self._run.device

    @property
    def workspace(self) -> ArenaManager:
        return self._run.manager

    @property
    def phase(self) -> str:
        return self._run.device.phase

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

    def allocate(self, nbytes: int, tag: str, *, pinned_host: bool = False,
                 role: Role | str = Role.OTHER) -> Allocation:
        """Device (or pinned host) memory in the ledger, attributed to this builder; ``role`` says what it is for.
        The builder's line that called it is kept as the allocation's ``site``, which messages name."""
        alloc = self._run.device.allocate(int(nbytes), owner=self.owner, tag=tag, pinned_host=pinned_host, role=role)
        if alloc.stack is None:
            alloc.site = caller_site()
        return alloc

    def free(self, alloc: Allocation) -> None:
        self._run.device.free(alloc)

    def get_workspace(self, nbytes: int, ubatch: int = 0, *, route: str | None = None,
                      cuda_graph: bool | None = None) -> ArenaView:
        """A view of ``ubatch``'s float arena. ``route`` (``"prefill"``, ``"decode"``): the case route whose wrapper
        plans into it, so ``workspace_covers_planner`` sizes the view for that route alone; without one the view
        is sized for every route of the case. A route sent to trtllm-gen asks for no view. ``cuda_graph``: the
        route's plans into the view are made only with CUDA graphs (True) or only without (False: vLLM's prefill),
        so the view is sized for those sub-routes; None (the default) sizes it for both."""
        if route is not None and route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, not {route!r}")
        if cuda_graph is not None and route is None:
            raise ValueError("cuda_graph= names the CUDA-graph mode of one route's plans: give route= too")
        if cuda_graph is None:  # a host written before ``cuda_graph`` takes four arguments
            return self._run.arena_view(self.owner, int(nbytes), ubatch, route)
        return self._run.arena_view(self.owner, int(nbytes), ubatch, route, bool(cuda_graph))

    def plan_into(self, target: ArenaView | Allocation, part: Batch | None = None) -> None:
        """Say that the current call plans into, writes or reads ``target`` (an arena view or an allocation).

        ``part``: the part of the batch being built that is planned into ``target``, when a build splits a batch
        (the decode requests of a mixed batch into a decode view, say): ``workspace_covers_planner`` sizes the view
        for that part's route. Without it a view is sized for the whole batch, unless the build plans into views of
        both routes (or into its trtllm-gen workspace) too: then a view named ``route="decode"`` holds the decode part.

        The harness judges the use from what it knows, not from the builder: a view whose arena grew or was
        released since it was handed out, or an allocation already freed, is a use after free
        (``no_use_after_free``); a view of another micro-batch's arena while building a batch is aliasing
        (``ubatch_arenas_disjoint``). Torch mode observes tensor reads and writes without this call.
        """
        if part is None:  # a host written before ``part`` takes two arguments
            self._run.note_plan(self.owner, target)
        else:
            self._run.note_plan(self.owner, target, part)

    def lease(self, resources: Iterable[object] = (), on_release: Callable[[], None] | None = None) -> Lease:
        return Lease(self.owner, resources, on_release)


def caller_site() -> str:
    """``path:line in func`` of the builder code that called into the context (the first frame outside this file),
    followed by ``(builder call site ...)`` where it differs from the innermost frame of the file of the builder
    method the harness called (as ``memory.device.builder_call_site`` says it for torch mode)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    here = _frame_site(frame)
    frames: list[FrameType] = []
    entry: FrameType | None = frame
    while entry is not None and not (entry.f_back is not None and entry.f_back.f_code.co_name == "call_optional"
                                     and entry.f_back.f_code.co_filename == __file__):
        frames.append(entry)
        entry = entry.f_back
    if entry is None:
        return here
    while frames and entry.f_code.co_filename.startswith(_CONTRACT_DIR):  # an adapter (a resource's): its callee
        entry = frames.pop()
    site = _frame_site(next(f for f in [*frames, entry] if f.f_code.co_filename == entry.f_code.co_filename))
    return here if site == here else f"{here} (builder call site {site})"


_CONTRACT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _frame_site(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def call_optional(builder: Builder, method: Hook, *args: BuilderContext | Batch) -> object:
    """Call ``builder.method(*args)`` if the builder has it; absence means 'nothing to do'."""
    fn = getattr(builder, method, None)
    if fn is None:
        return None
    return fn(*args)
