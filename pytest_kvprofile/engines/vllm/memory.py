"""vLLM's own ``memory_profiling`` (``vllm/utils/mem_utils.py``) around the lifecycle's profiling window.

The harness's KV arithmetic (``memory/budget.py``) has the shape of vLLM 0.33's ``memory_profiling`` and
``determine_available_memory``; this observer runs vLLM's code on the same simulated device so the two stand side
by side, case by case. vLLM takes its before-instance snapshot after the CUDA context and NCCL are up, so those
non-torch bytes are outside its non-KV figure (they sit in the 1 - gmu margin); the harness counts them. The one
expected difference is therefore the device's non-torch bytes (``non_kv_difference``).

``VllmBudget`` is the same code as an engine's budget arithmetic (``EnginePolicy.budget``): its terms, each counting
from the snapshot vLLM takes it at, are read against the ledger by ``budget_counts_every_byte``.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from pytest_kvprofile.contract.budget import BudgetTerm, EngineTerms, SnapshotPoint
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.engines.adapter import torch_on

NAME = "vllm.memory_profiling"
# vLLM's MemorySnapshot, its memory_profiling context and that context's result: each made by an earlier step of the
# window (None before it), and read without a None check
VllmMeasurement: TypeAlias = Any


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

        with torch_on(device):
            self._before = MemorySnapshot(device=torch.device("cuda", 0))

    def window_opens(self, device: Device) -> None:
        from vllm.utils.mem_utils import memory_profiling

        with torch_on(device):
            self._profiling = memory_profiling(self._before)
            self.result = self._profiling.__enter__()

    def window_closes(self, device: Device) -> int:
        with torch_on(device):
            self._profiling.__exit__(None, None, None)
        return int(self.result.non_kv_cache_memory)


class VllmBudget:
    """vLLM's KV budget arithmetic, its own code (``vllm/utils/mem_utils.py``: ``MemorySnapshot``,
    ``memory_profiling``, as ``determine_available_memory`` calls it), fed the lifecycle's snapshots: a
    ``BudgetArithmetic`` (``contract/budget.py``, ``EnginePolicy.budget``).

    ``at``: where the instance snapshot (``init_snapshot``) is taken. vLLM takes it in ``init_device``, before it makes
    the model runner (``before_instance``); a fork that takes it after the runner's ``__init__`` (``after_init``) is
    issue 51's item 2. Its terms are vLLM's ``non_kv_cache_memory``: ``total_consumed`` (free memory at the instance
    snapshot minus free memory after profiling) and ``transient_peak_headroom``.
    """

    def __init__(self, at: SnapshotPoint = "before_instance"):
        self.at = at
        self.name = f"vLLM {_version()} memory_profiling (init_snapshot {at})"
        self._init: VllmMeasurement = None
        self._profiling: VllmMeasurement = None
        self.result: VllmMeasurement = None

    def snapshot(self, point: SnapshotPoint, device: Device) -> None:
        import torch
        from vllm.utils.mem_utils import MemorySnapshot, memory_profiling

        with torch_on(device):
            if point == self.at:
                self._init = MemorySnapshot(device=torch.device("cuda", 0))
            if point == "baseline":  # determine_available_memory enters memory_profiling around the profile run
                if self._init is None:
                    raise RuntimeError(f"{self.name}: the window opened before the init snapshot ({self.at!r})")
                self._profiling = memory_profiling(self._init)
                self.result = self._profiling.__enter__()
            elif point == "closing" and self._profiling is not None:
                self._profiling.__exit__(None, None, None)

    def terms(self) -> EngineTerms:
        r = self.result
        if r is None:
            raise RuntimeError(f"{self.name}: terms() before the profiling window closed")
        return EngineTerms(self.name, (
            BudgetTerm("total_consumed", int(r.total_consumed), self.at, "closing",
                       "vllm/utils/mem_utils.py memory_profiling: before_create.free_memory - "
                       "after_profile.free_memory"),
            BudgetTerm("transient_peak_headroom", int(r.transient_peak_headroom),
                       formula="vllm/utils/mem_utils.py memory_profiling: after_profile.torch_peak - "
                               "after_profile.torch_allocated"),
        ))


def _version() -> str:
    from importlib.metadata import version

    return version("vllm")


def vllm_budget() -> VllmBudget:
    """vLLM's own arithmetic with its own snapshot point (``EnginePolicy.budget`` of vLLM's backends)."""
    return VllmBudget("before_instance")


def non_kv_difference(device: Device) -> int:
    """What the harness counts as non-KV and vLLM does not: the non-torch bytes present before the instance."""
    return int(getattr(device, "nontorch_bytes", 0))
