"""``simulated_gpu``: plain torch "cuda" code, and FlashInfer's own wrappers, on a simulated catalog GPU.

Why: a backend author's builder is written against ``torch.cuda`` and FlashInfer's public API. Inside
``with simulated_gpu("H100") as dev:`` both run unmodified on a CPU-only torch: "cuda" tensors live in
the :class:`SimDevice` ledger (``memory/torch_mode.py``), ``torch.version.cuda`` is set, FlashInfer's
per-process device caches (``get_device_properties``, ``get_compute_capability``,
``is_sm90a_supported``, ...) are cleared on entry and exit so they answer this GPU and no other, and
FlashInfer's batch prefill/decode and batch MLA JIT loaders return host modules whose ``plan()`` is
FlashInfer's own planner compiled for the host (``attention/host_plan.py``; MLA's ``run()`` is refused).
Any other JIT build raises :class:`SimulatedDeviceUnsupported` naming the module, instead of invoking
nvcc for a GPU.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Sequence, TypeAlias

from pytest_kvprofile.attention.host_plan import SimulatedDeviceUnsupported  # the host modules raise it too
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.matrix.gpus import GpuSpec, lookup_gpu
from pytest_kvprofile.memory.device import SimDevice

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType

    from pytest_kvprofile.contract.device import Allocation

__all__ = [
    "SIMULATED_CUDA_VERSION", "SimulatedDeviceUnsupported", "clear_flashinfer_caches", "loaded_modules",
    "simulated_gpu", "simulated_gpu_on",
]

SIMULATED_CUDA_VERSION = "13.0"  # what torch.version.cuda reads inside the block (FlashInfer's sm*a checks)
DEFAULT_COMPUTE_CAPABILITY = (9, 0)  # a catalog entry without one is simulated as a Hopper part
_MISSING = object()

# a memoized function of FlashInfer's (functools.cache, or a wrapper around one): found by its cache_info and
# cache_clear, which is all that is known of it
CachedFunction: TypeAlias = Any


def clear_flashinfer_caches() -> int:
    """Clear every ``functools`` cache of the loaded ``flashinfer`` modules; returns how many held entries.

    FlashInfer memoizes device queries and module loaders per process, keyed on ``torch.device("cuda")``
    only, so a second simulated GPU (or the real one afterwards) would otherwise see the first's answers.
    """
    cleared = 0
    for fn in _flashinfer_cached_functions():
        if fn.cache_info().currsize:
            fn.cache_clear()
            cleared += 1
    return cleared


_cached_functions: tuple[list[tuple[str, ModuleType]] | None, list[CachedFunction]] = (None, [])
_loaded: dict[str, tuple[tuple[int, str], list[tuple[str, ModuleType]]]] = {}


def loaded_modules(package: str) -> list[tuple[str, ModuleType]]:
    """``package``'s imported modules, by name. Walking ``sys.modules`` (thousands of entries once vLLM or FlashInfer
    is imported) on every simulated phase or builder call would cost more than the call, so the list is kept until
    a module is imported or dropped (the count or the newest name changes); the same list object until then."""
    key = (len(sys.modules), next(reversed(sys.modules), ""))
    cached = _loaded.get(package)
    if cached is None or cached[0] != key:
        cached = _loaded[package] = (key, [(n, m) for n, m in list(sys.modules.items())
                                           if m is not None and (n == package or n.startswith(package + "."))])
    return cached[1]


def _flashinfer_cached_functions() -> list[CachedFunction]:
    """The memoized functions of the loaded ``flashinfer`` modules, found again only when those modules change."""
    global _cached_functions
    modules = loaded_modules("flashinfer")
    if modules is _cached_functions[0]:
        return _cached_functions[1]
    found: dict[int, CachedFunction] = {}
    for _name, module in modules:
        for value in list(vars(module).values()):
            fn = value
            while fn is not None:
                if _static(fn, "cache_info") is not None and callable(_static(fn, "cache_clear")):
                    found[id(fn)] = fn
                    break
                fn = _static(fn, "__wrapped__")
    _cached_functions = (modules, list(found.values()))
    return _cached_functions[1]


def _static(obj: object, name: str) -> object:
    """``obj``'s attribute ``name`` without running its ``__getattr__`` or descriptors: a module global may be a
    lazy proxy that loads a library on any attribute read (``flashinfer.comm.cuda_ipc.cudart`` loads libcudart,
    which a CPU machine does not have)."""
    try:
        return inspect.getattr_static(obj, name, None)
    except Exception:  # noqa: BLE001 - an object whose type resists introspection holds no cache
        return None


def _resolve(gpu: str | GpuSpec, total_memory: int | None, nontorch_bytes: int, record_stacks: bool) -> SimDevice:
    spec = lookup_gpu(gpu) if isinstance(gpu, str) else gpu
    if not isinstance(spec, GpuSpec):
        raise TypeError(f"simulated_gpu takes a catalog GPU name or a GpuSpec, not {type(gpu).__name__}")
    cc = spec.compute_capability if spec.compute_capability != (0, 0) else DEFAULT_COMPUTE_CAPABILITY
    return SimDevice(
        name=spec.name, total_memory=spec.memory_bytes if total_memory is None else int(total_memory),
        num_sm=spec.num_sm, nontorch_bytes=nontorch_bytes, record_stacks=record_stacks, compute_capability=cc,
    )


class _Patches:
    """Attribute replacements undone in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    def set(self, obj: object, name: str, value: object) -> None:
        self._saved.append((obj, name, getattr(obj, name, _MISSING)))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._saved:
            obj, name, value = self._saved.pop()
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


