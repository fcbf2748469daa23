"""Persistent device memory that is not an attention builder's: communication buffers, DMA output
workspaces, autotune caches.

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

from typing import Any

from pytest_kvprofile.contract.protocol import (
    Batch,
    BuilderContext,
    WorkspaceDeclaration,
)


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


def is_resource(part: Any) -> bool:
    return bool(getattr(part, "is_resource", False))
