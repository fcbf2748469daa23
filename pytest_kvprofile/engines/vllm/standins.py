"""The stand-ins vLLM's FlashInfer builder needs on a CPU-only machine, each installed only for a run.

Why each exists (docs/vllm.md, "Stand-ins"):

- :func:`standin_platform`: vLLM's CUDA platform loads ``libcuda``/NVML; the stand-in is a CUDA-kind
  ``Platform`` answering the case's GPU (compute capability, name, memory), so every
  ``current_platform.is_device_capability(...)`` branch in the builder takes that GPU's side.
- :func:`no_nvidia_artifactory`: ``vllm.utils.flashinfer.has_nvidia_artifactory`` probes NVIDIA's
  artifactory over the network (5 s timeout); the stand-in answers False, as vLLM does offline, which turns
  the trtllm-gen routes off (the simulated device runs FlashInfer's native wrappers only).
- :func:`host_copy_page_indices`: ``_copy_page_indices_kernel`` is a Triton kernel; the stand-in does the
  same copy (each request's block-table row into the flat page-index array) on the host tensors.
- :func:`dcp_group`: vLLM reads the decode-context-parallel group from ``parallel_state._DCP``, which only
  ``torch.distributed`` initialisation creates; the stand-in is rank 0 of a group of the case's size.
- :func:`vllm_caches_cleared`: vLLM memoizes platform answers (``supports_trtllm_attention``, ...) per
  process; they are cleared on entry and exit so one GPU's answers never leak into the next case.

``torch.version.cuda`` and ``torch.cuda.device`` are the simulated device's (``simulated_gpu_on`` and torch
mode) inside a lifecycle; :func:`cuda_version` covers the import and configuration outside one.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeAlias

from pytest_kvprofile.engines.adapter import EngineUnavailable, Patches, import_engine
from pytest_kvprofile.matrix.gpus import GpuSpec
from pytest_kvprofile.memory.simulated_gpu import loaded_modules

if TYPE_CHECKING:
    from types import ModuleType

    from torch import Tensor
    from vllm.config import VllmConfig
    from vllm.platforms.interface import Platform

# the stand-in Platform subclass: defined inside _standin_platform_cls (vLLM is imported lazily), so its gpu and
# ranks class attributes have no type mypy can see here
StandinPlatformClass: TypeAlias = Any

__all__ = [
    "VLLM_INSTALL_HINT",
    "VllmUnavailable",
    "cuda_version",
    "dcp_group",
    "host_copy_page_indices",
    "import_vllm_flashinfer",
    "no_nvidia_artifactory",
    "standin_platform",
    "vllm_caches_cleared",
    "vllm_standins",
]

VLLM_INSTALL_HINT = "scripts/install_vllm_cpu.sh .venv (pip install --no-deps vllm + requirements/vllm-cpu.txt)"
_BACKEND_MODULE = "vllm.v1.attention.backends.flashinfer"
_SIM_CUDA_VERSION = "13.0"


class VllmUnavailable(EngineUnavailable):
    """vLLM (or one of its pure-Python dependencies) is not importable; the message names the install."""


# -- the platform ---------------------------------------------------------------------------------------------

_platform_cls: StandinPlatformClass = None


def _standin_platform_cls() -> StandinPlatformClass:
    """The stand-in platform class (made once: vLLM modules bind ``current_platform`` at their import)."""
    global _platform_cls
    if _platform_cls is None:
        import torch
        from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

        class KvprofileCudaPlatform(Platform):  # type: ignore[misc,unused-ignore]  # Any without vLLM
            """A CUDA-kind platform answering the simulated GPU; no device queries, no libcuda."""

            _enum = PlatformEnum.CUDA
            device_name = "cuda"
            device_type = "cuda"
            dispatch_key = "CUDA"
            ray_device_key = "GPU"
            dist_backend = "nccl"
            device_control_env_var = "CUDA_VISIBLE_DEVICES"
            gpu: GpuSpec | None = None
            ranks = 1  # GPUs in the node: every rank of the case's layout

            @classmethod
            def device_count(cls) -> int:
                return cls.ranks

            @classmethod
            def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
                if cls.gpu is None:
                    return None
                return DeviceCapability(*cls.gpu.compute_capability)

            @classmethod
            def get_device_name(cls, device_id: int = 0) -> str:
                return cls.gpu.name if cls.gpu is not None else "kvprofile simulated GPU"

            @classmethod
            def get_device_total_memory(cls, device_id: int = 0) -> int:
                return cls.gpu.memory_bytes if cls.gpu is not None else 0

            @classmethod
            def is_pin_memory_available(cls) -> bool:
                return True

            @classmethod
            def fp8_dtype(cls) -> torch.dtype:
                return torch.float8_e4m3fn

            @classmethod
            def support_static_graph_mode(cls) -> bool:
                return True

            @classmethod
            def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
                return None

        _platform_cls = KvprofileCudaPlatform
    return _platform_cls


@contextlib.contextmanager
def standin_platform(gpu: GpuSpec | None, ranks: int = 1) -> Iterator[Platform]:
    """vLLM's ``current_platform`` is the stand-in answering ``gpu`` for the block; the previous one after.

    Modules that bound ``current_platform`` at import keep the object they bound, so vLLM's attention modules
    are imported with the stand-in current (:func:`import_vllm_flashinfer`); its answers are class-level, so
    that object answers whichever GPU the block is for."""
    import vllm.platforms as platforms

    cls = _standin_platform_cls()
    current = platforms._current_platform
    previous = cls.gpu, cls.ranks
    platform = current if isinstance(current, cls) else cls()
    cls.gpu, cls.ranks = gpu, ranks
    platforms._current_platform = platform
    try:
        yield platform
    finally:
        cls.gpu, cls.ranks = previous
        platforms._current_platform = current


# -- the network probe ----------------------------------------------------------------------------------------

def _offline() -> bool:
    """``has_nvidia_artifactory`` as vLLM answers without network access."""
    return False


@contextlib.contextmanager
def no_nvidia_artifactory() -> Iterator[None]:
    """``has_nvidia_artifactory`` answers False for the block, wherever vLLM imported it by name."""
    import vllm.utils.flashinfer as fi_utils

    original = fi_utils.has_nvidia_artifactory
    patches = Patches()
    for module in _modules_binding_artifactory():
        if getattr(module, "has_nvidia_artifactory", None) is original:
            patches.set(module, "has_nvidia_artifactory", _offline)
    try:
        yield
    finally:
        patches.undo()


# -- the Triton kernel ----------------------------------------------------------------------------------------

class HostCopyPageIndices:
    """``_copy_page_indices_kernel[(num_reqs,)](out, block_table, stride, indptr, BLOCK_SIZE=...)`` on the host:
    request ``i``'s first ``indptr[i+1] - indptr[i]`` block-table entries go to ``out[indptr[i]:indptr[i+1]]``."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return self._launch

    @staticmethod
    def _launch(page_indices: Tensor, block_table: Tensor, block_table_stride: int, indptr: Tensor,
                **_: object) -> None:
        """The copy through NumPy views of both tensors: one torch call each (the simulation sees the kernel read
        the block table and write the output), then one masked gather: row ``i``'s first ``len_i`` entries, rows in
        order, are exactly the output's ``indptr[i]:indptr[i+1]`` runs laid end to end."""
        import numpy as np

        bounds = indptr.numpy()
        out, table = page_indices.numpy(), block_table.numpy()
        lens = np.diff(bounds)
        if not len(lens):
            return
        rows = table[:len(lens), :int(lens.max(initial=0))]
        out[int(bounds[0]):int(bounds[-1])] = rows[np.arange(rows.shape[1]) < lens[:, None]]


