"""The stand-ins SGLang's import and its FlashInfer attention backend need on a CPU-only machine, each installed only
for a block and undone after (never at plugin import).

Why each exists (docs/sglang.md, "Stand-ins"):

- :func:`triton_standin`: every ``import sglang...`` reaches ``import triton`` (``sglang/srt/utils/common.py``), and
  SGLang's modules define Triton kernels at import (``@triton.jit``, ``tl.constexpr`` annotations, autotune
  configs). No kernel is launched on the path the adapter drives; the stand-in is a module whose every attribute is a
  stand-in (a pass-through decorator when called, a class when capitalized), as SGLang's own macOS stub
  (``sglang/_platform_stubs.py``) makes it. Only where the real Triton is not importable.
- :func:`torchvision_standin`: ``sglang/srt/configs/__init__.py`` imports ``torchvision.transforms`` at import
  (InternVL's image utilities), which ``ModelConfig`` and the backends reach. transformers is asked about torchvision
  before the stand-in exists, so it never takes the stand-in for a torchvision. Only around the import.
- :func:`flashinfer_available`: SGLang's backends import FlashInfer's wrappers only under
  ``is_flashinfer_available()``, which is ``find_spec("flashinfer") and is_cuda()``: false on a CPU build of torch,
  and then the wrapper names are simply undefined in the backend module. The stand-in answers True in
  ``sglang.srt.utils`` and ``sglang.srt.utils.common`` (the backends bind it from the first); nothing else of
  ``is_cuda()`` changes, so no ``sgl_kernel`` is needed.
- :func:`sglang_platform`: SGLang reads the machine from ``get_platform()`` (``is_sm100`` picks the prefill FMHA
  backend, ...), whose probes are memoized per process. The stand-in is SGLang's own scoped
  ``override_platform(...)`` answering the case's GPU.
- :func:`sglang_env_restored`: SGLang writes process environment variables: its import points third-party caches at
  its own directory, and ``FlashInferAttnBackend.__init__`` ``.set()``s ``SGLANG_FLASHINFER_WORKSPACE_SIZE`` (512 MiB
  for Qwen2/Qwen3 architectures, 2 GiB in deterministic mode; sglang#30244), which would size the next case's
  workspace. Every variable is put back after the block.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, Iterator

from pytest_kvprofile.engines.adapter import EngineUnavailable, Patches, import_engine, module_standin
from pytest_kvprofile.matrix.gpus import GpuSpec

# An SGLang, torch or numpy object: each is imported lazily (never at plugin import), and SGLang ships no types
SglangValue = Any

__all__ = [
    "BACKEND_MODULE",
    "SGLANG_INSTALL_HINT",
    "SglangUnavailable",
    "cpu_machine",
    "flashinfer_available",
    "import_sglang_flashinfer",
    "sglang_env_restored",
    "sglang_platform",
    "sglang_standins",
    "torchvision_standin",
    "triton_standin",
]

SGLANG_INSTALL_HINT = "scripts/install_sglang_cpu.sh .venv (pip install --no-deps sglang + its pinned pure-Python set)"
BACKEND_MODULE = "sglang.srt.layers.attention.flashinfer_backend"
# What the adapter imports with the backend, while the import stand-ins are current
_WITH_BACKEND = ("sglang.srt.server_args", "sglang.srt.configs.model_config", "sglang.srt.runtime_context",
                 "sglang.srt.model_executor.forward_batch_info")
_TRITON_VERSION = "3.0.0"  # what SGLang's own Triton stub answers (sglang/_platform_stubs.py)


class SglangUnavailable(EngineUnavailable):
    """SGLang (or one of its pure-Python dependencies) is not importable; the message names the install."""


# -- module stand-ins -------------------------------------------------------------------------------------------

class _StandinBase:
    """What a capitalized stand-in attribute is: a class SGLang may subclass or name in ``isinstance``."""


class StandinModule(types.ModuleType):
    """A module whose every attribute is a stand-in: a child :class:`StandinModule`, or a class for a capitalized
    name; called, it is a pass-through decorator (``@triton.jit``, ``@triton.autotune(...)``). Falsy and empty, as
    SGLang's own stub."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__package__ = name
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def __getattr__(self, name: str) -> SglangValue:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        value: SglangValue = (type(name, (_StandinBase,), {"__module__": self.__name__}) if name[:1].isupper()
                      else StandinModule(full))
        object.__setattr__(self, name, value)
        return value

    def __call__(self, *args: SglangValue, **kwargs: SglangValue) -> SglangValue:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Iterator[SglangValue]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __contains__(self, item: SglangValue) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<kvprofile stand-in {self.__name__!r}>"


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import top.sub`` finds a :class:`StandinModule` for every submodule of ``top`` while the finder is in
    ``sys.meta_path``."""

    def __init__(self, top: str, made: list[str]) -> None:
        self.top = top
        self.made = made

    def find_spec(self, fullname: str, path: SglangValue = None, target: SglangValue = None) -> SglangValue:
        if not fullname.startswith(self.top + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: SglangValue) -> SglangValue:
        self.made.append(spec.name)
        return StandinModule(spec.name)

    def exec_module(self, module: SglangValue) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent in sys.modules:
            object.__setattr__(sys.modules[parent], child, module)


def _real(name: str) -> bool:
    """``name`` is importable as a real module (or already imported)."""
    if name in sys.modules:
        return not isinstance(sys.modules[name], StandinModule)
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _package_standin(top: str, make: SglangValue) -> Iterator[None]:
    """``top`` and any ``top.*`` submodule are stand-ins for the block (unless the real one is importable); every
    stand-in module is dropped from ``sys.modules`` after (modules that bound one keep it)."""
    if _real(top):
        yield
        return
    made: list[str] = []
    finder = _StandinFinder(top, made)
    sys.meta_path.insert(0, finder)
    try:
        with module_standin(top, make):
            yield
    finally:
        sys.meta_path.remove(finder)
        for name in made:
            if isinstance(sys.modules.get(name), StandinModule):
                del sys.modules[name]
        for name in [n for n, m in list(sys.modules.items()) if n.startswith(top + ".")
                     and isinstance(m, StandinModule)]:
            del sys.modules[name]


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1


class _Config:
    """``triton.Config(kwargs, num_warps=, num_stages=)`` as autotune tables name it."""

    def __init__(self, kwargs: SglangValue = None, num_warps: int = 4, num_stages: int = 2,
                 **extra: SglangValue) -> None:
        self.kwargs = kwargs or {}
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.extra = extra


def make_triton() -> StandinModule:
    """The ``triton`` stand-in: the helpers SGLang calls at import as Triton computes them, every other name a
    stand-in."""
    triton = StandinModule("triton")
    for name, value in (("__version__", _TRITON_VERSION), ("cdiv", _cdiv), ("next_power_of_2", _next_power_of_2),
                        ("Config", _Config)):
        object.__setattr__(triton, name, value)
    return triton


@contextlib.contextmanager
def triton_standin() -> Iterator[None]:
    """``triton`` and ``triton.*`` are stand-ins for the block, where the real Triton is not importable."""
    with _package_standin("triton", make_triton):
        yield


def make_torchvision() -> StandinModule:
    import enum

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    torchvision = StandinModule("torchvision")
    object.__setattr__(torchvision, "__version__", "0.0.0+kvprofile-standin")
    transforms = StandinModule("torchvision.transforms")
    functional = StandinModule("torchvision.transforms.functional")
    for module in (transforms, functional):
        object.__setattr__(module, "InterpolationMode", InterpolationMode)
    object.__setattr__(transforms, "functional", functional)
    object.__setattr__(torchvision, "transforms", transforms)
    return torchvision


@contextlib.contextmanager
def torchvision_standin() -> Iterator[None]:
    """``torchvision`` (``transforms``, ``transforms.functional`` with ``InterpolationMode``) is a stand-in for the
    block, where the real one is not importable; transformers has answered whether torchvision is available first."""
    if _real("torchvision"):
        yield
        return
    with contextlib.suppress(ImportError):
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()  # memoized: asked before the stand-in exists
    made = make_torchvision()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_package_standin("torchvision", lambda: made))
        for name in ("torchvision.transforms", "torchvision.transforms.functional"):
            stack.enter_context(module_standin(name, functools.partial(_attr_path, made, name)))
        yield


def _attr_path(root: SglangValue, name: str) -> SglangValue:
    for part in name.split(".")[1:]:
        root = getattr(root, part)
    return root


# -- SGLang's own answers -------------------------------------------------------------------------------------------

def _available() -> bool:
    """``is_flashinfer_available()`` as on a CUDA machine with FlashInfer installed."""
    return True


@contextlib.contextmanager
def flashinfer_available() -> Iterator[None]:
    """``is_flashinfer_available()`` answers True for the block, in ``sglang.srt.utils.common`` and every SGLang module
    that bound it by name (imports ``sglang.srt.utils``, which needs :func:`triton_standin` current)."""
    import sglang.srt.utils as utils
    import sglang.srt.utils.common as common

    original = common.is_flashinfer_available
    patches = Patches()
    for module in (common, utils, *[m for n, m in list(sys.modules.items()) if n.startswith("sglang.")
                                    and m is not None and m not in (common, utils)]):
        if getattr(module, "__dict__", {}).get("is_flashinfer_available") is original:
            patches.set(module, "is_flashinfer_available", _available)
    try:
        yield
    finally:
        patches.undo()


def platform_facts(gpu: GpuSpec | None) -> dict[str, SglangValue]:
    """The facts SGLang's ``get_platform()`` answers on ``gpu`` (a CUDA machine with FlashInfer)."""
    if gpu is None:
        return {"is_cuda": True, "has_flashinfer": True}
    major, minor = gpu.compute_capability
    return {
        "is_cuda": True, "is_hip": False, "is_npu": False, "is_xpu": False, "is_musa": False, "is_mps": False,
        "is_sm90": major == 9, "is_sm100": major == 10, "is_sm100_or_sm110": major in (10, 11),
        "is_sm110": major == 11, "is_sm120": major == 12, "is_blackwell": major >= 10,
        "is_hopper_with_cuda_12_3": major == 9, "has_amx": False, "has_flashinfer": True,
        "device_sm": major * 10 + minor, "device_capability": (major, minor),
    }


