"""Persistent device memory that is not an attention builder's: communication buffers, DMA output
workspaces, autotune caches (issue: seed 001's "related fixes").

A resource fails the same way a lazy attention workspace does, so it gets the same contract and the
same checks. Its protocol is small:

``name``, ``get_persistent_workspace_memory_profiling_support()``
    As for builders; fail-closed. One UNSUPPORTED resource keeps the whole model legacy.
``capacity_bytes``
    Optional: the exact device bytes it promises to hold at most (checked at every phase).
``materialize(ctx) -> Lease``
    Inside the profiling window: allocate everything it will keep.
``use(ctx, batch)``
    Each forward that touches it (capture and serving): where lazy allocations happen.
``warmup(ctx)``
    Optional, idempotent.

The harness adapts a resource to the builder protocol, so the lifecycle and every check treat both
alike; ``resource_capacity_honoured`` is the one check that is theirs alone.
"""

from __future__ import annotations

from typing import Any, Callable

from pytest_kvprofile.contract.protocol import Batch, BuilderContext, WorkspaceDeclaration
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.units import MiB



class ResourceAdapter:
    """Presents a resource through the builder protocol (the engine drives both the same way)."""

    is_resource = True

    def __init__(self, resource: Any):
        self.resource = resource
        self.name = str(getattr(resource, "name", None) or type(resource).__name__)
        self.capacity_bytes = getattr(resource, "capacity_bytes", None)
        self.warmup_materializes_persistent = bool(getattr(resource, "warmup_materializes_persistent", False))
        method = getattr(resource, "get_persistent_workspace_memory_profiling_support", None)
        if method is not None:
            self.get_persistent_workspace_memory_profiling_support = method

    def declared_workspace(self, case: Any) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=0, int_bytes=0)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        return self.resource.materialize(ctx)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        use = getattr(self.resource, "use", None)
        if use is not None:
            use(ctx, batch)

    def warmup(self, ctx: BuilderContext) -> None:
        fn = getattr(self.resource, "warmup", None)
        if fn is not None:
            fn(ctx)


class DMAOutputWorkspace:
    """A PCIe ring-DMA default-output workspace of exact capacity, visible to profiling (correct).

    Sized from its tensor shapes: one output row of ``hidden_size`` per token, for ``max_tokens``.
    It keeps the buffer for life; its lease only vouches that it existed at the closing measurement.
    """

    name = "dma-output-workspace"

    def __init__(self, case: Any, params: dict):
        self.case = case
        self.capacity_bytes = int(params.get("max_tokens", 8192)) * int(params.get("hidden_size", 4096)) * int(
            params.get("dtype_bytes", 2)
        )
        self.buffer: Any = None

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def _allocate(self, ctx: BuilderContext) -> None:
        if self.buffer is None:
            self.buffer = ctx.allocate(self.capacity_bytes, "dma output workspace")

    def materialize(self, ctx: BuilderContext) -> Any:
        self._allocate(ctx)
        return ctx.lease([self.buffer])

    def use(self, ctx: BuilderContext, batch: Batch) -> None:
        self._allocate(ctx)


class LazyDMAOutputWorkspace(DMAOutputWorkspace):
    """Resource mutant (a): allocates on first use, after KV sizing."""

    def materialize(self, ctx: BuilderContext) -> Any:
        return ctx.lease([])


class OversizedDMAOutputWorkspace(DMAOutputWorkspace):
    """Resource mutant (b): allocates more than the capacity it declared (a rounding to whole rings)."""

    def _allocate(self, ctx: BuilderContext) -> None:
        if self.buffer is None:
            self.buffer = ctx.allocate(self.capacity_bytes + 16 * MiB, "dma output workspace")


class CaptureStagingDMAOutputWorkspace(DMAOutputWorkspace):
    """Resource mutant (c): allocates a staging buffer inside graph capture."""

    def use(self, ctx: BuilderContext, batch: Batch) -> None:
        super().use(ctx, batch)
        if ctx.capturing:
            staging = ctx.allocate(4 * MiB, "dma staging buffer")
            ctx.free(staging)


RESOURCE_KINDS: dict[str, Callable[[Any, dict], Any]] = {"dma-output-workspace": DMAOutputWorkspace}
DEFAULT_PARAMS = {"max_tokens": 8192, "hidden_size": 4096, "dtype_bytes": 2}


def case_resources(case: Any) -> list[Any]:
    """The resources a case carries (from its matrix), built from the registry of correct stubs."""
    out = []
    for res in case.resources:
        factory = RESOURCE_KINDS.get(res.kind)
        if factory is None:
            raise KeyError(f"unknown resource kind {res.kind!r} (known: {', '.join(RESOURCE_KINDS)})")
        out.append(factory(case, dict(res.params)))
    return out


def model_parts(backend: Any, case: Any) -> list[Any]:
    """Everything the engine drives for one model: the backend's builders, then its resources.

    A backend may bring its own resources (``make_resources``); otherwise the case's are used.
    """
    builders = list(backend.make_builders(case))
    make_resources = getattr(backend, "make_resources", None)
    resources = list(make_resources(case)) if make_resources is not None else case_resources(case)
    return builders + [ResourceAdapter(r) for r in resources]


def is_resource(part: Any) -> bool:
    return bool(getattr(part, "is_resource", False))