_LOADERS = ("get_batch_prefill_module", "get_batch_decode_module", "get_batch_mla_module", "get_quantization_module",
            "get_fmha_module")


def _patch_flashinfer(patches: _Patches, device: SimDevice) -> None:
    """Host module loaders in every loaded flashinfer namespace; every other JIT build refused."""
    import flashinfer.decode
    import flashinfer.jit.core
    import flashinfer.prefill

    from pytest_kvprofile.attention import host_plan
    from pytest_kvprofile.attention.host_cutlass import fmha_cutlass_loader
    from pytest_kvprofile.attention.host_packbits import host_quantization_module

    originals: dict[str, Callable[..., object]] = {
        "get_batch_prefill_module": flashinfer.prefill.get_batch_prefill_module,
        "get_batch_decode_module": flashinfer.decode.get_batch_decode_module,
    }
    replacements: dict[str, Callable[..., object]] = {
        "get_batch_prefill_module": host_plan.prefill_loader(device),
        "get_batch_decode_module": host_plan.decode_loader(device),
    }
    mla_loader = _flashinfer_mla_loader()
    if mla_loader is not None:
        originals["get_batch_mla_module"] = mla_loader
        replacements["get_batch_mla_module"] = host_plan.mla_loader(device)
    fmha_loader = getattr(flashinfer.prefill, "get_fmha_module", None)  # CUTLASS sm100 FMHA (FlashInfer >= 0.2)
    if fmha_loader is not None:
        originals["get_fmha_module"] = fmha_loader
        replacements["get_fmha_module"] = fmha_cutlass_loader(device)
    packbits_loader = _flashinfer_packbits_loader()
    if packbits_loader is not None:
        originals["get_quantization_module"] = packbits_loader
        replacements["get_quantization_module"] = host_quantization_module
    for _name, module in loaded_modules("flashinfer"):
        namespace = vars(module)
        for loader in _LOADERS:
            if loader in originals and namespace.get(loader) is originals[loader]:
                patches.set(module, loader, replacements[loader])

    def build_and_load(spec: object, *args: object, **kwargs: object) -> NoReturn:
        raise SimulatedDeviceUnsupported(
            f"FlashInfer JIT module {getattr(spec, 'name', spec)!r} has no host implementation on the simulated "
            f"{device.name}: only the batch prefill (FA2, paged and ragged) and batch decode (CUDA-core and "
            "tensor-core) modules, the plan() of the batch MLA module (FA2/FA3) and of the CUTLASS sm100 FMHA module, "
            "and the quantization module's bit packing are served (pytest_kvprofile.attention.host_plan, "
            "host_cutlass, host_packbits)")

    patches.set(flashinfer.jit.core.JitSpec, "build_and_load", build_and_load)
    _patch_wrapper_roles(patches)
    _patch_cudnn_probe(patches)


def _no_cudnn() -> bool:
    return False


