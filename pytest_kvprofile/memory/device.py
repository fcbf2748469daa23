"""A simulated GPU whose memory figures follow PyTorch's caching allocator.

The harness drives thousands of engine lifecycles (profile, lease, KV sizing, capture) on CPU, so
the device must be pure Python and cheap, yet report ``mem_get_info``/``memory_reserved`` the way a
real GPU under PyTorch would: KV sizing reads reserved bytes, not tensor bytes. Every allocation is
a ledger entry with an owner, a tag and the phase it was made in, so a violation can be reported
in bytes and traced to the allocation that caused it.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import (
    TYPE_CHECKING,
    Callable,
    Collection,
    Iterator,
    NoReturn,
)

from pytest_kvprofile.contract.device import Allocation, DeviceEvent
from pytest_kvprofile.contract.roles import Role, as_role
from pytest_kvprofile.contract.workspace import TorchSimulation
from pytest_kvprofile.memory.allocator import (
    DEVICE_ADDRESS_BASE,
    Block,
    CachingAllocator,
    GraphPool,
    MemPool,
    Segment,
    round_size,
    segment_size,
)

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.gpus import GpuSpec

__all__ = [
    "own_frame",
    "Allocation",
    "DeviceEvent",
    "DeviceOutOfMemory",
    "EventSource",
    "GraphPool",
    "MemPool",
    "SimDevice",
    "format_size",
]

HOST_ADDRESS_BASE = DEVICE_ADDRESS_BASE + (1 << 44)  # pinned host: its own range, 16 TiB above the device's
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package root
_PROTOCOL_FILE = os.path.join(_PACKAGE_DIR, "contract", "protocol.py")  # where the harness calls builder methods


def format_size(nbytes: int) -> str:
    """Human size the way PyTorch's OOM message prints it (``format_size`` in the allocator)."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1048576:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1073741824:
        return f"{nbytes / 1048576:.2f} MiB"
    return f"{nbytes / 1073741824:.2f} GiB"


class DeviceOutOfMemory(RuntimeError):
    """Raised like ``torch.cuda.OutOfMemoryError``, but naming the owner, tag and phase."""

    def __init__(
        self,
        *,
        requested: int,
        segment: int,
        free: int,
        capacity: int,
        allocated: int,
        reserved: int,
        nontorch: int,
        owner: str,
        tag: str,
        phase: str,
        device_name: str = "",
        injected: bool = False,
    ) -> None:
        self.requested = requested
        self.segment = segment
        self.free = free
        self.capacity = capacity
        self.allocated = allocated
        self.reserved = reserved
        self.nontorch = nontorch
        self.owner = owner
        self.tag = tag
        self.phase = phase
        self.injected = injected
        self.device_name = device_name
        cause = " (injected by fail_after)" if injected else ""
        super().__init__(
            f"CUDA out of memory{cause}. Tried to allocate {format_size(segment)} "
            f"(owner {owner!r}, tag {tag!r}, phase {phase!r}; {requested} bytes requested). "
            f"GPU {device_name or 0} has a total capacity of {format_size(capacity)} of which "
            f"{format_size(free)} is free. Non-PyTorch memory: {format_size(nontorch)}. "
            f"Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and "
            f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_oom, (self.__dict__.copy(), self.args))


def _rebuild_oom(state: dict[str, object], args: tuple[object, ...]) -> DeviceOutOfMemory:
    err = DeviceOutOfMemory.__new__(DeviceOutOfMemory)
    RuntimeError.__init__(err, *args)
    err.__dict__.update(state)
    return err


@dataclass(frozen=True)
class ForeignUse:
    """Memory of an earlier device (an earlier case) used on this one: who used it, where, and its ledger entry."""

    owner: str
    tag: str
    stack: str
    alloc: Allocation


def _site(frame: FrameType) -> str:
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


