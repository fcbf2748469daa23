"""The Device interface on real ``torch.cuda``, so ``run_lifecycle`` runs unchanged on a GPU.

Every allocation is a ``uint8`` CUDA tensor held by the ledger entry; freeing drops the reference
and PyTorch's caching allocator does the rest, so ``memory_reserved``/``mem_get_info`` are the real
allocator's figures, not a model. The block size the allocator rounded to is measured as the rise
of ``memory_allocated`` across the allocation. Graph captures are real ``torch.cuda.graph`` captures
into a private pool; a pool's reserved bytes are the rise of ``memory_reserved`` inside its
captures (``cudaFree`` cannot happen during capture), checked against ``memory_snapshot`` where
torch reports segment pools.

Non-torch memory (the CUDA context, cuBLAS/NCCL handles) is ``total - free - reserved`` measured
when the device is created, as vLLM measures it.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from pytest_kvprofile.contract.roles import Role, as_role
from pytest_kvprofile.memory.allocator import round_size, segment_size
from pytest_kvprofile.memory.device import (
    Allocation,
    DeviceOutOfMemory,
    EventSource,
    host_block_size,
)

if TYPE_CHECKING:
    from torch import Tensor
    from torch.cuda import CUDAGraph

    from pytest_kvprofile.lifecycle.record import LifecycleResult
    from pytest_kvprofile.matrix.cases import Case

# the torch module, or a test's stand-in for it (tests/gpu drive CudaDevice on a fake torch.cuda): read by attribute
TorchModule: TypeAlias = Any

__all__ = ["MEM_GET_INFO_TOLERANCE", "CudaDevice", "CudaDeviceFactory", "CudaGraphPool"]

# How far the driver's free-memory delta (``mem_get_info``) may differ from the caching allocator's
# reserved delta over the same steps. Not zero because the driver, not torch, owns ``free``: it maps
# device memory in 2 MiB pages and may grow the context's own allocations (the first kernel launch
# loads modules, cuBLAS/FlashInfer handles take memory) between two readings. Reserved and allocated
# figures are compared exactly; only the driver's view gets this allowance.
MEM_GET_INFO_TOLERANCE = 4 << 20


@dataclass(eq=False)
class CudaGraphPool:
    """A private graph pool: torch's handle, the graphs captured into it, and its reserved bytes.

    Attribute names follow the simulated GraphPool so the lifecycle and checks read either.
    """

    id: str
    handle: object  # torch's graph pool handle, handed back to torch as it came
    graphs: list[CUDAGraph] = field(default_factory=list)
    use_count: int = 0
    released: bool = False
    reserved: int = 0
    high_water_reserved: int = 0
    allocated: int = 0
    high_water_allocated: int = 0
    measured_reserved: int | None = None  # from memory_snapshot at the end of the last capture


class CudaDevice(EventSource):
    """A real CUDA device behind the simulated device's interface (see ``pytest_kvprofile.memory.device``)."""

    def __init__(self, index: int = 0, *, torch_mod: TorchModule = None, record_stacks: bool = False) -> None:
        if torch_mod is None:
            import torch as torch_mod
        self._torch = torch_mod
        self._cuda = torch_mod.cuda
        self.index = index
        self._dev = torch_mod.device("cuda", index) if hasattr(torch_mod, "device") else f"cuda:{index}"
        props = self._cuda.get_device_properties(index)
        self.name: str = str(props.name)
        self.num_sm: int = int(props.multi_processor_count)
        self.compute_capability: tuple[int, int] = (int(props.major), int(props.minor))
        self.record_stacks = record_stacks
        free, total = self._cuda.mem_get_info(index)
        self.total_memory: int = int(total)
        self.start_reserved: int = int(self._cuda.memory_reserved(index))
        self.start_allocated: int = int(self._cuda.memory_allocated(index))
        self.nontorch_bytes: int = int(total) - int(free) - self.start_reserved
        self._init_events()
        self._tensors: dict[int, Tensor] = {}  # a live allocation's uint8 torch.Tensor, by allocation id
        self._pools: dict[str, CudaGraphPool] = {}
        self._pool_counter = 0
        self._capture: tuple[CudaGraphPool, int, int] | None = None  # (pool, reserved at start, pool bytes before)
        self.host_allocated = 0
        self.max_host_allocated = 0

    def __repr__(self) -> str:
        return (f"CudaDevice(cuda:{self.index} {self.name!r}, allocated={self.memory_allocated()}, "
                f"reserved={self.memory_reserved()}, phase={self._phase!r})")

    # -- phase and events ----------------------------------------------------------------------
    @property
    def capturing(self) -> bool:
        return self._capture is not None

    def _figures(self) -> tuple[int, int]:
        return self.memory_allocated(), self.memory_reserved()

    def _pool_id(self) -> str:
        return self._capture[0].id if self._capture is not None else "default"

    def allocate(self, nbytes: int, *, owner: str, tag: str = "", pinned_host: bool = False,
                 stack: str | None = None, role: Role | str = Role.OTHER) -> Allocation:
        """A ``uint8`` tensor of ``nbytes`` (pinned host memory with ``pinned_host``), in the ledger."""
        stack = self._admit(nbytes, owner, tag, stack)
        torch = self._torch
        if pinned_host:
            tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            size = host_block_size(nbytes)
            kind, pool = "pinned_host", "default"
            self.host_allocated += size
            self.max_host_allocated = max(self.max_host_allocated, self.host_allocated)
        else:
            before = self.memory_allocated()
            try:
                tensor = torch.empty(nbytes, dtype=torch.uint8, device=self._dev)
            except self._cuda.OutOfMemoryError:
                self._raise_oom(nbytes, owner, tag)
            size = self.memory_allocated() - before
            kind, pool = "device", self._pool_id()
        self._next_id += 1
        ptr = int(tensor.data_ptr()) if nbytes else 0
        alloc = Allocation(self._next_id, ptr, nbytes, size, owner, tag, kind, pool, self._phase, stack,
                           role=as_role(role))
        self._tensors[alloc.id] = tensor  # a side table: asdict()/replace() must not copy device memory
        self._live[alloc.id] = alloc
        if self._capture is not None and kind == "device":
            self._update_capture()
        self._emit("alloc", alloc)
        return alloc

    def _raise_oom(self, nbytes: int, owner: str, tag: str, injected: bool = False) -> NoReturn:
        err = DeviceOutOfMemory(
            requested=nbytes, segment=segment_size(round_size(nbytes)) if nbytes else 0,
            free=self.mem_get_info()[0], capacity=self.total_memory, allocated=self.memory_allocated(),
            reserved=self.memory_reserved(), nontorch=self.nontorch_bytes, owner=owner, tag=tag,
            phase=self._phase, device_name=self.name, injected=injected,
        )
        self._emit("oom", None, nbytes)
        raise err

    def free(self, alloc: Allocation) -> None:
        """Drop the ledger's reference; the caching allocator keeps the block cached (reserved stays)."""
        self._forget(alloc)
        self._tensors.pop(alloc.id, None)
        if alloc.kind == "pinned_host":
            self.host_allocated -= alloc.size
        self._emit("free", alloc)

    def live_allocations(self) -> list[Allocation]:
        return list(self._live.values())

    def tensor(self, alloc: Allocation) -> Tensor:
        """The uint8 tensor behind a live allocation."""
        t = self._tensors.get(alloc.id) if self._live.get(alloc.id) is alloc else None
        if t is None:
            raise ValueError(f"allocation {alloc.id} ({alloc.owner!r}, {alloc.tag!r}) is not alive on this device")
        return t

    def view(self, ptr: int, nbytes: int) -> Tensor:
        """A uint8 view of ``[ptr, ptr + nbytes)`` inside one live device allocation (an arena view)."""
        for a in self._live.values():
            if a.kind == "device" and a.ptr <= ptr and ptr + nbytes <= a.ptr + a.nbytes:
                off = ptr - a.ptr
                return self.tensor(a)[off:off + nbytes]
        raise ValueError(f"no live device allocation holds [{ptr:#x}, {ptr + nbytes:#x}) ({nbytes} bytes)")

    def close(self) -> None:
        """Let go of every tensor the ledger holds (the ledger's figures stay as they were), then
        return the cached memory, so the next case starts from an empty allocator."""
        self._tensors.clear()
        for pool in self._pools.values():
            for g in pool.graphs:
                g.reset()
            pool.graphs.clear()
        # a reference cycle (a run's builders and their contexts) may still hold tensors: the young generations
        # first, then, if memory is still held, a full collection (0.2 s with FlashInfer imported)
        for generation in (1, 2):
            if int(self._cuda.memory_allocated(self.index)) <= self.start_allocated:
                break
            gc.collect(generation)
        self._cuda.empty_cache()

    # -- torch.cuda-shaped queries -------------------------------------------------------------
    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._cuda.mem_get_info(self.index)
        return int(free), int(total)

    def memory_allocated(self) -> int:
        return int(self._cuda.memory_allocated(self.index))

    def memory_reserved(self) -> int:
        return int(self._cuda.memory_reserved(self.index))

    def max_memory_allocated(self) -> int:
        return int(self._cuda.max_memory_allocated(self.index))

    def max_memory_reserved(self) -> int:
        return int(self._cuda.max_memory_reserved(self.index))

    def reset_peak_memory_stats(self) -> None:
        self._cuda.reset_peak_memory_stats(self.index)
        self.max_host_allocated = self.host_allocated

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``; skipped while capturing, where cudaFree is illegal."""
        if self.capturing:
            return
        self._cuda.empty_cache()

    def memory_stats(self) -> dict[str, int]:
        return dict(self._cuda.memory_stats(self.index))

    def segments(self) -> list[dict[str, Any]]:  # Any: torch's memory_snapshot segments, JSON-like
        """Torch's segment snapshot for this device (address order)."""
        segs = [s for s in self._cuda.memory_snapshot() if s.get("device", self.index) == self.index]
        return sorted(segs, key=lambda s: s.get("address", 0))

    # -- CUDA graphs ---------------------------------------------------------------------------
    def new_graph_pool(self) -> CudaGraphPool:
        self._pool_counter += 1
        pool = CudaGraphPool(f"graph_pool_{self._pool_counter}", self._cuda.graph_pool_handle())
        self._pools[pool.id] = pool
        return pool

    def _pool_bytes(self, pool: CudaGraphPool) -> int | None:
        """Reserved bytes of ``pool``'s segments per memory_snapshot, or None if torch does not say."""
        try:
            segs = self.segments()
        except Exception:  # noqa: BLE001 - a snapshot is a cross-check, never required
            return None
        if not segs or "segment_pool_id" not in segs[0]:
            return None
        want = tuple(pool.handle) if isinstance(pool.handle, (tuple, list)) else pool.handle
        return sum(int(s["total_size"]) for s in segs if tuple(s["segment_pool_id"]) == want)

    def _update_capture(self) -> None:
        assert self._capture is not None
        pool, start, before = self._capture
        pool.reserved = before + max(0, self.memory_reserved() - start)
        pool.high_water_reserved = max(pool.high_water_reserved, pool.reserved)

    @contextmanager
    def graph_capture(self, pool: CudaGraphPool | None = None) -> Iterator[CudaGraphPool]:
        """Capture one real CUDA graph into ``pool`` (a new one by default); its memory stays
        reserved until ``release_graph_pool``. ``torch.cuda.graph`` empties the cache on entry, so
        the pool's growth is measured from inside the capture."""
        if self.capturing:
            raise RuntimeError("graph_capture() is already active on this device; captures do not nest")
        if pool is None:
            pool = self.new_graph_pool()
        elif pool.released or self._pools.get(pool.id) is not pool:
            raise ValueError(f"graph pool {pool.id!r} was released or belongs to another device")
        graph = self._cuda.CUDAGraph()
        pool.graphs.append(graph)  # before capturing: a failed capture's graph is still reset on release
        pool.use_count += 1
        with warnings.catch_warnings():
            # The lifecycle's captured steps allocate but may launch nothing; an empty graph is fine.
            warnings.filterwarnings("ignore", message=".*[Gg]raph.*empty.*")
            with self._cuda.graph(graph, pool=pool.handle):
                self._capture = (pool, self.memory_reserved(), pool.reserved)
                try:
                    yield pool
                finally:
                    self._update_capture()
                    self._capture = None
        measured = self._pool_bytes(pool)
        if measured is not None:
            pool.measured_reserved = measured

    def release_graph_pool(self, pool: CudaGraphPool, *, lazy: bool = False, graphs: int | None = None) -> None:
        """Reset ``graphs`` of the pool's graphs (all by default); at zero the pool's free segments
        go back to the device now (``empty_cache``) or, with ``lazy``, at the next ``empty_cache``."""
        if self._pools.get(pool.id) is not pool:
            if pool.released:
                return
            raise ValueError(f"graph pool {pool.id!r} belongs to another device")
        if self._capture is not None and self._capture[0] is pool:
            raise RuntimeError(f"cannot release graph pool {pool.id!r} while capturing into it")
        n = len(pool.graphs) if graphs is None else min(graphs, len(pool.graphs))
        for g in pool.graphs[:n]:
            g.reset()
        del pool.graphs[:n]
        pool.use_count = len(pool.graphs)
        if pool.use_count > 0 or lazy:
            return
        before = self.memory_reserved()
        self._cuda.empty_cache()
        measured = self._pool_bytes(pool)
        pool.reserved = measured if measured is not None else max(0, pool.reserved - (before - self.memory_reserved()))
        pool.released = True
        if pool.reserved == 0:
            self._pools.pop(pool.id, None)

    def graph_pools(self) -> list[CudaGraphPool]:
        return [p for p in self._pools.values() if p.reserved or p.use_count > 0]


class CudaDeviceFactory:
    """``device_factory`` for ``run_lifecycle`` on the GPU tier: one fresh CudaDevice per case.

    A real device cannot hold every case's weights and KV cache at once, so ``release(result)``
    drops what the run still references (builders' ``close()``, the ledger's tensors) as soon as
    the result is recorded; the figures stay in the result.
    """

    def __init__(self, index: int = 0, *, torch_mod: TorchModule = None, record_stacks: bool = False) -> None:
        self.index = index
        self._torch = torch_mod
        self.record_stacks = record_stacks
        self.last: CudaDevice | None = None
        self.cases = 0

    def __call__(self, case: Case) -> CudaDevice:
        if self.last is not None:
            self.last.close()
            self.last = None
        dev = CudaDevice(self.index, torch_mod=self._torch, record_stacks=self.record_stacks)
        self.last = dev
        self.cases += 1
        return dev

    def release(self, result: LifecycleResult) -> None:
        """Free the device memory a finished run still holds."""
        from pytest_kvprofile.lifecycle.driver import close_parts

        close_parts(result)
        if self.last is not None:
            self.last.close()
            self.last = None
