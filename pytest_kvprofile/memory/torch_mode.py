"""Run unmodified ``torch.empty(..., device="cuda")`` code against a :class:`SimDevice` on CPU torch.

Backends are written against ``torch.cuda``; rewriting them for a test double would test the double.
While :class:`SimulatedCuda` is active, "cuda" tensors are real CPU tensors whose storage is recorded
in the device ledger (freed when the storage dies), and the ``torch.cuda`` memory and graph API
answers from that ledger. Limits are listed in ``docs/simulated-device.md``.
"""

from __future__ import annotations

import bisect
import os
import sys
import threading
import weakref
from contextlib import contextmanager
from types import FrameType
from typing import Callable, ContextManager, Iterator

import torch
import torch.cuda.graphs
import torch.cuda.memory
import torch.cuda.nvtx
import torch.cuda.streams

from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.matrix.gpus import smem_optin_for
from pytest_kvprofile.memory.allocator import GraphPool
from pytest_kvprofile.memory.cuda_standins import (
    DEFAULT_STREAM,
    DeviceProperties,
    SimDeviceGuard,
    SimEvent,
    SimGenerator,
    SimStream,
    no_op,
    sim_stream,
)
from pytest_kvprofile.memory.device import (
    Allocation,
    DeviceOutOfMemory,
    ForeignUse,
    SimDevice,
)
from pytest_kvprofile.memory.torch_dispatch import LIVE_STORAGES, MISSING, PlacementMode, storage_ptr

__all__ = ["active_simulation", "assign_role", "SimEvent", "SimStream", "SimulatedCuda", "SimulatedCudaOutOfMemory",
           "SimCUDAGraph", "active_device"]