@contextlib.contextmanager
def sglang_platform(gpu: GpuSpec | None) -> Iterator[SglangValue]:
    """SGLang's ``get_platform()`` answers ``gpu`` for the block (SGLang's own ``override_platform``); yields it.

    SGLang's default prefill CUDA-graph backend is asked of ``is_cuda()`` instead (``default_prefill_backend``:
    breakable on CUDA, disabled elsewhere), which this CPU machine answers False; for the block it answers as on
    the case's GPU, so a ``ServerArgs`` resolves as it does there (its memory heuristic and its post-capture KV
    sizing both read it)."""
    import sglang.srt.model_executor.cuda_graph_config as graph_config
    from sglang.srt.runtime_context import override_platform

    patches = Patches()
    patches.set(graph_config, "default_prefill_backend", _cuda_default_prefill_backend)
    try:
        with override_platform(**platform_facts(gpu)) as platform:
            yield platform
    finally:
        patches.undo()


def _cuda_default_prefill_backend() -> str:
    from sglang.srt.model_executor.cuda_graph_config import Backend

    return str(Backend.BREAKABLE)


@contextlib.contextmanager
def sglang_env_restored() -> Iterator[None]:
    """Every environment variable SGLang sets in the block is put back after it (removed where it was unset)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in before]:
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def sglang_standins(gpu: GpuSpec | None) -> Iterator[SglangValue]:
    """Every stand-in for a call into SGLang on ``gpu``; yields SGLang's FlashInfer backend module (imported on first
    use, with the import stand-ins current)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(sglang_env_restored())
        stack.enter_context(triton_standin())
        module = import_sglang_flashinfer()
        stack.enter_context(flashinfer_available())
        stack.enter_context(sglang_platform(gpu))
        yield module