@contextlib.contextmanager
def host_copy_page_indices() -> Iterator[None]:
    """vLLM's FlashInfer backend copies page indices with :class:`HostCopyPageIndices` for the block."""
    module = sys.modules[_BACKEND_MODULE]
    patches = Patches()
    if hasattr(module, "_copy_page_indices_kernel"):
        patches.set(module, "_copy_page_indices_kernel", HostCopyPageIndices())
    try:
        yield
    finally:
        patches.undo()


# -- the DCP group --------------------------------------------------------------------------------------------

class StandinGroup:
    """Rank 0 of a ``world_size`` process group, as far as a metadata builder reads one."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rank_in_group = 0
        self.rank = 0
        self.ranks = list(range(world_size))
        self.local_rank = 0
        self.device_group = None
        self.cpu_group = None


@contextlib.contextmanager
def dcp_group(world_size: int) -> Iterator[None]:
    """``parallel_state._DCP`` is a :class:`StandinGroup` of ``world_size`` for the block (none when 1)."""
    import vllm.distributed.parallel_state as ps

    patches = Patches()
    if world_size > 1:
        patches.set(ps, "_DCP", StandinGroup(world_size))
    try:
        yield
    finally:
        patches.undo()


# -- caches and torch ------------------------------------------------------------------------------------------

_BOUND: tuple[list[tuple[str, ModuleType]] | None, list[ModuleType]] = (None, [])


def _modules_binding_artifactory() -> list[ModuleType]:
    """vLLM's imported modules that bind a ``has_nvidia_artifactory``, found again only when a module is imported
    (every builder call asks)."""
    global _BOUND
    modules = loaded_modules("vllm")
    if modules is not _BOUND[0]:
        _BOUND = (modules, [m for _n, m in modules if "has_nvidia_artifactory" in getattr(m, "__dict__", {})])
    return _BOUND[1]


# module -> (its identity and size, its caches)
_CACHED_FUNCTIONS: dict[str, tuple[tuple[int, int], list[functools._lru_cache_wrapper[object]]]] = {}


def _clear_vllm_caches() -> None:
    """Clear the memoized functions of vLLM's platform-reading modules (found again only when a module's namespace
    changes: every builder call clears them)."""
    for name in ("vllm.utils.flashinfer", _BACKEND_MODULE, "vllm.utils.torch_utils", "vllm.platforms.interface"):
        module = sys.modules.get(name)
        if module is None:
            continue
        namespace = vars(module)
        key = (id(module), len(namespace))
        cached = _CACHED_FUNCTIONS.get(name)
        if cached is None or cached[0] != key:
            cached = _CACHED_FUNCTIONS[name] = (key, [
                value for value in list(namespace.values())
                if isinstance(value, functools._lru_cache_wrapper) and getattr(value, "__module__", "") == name])
        for value in cached[1]:
            value.cache_clear()


@contextlib.contextmanager
def vllm_caches_cleared() -> Iterator[None]:
    """vLLM's memoized platform answers are cleared on entry and exit."""
    _clear_vllm_caches()
    try:
        yield
    finally:
        _clear_vllm_caches()


