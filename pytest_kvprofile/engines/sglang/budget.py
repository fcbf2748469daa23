"""SGLang's own KV budget arithmetic on its post-capture path, fed the lifecycle's snapshots.

SGLang measures free memory twice, with its own ``get_available_gpu_memory`` (``sglang/srt/utils/common.py``):
- ``pre_model_load_memory``, before the model loads (``distributed/bootstrap.py``, ``measure_pre_model_load_memory``);
- free memory at its sizing point, after the backend and its graphs (``kv_pool_runtime.py``,
  ``compute_post_capture_kv_resize``).

The pool gets ``free - pre_model_load_memory x (1 - mem_fraction_static)``. As terms of ``total x mem_fraction_static``:
- ``resident``: ``pre_model_load_memory - free``, what was made after the first snapshot and is alive at the second;
- ``outside_pre_model_load``: ``total - pre_model_load_memory``, what was made before the first snapshot.

A free-memory measurement counts every byte alive when it is taken. So SGLang's budget leaves out only what is made
after its sizing point, which ``persistent_memory_visible_at_closing`` judges. A first snapshot taken late misses
nothing either: what was made before it is outside the pool's base (unlike vLLM's ``total x gmu`` base, bug 10c).
``at`` says where the first snapshot is taken: ``before_instance``, as SGLang takes it.
"""

from __future__ import annotations

from typing import Final

from pytest_kvprofile.contract.budget import BudgetTerm, EngineTerms, SnapshotPoint
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.engines.adapter import torch_on

__all__ = ["SglangBudget", "sglang_budget"]

GiB: Final = 1 << 30


def _available_bytes() -> int:
    """SGLang's ``get_available_gpu_memory`` on cuda:0 (GB, as SGLang returns it), back in bytes."""
    from sglang.srt.utils.common import get_available_gpu_memory

    return round(float(get_available_gpu_memory("cuda", 0)) * GiB)


class SglangBudget:
    """SGLang's post-capture KV budget, its own code: a ``BudgetArithmetic`` (``contract/budget.py``)."""

    def __init__(self, at: SnapshotPoint = "before_instance", engine: str = ""):
        self.at = at
        self.name = engine or f"SGLang {_version()} compute_post_capture_kv_resize (pre_model_load_memory {at})"
        self._total = 0
        self._pre_model_load: int | None = None
        self._free_at_sizing: int | None = None

    def snapshot(self, point: SnapshotPoint, device: Device) -> None:
        if point == "device_start":
            self._total = device.total_memory
        if point not in (self.at, "closing"):
            return
        with torch_on(device):
            free = _available_bytes()
        if point == self.at:
            self._pre_model_load = free
        else:
            self._free_at_sizing = free

    def terms(self) -> EngineTerms:
        pre, free = self._pre_model_load, self._free_at_sizing
        if pre is None or free is None:
            raise RuntimeError(f"{self.name}: terms() before both free-memory snapshots ({self.at!r}, 'closing')")
        return EngineTerms(self.name, (
            BudgetTerm("outside_pre_model_load", self._total - pre, "device_start", self.at,
                       "sglang/srt/distributed/bootstrap.py: pre_model_load_memory = get_available_gpu_memory(); "
                       "what was made before it is outside the pool's base"),
            BudgetTerm("resident", pre - free, self.at, "closing",
                       "sglang/srt/model_executor/model_runner_components/kv_pool_runtime.py "
                       "compute_post_capture_kv_resize: pre_model_load_memory - get_available_gpu_memory()"),
        ))


def _version() -> str:
    from importlib.metadata import version

    return version("sglang")


def sglang_budget() -> SglangBudget:
    """SGLang's arithmetic with its own first snapshot (``EnginePolicy.budget`` of its post-capture backends)."""
    return SglangBudget("before_instance")