def _caller_stack() -> str:
    """``path:line in func`` of the first frame outside this package (the code that allocated), followed by
    the builder's own call site when they differ (:func:`builder_call_site`)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:
        return with_builder_call_site("<unknown>")
    return with_builder_call_site(_site(frame))


def builder_call_site() -> str | None:
    """``path:line in func`` of the innermost frame, on the current stack, of the builder method the harness
    is calling (the frame ``contract.protocol.call_optional`` called, and frames of the same file).

    Why: a library (FlashInfer) allocates on the builder's behalf; its frame says *what* allocated, this
    one says *which line of the builder* made it do so, which is what the backend author has to change.
    None outside a harness call.
    """
    frames: list[FrameType] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        back = frame.f_back
        if back is not None and back.f_code.co_name == "call_optional" and back.f_code.co_filename == _PROTOCOL_FILE:
            entry_file = frame.f_code.co_filename
            return next(_site(f) for f in frames + [frame] if f.f_code.co_filename == entry_file)
        frames.append(frame)
        frame = back
    return None


def with_builder_call_site(stack: str) -> str:
    """``stack`` followed by ``(builder call site ...)`` when a builder method is on the stack and its call site
    is not already ``stack`` (a builder that allocated directly)."""
    site = builder_call_site()
    if site is None or site == stack or stack.startswith(site + " "):
        return stack
    return f"{stack} (builder call site {site})"


def own_frame(stack: str) -> str:
    """The allocating line of a stack ``with_builder_call_site`` wrote, without the builder call site."""
    return stack.split(" (builder call site", 1)[0]


def host_block_size(nbytes: int) -> int:
    """Pinned host blocks are rounded up to a power of two (CachingHostAllocator)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


