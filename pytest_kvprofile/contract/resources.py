"""Persistent device memory that is not an attention builder's: communication buffers, DMA output
workspaces, autotune caches.

A resource fails the same way a lazy attention workspace does, so it gets the same contract and the
same checks. Its protocol is small (``PersistentResource`` is its required part):

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

from typing import TYPE_CHECKING, Callable, Protocol

from pytest_kvprofile.contract.lease import Lease
from pytest_kvprofile.contract.protocol import (
    Batch,
    BuilderContext,
    WorkspaceDeclaration,
)

if TYPE_CHECKING:
    from pytest_kvprofile.contract.support import ProfilingSupport
    from pytest_kvprofile.matrix.cases import Case


class PersistentResource(Protocol):
    """The required part of the resource protocol: ``materialize``. A resource inherits nothing; ``name`` (its
    class name when missing), the support declaration (fail-closed when missing), ``capacity_bytes`` (no capacity
    checked when missing), ``use`` and ``warmup`` (nothing to do when missing) are optional, as the module
    docstring says, and :class:`ResourceAdapter` looks each one up."""

    def materialize(self, ctx: BuilderContext) -> Lease: ...


class ResourceAdapter:
    """Presents a resource through the builder protocol (the engine drives both the same way)."""

    is_resource = True
    get_persistent_workspace_memory_profiling_support: Callable[[], ProfilingSupport]  # when the resource has one

    def __init__(self, resource: PersistentResource):
        self.resource = resource
        self.name = str(getattr(resource, "name", None) or type(resource).__name__)
        self.capacity_bytes: int | None = getattr(resource, "capacity_bytes", None)
        self.warmup_materializes_persistent = bool(getattr(resource, "warmup_materializes_persistent", False))
        method = getattr(resource, "get_persistent_workspace_memory_profiling_support", None)
        if method is not None:
            self.get_persistent_workspace_memory_profiling_support = method

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=0, int_bytes=0)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        return self.resource.materialize(ctx)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        use = getattr(self.resource, "use", None)
        if use is not None:
            use(ctx, batch)

    def warmup(self, ctx: BuilderContext) -> None:
        fn = getattr(self.resource, "warmup", None)
        if fn is not None:
            fn(ctx)


def is_resource(part: object) -> bool:
    return bool(getattr(part, "is_resource", False))