OwnerResolver = Callable[[FrameType, str], "str | tuple[str, str] | None"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package root
_MEMORY_DIR = _PACKAGE_DIR + "memory" + os.sep  # the simulation itself
_BUILTIN_DIR = _PACKAGE_DIR + "builtin" + os.sep  # the built-in backends are backend code, not the harness
_CONTEXTLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep + "contextlib.py"

_active_lock = threading.Lock()
_active: list["SimulatedCuda"] = []


class SimulatedCudaOutOfMemory(DeviceOutOfMemory, torch.OutOfMemoryError):
    """Caught by ``except torch.cuda.OutOfMemoryError`` as well as ``except DeviceOutOfMemory``."""


def active_device() -> SimDevice | None:
    """The SimDevice of the innermost active :class:`SimulatedCuda`, if any."""
    return _active[-1].device if _active else None


def active_simulation() -> "SimulatedCuda | None":
    """The innermost active :class:`SimulatedCuda`, if any."""
    return _active[-1] if _active else None


def assign_role(tensor: object, role: Role, keep: tuple[Role, ...] = ()) -> Allocation | None:
    """Give the simulated allocation behind ``tensor`` the role it plays (``contract/roles.py``), so checks read
    roles in torch mode as they do in ctx mode; a role in ``keep`` stays (an arena view handed to a wrapper is
    still the arena). Returns the allocation, or None off the simulator or for a plain CPU tensor. Looked up
    without counting as a use of the tensor."""
    sim = active_simulation()
    if sim is None or not isinstance(tensor, torch.Tensor):
        return None
    with torch._C.DisableTorchFunction():
        alloc = sim._registry.get(storage_ptr(tensor))
    if alloc is not None and alloc.role not in keep:
        alloc.role = role
    return alloc


class SimCUDAGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: capture maps to ``SimDevice.graph_capture``; replay is
    a no-op; ``reset`` (and garbage collection) releases the pool the way torch does, lazily: its
    free segments are returned at the next ``empty_cache``."""

    def __init__(self, keep_graph: bool = False) -> None:
        sim = _active[-1] if _active else None
        if sim is None:
            raise RuntimeError("SimCUDAGraph needs an active SimulatedCuda")
        self._device = sim.device
        self._pool: GraphPool | None = None
        self._capture: ContextManager[GraphPool] | None = None
        self._finalizer: weakref.finalize[..., SimCUDAGraph] | None = None

    def capture_begin(self, pool: GraphPool | None = None, capture_error_mode: str = "global") -> None:
        self._capture = self._device.graph_capture(pool)
        self._pool = self._capture.__enter__()
        self._finalizer = weakref.finalize(self, _release_pool, self._device, self._pool)

    def capture_end(self) -> None:
        capture, self._capture = self._capture, None
        if capture is None:
            raise RuntimeError("capture_end() without capture_begin()")
        capture.__exit__(None, None, None)

    def replay(self) -> None:
        if self._pool is None:
            raise RuntimeError("replay() of a graph that was never captured")

    def reset(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._pool = None

    def pool(self) -> GraphPool:
        if self._pool is None:
            raise RuntimeError("pool() of a graph that was never captured")
        return self._pool

    def enable_debug_mode(self) -> None:
        pass

    def debug_dump(self, debug_path: str) -> None:
        pass


def _release_pool(device: SimDevice, pool: GraphPool) -> None:
    if not pool.released and device.allocator.graph_pools.get(pool.id) is pool:
        device.release_graph_pool(pool, lazy=True, graphs=1)


class _SimGraphContext:
    """Stands in for ``torch.cuda.graph``: empty_cache, then capture into the graph's pool."""

    default_capture_stream = None

    def __init__(
        self,
        cuda_graph: SimCUDAGraph,
        pool: GraphPool | None = None,
        stream: object = None,
        capture_error_mode: str = "global",
        **_: object,
    ) -> None:
        self.cuda_graph = cuda_graph
        self.pool = pool

    def __enter__(self) -> None:
        self.cuda_graph._device.empty_cache()
        self.cuda_graph.capture_begin(self.pool)

    def __exit__(self, *exc: object) -> None:
        self.cuda_graph.capture_end()


class SimulatedCuda:
    """Serve ``device="cuda"`` tensor creation from CPU memory, recorded on ``device``.

    Owners default to ``module.qualname`` of the first calling frame outside torch and this
    package, tags to the torch API (``torch.empty``, ``Tensor.to``); ``owner_resolver(frame, api)``
    may return an owner or an ``(owner, tag)`` pair instead (``None`` keeps the default), and
    :meth:`owner_scope` overrides both for a block of code. Re-entrant use of one instance is not
    supported; nesting two instances is (the inner one wins).
    """

    def __init__(self, device: SimDevice, owner_resolver: OwnerResolver | None = None) -> None:
        self.device = device
        self.owner_resolver = owner_resolver
        self._registry: dict[int, Allocation] = {}
        self._scope: list[tuple[str, str | None]] = []
        self._saved: list[tuple[object, str, object]] = []
        self._mode: PlacementMode | None = None
        self.foreign: dict[int, ForeignUse] = {}  # id(allocation) -> its first use here
        self._direct: dict[int, Allocation] = {}  # caching_allocator_alloc's pointers: kept across re-entries
        # Called with (allocation, torch API) when a torch call reads or writes a storage the ledger already freed
        # (an arena a growth gave back), a float arena or an int workspace; the lifecycle judges the use
        # (no_use_after_free, and which micro-batch planned into which arena or int workspace).
        self.on_use: Callable[[Allocation, str], None] | None = None
        # Called with (allocation, wrapper, attribute) when a FlashInfer wrapper takes an int workspace.
        self.on_int_holder: Callable[[Allocation, object, str], None] | None = None
        self.watch_all = False  # on_use for every simulated storage a call touches (while a graph is captured)

    # -- public ----------------------------------------------------------------------------------------

    @contextmanager
    def owner_scope(self, owner: str, tag: str | None = None) -> Iterator[None]:
        """Attribute every allocation inside the block to ``owner`` (and ``tag`` when given)."""
        self._scope.append((owner, tag))
        try:
            yield
        finally:
            self._scope.pop()

    def allocation_of(self, tensor: torch.Tensor) -> Allocation | None:
        """The ledger entry behind a simulated tensor (``None`` for plain CPU tensors)."""
        return self._registry.get(storage_ptr(tensor))

    def memory_of(self, tensor: torch.Tensor) -> Allocation | None:
        """The ledger entry behind a tensor of this or an earlier simulation, looked up without counting as a
        use of it (the harness inspecting module state is not the backend touching the tensor)."""
        with torch._C.DisableTorchFunction():
            ptr = storage_ptr(tensor)
        return self._registry.get(ptr) or LIVE_STORAGES.get(ptr)

    def storage_owner(self, ptr: int) -> Allocation | None:
        """The ledger entry of another (earlier) simulation behind a live storage, or None."""
        alloc = LIVE_STORAGES.get(ptr)
        return alloc if alloc is not None and self._registry.get(ptr) is not alloc else None

    def simulated_ptr(self, host_ptr: int, nbytes: int = 0) -> int | None:
        """The simulated device address of a host address inside one of this simulation's storages (a tensor's
        ``data_ptr()``, view offsets included), or None when ``[host_ptr, host_ptr + nbytes)`` is in none of them.

        Torch mode keeps device tensors in host memory, so what a builder reads from ``data_ptr()`` is a host
        address; the ledger, the arena and every check speak simulated addresses.
        """
        alloc = self._registry.get(host_ptr)
        if alloc is not None:
            return alloc.ptr if nbytes <= alloc.nbytes else None
        starts = sorted(self._registry)
        i = bisect.bisect_right(starts, host_ptr) - 1
        if i < 0:
            return None
        base = starts[i]
        alloc = self._registry[base]
        if host_ptr + nbytes > base + alloc.nbytes:
            return None
        return alloc.ptr + host_ptr - base

    def _note_foreign(self, ptr: int, api: str) -> None:
        """A torch call here reads a tensor another simulation (an earlier case) created: state outlived it."""
        alloc = self.storage_owner(ptr)
        if alloc is not None and id(alloc) not in self.foreign:
            owner, tag, stack = self._attribution(api)
            self.foreign[id(alloc)] = ForeignUse(owner, tag, stack, alloc)

    def attribution(self, api: str) -> tuple[str, str, str]:
        """Owner, tag (the running method) and source line of the torch call being made now."""
        return self._attribution(api)

    def is_simulated(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a simulated device (or pinned host) tensor."""
        return storage_ptr(tensor) in self._registry

    def __enter__(self) -> "SimulatedCuda":
        if self._mode is not None:
            raise RuntimeError("this SimulatedCuda is already active")
        mode = PlacementMode(self)
        mode.__enter__()  # type: ignore[no-untyped-call]  # TorchFunctionMode's methods are untyped in torch
        self._mode = mode
        try:
            self._patch()
        except BaseException:
            self._unpatch()
            self._mode = None
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            raise
        with _active_lock:
            _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _active_lock:
            if self in _active:
                _active.remove(self)
        mode, self._mode = self._mode, None
        self.owner_resolver = None  # every live storage's finalizer holds this instance: let the resolver's run go
        try:
            self._unpatch()
        finally:
            if mode is not None:
                mode.__exit__(*exc)  # type: ignore[no-untyped-call]

    # -- torch.cuda patching ---------------------------------------------------------------------------

    def _patch(self) -> None:
        replacements = self._cuda_replacements()
        nvtx: dict[str, object] = {"range_push": no_op, "range_pop": no_op, "mark": no_op,
                                   "range_start": lambda msg: 0, "range_end": no_op}
        self._saved.append((torch.Tensor, "record_stream", torch.Tensor.__dict__.get("record_stream", MISSING)))
        torch.Tensor.record_stream = no_op  # type: ignore[method-assign]
        self._saved.append((torch, "Generator", torch.__dict__["Generator"]))
        torch.Generator = SimGenerator  # type: ignore[misc]
        for name, value in nvtx.items():
            self._saved.append((torch.cuda.nvtx, name, torch.cuda.nvtx.__dict__.get(name, MISSING)))
            setattr(torch.cuda.nvtx, name, value)
        for module in (torch.cuda, torch.cuda.memory, torch.cuda.graphs, torch.cuda.streams):
            for name, value in replacements.items():
                if module is not torch.cuda and not hasattr(module, name):
                    continue
                self._saved.append((module, name, module.__dict__.get(name, MISSING)))
                setattr(module, name, value)
        self._patch_accelerator(replacements)

    def _cuda_replacements(self) -> dict[str, object]:
        """What each ``torch.cuda`` name answers while this simulation is active: the device's ledger.

        Long because it is one table: a name and its answer per line, read as a whole (splitting it would split the
        table, not the logic)."""
        dev = self.device

        def ignore_device(fn: Callable[[], object]) -> Callable[..., object]:
            def wrapper(device: object = None) -> object:
                return fn()

            wrapper.__name__ = getattr(fn, "__name__", "sim")
            wrapper.__doc__ = "Simulated: answered from the SimDevice ledger."
            return wrapper

        cc = dev.compute_capability
        props = DeviceProperties(dev.name, dev.total_memory, dev.num_sm, cc[0], cc[1],
                                  shared_memory_per_block_optin=smem_optin_for(cc))
        direct = self._direct

        def caching_allocator_alloc(size: int, device: object = None, stream: object = None) -> int:
            owner, tag, stack = self._attribution("torch.cuda.caching_allocator_alloc")
            alloc = self.device.allocate(int(size), owner=owner, tag=tag, stack=stack)
            direct[alloc.ptr] = alloc
            return alloc.ptr

        def caching_allocator_delete(mem_ptr: int) -> None:
            alloc = direct.pop(int(mem_ptr), None)
            if alloc is None:
                raise ValueError(f"caching_allocator_delete: {mem_ptr:#x} is not a live caching_allocator_alloc "
                                 "pointer (freed already: a double free; or never allocated by it)")
            dev.free(alloc)

        def memory_snapshot(mempool_id: object = None, include_traces: bool = True) -> list[dict[str, object]]:
            return [dict(seg, device=0, stream=0, is_expandable=False, frames=[])
                    for seg in dev.allocator.snapshot()]

        def synchronize(device: object = None) -> None:
            return None

        def graph_pool_handle() -> GraphPool:
            return dev.new_graph_pool()

        replacements: dict[str, object] = {
            "mem_get_info": ignore_device(dev.mem_get_info),
            "memory_allocated": ignore_device(dev.memory_allocated),
            "memory_reserved": ignore_device(dev.memory_reserved),
            "max_memory_allocated": ignore_device(dev.max_memory_allocated),
            "max_memory_reserved": ignore_device(dev.max_memory_reserved),
            "memory_stats": ignore_device(dev.memory_stats),
            "reset_peak_memory_stats": ignore_device(dev.reset_peak_memory_stats),
            "reset_max_memory_allocated": ignore_device(dev.reset_peak_memory_stats),
            "empty_cache": lambda: dev.empty_cache(),
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "init": lambda: None,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda device: None,
            "synchronize": synchronize,
            "get_device_properties": ignore_device(lambda: props),
            "get_device_name": ignore_device(lambda: dev.name),
            "get_device_capability": ignore_device(lambda: (props.major, props.minor)),
            "graph": _SimGraphContext,
            "CUDAGraph": SimCUDAGraph,
            "graph_pool_handle": graph_pool_handle,
            "is_current_stream_capturing": lambda: dev.capturing,
            "current_stream": ignore_device(lambda: DEFAULT_STREAM),
            "default_stream": ignore_device(lambda: DEFAULT_STREAM),
            "set_stream": no_op,
            "stream": sim_stream,
            "Stream": SimStream,
            "Event": SimEvent,
            "device": SimDeviceGuard,
            "memory_snapshot": memory_snapshot,
            "caching_allocator_alloc": caching_allocator_alloc,
            "caching_allocator_delete": caching_allocator_delete,
        }
        return replacements

    def _patch_accelerator(self, cuda: dict[str, object]) -> None:
        """``torch.accelerator`` answers the simulated GPU too: vLLM measures memory (``memory_profiling``) and
        empties the cache (its ``WorkspaceManager``) through it, and on a CPU-only build it has no accelerator."""
        import torch

        accelerator = getattr(torch, "accelerator", None)
        if accelerator is None:
            return
        same = ("empty_cache", "memory_stats", "memory_allocated", "memory_reserved", "max_memory_allocated",
                "max_memory_reserved", "reset_peak_memory_stats", "synchronize", "device_count", "current_stream",
                "set_stream")
        replacements: dict[str, object] = {name: cuda[name] for name in same}
        replacements.update({
            "get_memory_info": cuda["mem_get_info"],
            "is_available": lambda: True,
            "current_accelerator": lambda check_available=False: torch.device("cuda"),
            "current_device_index": lambda: 0,
            "current_device_idx": lambda: 0,
            "set_device_index": lambda device: None,
            "set_device_idx": lambda device: None,
        })
        for module in (accelerator, getattr(accelerator, "memory", None)):
            if module is None:
                continue
            for name, value in replacements.items():
                if module is not accelerator and not hasattr(module, name):
                    continue
                self._saved.append((module, name, module.__dict__.get(name, MISSING)))
                setattr(module, name, value)

    def _unpatch(self) -> None:
        while self._saved:
            module, name, value = self._saved.pop()
            if value is MISSING:
                if name in vars(module):
                    delattr(module, name)
            else:
                setattr(module, name, value)

    # -- the ledger ------------------------------------------------------------------------------------

    def _attribution(self, api: str) -> tuple[str, str, str]:
        """Owner, tag and source line of an allocation being made now.

        The source line is the first frame outside torch and the harness (the built-in backends count as
        backend code); the resolver sees the innermost frame outside torch, so it can walk out through the
        backend's own frames to the part whose code is running.
        """
        frame: FrameType | None = sys._getframe(1)
        inner: FrameType | None = None
        while frame is not None:
            filename = frame.f_code.co_filename
            if not (filename.startswith(_TORCH_DIR) or filename.startswith(_MEMORY_DIR) or filename == _CONTEXTLIB):
                if inner is None:
                    inner = frame
                if not filename.startswith(_PACKAGE_DIR) or filename.startswith(_BUILTIN_DIR):
                    break
            frame = frame.f_back
        if frame is None:
            return ("<unknown>", api, "<unknown>")
        code = frame.f_code
        stack = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        owner = f"{frame.f_globals.get('__name__', '?')}.{getattr(code, 'co_qualname', code.co_name)}"
        tag = api
        if self._scope:
            scope_owner, scope_tag = self._scope[-1]
            if scope_tag is not None:  # the harness named the part and its method: the resolver's answer is moot
                return scope_owner, scope_tag, stack
        if self.owner_resolver is not None:
            answer = self.owner_resolver(inner or frame, api)
            if isinstance(answer, tuple):
                owner, tag = answer
            elif answer is not None:
                owner = answer
        if self._scope:  # a scope without a tag names the owner only
            owner = self._scope[-1][0]
        return owner, tag, stack

    def _record(self, t: torch.Tensor, api: str, pinned: bool) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        nbytes = storage.nbytes()
        if ptr == 0 or nbytes == 0 or ptr in self._registry:
            return
        owner, tag, stack = self._attribution(api)
        try:
            alloc = self.device.allocate(nbytes, owner=owner, tag=tag, pinned_host=pinned, stack=stack)
        except DeviceOutOfMemory as err:
            if isinstance(err, torch.OutOfMemoryError):
                raise
            raise SimulatedCudaOutOfMemory(**vars(err)) from None  # the same fields, as torch's OOM type
        self._registry[ptr] = alloc
        LIVE_STORAGES[ptr] = alloc
        weakref.finalize(storage, self._release, ptr, alloc)

    def _release(self, ptr: int, alloc: Allocation) -> None:
        if self._registry.get(ptr) is alloc:
            del self._registry[ptr]
        if LIVE_STORAGES.get(ptr) is alloc:
            del LIVE_STORAGES[ptr]
        if alloc.alive:
            self.device.free(alloc)