class EventSource:
    """Phase, event subscription and fault injection, shared by the simulated and the CUDA device.

    Subclasses call ``_init_events()`` in ``__init__`` and say what the event figures are through
    ``_figures()`` (allocated, reserved).
    """

    name: str
    _phase: str
    _seq: int
    _subscribers: list[tuple[Callable[[DeviceEvent], None], frozenset[str] | None]]
    _wanted: frozenset[str] | None
    _fail_countdown: int | None
    _live: dict[int, Allocation]
    _next_id: int

    def _init_events(self) -> None:
        """The ledger and event state both devices start from."""
        self._phase = "init"
        self._seq = 0
        self._next_id = 0
        self._live = {}
        self._subscribers = []
        self._wanted = frozenset()
        self._fail_countdown = None

    def _figures(self) -> tuple[int, int]:
        raise NotImplementedError

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self._emit("phase", None)

    def subscribe(self, callback: Callable[[DeviceEvent], None],
                  kinds: Collection[str] | None = None) -> Callable[[], None]:
        """Call ``callback`` for every event from now on (only those of ``kinds`` when given: an event nobody
        asked for is never built); the returned function unsubscribes."""
        entry = (callback, None if kinds is None else frozenset(kinds))
        self._subscribers.append(entry)
        self._listen()

        def unsubscribe() -> None:
            if any(e is entry for e in self._subscribers):
                self._subscribers[:] = [e for e in self._subscribers if e is not entry]
                self._listen()

        return unsubscribe

    def _listen(self) -> None:
        """The event kinds some subscriber wants (None: every kind)."""
        wanted: set[str] = set()
        for _callback, kinds in self._subscribers:
            if kinds is None:
                self._wanted = None
                return
            wanted |= kinds
        self._wanted = frozenset(wanted)

    def _emit(self, kind: str, alloc: Allocation | None, nbytes: int = 0, pool: str = "", ptr: int = 0) -> None:
        self._seq += 1
        wanted = self._wanted
        if wanted is not None and kind not in wanted:
            return
        allocated, reserved = self._figures()
        event = DeviceEvent(self._seq, kind, self._phase, alloc, allocated, reserved, nbytes, pool, ptr)
        for callback, kinds in tuple(self._subscribers):
            if kinds is None or kind in kinds:
                callback(event)

    def fail_after(self, n: int | None) -> None:
        """Fault injection: the next ``n`` calls to ``allocate`` succeed, the one after raises
        ``DeviceOutOfMemory`` (once). Counts device and pinned-host allocations alike. None disarms it."""
        if n is None:
            self._fail_countdown = None
            return
        if n < 0:
            raise ValueError(f"fail_after needs n >= 0, got {n}")
        self._fail_countdown = n

    record_stacks: bool

    def _raise_oom(self, nbytes: int, owner: str, tag: str, injected: bool = False) -> NoReturn:
        raise NotImplementedError

    def _admit(self, nbytes: int, owner: str, tag: str, stack: str | None) -> str | None:
        """The checks every allocation passes first: size, an armed fault injection, the caller's frame."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes (owner {owner!r}, tag {tag!r})")
        if self._fail_countdown is not None:
            if self._fail_countdown == 0:
                self._fail_countdown = None
                self._raise_oom(nbytes, owner, tag, injected=True)
            self._fail_countdown -= 1
        if stack is None and self.record_stacks:
            stack = _caller_stack()
        elif stack is not None:
            stack = with_builder_call_site(stack)
        return stack

    def _forget(self, alloc: Allocation) -> None:
        """Take a live allocation out of the ledger, refusing double frees and foreign allocations."""
        if not alloc.alive:
            raise ValueError(
                f"double free of allocation {alloc.id} (owner {alloc.owner!r}, tag {alloc.tag!r}, "
                f"allocated in phase {alloc.phase!r}, freed in phase {alloc.freed_phase!r})"
            )
        if self._live.pop(alloc.id, None) is not alloc:
            raise ValueError(
                f"allocation {alloc.id} (owner {alloc.owner!r}, tag {alloc.tag!r}) does not belong to {self.name!r}"
            )
        alloc.alive = False
        alloc.freed_phase = self._phase


class SimDevice(EventSource):
    """A simulated GPU: PyTorch caching-allocator figures, an allocation ledger, and events.

    ``free = total - nontorch - reserved``, where ``nontorch_bytes`` stands for the CUDA context,
    NCCL buffers and other memory PyTorch does not see.
    """

    def __init__(
        self,
        *,
        name: str,
        total_memory: int,
        num_sm: int = 0,
        nontorch_bytes: int = 0,
        record_stacks: bool = False,
        compute_capability: tuple[int, int] = (0, 0),
    ) -> None:
        if total_memory <= 0:
            raise ValueError(f"total_memory must be positive, got {total_memory}")
        if not 0 <= nontorch_bytes <= total_memory:
            raise ValueError(f"nontorch_bytes {nontorch_bytes} outside [0, total_memory={total_memory}]")
        self.name = name
        self.total_memory = total_memory
        self.num_sm = num_sm
        self.nontorch_bytes = nontorch_bytes
        self.record_stacks = record_stacks
        self.compute_capability = compute_capability
        self.allocator = CachingAllocator(self._can_reserve, self._on_segment)
        self._blocks: dict[int, Block] = {}  # a live device allocation's allocator block, by allocation id
        self._init_events()
        self._graph_pool_counter = 0
        self._host_next_ptr = HOST_ADDRESS_BASE
        self.host_allocated = 0
        self.max_host_allocated = 0

    @classmethod
    def from_gpu(cls, gpu: "GpuSpec", *, nontorch_bytes: int = 0, record_stacks: bool = False) -> "SimDevice":
        """A device shaped like a catalog GPU (name, SM count, memory)."""
        return cls(
            name=gpu.name,
            total_memory=gpu.memory_bytes,
            num_sm=gpu.num_sm,
            nontorch_bytes=nontorch_bytes,
            record_stacks=record_stacks,
            compute_capability=gpu.compute_capability,
        )

    def __repr__(self) -> str:
        return (
            f"SimDevice(name={self.name!r}, total={format_size(self.total_memory)}, "
            f"allocated={self.memory_allocated()}, reserved={self.memory_reserved()}, phase={self._phase!r})"
        )

    # -- phase and events ----------------------------------------------------------------------------

    @property
    def capturing(self) -> bool:
        return self.allocator.capture_pool is not None

    def _figures(self) -> tuple[int, int]:
        a = self.allocator
        return a.allocated_bytes[0].current, a.reserved_bytes[0].current

    def _on_segment(self, kind: str, segment: Segment) -> None:
        self._emit(kind, None, segment.size, segment.pool.id, segment.ptr)

    def _can_reserve(self, nbytes: int) -> bool:
        return self.allocator.reserved_bytes[0].current + self.nontorch_bytes + nbytes <= self.total_memory

    # -- allocate / free -----------------------------------------------------------------------------

    def allocate(
        self,
        nbytes: int,
        *,
        owner: str,
        tag: str = "",
        pinned_host: bool = False,
        stack: str | None = None,
        role: Role | str = Role.OTHER,
    ) -> Allocation:
        """Allocate ``nbytes`` for ``owner``; raises ``DeviceOutOfMemory`` when the allocator cannot
        reserve a segment even after releasing its cache. ``stack`` overrides the recorded frame."""
        stack = self._admit(nbytes, owner, tag, stack)
        self._next_id += 1
        if pinned_host:
            size = host_block_size(nbytes)
            ptr = self._host_next_ptr
            self._host_next_ptr += max(size, 512)
            self.host_allocated += size
            if self.host_allocated > self.max_host_allocated:
                self.max_host_allocated = self.host_allocated
            alloc = Allocation(self._next_id, ptr, nbytes, size, owner, tag, "pinned_host", "default", self._phase,
                               stack)
        elif nbytes == 0:
            # torch hands out a null pointer for empty tensors and reserves nothing.
            alloc = Allocation(self._next_id, 0, 0, 0, owner, tag, "device", self._pool_id(), self._phase, stack)
        else:
            block = self.allocator.malloc(nbytes)
            if block is None:
                self._next_id -= 1
                self._raise_oom(nbytes, owner, tag)
            pool = block.segment.pool.id
            alloc = Allocation(self._next_id, block.ptr, nbytes, block.size, owner, tag, "device", pool, self._phase,
                               stack)
            self._blocks[alloc.id] = block  # a side table: asdict()/replace() must not walk the allocator's lists
        alloc.role = as_role(role)
        self._live[alloc.id] = alloc
        self._emit("alloc", alloc)
        return alloc

    def _pool_id(self) -> str:
        pool = self.allocator.capture_pool
        return "default" if pool is None else pool.id

    def _raise_oom(self, nbytes: int, owner: str, tag: str, injected: bool = False) -> NoReturn:
        a = self.allocator
        if injected:
            a.num_ooms += 1
        self._emit("oom", None, nbytes)
        raise DeviceOutOfMemory(  # raised, not bound: a local would tie this frame to its traceback in a cycle
            requested=nbytes,
            segment=segment_size(round_size(nbytes)),
            free=self.mem_get_info()[0],
            capacity=self.total_memory,
            allocated=a.allocated,
            reserved=a.reserved,
            nontorch=self.nontorch_bytes,
            owner=owner,
            tag=tag,
            phase=self._phase,
            device_name=self.name,
            injected=injected,
        )

    def free(self, alloc: Allocation) -> None:
        """Return an allocation to the allocator's cache (reserved bytes do not drop)."""
        self._forget(alloc)
        if alloc.kind == "device":
            block = self._blocks.pop(alloc.id, None)
            if block is not None:
                self.allocator.free(block)
        else:
            self.host_allocated -= alloc.size
        self._emit("free", alloc)

    def live_allocations(self) -> list[Allocation]:
        """Live allocations (device and pinned host) in allocation order."""
        return list(self._live.values())

    # -- torch.cuda-shaped queries -------------------------------------------------------------------

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` as ``cudaMemGetInfo`` reports it."""
        return (self.total_memory - self.nontorch_bytes - self.allocator.reserved_bytes[0].current, self.total_memory)

    def memory_allocated(self) -> int:
        return self.allocator.allocated_bytes[0].current

    def memory_reserved(self) -> int:
        return self.allocator.reserved_bytes[0].current

    def max_memory_allocated(self) -> int:
        return self.allocator.allocated_bytes[0].peak

    def max_memory_reserved(self) -> int:
        return self.allocator.reserved_bytes[0].peak

    def reset_peak_memory_stats(self) -> None:
        """Set every peak (device, graph pools, pinned host) to its current value."""
        self.allocator.reset_peak()
        self.max_host_allocated = self.host_allocated

    def empty_cache(self) -> None:
        """Release fully-free cached segments. Ignored during capture, where ``cudaFree`` is illegal
        and torch's graph capture would fail."""
        if self.capturing:
            return
        self.allocator.release_cached()

    def memory_stats(self) -> dict[str, int]:
        """Torch's flat statistics dict (``allocated_bytes.all.current`` etc.)."""
        return self.allocator.stats()

    def segments(self) -> list[Segment]:
        """Reserved segments in address order (for snapshots and fragmentation reports)."""
        return self.allocator.segments()

    # -- CUDA graphs ---------------------------------------------------------------------------------

    def new_graph_pool(self) -> GraphPool:
        """A fresh private pool (``torch.cuda.graph_pool_handle()``)."""
        self._graph_pool_counter += 1
        return self.allocator.new_graph_pool(f"graph_pool_{self._graph_pool_counter}")

    @contextmanager
    def graph_capture(self, pool: GraphPool | None = None) -> Iterator[GraphPool]:
        """Capture one graph: allocations inside come from ``pool`` (a new one by default) and its
        segments stay reserved after capture until ``release_graph_pool``. Each capture counts as
        one graph using the pool."""
        if self.capturing:
            raise RuntimeError("graph_capture() is already active on this device; captures do not nest")
        if pool is None:
            pool = self.new_graph_pool()
        elif pool.released or self.allocator.graph_pools.get(pool.id) is not pool:
            raise ValueError(f"graph pool {pool.id!r} was released or belongs to another device")
        pool.use_count += 1
        self.allocator.capture_pool = pool
        try:
            yield pool
        finally:
            self.allocator.capture_pool = None

    def release_graph_pool(self, pool: GraphPool, *, lazy: bool = False, graphs: int | None = None) -> None:
        """The graphs captured into ``pool`` were deleted (``graphs``: only that many of them), so
        its free segments return to the device and reserved drops; segments still holding live
        tensors return when those are freed. ``lazy=True`` defers the return to the next
        ``empty_cache``, as torch does. Releasing an already released pool is a no-op."""
        if self.allocator.graph_pools.get(pool.id) is not pool:
            if pool.released:
                return
            raise ValueError(f"graph pool {pool.id!r} belongs to another device")
        if self.allocator.capture_pool is pool:
            raise RuntimeError(f"cannot release graph pool {pool.id!r} while capturing into it")
        self.allocator.release_graph_pool(pool, lazy=lazy, graphs=graphs)

    def graph_pools(self) -> list[GraphPool]:
        """Graph pools that still hold segments or are used by a graph."""
        return [p for p in self.allocator.graph_pools.values() if p.segments or p.use_count > 0]

    # -- torch mode ------------------------------------------------------------------------------------

    def active_simulation(self) -> TorchSimulation | None:
        """The innermost active torch-mode simulation (``memory/torch_mode.py``) if it serves this device, else None.

        Why here: the contract's workspace manager asks its device instead of importing torch mode (the contract
        imports nothing above it). Torch mode imports this module and torch, so it is looked up, not imported: read
        only when something loaded it.
        """
        torch_mode = sys.modules.get("pytest_kvprofile.memory.torch_mode")
        sim = torch_mode.active_simulation() if torch_mode is not None else None
        return sim if sim is not None and sim.device is self else None
