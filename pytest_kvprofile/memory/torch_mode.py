"""Run unmodified ``torch.empty(..., device="cuda")`` code against a :class:`SimDevice` on CPU torch.

Backends are written against ``torch.cuda``; rewriting them for a test double would test the double.
While :class:`SimulatedCuda` is active, "cuda" tensors are real CPU tensors whose storage is recorded
in the device ledger (freed when the storage dies), and the ``torch.cuda`` memory and graph API
answers from that ledger. Limits are listed in ``docs/simulated-device.md``.
"""

from __future__ import annotations

import bisect
import mmap
import os
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, ContextManager, Iterator, Literal, TypeAlias, cast

import torch
import torch.cuda.graphs
import torch.cuda.memory
import torch.cuda.nvtx
import torch.cuda.streams
from torch.overrides import TorchFunctionMode

from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.matrix.gpus import smem_optin_for
from pytest_kvprofile.memory.allocator import GraphPool
from pytest_kvprofile.memory.device import (
    Allocation,
    DeviceOutOfMemory,
    ForeignUse,
    SimDevice,
)

__all__ = ["active_simulation", "assign_role", "SimEvent", "SimStream", "SimulatedCuda", "SimulatedCudaOutOfMemory",
           "SimCUDAGraph", "active_device"]

OwnerResolver = Callable[[FrameType, str], "str | tuple[str, str] | None"]
# an argument or the result of a torch call that __torch_function__ sees (a tensor, a shape, a dtype, a device, a
# list of tensors...): whatever the call takes, passed on as it came
TorchArg: TypeAlias = Any
TorchFunc = Callable[..., TorchArg]  # a torch function, method or property getter torch dispatches to the mode

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package root
_MEMORY_DIR = _PACKAGE_DIR + "memory" + os.sep  # the simulation itself
_BUILTIN_DIR = _PACKAGE_DIR + "builtin" + os.sep  # the built-in backends are backend code, not the harness
_CONTEXTLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep + "contextlib.py"

_DEVICE_GET = torch.Tensor.device.__get__
_IS_CUDA_GET = cast(Any, torch.Tensor.is_cuda).__get__  # Any: a descriptor, which torch's stubs type as its bool
_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_CPU = torch.Tensor.cpu
_TENSOR_PIN = torch.Tensor.pin_memory
_TENSOR_IS_PINNED = torch.Tensor.is_pinned
_TENSOR_GET_DEVICE = torch.Tensor.get_device
_CUDA0 = torch.device("cuda", 0)
_MISSING = object()
_active_lock = threading.Lock()
_active: list["SimulatedCuda"] = []
_live_storages: dict[int, Allocation] = {}  # every simulation's live storages: tells another case's tensors


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
        alloc = sim._registry.get(_storage_ptr(tensor))
    if alloc is not None and alloc.role not in keep:
        alloc.role = role
    return alloc