def _patch_cudnn_probe(patches: _Patches) -> None:
    """The simulated GPU has no cuDNN runtime: FlashInfer's "may cuDNN serve this paged prefill?" probe (asked by
    ``plan()`` on compute capability 10.0) answers no, as on a machine without cuDNN, instead of raising from the
    CPU machine's cuDNN frontend; ``plan()`` then takes its own FA2 route, which the host modules serve."""
    probe = getattr(sys.modules.get("flashinfer.cudnn.prefill"), "_cudnn_supports_paged_auto", None)
    if probe is None:
        return
    for _name, module in loaded_modules("flashinfer"):
        if vars(module).get("_cudnn_supports_paged_auto") is probe:
            patches.set(module, "_cudnn_supports_paged_auto", _no_cudnn)


# What a FlashInfer wrapper keeps in each buffer attribute, by role (prefill, ragged prefill, decode, sparse).
_WRAPPER_BUFFERS = (("_float_workspace_buffer", Role.FLOAT_WORKSPACE), ("_int_workspace_buffer", Role.INT_WORKSPACE),
                    ("_pin_memory_int_workspace_buffer", Role.PINNED_MIRROR))
_ROLE_METHODS = ("__init__", "reset_workspace_buffer")  # where a wrapper takes its buffers


def _patch_wrapper_roles(patches: _Patches) -> None:
    """Every FlashInfer wrapper class that takes workspace buffers gives them their roles when it takes them: the
    float workspace (``FLOAT_WORKSPACE`` unless it is the engine's arena), the int workspace and its pinned mirror.
    Why here: in torch mode nothing else says which tensor a wrapper plans into, and the checks read roles."""
    for name in ("flashinfer.prefill", "flashinfer.decode", "flashinfer.sparse"):
        module = sys.modules.get(name)
        for cls in list(vars(module).values()) if module is not None else ():
            if not isinstance(cls, type) or cls.__module__ != name or "reset_workspace_buffer" not in dir(cls):
                continue
            for method in _ROLE_METHODS:
                if method in vars(cls):
                    patches.set(cls, method, _assigning_roles(vars(cls)[method], lambda wrapper: wrapper))
    mla = sys.modules.get("flashinfer.mla")
    cls = getattr(mla, "BatchMLAPagedAttentionWrapper", None)
    if isinstance(cls, type) and "plan" in vars(cls):  # its FA backend makes the int workspace in plan()
        patches.set(cls, "plan", _assigning_roles(vars(cls)["plan"], lambda w: getattr(w, "_planned_backend", None)))


def _assigning_roles(method: Callable[..., object], holder: Callable[[object], object]) -> Callable[..., object]:
    """``method``, then the roles of the buffers ``holder(wrapper)`` keeps (the wrapper, or MLA's planned backend)."""
    from pytest_kvprofile.memory.torch_mode import assign_role

    @functools.wraps(method)
    def wrapper(self: object, *args: object, **kwargs: object) -> object:
        out = method(self, *args, **kwargs)
        buffers = holder(self)
        for attr, role in _WRAPPER_BUFFERS:
            if role is Role.FLOAT_WORKSPACE and getattr(buffers, "_backend", None) == "trtllm-gen":
                role = Role.TRTLLM_WORKSPACE  # a trtllm-gen wrapper's float buffer is the trtllm-gen workspace
            alloc = assign_role(getattr(buffers, attr, None), role, keep=(Role.FLOAT_ARENA,))
            if alloc is not None and role is Role.INT_WORKSPACE:
                note_int_holder(alloc, buffers, attr)
        return out

    return wrapper


def note_int_holder(alloc: Allocation, wrapper: object, attr: str) -> None:
    """A FlashInfer wrapper took ``alloc`` as its int workspace: the run's simulation is told (``on_int_holder``),
    which judges whether another live wrapper plans into it too (found from the wrapper objects, whatever the
    builder reports in ``bound_workspaces()``)."""
    from pytest_kvprofile.memory.torch_mode import active_simulation

    sim = active_simulation()
    callback = getattr(sim, "on_int_holder", None)
    if callback is not None:
        callback(alloc, wrapper, attr)


def _flashinfer_packbits_loader() -> Callable[..., object] | None:
    """FlashInfer's quantization module loader (``flashinfer.quantization.packbits.get_quantization_module``), if
    this install has one."""
    try:  # by its module name: the package's ``packbits`` attribute is the function of that name
        packbits = importlib.import_module("flashinfer.quantization.packbits")
    except ImportError:
        return None
    return getattr(packbits, "get_quantization_module", None)


