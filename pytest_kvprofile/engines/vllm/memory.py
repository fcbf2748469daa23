"""vLLM's own ``memory_profiling`` (``vllm/utils/mem_utils.py``) around the lifecycle's profiling window.

The harness's KV arithmetic (``memory/budget.py``) has the shape of vLLM 0.33's ``memory_profiling`` and
``determine_available_memory``; this observer runs vLLM's code on the same simulated device so the two stand side
by side, case by case. vLLM takes its before-instance snapshot after the CUDA context and NCCL are up, so those
non-torch bytes are outside its non-KV figure (they sit in the 1 - gmu margin); the harness counts them. The one
expected difference is therefore the device's non-torch bytes (``non_kv_difference``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, TypeAlias

from pytest_kvprofile.memory.device import Device

NAME = "vllm.memory_profiling"
# vLLM's MemorySnapshot, its memory_profiling context and that context's result: each made by an earlier step of the
# window (None before it), and read without a None check
VllmMeasurement: TypeAlias = Any


@contextlib.contextmanager
def _torch_on(device: Device) -> Iterator[None]:
    """torch "cuda" (and ``torch.accelerator``) answered by ``device``: the run's own simulation when it is in torch
    mode on this device, a scope of its own otherwise; the GPU tier's device already is torch's."""
    from pytest_kvprofile.memory.device import SimDevice
    from pytest_kvprofile.memory.torch_mode import SimulatedCuda, active_simulation

    sim = active_simulation()
    if not isinstance(device, SimDevice) or (sim is not None and sim.device is device):
        yield
        return
    with SimulatedCuda(device):
        yield


class VllmMemoryProfiling:
    """The window as vLLM measures it: ``MemorySnapshot`` before the instance, ``memory_profiling`` around the
    profile run. ``window_closes`` returns vLLM's ``non_kv_cache_memory``; ``result`` keeps the whole
    ``MemoryProfilingResult`` for inspection."""

    name = NAME

    def __init__(self) -> None:
        self._before: VllmMeasurement = None
        self._profiling: VllmMeasurement = None
        self.result: VllmMeasurement = None

    def before_instance(self, device: Device) -> None:
        import torch
        from vllm.utils.mem_utils import MemorySnapshot

        with _torch_on(device):
            self._before = MemorySnapshot(device=torch.device("cuda", 0))

    def window_opens(self, device: Device) -> None:
        from vllm.utils.mem_utils import memory_profiling

        with _torch_on(device):
            self._profiling = memory_profiling(self._before)
            self.result = self._profiling.__enter__()

    def window_closes(self, device: Device) -> int:
        with _torch_on(device):
            self._profiling.__exit__(None, None, None)
        return int(self.result.non_kv_cache_memory)


def non_kv_difference(device: Device) -> int:
    """What the harness counts as non-KV and vLLM does not: the non-torch bytes present before the instance."""
    return int(getattr(device, "nontorch_bytes", 0))
