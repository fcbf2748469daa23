"""pytest side of the GPU tier: worker pinning, case selection, the CUDA device factory, fixtures.

Registered by the plugin on both tiers (so the fixtures exist and skip with a reason on the CPU
tier). Registration happens inside the plugin's ``pytest_configure``; ``pytest_configure`` is a
historic hook, so this module's runs as soon as it is registered, before any test imports torch.cuda.
Nothing here creates a CUDA context: pinning and case selection read NVML.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_kvprofile.gpu.cuda_device import CudaDeviceFactory
    from pytest_kvprofile.gpu.pinning import WorkerPin
    from pytest_kvprofile.gpu.selection import CaseSelection
    from pytest_kvprofile.gpu.topology import GpuTopology
    from pytest_kvprofile.matrix.cases import Case
    from pytest_kvprofile.plugin.session import KvprofileSession

PIN_KEY: pytest.StashKey[WorkerPin | None] = pytest.StashKey()
SELECTION_KEY: pytest.StashKey[CaseSelection] = pytest.StashKey()
CUDA_ERROR_NOT_INITIALIZED = 3
CPU_TIER_REASON = "GPU tier: pass --kvprofile-gpu on a machine with a CUDA device"


def _state(config: pytest.Config) -> KvprofileSession | None:
    from pytest_kvprofile.plugin.session import SESSION_KEY

    return config.stash.get(SESSION_KEY, None)


def gpu_tier(config: pytest.Config) -> bool:
    state = _state(config)
    if state is not None:
        return state.tier == "gpu"
    opt = getattr(config.option, "kvprofile_gpu", None)
    return bool(opt if opt is not None else config.getini("kvprofile_gpu"))


def _cuda_initialized() -> bool:
    """Whether CUDA read CUDA_VISIBLE_DEVICES already: torch's lazy init ran, or anything (a conftest
    calling ``torch.cuda.is_available()``, which runs ``cuInit`` without initializing torch) did."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    return driver_initialized()


def driver_initialized(maps: str | None = None, cdll: Callable[..., ctypes.CDLL] = ctypes.CDLL) -> bool:
    """``cuInit`` has run in this process: libcuda is mapped, and ``cuDeviceGetCount`` answers
    something other than CUDA_ERROR_NOT_INITIALIZED. Loads nothing that is not loaded already."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return False
    if "/libcuda.so" not in maps:
        return False
    try:
        lib = cdll("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
    except OSError:
        return False
    count = ctypes.c_int(0)
    return int(lib.cuDeviceGetCount(ctypes.byref(count))) != CUDA_ERROR_NOT_INITIALIZED


def _device_count() -> int:
    """GPUs NVML counts (no CUDA context)."""
    from pytest_kvprofile.gpu.nvml import cuda_device_count

    return cuda_device_count()[0]


def _preview(config: pytest.Config) -> str | None:
    """Why the GPU tier only lists its cases here (``--collect-only`` without a CUDA device), or None."""
    state = _state(config)
    return getattr(state, "gpu_preview", None)


def pytest_configure(config: pytest.Config) -> None:
    if not gpu_tier(config) or _preview(config):
        return
    if hasattr(config, "workerinput"):
        from pytest_kvprofile.gpu.pinning import PinningError, apply_pinning

        count = _device_count()
        try:
            pin = apply_pinning(os.environ, count, cuda_initialized=_cuda_initialized())
        except PinningError as exc:
            raise pytest.UsageError(str(exc)) from None
        config.stash[PIN_KEY] = pin
    state = _state(config)
    if state is not None:
        selection = select_for_this_gpu(state.cases)
        config.stash[SELECTION_KEY] = selection
        state.cases = list(selection.run)


def select_for_this_gpu(cases: list[Case], topology: GpuTopology | None = None) -> CaseSelection:
    """The cases that fit the GPU this process will use (NVML and the catalog; no CUDA context)."""
    from pytest_kvprofile.gpu.selection import device_facts, select_cases
    from pytest_kvprofile.gpu.topology import TopologyError, detect_topology

    try:
        facts = device_facts(topology if topology is not None else detect_topology())
    except TopologyError as exc:
        raise pytest.UsageError(f"--kvprofile-gpu: cannot tell which cases fit this GPU: {exc}") from None
    return select_cases(cases, facts)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Hand the plugin's session the CUDA device factory (and, on the controller, the hardware
    description for the JSON report). Done here rather than in pytest_configure so that it works
    whether this module was registered before or after the plugin built its session."""
    config = session.config
    state = _state(config)
    if state is None or not gpu_tier(config) or _preview(config):
        return
    from pytest_kvprofile.gpu.cuda_device import CudaDeviceFactory

    state.device_factory = CudaDeviceFactory(0)
    if not hasattr(config, "workerinput"):
        state.hardware = controller_hardware()
        selection = config.stash.get(SELECTION_KEY, None)
        if selection is not None:
            state.hardware["case_selection"] = selection.as_dict()


def controller_hardware() -> dict[str, object]:
    """What the JSON report records about the machine: NVML and package versions, no CUDA context."""
    from importlib import metadata

    from pytest_kvprofile.gpu.topology import TopologyError, detect_topology

    doc: dict[str, object] = {}
    try:
        doc["topology"] = detect_topology().as_dict()
    except TopologyError as exc:
        doc["topology_error"] = str(exc)
    for pkg in ("torch", "flashinfer-python", "nvidia-ml-py"):
        try:
            doc[f"{pkg}_version"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            doc[f"{pkg}_version"] = None
    return doc


def pytest_report_header(config: pytest.Config) -> str | None:
    if not gpu_tier(config) or hasattr(config, "workerinput"):
        return None
    preview = _preview(config)
    if preview:
        return (f"kvprofile-gpu: {preview}: every case of the matrix is listed; a GPU runner runs those that fit "
                "its GPUs (its header names them)")
    from pytest_kvprofile.gpu.topology import TopologyError, detect_topology

    try:
        lines = [f"kvprofile-gpu: {detect_topology().describe()}"]
    except TopologyError as exc:
        lines = [f"kvprofile-gpu: topology unavailable ({exc})"]
    selection = config.stash.get(SELECTION_KEY, None)
    return "\n".join(lines + (selection.summary() if selection is not None else []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """Repeat what the GPU tier skipped and why at the end, where a reader looks for it."""
    selection = config.stash.get(SELECTION_KEY, None)
    if selection is None or hasattr(config, "workerinput"):
        return
    terminalreporter.section("kvprofile-gpu case selection")
    for line in selection.summary():
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def gpu_topology(request: pytest.FixtureRequest) -> GpuTopology:
    """The machine's GPUs, with SM counts and capability from torch (this process's view)."""
    if not gpu_tier(request.config):
        pytest.skip(CPU_TIER_REASON)
    from pytest_kvprofile.gpu.topology import detect_topology

    topo = detect_topology(use_torch=True)
    if not topo.visible:
        pytest.fail(f"--kvprofile-gpu: no GPU is visible to this process ({topo.describe()}, "
                    f"CUDA_VISIBLE_DEVICES={topo.cuda_visible_devices!r})", pytrace=False)
    return topo


@pytest.fixture(scope="session")
def gpu_device_factory(request: pytest.FixtureRequest, gpu_topology: GpuTopology) -> CudaDeviceFactory:
    """The session's CudaDeviceFactory (``run_lifecycle(..., device_factory=...)``)."""
    state = _state(request.config)
    factory = getattr(state, "device_factory", None)
    if factory is None:
        from pytest_kvprofile.gpu.cuda_device import CudaDeviceFactory

        factory = CudaDeviceFactory(0)
    return factory