def _flashinfer_mla_loader() -> Callable[..., object] | None:
    """FlashInfer's batch MLA module loader (``flashinfer.mla.get_batch_mla_module``), if this install has one."""
    try:
        from flashinfer import mla
    except ImportError:  # an install without the MLA package keeps the other loaders served
        return None
    return getattr(mla, "get_batch_mla_module", None)


@contextmanager
def simulated_gpu_on(device: SimDevice, gpu: str | GpuSpec | None = None, *,
                     flashinfer: bool | None = None) -> Iterator[SimDevice]:
    """FlashInfer's view of an existing ``device`` for the block: ``torch.version.cuda``, FlashInfer's device
    caches cleared on entry and exit, its batch prefill/decode loaders answered by host modules planning for
    ``device``'s SM count, any other JIT build refused.

    Why separate from :func:`simulated_gpu`: the lifecycle driver already serves torch "cuda" from the run's
    own device (``SimulatedCuda``); this adds what a real-wrapper backend needs on that same device. Enter it
    *outside* ``SimulatedCuda(device)``, which reads the compute capability on entry: a device without one
    (``(0, 0)``) takes ``gpu``'s for the block (a catalog name or :class:`GpuSpec`; Hopper's when neither
    has one). ``flashinfer``: None patches FlashInfer if it is imported, now or by the block's code (a block that
    never imports it does not pay the import), True imports and patches it, False leaves it alone.
    """
    import torch.version

    patches = _Patches()
    if tuple(device.compute_capability) == (0, 0):
        spec = lookup_gpu(gpu) if isinstance(gpu, str) else gpu
        cc = spec.compute_capability if spec is not None and spec.compute_capability != (0, 0) else None
        patches.set(device, "compute_capability", cc or DEFAULT_COMPUTE_CAPABILITY)
    fi_patches = _Patches()
    patched = False

    def patch_flashinfer() -> None:
        nonlocal patched
        clear_flashinfer_caches()
        _patch_flashinfer(fi_patches, device)
        patched = True

    hook: _PatchOnImport | None = None
    try:
        patches.set(torch.version, "cuda", SIMULATED_CUDA_VERSION)
        if flashinfer or (flashinfer is None and "flashinfer" in sys.modules):
            patch_flashinfer()
        elif flashinfer is None and importlib.util.find_spec("flashinfer") is not None:
            hook = _PatchOnImport(patch_flashinfer)  # imported only if the block's code imports it (3 s)
        yield device
    finally:
        if hook is not None:
            hook.remove()
        fi_patches.undo()
        patches.undo()
        if patched:
            clear_flashinfer_caches()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patch`` right after ``flashinfer`` is first imported, until :meth:`remove`: a block whose code never
    imports FlashInfer does not pay its import. An import finishing after ``remove`` (on another thread) patches
    nothing."""

    def __init__(self, patch: Callable[[], None]) -> None:
        self._patch: Callable[[], None] | None = patch
        self._lock = threading.Lock()  # a patch under way on an import thread finishes before remove() returns
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        with self._lock:
            self._patch = None
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name != "flashinfer" or self._patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenPatch(spec.loader, self)
                return spec
        return None

    def loaded(self) -> None:
        with self._lock:
            patch, self._patch = self._patch, None
            if patch is not None:
                patch()


class _ThenPatch(importlib.abc.Loader):
    """``loader``, then the hook's patch once the module has run."""

    def __init__(self, loader: importlib.abc.Loader, hook: _PatchOnImport) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._hook.loaded()

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)


@contextmanager
def simulated_gpu(gpu: str | GpuSpec, *, total_memory: int | None = None, nontorch_bytes: int = 0,
                  record_stacks: bool = False, flashinfer: bool | None = None) -> Iterator[SimDevice]:
    """Torch "cuda" is a simulated ``gpu`` (catalog name or :class:`GpuSpec`) for the block; yields its device.

    ``total_memory`` overrides the catalog's bytes. ``flashinfer``: None patches FlashInfer if it is imported, now
    or by the block's code, True imports and patches it, False leaves it alone. Everything is restored on exit,
    FlashInfer's device caches included.
    """
    from pytest_kvprofile.memory.torch_mode import SimulatedCuda

    device = _resolve(gpu, total_memory, nontorch_bytes, record_stacks)
    with simulated_gpu_on(device, flashinfer=flashinfer), SimulatedCuda(device):
        yield device