def import_sglang_flashinfer() -> SglangValue:
    """SGLang's FlashInfer backend module, bound to the real FlashInfer; :class:`SglangUnavailable` naming the
    install when it cannot be imported."""
    module = sys.modules.get(BACKEND_MODULE)
    if module is not None:
        return module
    return import_engine(_import_backend, what="SGLang's FlashInfer attention backend",
                         install_hint=SGLANG_INSTALL_HINT, unavailable=SglangUnavailable,
                         thread_name="kvprofile-sglang-import")


@contextlib.contextmanager
def cpu_machine() -> Iterator[None]:
    """``torch.cuda.is_available()`` answers False for the block (a lifecycle's simulated device answers True).

    SGLang's import branches on ``is_cuda()`` (memoized for the process at its first call): on a CUDA machine it
    imports ``sgl_kernel``, DeepGEMM and the CUDA platform at import. The import is made to see the machine it runs
    on, a CPU one, wherever it happens (at collection or inside a run), so its memoized answers are the same in every
    process; what the backend reads of the GPU at run time comes from :func:`sglang_platform`."""
    import torch

    patches = Patches()
    patches.set(torch.cuda, "is_available", _no_cuda)
    try:
        yield
    finally:
        patches.undo()


def _no_cuda() -> bool:
    return False


@contextlib.contextmanager
def _import_warnings_quiet() -> Iterator[None]:
    """The warnings SGLang's import gives because it sees a CPU machine (:func:`cpu_machine`: "Only CUDA, ... support
    AWQ/GGUF ... currently") and the SWIG types one of its dependencies defines are not shown: they say nothing
    about this run. The import runs on its own thread while the caller waits, so the process-wide filters are put
    back before anything else runs."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Only .* support .* currently", category=UserWarning)
        warnings.filterwarnings("ignore", message=r"builtin type .* has no __module__ attribute",
                                category=DeprecationWarning)
        yield


def _import_backend() -> SglangValue:
    """The import with the stand-ins current (on its own thread: :func:`import_engine`), seeing the CPU machine:
    ``sglang.srt.utils`` first, then ``is_flashinfer_available`` answering True, then the backend and the modules the
    adapter uses."""
    with sglang_env_restored(), cpu_machine(), triton_standin(), torchvision_standin(), _import_warnings_quiet():
        importlib.import_module("sglang.srt.utils")
        with flashinfer_available():
            module = importlib.import_module(BACKEND_MODULE)
            for name in _WITH_BACKEND:
                importlib.import_module(name)
    if "BatchDecodeWithPagedKVCacheWrapper" not in vars(module):
        raise SglangUnavailable(f"{BACKEND_MODULE} imported without FlashInfer's wrappers (is_flashinfer_available() "
                                "was false at its import; was it imported before this adapter?)")
    return module
