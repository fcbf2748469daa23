"""The built-in persistent resource: a DMA output workspace, correct and in three buggy variants.

Matrices name resources by kind (``resources:`` with a ``when:`` filter); :data:`RESOURCE_KINDS`
builds them. The correct workspace, the kinds and :func:`case_resources` are the engine's
(``lifecycle/resources.py``: the lifecycle builds a case's resources without importing a backend), named here
too; the variants back the mutant catalog's bug class 13.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pytest_kvprofile.builtin.mutant_declarations import resource_mutant
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.lifecycle.resources import (
    DEFAULT_PARAMS,
    RESOURCE_KINDS,
    DMAOutputWorkspace,
    case_resources,
)
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from pytest_kvprofile.contract.lease import Lease

__all__ = [
    "DEFAULT_PARAMS", "RESOURCE_KINDS", "CaptureStagingDMAOutputWorkspace", "DMAOutputWorkspace",
    "LazyDMAOutputWorkspace", "OversizedDMAOutputWorkspace", "WarmedInWindowDMAOutputWorkspace",
    "WarmupMadeDMAOutputWorkspace", "case_resources",
]


@resource_mutant("mutant-13a-resource-lazy", catches=("no_post_kv_overrun", "no_synthetic_workspace_in_capture",
        "persistent_memory_visible_at_closing"))
class LazyDMAOutputWorkspace(DMAOutputWorkspace):
    """Resource mutant (a): allocates on first use, after KV sizing."""

    def materialize(self, ctx: BuilderContext) -> Lease:
        return ctx.lease([])


@resource_mutant("mutant-13b-resource-over-capacity", catches=("resource_capacity_honoured",))
class OversizedDMAOutputWorkspace(DMAOutputWorkspace):
    """Resource mutant (b): allocates more than the capacity it declared (a rounding to whole rings)."""

    def _allocate(self, ctx: BuilderContext) -> None:
        if self.buffer is None:
            self.buffer = ctx.allocate(self.capacity_bytes + 16 * MiB, "dma output workspace")


@resource_mutant("mutant-13c-resource-in-capture", catches=("no_synthetic_workspace_in_capture",))
class CaptureStagingDMAOutputWorkspace(DMAOutputWorkspace):
    """Resource mutant (c): allocates a staging buffer inside graph capture."""

    def use(self, ctx: BuilderContext, batch: Batch) -> None:
        super().use(ctx, batch)
        if ctx.capturing:
            staging = ctx.allocate(4 * MiB, "dma staging buffer")
            ctx.free(staging)


@resource_mutant("mutant-13d-resource-made-in-late-warmup", catches=("no_post_kv_overrun",
        "persistent_memory_visible_at_closing"))
class WarmupMadeDMAOutputWorkspace(DMAOutputWorkspace):
    """Resource mutant (d), issue 51 item 5: makes its buffer in its warmup, which its engine first calls after KV
    sizing (it does not say its warmup materializes persistent memory), and leases nothing. Beside a builder the
    engine warms inside the window, an engine that warmed every part there hid it."""

    def materialize(self, ctx: BuilderContext) -> Lease:
        return ctx.lease([])

    def warmup(self, ctx: BuilderContext) -> None:
        self._allocate(ctx)


class WarmedInWindowDMAOutputWorkspace(WarmupMadeDMAOutputWorkspace):
    """Correct twin of (d): the same buffer made in its warmup, which its engine warms inside the profiling window
    (``warmup_materializes_persistent``), so the closing measurement counts it."""

    warmup_materializes_persistent = True
