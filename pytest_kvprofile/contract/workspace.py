"""The reference shared workspace manager: one float arena per micro-batch, locked after warmup.

It allocates through a Device (simulated or CUDA) so that the same manager runs on both tiers.
Captured CUDA graphs hold raw pointers into the arena, so once locked the arena may neither grow nor
move; growth after lock is an error that says who asked, for how much, and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ContextManager, Protocol

from pytest_kvprofile.contract.device import Allocation, Device
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from torch import Tensor


class TorchSimulation(Protocol):
    """A torch-mode simulation as the contract uses it: ``memory/torch_mode.py``'s ``SimulatedCuda``, which the
    contract, below memory, cannot name."""

    @property
    def device(self) -> Device: ...
    def owner_scope(self, owner: str, tag: str | None = None) -> ContextManager[None]: ...
    def allocation_of(self, tensor: Tensor) -> Allocation | None: ...
    def __enter__(self) -> TorchSimulation: ...
    def __exit__(self, *exc: object) -> None: ...


OWNER = "workspace-manager"


class WorkspaceLockedError(RuntimeError):
    """A requester asked the locked arena to grow."""

    def __init__(self, requester: str, ubatch: int, requested: int, current: int):
        self.requester, self.ubatch, self.requested, self.current = requester, ubatch, requested, current
        super().__init__(
            f"Workspace is locked but {requester!r} requires {requested / MiB:.2f} MiB "
            f"({requested} bytes) in ubatch {ubatch}, current size is {current / MiB:.2f} MiB "
            f"({current} bytes). Growth after lock would move the arena under captured CUDA graphs; "
            "reserve the largest size the backend needs during memory profiling or warmup instead."
        )


@dataclass(frozen=True)
class ArenaView:
    """What a requester gets: a pointer into its micro-batch's arena and the bytes it may use.

    ``tensor``: a uint8 "cuda" tensor over exactly ``[ptr, ptr + nbytes)`` when the arena lives on a
    simulated device in torch mode (or the manager was asked for ``arena_tensors``), so a wrapper's
    float workspace can be the arena itself; views of one arena share its storage. ``None`` otherwise.
    It takes no part in equality, hashing or repr: phase records compare views by pointer and size.

    ``generation``: which allocation of the micro-batch's arena the view points into (1 for the first, one more
    for each growth). A growth or ``close()`` gives the arena back, so every view of an older generation is
    stale: planning into it is a use after free (``WorkspaceManager.is_current``). It takes no part in equality
    either.
    """

    ubatch: int
    ptr: int
    nbytes: int
    arena_size: int
    tensor: Tensor | None = field(default=None, compare=False, hash=False, repr=False)
    generation: int = field(default=0, compare=False)

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes


def check_ubatch(ubatch: int, num_ubatches: int) -> None:
    """A micro-batch index the manager has an arena for, or an IndexError saying how many it has."""
    if not 0 <= ubatch < num_ubatches:
        raise IndexError(f"ubatch {ubatch} out of range: the manager has {num_ubatches} micro-batch arenas")


def checked_request(requester: str, nbytes: int, ubatch: int, num_ubatches: int, alignment: int,
                    requesters: dict[str, int]) -> int:
    """An arena request as any manager takes it: who asks first (the ctx way round is a clear TypeError), a micro-batch
    it has, no negative size; the size rounded up to ``alignment`` and kept as the requester's largest."""
    if not isinstance(requester, str) or isinstance(nbytes, str):
        raise TypeError(
            f"WorkspaceManager.get_workspace(requester, nbytes, ubatch) takes the requester's name first, got "
            f"({requester!r}, {nbytes!r}, {ubatch!r}); a builder asks through its context: "
            "ctx.get_workspace(nbytes, ubatch), which names the builder for it")
    check_ubatch(ubatch, num_ubatches)
    if nbytes < 0:
        raise ValueError(f"{requester!r} asked for a negative workspace ({nbytes} bytes)")
    nbytes = -(-nbytes // alignment) * alignment
    requesters[requester] = max(requesters.get(requester, 0), nbytes)
    return nbytes


class WorkspaceManager:
    """Owns one float arena per micro-batch; grows on demand until ``lock()``."""

    def __init__(self, device: Device, num_ubatches: int = 1, alignment: int = 256,
                 arena_tensors: Callable[[], TorchSimulation] | None = None):
        """``arena_tensors``: a factory of a torch-mode simulation of ``device`` (``lambda: SimulatedCuda(dev)``), so
        views carry tensors outside torch mode too; inside torch mode they always do."""
        if num_ubatches < 1:
            raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
        if isinstance(arena_tensors, bool):  # the form before issue 53: say the new one rather than fail on a call
            raise TypeError("WorkspaceManager(arena_tensors=...) takes a factory of the device's torch-mode "
                            "simulation now, not a bool: arena_tensors=lambda: SimulatedCuda(device) "
                            "(pytest_kvprofile.memory.torch_mode.SimulatedCuda)")
        self.device = device
        self.num_ubatches = num_ubatches
        self.alignment = alignment
        self.arena_tensors = arena_tensors
        self._arenas: list[Allocation | None] = [None] * num_ubatches
        self._tensors: list[Tensor | None] = [None] * num_ubatches
        self.locked = False
        self.grow_count = 0
        self.requesters: dict[str, int] = {}
        self._generations: list[int] = [0] * num_ubatches  # 0: never allocated
        self.retired: dict[tuple[int, int], str] = {}  # (ubatch, generation) -> the phase it was given back in
        self._allocation_generation: dict[int, tuple[int, int]] = {}  # arena allocation id -> (ubatch, generation)

    def _check_ubatch(self, ubatch: int) -> None:
        check_ubatch(ubatch, self.num_ubatches)

    def size(self, ubatch: int = 0) -> int:
        self._check_ubatch(ubatch)
        arena = self._arenas[ubatch]
        return arena.nbytes if arena is not None else 0

    def get_workspace(self, requester: str, nbytes: int, ubatch: int = 0) -> ArenaView:
        """Return a view of at least ``nbytes`` in ``ubatch``'s arena, growing it if unlocked."""
        nbytes = checked_request(requester, nbytes, ubatch, self.num_ubatches, self.alignment, self.requesters)
        arena = self._arenas[ubatch]
        current = arena.nbytes if arena is not None else 0
        if nbytes > current:
            if self.locked:
                raise WorkspaceLockedError(requester, ubatch, nbytes, current)
            if arena is not None:
                self._retire(ubatch, arena)
            arena, self._tensors[ubatch] = self._allocate(nbytes, f"float-arena[ubatch {ubatch}] for {requester}")
            self._arenas[ubatch] = arena
            self._generations[ubatch] += 1
            if arena is not None:
                self._allocation_generation[arena.id] = (ubatch, self._generations[ubatch])
            self.grow_count += 1
        if arena is None:  # a zero-byte request before any arena exists: an empty view, nothing reserved
            return ArenaView(ubatch=ubatch, ptr=0, nbytes=0, arena_size=0, tensor=None,
                             generation=self._generations[ubatch])
        return ArenaView(ubatch=ubatch, ptr=arena.ptr, nbytes=nbytes, arena_size=arena.nbytes,
                         tensor=self._view(ubatch, nbytes), generation=self._generations[ubatch])

    def _retire(self, ubatch: int, arena: Allocation) -> None:
        """Give an arena back (growth or close): views of its generation are stale from now on."""
        self.retired[(ubatch, self._generations[ubatch])] = str(getattr(self.device, "phase", ""))
        self.device.free(arena)
        self._arenas[ubatch] = None
        self._tensors[ubatch] = None

    def is_current(self, view: ArenaView) -> bool:
        """Whether ``view`` still points into its micro-batch's live arena (not one a growth or close gave back)."""
        return (0 <= view.ubatch < self.num_ubatches and self._arenas[view.ubatch] is not None
                and view.generation == self._generations[view.ubatch])

    def generation_of(self, alloc: Allocation) -> tuple[int, int] | None:
        """``(ubatch, generation)`` of an arena allocation this manager made, live or given back; None otherwise."""
        return self._allocation_generation.get(alloc.id)

    def ubatch_of(self, alloc: Allocation) -> int | None:
        """The micro-batch whose arena ``alloc`` is (live now), or None."""
        for u, arena in enumerate(self._arenas):
            if arena is alloc:
                return u
        return None

    def _allocate(self, nbytes: int, tag: str) -> tuple[Allocation | None, Tensor | None]:
        """The arena's ledger entry and, on a simulated device in torch mode or on request, its tensor."""
        # A simulated device answers (``SimDevice.active_simulation``); a CUDA device does not.
        active = getattr(self.device, "active_simulation", None)
        sim = active() if active is not None else None
        if sim is not None:
            return _arena_tensor(sim, nbytes, tag)
        if self.arena_tensors is not None:
            with self.arena_tensors() as sim:
                return _arena_tensor(sim, nbytes, tag)
        return self.device.allocate(nbytes, owner=OWNER, tag=tag, role=Role.FLOAT_ARENA), None

    def _view(self, ubatch: int, nbytes: int) -> Tensor | None:
        backing = self._tensors[ubatch]
        return backing[:nbytes] if backing is not None else None

    def reserve(self, requester: str, nbytes: int) -> list[ArenaView]:
        """Grow every micro-batch arena to ``nbytes`` (what a backend does inside the profiling window)."""
        return [self.get_workspace(requester, nbytes, u) for u in range(self.num_ubatches)]

    def snapshot(self) -> tuple[ArenaView, ...]:
        """Every micro-batch's whole arena (pointer and size): what captured graphs depend on."""
        out = []
        for u, arena in enumerate(self._arenas):
            ptr, size = (arena.ptr, arena.nbytes) if arena is not None else (0, 0)
            out.append(ArenaView(ubatch=u, ptr=ptr, nbytes=size, arena_size=size, tensor=self._view(u, size),
                                 generation=self._generations[u]))
        return tuple(out)

    def stale_since(self, alloc: Allocation) -> str | None:
        """None: this manager frees an arena it gives back, so no kept view keeps one allocated (a view of a given-back
        arena is told by its generation instead). vLLM's manager answers otherwise (``engines/vllm/workspace.py``)."""
        return None

    def lock(self) -> None:
        self.locked = True

    def release(self) -> None:
        """Nothing to put back at the end of a run: this manager is no engine's process-wide global."""

    def close(self) -> None:
        """Free every arena (end of a case); the manager is unusable afterwards."""
        for u, arena in enumerate(self._arenas):
            if arena is not None:
                self._retire(u, arena)
        self.locked = True


def _arena_tensor(sim: TorchSimulation, nbytes: int, tag: str) -> tuple[Allocation | None, Tensor]:
    import torch

    with sim.owner_scope(OWNER, tag):
        tensor = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    alloc = sim.allocation_of(tensor)
    if alloc is not None:
        alloc.role = Role.FLOAT_ARENA
    return alloc, tensor


class ArenaManager(Protocol):
    """The shared arena's manager as a run drives it: the harness's :class:`WorkspaceManager` or an engine's own
    (vLLM's, ``engines/vllm/workspace.py``), each recording what it hands out for the run that made it
    (``EnginePolicy.manager_factory``). The seam the lifecycle driver and ``BuilderContext`` read, so a second
    engine's manager plugs in without sharing a class.
    """

    num_ubatches: int
    alignment: int
    retired: dict[tuple[int, int], str]  # (ubatch, generation) -> the phase that arena was given back in

    @property
    def locked(self) -> bool: ...
    def size(self, ubatch: int = 0) -> int: ...
    def get_workspace(self, requester: str, nbytes: int, ubatch: int = 0, route: str | None = None) -> ArenaView:
        """A view of at least ``nbytes`` of ``ubatch``'s arena, growing it unless locked; ``route``: what plans
        into it, for the record."""
    def reserve(self, requester: str, nbytes: int) -> list[ArenaView]: ...
    def is_current(self, view: ArenaView) -> bool: ...
    def generation_of(self, alloc: Allocation) -> tuple[int, int] | None: ...
    def ubatch_of(self, alloc: Allocation) -> int | None: ...
    def stale_since(self, alloc: Allocation) -> str | None:
        """The phase an arena this manager gave back was replaced in, while a kept view keeps it allocated."""
    def snapshot(self) -> tuple[ArenaView, ...]: ...
    def lock(self) -> None: ...
    def release(self) -> None:
        """The end of the run: put back what the manager changed outside itself (an engine's global)."""
    def close(self) -> None: ...


def _available() -> str | None:
    return None


@dataclass(frozen=True)
class ManagerKind:
    """A shared arena manager a run may name (``--kvprofile-workspace-manager``, the ``kvprofile_workspace_manager``
    fixture's parameter).

    ``for_run``: how a lifecycle run makes it, ``(run, device, num_ubatches) -> ArenaManager`` recording into the run
    (None: the engine's own, the harness's); ``plain``: ``(device, num_ubatches) -> manager`` for a test's fixture;
    ``unavailable()``: why it cannot be used in this process (its engine not installed, said with the install), or
    None; ``gpu_refusal``: why the GPU tier cannot use it, or None when it can.
    """

    name: str
    for_run: Callable[..., ArenaManager] | None
    plain: Callable[[Device, int], WorkspaceManager | ArenaManager]
    unavailable: Callable[[], str | None] = _available
    gpu_refusal: str | None = None