def _is_cuda(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _is_cpu(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cpu")
    return isinstance(device, torch.device) and device.type == "cpu"


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


@dataclass(frozen=True)
class _DeviceProperties:
    """What ``torch.cuda.get_device_properties`` callers read."""

    name: str
    total_memory: int
    multi_processor_count: int
    major: int
    minor: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    L2_cache_size: int = 0
    uuid: str = "GPU-simulated"
    shared_memory_per_block_optin: int = 101376
    shared_memory_per_block: int = 49152
    shared_memory_per_multiprocessor: int = 102400
    max_threads_per_multi_processor: int = 2048
    regs_per_multiprocessor: int = 65536
    warp_size: int = 32
    gcnArchName: str = "NVIDIA"


class SimStream:
    """Stands in for ``torch.cuda.Stream``: work on a simulated device completes at once, so every
    wait, record and query is immediate; ``cuda_stream`` is 0 (the legacy default stream)."""

    def __init__(self, device: object = None, priority: int = 0, **_: object) -> None:
        self.device = _CUDA0
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, stream: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: "SimEvent | None" = None) -> "SimEvent":
        event = event if event is not None else SimEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimStream)

    def __hash__(self) -> int:
        return 0

    def __enter__(self) -> "SimStream":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class SimEvent:
    """Stands in for ``torch.cuda.Event``: recorded work is already complete; timings read 0 ms."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.recorded = False

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def wait(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "SimEvent") -> float:
        if not (self.enable_timing and self.recorded and end_event.recorded):
            raise RuntimeError("elapsed_time needs two recorded events created with enable_timing=True")
        return 0.0


_DEFAULT_STREAM = SimStream()
_REAL_GENERATOR = torch.Generator


class _GeneratorMeta(type(torch.Generator)):  # type: ignore[misc]
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _REAL_GENERATOR)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _REAL_GENERATOR)


class SimGenerator(torch.Generator, metaclass=_GeneratorMeta):
    """Stands in for ``torch.Generator`` while active: a "cuda" generator is a CPU one, since "cuda"
    tensors are CPU tensors; ``isinstance(g, torch.Generator)`` still holds for every generator."""

    def __new__(cls, device: object = None) -> "SimGenerator":
        return _REAL_GENERATOR.__new__(cls, device="cpu")  # type: ignore[call-arg]  # torch.Generator.__new__ takes device; its stubs say object's

    def __init__(self, device: object = None) -> None:
        pass


class _SimDeviceGuard:
    """Stands in for ``torch.cuda.device(...)``: there is one simulated device, index 0."""

    def __init__(self, device: object = None) -> None:
        self.idx = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


@contextmanager
def _sim_stream(stream: object = None) -> Iterator[None]:
    yield


def _no_op(*_: object, **__: object) -> None:
    return None


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
        self._mode: _Mode | None = None
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
        return self._registry.get(_storage_ptr(tensor))

    def memory_of(self, tensor: torch.Tensor) -> Allocation | None:
        """The ledger entry behind a tensor of this or an earlier simulation, looked up without counting as a
        use of it (the harness inspecting module state is not the backend touching the tensor)."""
        with torch._C.DisableTorchFunction():
            ptr = _storage_ptr(tensor)
        return self._registry.get(ptr) or _live_storages.get(ptr)

    def storage_owner(self, ptr: int) -> Allocation | None:
        """The ledger entry of another (earlier) simulation behind a live storage, or None."""
        alloc = _live_storages.get(ptr)
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
        return _storage_ptr(tensor) in self._registry

    def __enter__(self) -> "SimulatedCuda":
        if self._mode is not None:
            raise RuntimeError("this SimulatedCuda is already active")
        mode = _Mode(self)
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
        dev = self.device

        def ignore_device(fn: Callable[[], object]) -> Callable[..., object]:
            def wrapper(device: object = None) -> object:
                return fn()

            wrapper.__name__ = getattr(fn, "__name__", "sim")
            wrapper.__doc__ = "Simulated: answered from the SimDevice ledger."
            return wrapper

        cc = dev.compute_capability
        props = _DeviceProperties(dev.name, dev.total_memory, dev.num_sm, cc[0], cc[1],
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
            "current_stream": ignore_device(lambda: _DEFAULT_STREAM),
            "default_stream": ignore_device(lambda: _DEFAULT_STREAM),
            "set_stream": _no_op,
            "stream": _sim_stream,
            "Stream": SimStream,
            "Event": SimEvent,
            "device": _SimDeviceGuard,
            "memory_snapshot": memory_snapshot,
            "caching_allocator_alloc": caching_allocator_alloc,
            "caching_allocator_delete": caching_allocator_delete,
        }
        nvtx: dict[str, object] = {"range_push": _no_op, "range_pop": _no_op, "mark": _no_op,
                                   "range_start": lambda msg: 0, "range_end": _no_op}
        self._saved.append((torch.Tensor, "record_stream", torch.Tensor.__dict__.get("record_stream", _MISSING)))
        torch.Tensor.record_stream = _no_op  # type: ignore[method-assign]
        self._saved.append((torch, "Generator", torch.__dict__["Generator"]))
        torch.Generator = SimGenerator  # type: ignore[misc]
        for name, value in nvtx.items():
            self._saved.append((torch.cuda.nvtx, name, torch.cuda.nvtx.__dict__.get(name, _MISSING)))
            setattr(torch.cuda.nvtx, name, value)
        for module in (torch.cuda, torch.cuda.memory, torch.cuda.graphs, torch.cuda.streams):
            for name, value in replacements.items():
                if module is not torch.cuda and not hasattr(module, name):
                    continue
                self._saved.append((module, name, module.__dict__.get(name, _MISSING)))
                setattr(module, name, value)
        self._patch_accelerator(replacements)

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
                self._saved.append((module, name, module.__dict__.get(name, _MISSING)))
                setattr(module, name, value)

    def _unpatch(self) -> None:
        while self._saved:
            module, name, value = self._saved.pop()
            if value is _MISSING:
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
        _live_storages[ptr] = alloc
        weakref.finalize(storage, self._release, ptr, alloc)

    def _release(self, ptr: int, alloc: Allocation) -> None:
        if self._registry.get(ptr) is alloc:
            del self._registry[ptr]
        if _live_storages.get(ptr) is alloc:
            del _live_storages[ptr]
        if alloc.alive:
            self.device.free(alloc)


class _Mode(TorchFunctionMode):
    """Rewrites cuda placements to cpu and records the new storages the call produced."""

    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: TorchFunc, types: object, args: tuple[TorchArg, ...] = (),
                           kwargs: dict[str, TorchArg] | None = None) -> TorchArg:
        registry = self.sim._registry
        try:
            kind = _KINDS[func]
        except (KeyError, TypeError):
            kind = _kind(func)
        if kind == _METADATA_CALL:  # reads what a tensor is, not its bytes: never a use, even of freed memory
            return func(*args, **kwargs) if kwargs else func(*args)
        if kind == _PLAIN_CALL and not kwargs and not self.sim.watch_all:
            quiet = _quiet_inputs(registry, args)
            if quiet is not None:  # live simulated storages nothing watches: only what the call creates counts
                out = func(*args)
                if quiet and isinstance(out, torch.Tensor):
                    try:
                        made = out.untyped_storage().data_ptr() not in registry
                    except (RuntimeError, NotImplementedError):
                        return out
                    if made:
                        self.sim._record(out, _api_name(func), False)
                    return out
                return self._record_outputs(out, _api_name(func), False, set()) if quiet else out
        if kwargs is None:
            kwargs = {}
        if kind == _SPECIAL_CALL:  # one of _SPECIAL, a property getter or an unhashable callable: most calls are not
            if func == _DEVICE_GET:
                alloc = registry.get(_storage_ptr(args[0]))
                return _CUDA0 if alloc is not None and alloc.kind == "device" else func(*args)
            if func == _IS_CUDA_GET:
                alloc = registry.get(_storage_ptr(args[0]))
                return alloc is not None and alloc.kind == "device"
            if getattr(func, "__name__", None) == "__get__":
                return func(*args, **kwargs)
            if func == _TENSOR_CUDA:
                return self._to_cuda(args[0], "Tensor.cuda")
            if func == _TENSOR_TO:
                return self._tensor_to(func, args, kwargs)
            if func == _TENSOR_CPU:
                return self._to_cpu(func(*args, **kwargs))
            if func == _TENSOR_GET_DEVICE:
                alloc = registry.get(_storage_ptr(args[0]))
                return 0 if alloc is not None and alloc.kind == "device" else func(*args, **kwargs)
            if func == _TENSOR_PIN:
                out = args[0].clone()
                self.sim._record(out, "Tensor.pin_memory", pinned=True)
                return out
            if func == _TENSOR_IS_PINNED:
                alloc = registry.get(_storage_ptr(args[0]))
                return alloc is not None and alloc.kind == "pinned_host"

        pinned = bool(kwargs.get("pin_memory"))
        if pinned:
            kwargs = dict(kwargs)
            kwargs.pop("pin_memory")
        device = kwargs.get("device", _MISSING)
        if device is not _MISSING and _is_cuda(device):
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
            to_cuda = True
        elif device is not _MISSING and device is not None:
            to_cuda = False
        else:
            to_cuda = None
        host_inputs = set()
        any_sim = False
        on_use = self.sim.on_use
        for tensor in _tensor_inputs(args, kwargs):
            ptr = _storage_ptr(tensor)
            alloc = registry.get(ptr)
            if alloc is not None:
                any_sim = True
                if on_use is not None and (not alloc.alive or alloc.role is Role.FLOAT_ARENA
                                           or alloc.role is Role.INT_WORKSPACE or self.sim.watch_all):
                    on_use(alloc, _api_name(func))
            else:
                host_inputs.add(ptr)
        for ptr in host_inputs:
            if ptr in _live_storages:
                self.sim._note_foreign(ptr, _api_name(func))
        record_device = to_cuda if to_cuda is not None else any_sim
        out = None
        if (record_device or pinned) and kind == _PLAIN_CALL and func in _ZERO_FACTORIES:
            out = _untouched_zeros(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        if not (record_device or pinned):
            return out
        api = _api_name(func)
        return self._record_outputs(out, api, pinned and not to_cuda, host_inputs)

    def _record_outputs(self, out: TorchArg, api: str, pinned: bool, host_inputs: set[int]) -> TorchArg:
        if isinstance(out, torch.Tensor):
            if _storage_ptr(out) in host_inputs:
                out = out.clone()
            self.sim._record(out, api, pinned)
            return out
        if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
            items = [self._record_outputs(o, api, pinned, host_inputs) for o in out]
            return type(out)(items) if not hasattr(out, "_fields") else type(out)(*items)
        return out

    def _to_cuda(self, t: torch.Tensor, api: str) -> torch.Tensor:
        if _storage_ptr(t) in self.sim._registry and self.sim._registry[_storage_ptr(t)].kind == "device":
            return t
        out = t.clone()
        self.sim._record(out, api, pinned=False)
        return out

    def _to_cpu(self, out: torch.Tensor) -> torch.Tensor:
        registry = self.sim._registry
        alloc = registry.get(_storage_ptr(out))
        if alloc is not None and alloc.kind == "device":
            return out.clone()
        return out

    def _tensor_to(self, func: TorchFunc, args: tuple[TorchArg, ...], kwargs: dict[str, TorchArg]) -> TorchArg:
        src = args[0]
        target: object = kwargs.get("device", _MISSING)
        rest = list(args[1:])
        if target is _MISSING:
            target = None
            for i, a in enumerate(rest):
                if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
                    target = a
                    rest[i] = "cpu"
                    break
                if isinstance(a, torch.Tensor):
                    alloc = self.sim._registry.get(_storage_ptr(a))
                    target = "cuda" if alloc is not None and alloc.kind == "device" else None
                    if target is not None:
                        rest[i] = a.dtype
                    break
        else:
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
        if target is not None and _is_cuda(target):
            registry = self.sim._registry
            src_alloc = registry.get(_storage_ptr(src))
            out = func(src, *rest, **kwargs)
            if src_alloc is not None and src_alloc.kind == "device":
                if _storage_ptr(out) == _storage_ptr(src):
                    return out
                self.sim._record(out, "Tensor.to", pinned=False)
                return out
            if _storage_ptr(out) == _storage_ptr(src):
                out = out.clone()
            self.sim._record(out, "Tensor.to", pinned=False)
            return out
        out = func(*args, **kwargs)
        if target is not None and _is_cpu(target):
            return self._to_cpu(out)
        src_alloc = self.sim._registry.get(_storage_ptr(src))
        if src_alloc is not None and src_alloc.kind == "device" and _storage_ptr(out) != _storage_ptr(src):
            self.sim._record(out, "Tensor.to", pinned=False)
        return out


_ZERO_FACTORIES = frozenset((torch.zeros, torch.zeros_like, torch.Tensor.new_zeros))
UNTOUCHED_MIN_BYTES = 1 << 20
"""Zero-filled device allocations from this size up are anonymous mappings, which the kernel gives as untouched zero
pages: a workspace costs host memory only where a kernel or a copy writes it (below it, an ``mmap`` costs more than the
fill it saves)."""


def _untouched_zeros(func: TorchFunc, args: tuple[TorchArg, ...], kwargs: dict[str, TorchArg]) -> torch.Tensor | None:
    """What ``func(*args, **kwargs)`` returns, as a tensor over untouched zero pages; None where that is not the same
    tensor (an ``out=``, a sparse or non-default layout, a small size): the caller makes it the usual way."""
    if "out" in kwargs or kwargs.get("layout", torch.strided) is not torch.strided:
        return None
    try:
        meta = func(*args, **{**kwargs, "device": "meta"})
    except (RuntimeError, TypeError, ValueError):
        return None
    if not isinstance(meta, torch.Tensor) or meta.layout is not torch.strided:
        return None
    nbytes = meta.untyped_storage().nbytes()
    if nbytes < UNTOUCHED_MIN_BYTES:
        return None
    storage = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()
    out = torch.empty(0, dtype=meta.dtype).set_(storage, 0, meta.size(), meta.stride())
    return out.requires_grad_() if meta.requires_grad else out


_WATCHED = (Role.FLOAT_ARENA, Role.INT_WORKSPACE)


def _quiet_inputs(registry: dict[int, Allocation], args: tuple[object, ...]) -> bool | None:
    """Whether a call's positional arguments include a simulated tensor (True) or no tensor (False), when every tensor
    among them is a live simulated storage no check watches (not a float arena, not an int workspace, not freed by the
    ledger); None when the call needs the full path (a host tensor, which may be another case's; a list of tensors; a
    tensor without storage; a watched storage)."""
    quiet = False
    for a in args:
        if isinstance(a, torch.Tensor):
            try:
                alloc = registry.get(a.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                return None
            if alloc is None or not alloc.alive or alloc.role in _WATCHED:
                return None
            quiet = True
        elif isinstance(a, (list, tuple)):
            return None
    return quiet


def _tensor_inputs(args: tuple[object, ...], kwargs: dict[str, object]) -> Iterator[torch.Tensor]:
    """The tensors a torch call receives: positional, keyword, and one level inside lists and tuples."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


