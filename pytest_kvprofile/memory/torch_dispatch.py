"""The torch function mode behind torch mode: every torch call passes through :class:`PlacementMode`.

It rewrites "cuda" placements to "cpu", records the storages a call creates in the simulation's ledger, and tells the
simulation when a call touches a watched or freed storage. :class:`~pytest_kvprofile.memory.torch_mode.SimulatedCuda`
enters it; this module knows the simulation only through :class:`Ledger`.
"""

from __future__ import annotations

import mmap
from typing import Any, Callable, Iterator, Protocol, TypeAlias, cast

import torch
from torch.overrides import TorchFunctionMode

from pytest_kvprofile.contract.device import Allocation
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.memory.cuda_standins import CUDA0

__all__ = ["LIVE_STORAGES", "Ledger", "PlacementMode", "TorchArg", "TorchFunc", "UNTOUCHED_MIN_BYTES", "MISSING",
           "is_cuda", "storage_ptr"]

# an argument or the result of a torch call that __torch_function__ sees (a tensor, a shape, a dtype, a device, a
# list of tensors...): whatever the call takes, passed on as it came
TorchArg: TypeAlias = Any
TorchFunc = Callable[..., TorchArg]  # a torch function, method or property getter torch dispatches to the mode

_DEVICE_GET = torch.Tensor.device.__get__
_IS_CUDA_GET = cast(Any, torch.Tensor.is_cuda).__get__  # Any: a descriptor, which torch's stubs type as its bool
_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_CPU = torch.Tensor.cpu
_TENSOR_PIN = torch.Tensor.pin_memory
_TENSOR_IS_PINNED = torch.Tensor.is_pinned
_TENSOR_GET_DEVICE = torch.Tensor.get_device
MISSING = object()
LIVE_STORAGES: dict[int, Allocation] = {}  # every simulation's live storages: tells another case's tensors


class Ledger(Protocol):
    """What the mode needs of the simulation it serves (:class:`~pytest_kvprofile.memory.torch_mode.SimulatedCuda`)."""

    _registry: dict[int, Allocation]  # host storage pointer -> its simulated allocation
    on_use: Callable[[Allocation, str], None] | None
    watch_all: bool

    def _record(self, t: torch.Tensor, api: str, pinned: bool) -> None: ...
    def _note_foreign(self, ptr: int, api: str) -> None: ...


def is_cuda(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def is_cpu(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cpu")
    return isinstance(device, torch.device) and device.type == "cpu"


def storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0



class PlacementMode(TorchFunctionMode):
    """Rewrites cuda placements to cpu and records the new storages the call produced."""

    def __init__(self, sim: Ledger) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: TorchFunc, types: object, args: tuple[TorchArg, ...] = (),
                           kwargs: dict[str, TorchArg] | None = None) -> TorchArg:
        """Every torch call while the simulation is active passes here: metadata reads, quiet calls on live storages,
        the special tensor methods, then placement, use and recording. Long because it
        is the hottest path of a run: each helper call would be paid on every torch call."""
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
                alloc = registry.get(storage_ptr(args[0]))
                return CUDA0 if alloc is not None and alloc.kind == "device" else func(*args)
            if func == _IS_CUDA_GET:
                alloc = registry.get(storage_ptr(args[0]))
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
                alloc = registry.get(storage_ptr(args[0]))
                return 0 if alloc is not None and alloc.kind == "device" else func(*args, **kwargs)
            if func == _TENSOR_PIN:
                out = args[0].clone()
                self.sim._record(out, "Tensor.pin_memory", pinned=True)
                return out
            if func == _TENSOR_IS_PINNED:
                alloc = registry.get(storage_ptr(args[0]))
                return alloc is not None and alloc.kind == "pinned_host"

        pinned = bool(kwargs.get("pin_memory"))
        if pinned:
            kwargs = dict(kwargs)
            kwargs.pop("pin_memory")
        device = kwargs.get("device", MISSING)
        if device is not MISSING and is_cuda(device):
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
            to_cuda = True
        elif device is not MISSING and device is not None:
            to_cuda = False
        else:
            to_cuda = None
        host_inputs = set()
        any_sim = False
        on_use = self.sim.on_use
        for tensor in _tensor_inputs(args, kwargs):
            ptr = storage_ptr(tensor)
            alloc = registry.get(ptr)
            if alloc is not None:
                any_sim = True
                if on_use is not None and (not alloc.alive or alloc.role is Role.FLOAT_ARENA
                                           or alloc.role is Role.INT_WORKSPACE or self.sim.watch_all):
                    on_use(alloc, _api_name(func))
            else:
                host_inputs.add(ptr)
        for ptr in host_inputs:
            if ptr in LIVE_STORAGES:
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
            if storage_ptr(out) in host_inputs:
                out = out.clone()
            self.sim._record(out, api, pinned)
            return out
        if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
            items = [self._record_outputs(o, api, pinned, host_inputs) for o in out]
            return type(out)(items) if not hasattr(out, "_fields") else type(out)(*items)
        return out

    def _to_cuda(self, t: torch.Tensor, api: str) -> torch.Tensor:
        if storage_ptr(t) in self.sim._registry and self.sim._registry[storage_ptr(t)].kind == "device":
            return t
        out = t.clone()
        self.sim._record(out, api, pinned=False)
        return out

    def _to_cpu(self, out: torch.Tensor) -> torch.Tensor:
        registry = self.sim._registry
        alloc = registry.get(storage_ptr(out))
        if alloc is not None and alloc.kind == "device":
            return out.clone()
        return out

    def _tensor_to(self, func: TorchFunc, args: tuple[TorchArg, ...], kwargs: dict[str, TorchArg]) -> TorchArg:
        src = args[0]
        target: object = kwargs.get("device", MISSING)
        rest = list(args[1:])
        if target is MISSING:
            target = None
            for i, a in enumerate(rest):
                if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
                    target = a
                    rest[i] = "cpu"
                    break
                if isinstance(a, torch.Tensor):
                    alloc = self.sim._registry.get(storage_ptr(a))
                    target = "cuda" if alloc is not None and alloc.kind == "device" else None
                    if target is not None:
                        rest[i] = a.dtype
                    break
        else:
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
        if target is not None and is_cuda(target):
            registry = self.sim._registry
            src_alloc = registry.get(storage_ptr(src))
            out = func(src, *rest, **kwargs)
            if src_alloc is not None and src_alloc.kind == "device":
                if storage_ptr(out) == storage_ptr(src):
                    return out
                self.sim._record(out, "Tensor.to", pinned=False)
                return out
            if storage_ptr(out) == storage_ptr(src):
                out = out.clone()
            self.sim._record(out, "Tensor.to", pinned=False)
            return out
        out = func(*args, **kwargs)
        if target is not None and is_cpu(target):
            return self._to_cpu(out)
        src_alloc = self.sim._registry.get(storage_ptr(src))
        if src_alloc is not None and src_alloc.kind == "device" and storage_ptr(out) != storage_ptr(src):
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
