"""What else may watch the profiling window: an engine's own profiler, held side by side with the harness's.

An observer sees the device before the engine instance exists (before the weights), when the window opens (the
baseline snapshot) and when it closes (before the closing measurement), and returns the non-KV bytes it measured;
the run records them per observer name (``LifecycleResult.observed_non_kv``). vLLM's ``memory_profiling`` is one
(``engines/vllm/memory.py``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pytest_kvprofile.contract.device import Device


@runtime_checkable
class WindowObserver(Protocol):
    """A profiler that measures the same window as the harness."""

    name: str

    def before_instance(self, device: Device) -> None:
        """Before the engine instance allocates anything (vLLM's init snapshot)."""

    def window_opens(self, device: Device) -> None:
        """At the baseline snapshot, after the cache was emptied and the peaks reset."""

    def window_closes(self, device: Device) -> int:
        """Before the closing measurement: the non-KV bytes this observer measured."""
