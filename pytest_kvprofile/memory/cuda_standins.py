"""The ``torch.cuda`` objects torch mode hands out in place of real ones: properties, streams, events, generators.

Work on a simulated device completes at once, so every stand-in answers "done" and waits for nothing. The graph
stand-ins, which capture into the device's pools, stay with :class:`~pytest_kvprofile.memory.torch_mode.SimulatedCuda`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

__all__ = ["CUDA0", "DEFAULT_STREAM", "DeviceProperties", "SimDeviceGuard", "SimEvent", "SimGenerator", "SimStream",
           "no_op", "sim_stream"]

CUDA0 = torch.device("cuda", 0)


@dataclass(frozen=True)
class DeviceProperties:
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
        self.device = CUDA0
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


DEFAULT_STREAM = SimStream()
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


class SimDeviceGuard:
    """Stands in for ``torch.cuda.device(...)``: there is one simulated device, index 0."""

    def __init__(self, device: object = None) -> None:
        self.idx = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


@contextmanager
def sim_stream(stream: object = None) -> Iterator[None]:
    yield


def no_op(*_: object, **__: object) -> None:
    return None