@contextlib.contextmanager
def cuda_version() -> Iterator[None]:
    """``torch.version.cuda`` reads a CUDA version for the block (a CPU build's is None; vLLM and FlashInfer
    branch on it), unless something (the simulated device) already set one."""
    import torch.version

    patches = Patches()
    if torch.version.cuda is None:
        patches.set(torch.version, "cuda", _SIM_CUDA_VERSION)
    try:
        yield
    finally:
        patches.undo()


@contextlib.contextmanager
def vllm_standins(gpu: GpuSpec | None, dcp: int = 1, ranks: int = 1) -> Iterator[ModuleType]:
    """Every stand-in for the block, on ``gpu`` (a node of ``ranks`` of them) with a DCP group of ``dcp``; yields
    vLLM's FlashInfer backend module (imported on first use, with the stand-in platform current)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_version())
        stack.enter_context(standin_platform(gpu, ranks))
        module = import_vllm_flashinfer()
        stack.enter_context(vllm_caches_cleared())
        stack.enter_context(no_nvidia_artifactory())
        stack.enter_context(host_copy_page_indices())
        stack.enter_context(dcp_group(dcp))
        yield module


def import_vllm_flashinfer() -> ModuleType:
    """vLLM's FlashInfer backend module; :class:`VllmUnavailable` naming the install when it cannot be imported.

    Import it with the stand-in platform current (:func:`vllm_standins` does): vLLM's modules bind
    ``current_platform`` when they are first imported."""
    module = sys.modules.get(_BACKEND_MODULE)
    if module is not None:
        return module
    return import_engine(_import_backend, what="vLLM's FlashInfer backend", install_hint=VLLM_INSTALL_HINT,
                         unavailable=VllmUnavailable, thread_name="kvprofile-vllm-import")


def _import_backend() -> ModuleType:
    """The import, with the stand-in platform current (on its own thread: :func:`import_engine`)."""
    import importlib

    with cuda_version(), standin_platform(_standin_platform_cls().gpu, _standin_platform_cls().ranks):
        return importlib.import_module(_BACKEND_MODULE)
