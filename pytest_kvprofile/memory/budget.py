"""The engine's KV-cache arithmetic (docs/contract.md, "The order"), as pure functions over measured figures."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pytest_kvprofile.contract.backends import KvSizingRule
from pytest_kvprofile.contract.budget import BudgetTerm, EngineTerms, SnapshotPoint
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.units import GiB, MiB

KV_ALIGN = 2 * MiB  # the KV cache is carved in allocator-block multiples, so sizing never rounds up


@dataclass(frozen=True)
class ProfileWindow:
    """What the baseline and closing snapshots of the profiling window measured (device bytes)."""

    weights: int
    nontorch: int
    baseline_reserved: int
    closing_reserved: int
    closing_allocated: int
    peak_allocated: int

    @property
    def consumed(self) -> int:
        """Reserved at the closing measurement beyond the baseline: the persistent memory, segments and all.

        Both snapshots are taken after ``empty_cache``, so cached free segments do not count.
        """
        return self.closing_reserved - self.baseline_reserved

    @property
    def transient_headroom(self) -> int:
        """How far the window's allocated peak rose above what is still allocated at its end.

        This is the term that misses persistent memory which did not coexist with the activation
        peak: memory freed before the peak, or created after it without a profile replay.
        """
        return self.peak_allocated - self.closing_allocated

    @property
    def non_kv(self) -> int:
        return self.baseline_reserved + self.consumed + self.transient_headroom + self.nontorch

    def persistent_allocated(self, baseline_allocated: int) -> int:
        return self.closing_allocated - baseline_allocated

    def terms(self) -> EngineTerms:
        """The harness's own budget as terms (``non_kv``): everything reserved at the baseline, counted from the fresh
        device on, then what the window added; so every byte alive at the closing measurement is in a term."""
        return EngineTerms(HARNESS_ENGINE, (
            BudgetTerm("baseline_reserved", self.baseline_reserved, "device_start", "baseline",
                       "memory_reserved() at the baseline, after empty_cache (memory/budget.py: ProfileWindow)"),
            BudgetTerm("consumed", self.consumed, "baseline", "closing",
                       "closing reserved - baseline reserved, both after empty_cache"),
            BudgetTerm("transient_headroom", self.transient_headroom, formula="peak allocated - closing allocated"),
            BudgetTerm("nontorch", self.nontorch, formula="the device's non-torch bytes (CUDA context, NCCL)"),
        ))


HARNESS_ENGINE = "the harness's engine (memory/budget.py: ProfileWindow.non_kv)"


class InstanceSnapshotBudget:
    """vLLM 0.33's ``memory_profiling`` arithmetic, in plain Python, with its instance snapshot taken at ``at``.

    ``non_kv = total_consumed + transient_peak_headroom``: ``total_consumed`` is the device's free memory at the
    instance snapshot minus its free memory at the closing measurement (after ``empty_cache``), so it counts what was
    made after that snapshot and is alive at the closing one. Upstream vLLM takes the snapshot in ``init_device``,
    before the model runner exists (``at="before_instance"``); a fork that takes it after the runner's ``__init__``
    (``at="after_init"``) counts none of the buffers the constructor made. ``engines/vllm/memory.py`` runs vLLM's own
    code with the same points and is held to the same terms.
    """

    def __init__(self, at: SnapshotPoint = "before_instance", engine: str = "vLLM 0.33 memory_profiling"):
        self.at = at
        self.name = f"{engine} (instance snapshot {at})"
        self._free_at: int | None = None
        self._closing: tuple[int, int] | None = None  # (free, transient headroom) at the closing measurement

    def snapshot(self, point: SnapshotPoint, device: Device) -> None:
        if point == self.at:
            self._free_at = _free(device)
        elif point == "closing":
            device.empty_cache()  # memory_profiling's exit: gc.collect(); empty_cache(); then it measures
            self._closing = (_free(device), device.max_memory_allocated() - device.memory_allocated())

    def terms(self) -> EngineTerms:
        if self._free_at is None or self._closing is None:
            raise RuntimeError(f"{self.name}: terms() before its snapshots ({self.at!r} and 'closing') were taken")
        free, headroom = self._closing
        return EngineTerms(self.name, (
            BudgetTerm("total_consumed", self._free_at - free, self.at, "closing",
                       f"free memory at the instance snapshot ({self.at}) - free memory after profiling"),
            BudgetTerm("transient_peak_headroom", headroom, formula="torch peak - torch allocated after profiling"),
        ))


def _free(device: Device) -> int:
    """The device's free memory as ``cudaMemGetInfo`` reports it (vLLM's ``MemorySnapshot.free_memory``)."""
    return device.mem_get_info()[0]


@dataclass(frozen=True)
class Budget:
    """A case's memory budget, laid out as engines log it."""

    total: int
    gmu: float
    weights: int
    nontorch: int
    persistent_workspace: int
    persistent_reserved: int
    peak_activation: int
    non_kv: int
    graph_pool_estimate: int
    graph_pool_high_water: int
    available_kv: int
    kv_bytes_per_token: int
    kv_tokens: int
    reservation_kv_tokens: int
    rule: KvSizingRule = "profile"

    @property
    def limit(self) -> int:
        """What the device may hold after KV sizing: ``total x gmu``, or the whole device where the engine keeps the
        rest as serving headroom."""
        return self.total if self.rule == "post_capture" else int(self.total * self.gmu)

    @property
    def limit_text(self) -> str:
        if self.rule == "post_capture":
            return (f"the device ({self.total / MiB:.1f} MiB: mem_fraction_static {self.gmu:.2f} static, the rest "
                    "serving headroom)")
        return f"total x gmu = {self.limit / MiB:.1f} MiB"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def lines(self) -> list[str]:
        def gib(n: int) -> str:
            return f"{n / GiB:.2f} GiB"

        static = int(self.total * self.gmu)
        if self.rule == "post_capture":
            first = (f"total {gib(self.total)} x mem_fraction_static {self.gmu:.2f} = {gib(static)} static, sized "
                     f"after capture; {gib(self.total - static)} serving headroom")
        else:
            first = f"total {gib(self.total)} x gmu {self.gmu:.2f} = {gib(self.limit)}"
            if self.rule == "post_warmup":
                first += ", sized after warmup and CUDA-graph capture (the profiled activation peak kept free)"
        return [
            first,
            f"weights {gib(self.weights)}, peak activation {gib(self.peak_activation)}, "
            f"non-torch {gib(self.nontorch)}, persistent workspace {self.persistent_workspace / MiB:.1f} MiB "
            f"({self.persistent_reserved / MiB:.1f} MiB reserved)",
            f"CUDA-graph pool estimate {self.graph_pool_estimate / MiB:.1f} MiB "
            f"(high-water {self.graph_pool_high_water / MiB:.1f} MiB)",
            f"available KV {gib(self.available_kv)} = {self.kv_tokens} tokens "
            f"({self.kv_bytes_per_token} B/token); the reservation costs {self.reservation_kv_tokens} tokens",
        ]


def available_kv_bytes(total: int, gmu: float, non_kv: int, graph_estimate: int) -> int:
    """``total * gmu - non_kv - graph_estimate``, rounded down to allocator blocks, never negative."""
    raw = int(total * gmu) - non_kv - graph_estimate
    return max(0, raw // KV_ALIGN * KV_ALIGN)


def tokens_for(nbytes: int, kv_bytes_per_token: int) -> int:
    """KV tokens that ``nbytes`` would hold (rounded up: the cost of a reservation is never understated)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // kv_bytes_per_token)
