"""The device a builder allocates on, as the contract sees it: the ``Device`` protocol and its ledger records.

The engine's devices implement it (``memory/device.py``'s simulated ``SimDevice``, the GPU tier's ``CudaDevice``);
a builder meets it as ``ctx.device`` and gets an :class:`Allocation` back from ``ctx.allocate``. Defined here, below
every device, so that the contract can name them without importing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, ContextManager, Protocol, TypeAlias, runtime_checkable

from pytest_kvprofile.contract.roles import Role

if TYPE_CHECKING:
    from torch import Tensor

# a device's own CUDA-graph pool (SimDevice's GraphPool, CudaDevice's CudaGraphPool): each device takes back only
# the pools its own captures gave, so the protocol cannot name one type for both
GraphPoolHandle: TypeAlias = Any

__all__ = ["Allocation", "Device", "DeviceEvent", "TensorDevice"]


@dataclass(eq=False)
class Allocation:
    """One ledger entry: who asked for how much, when, and what the allocator gave."""

    id: int
    ptr: int
    nbytes: int
    size: int
    owner: str
    tag: str
    kind: str
    pool: str
    phase: str
    stack: str | None = None
    alive: bool = True
    freed_phase: str | None = None
    role: Role = Role.OTHER  # what it is for (contract/roles.py); torch mode may set it when a wrapper takes it
    site: str | None = None  # ctx mode: the builder's line that called ``ctx.allocate`` (messages only; see ``where``)

    @property
    def where(self) -> str | None:
        """The source line a message names: the allocating frame (``stack``, torch mode), else the builder's line
        that called ``ctx.allocate`` (``site``)."""
        return self.stack or self.site

    @property
    def end(self) -> int:
        """One past the last byte of the block: live allocations occupy ``[ptr, end)``."""
        return self.ptr + self.size


@dataclass(frozen=True)
class DeviceEvent:
    """A change to the device. ``allocated``/``reserved`` are device bytes after the event;
    segment events carry the segment's bytes, pool and address in ``nbytes``/``pool``/``ptr``."""

    seq: int
    kind: str
    phase: str
    alloc: Allocation | None
    allocated: int
    reserved: int
    nbytes: int = 0
    pool: str = ""
    ptr: int = 0


@runtime_checkable
class Device(Protocol):
    """What the lifecycle needs of a device: the simulated one (:class:`SimDevice`) or the GPU tier's
    wrapper over ``torch.cuda`` (``pytest_kvprofile.gpu.cuda_device.CudaDevice``).

    Allocation with attribution (owner, tag, phase), a ledger of live allocations, torch's memory
    figures, events for recording, CUDA-graph capture into a private pool, and fault injection.
    """

    name: str
    total_memory: int
    num_sm: int
    nontorch_bytes: int
    phase: str

    @property
    def capturing(self) -> bool: ...
    def allocate(self, nbytes: int, *, owner: str, tag: str = "", pinned_host: bool = False,
                 role: Role | str = Role.OTHER) -> Allocation: ...
    def free(self, alloc: Allocation) -> None: ...
    def live_allocations(self) -> list[Allocation]: ...
    def subscribe(self, callback: Callable[[DeviceEvent], None],
                  kinds: Collection[str] | None = None) -> Callable[[], None]: ...
    def fail_after(self, n: int | None) -> None: ...  # None: disarm
    def graph_capture(self, pool: GraphPoolHandle = None) -> ContextManager[GraphPoolHandle]: ...
    def mem_get_info(self) -> tuple[int, int]: ...
    def memory_allocated(self) -> int: ...
    def memory_reserved(self) -> int: ...
    def max_memory_allocated(self) -> int: ...
    def max_memory_reserved(self) -> int: ...
    def reset_peak_memory_stats(self) -> None: ...
    def empty_cache(self) -> None: ...
    def memory_stats(self) -> dict[str, int]: ...


@runtime_checkable
class TensorDevice(Device, Protocol):
    """A device whose allocations are real tensors (the GPU tier's ``CudaDevice``): what a builder that runs real
    kernels on ``ctx.allocate``'d bytes needs beyond :class:`Device`. The simulated device is not one: in torch mode a
    builder makes its tensors with plain ``torch`` calls instead."""

    def tensor(self, alloc: Allocation) -> Tensor: ...  # the contract imports torch for type checking only
    def view(self, ptr: int, nbytes: int) -> Tensor: ...