_SPECIAL = (_DEVICE_GET, _IS_CUDA_GET, _TENSOR_CUDA, _TENSOR_TO, _TENSOR_CPU, _TENSOR_GET_DEVICE, _TENSOR_PIN,
            _TENSOR_IS_PINNED)
_METADATA = (torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride, torch.Tensor.numel,
             torch.Tensor.nelement, torch.Tensor.element_size, torch.Tensor.storage_offset, torch.Tensor.dim,
             torch.Tensor.ndimension, torch.Tensor.untyped_storage, torch.Tensor.is_contiguous, torch.Tensor.__len__)
"""Calls that read a tensor's metadata (its pointer, shape, strides, element size, storage) and none of its bytes:
comparing ``data_ptr()`` of a stale view with a new one is how real code tells a moved arena (vLLM's pull request
does in its wrapper reset), so none of these is a use of the memory, freed or not."""
_PLAIN_CALL, _SPECIAL_CALL, _METADATA_CALL = 0, 1, 2
_KINDS: dict[TorchFunc, int] = {}  # func -> its kind (every torch call asks)
_API_NAMES: dict[TorchFunc, str] = {}


def _kind(func: TorchFunc) -> int:
    try:
        return _KINDS[func]
    except KeyError:
        if any(func == f for f in _METADATA):
            kind = _METADATA_CALL
        elif any(func == f for f in _SPECIAL) or getattr(func, "__name__", None) == "__get__":
            kind = _SPECIAL_CALL
        else:
            kind = _PLAIN_CALL
        _KINDS[func] = kind
        return kind
    except TypeError:  # an unhashable callable
        return _SPECIAL_CALL


def _api_name(func: TorchFunc) -> str:
    try:
        return _API_NAMES[func]
    except KeyError:
        pass
    except TypeError:
        return _name_of(func)
    name = _API_NAMES[func] = _name_of(func)
    return name


def _name_of(func: object) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    qualname = getattr(func, "__qualname__", name)
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + name
    return "torch." + name
