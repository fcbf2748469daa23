"""An example attention backend, written only against pytest-kvprofile's public protocol.

``PagedAttentionBuilder`` keeps one dedicated int workspace per micro-batch, like a FlashInfer
wrapper, and plans into the shared float arena. It is correct: it materializes its workspaces
inside the profiling window and hands them to a lease. ``LazyPagedAttentionBuilder`` is the same
builder with the classic bug: it creates its int workspace on first plan(), after KV sizing.
"""

from __future__ import annotations

from typing import Any

from pytest_kvprofile import (
    Backend,
    BoundWorkspace,
    ProfilingSupport,
    Role,
    WorkspaceDeclaration,
)
from pytest_kvprofile.sizing import for_case

__version__ = "1.0.0"
MiB = 1 << 20
INT_WORKSPACE = 4 * MiB


def float_workspace_bytes(case: Any) -> int:
    """Size the float arena from FlashInfer's own planner, for this GPU and this rank's heads.

    ``pytest_kvprofile.sizing.for_case`` is the computation ``workspace_covers_planner`` checks
    against, so the declaration and the check cannot disagree.
    """
    return for_case(case).float_bytes


class PagedAttentionBuilder:
    name = "paged-attention"

    def __init__(self, case: Any):
        self.case = case
        self.int_workspaces: dict[int, Any] = {}
        self.views: dict[int, Any] = {}

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def declared_workspace(self, case: Any) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=float_workspace_bytes(case), int_bytes=INT_WORKSPACE)

    def _materialize(self, ctx: Any) -> list[Any]:
        """All or nothing: a reservation that fails frees what it made, then raises (it must leak nothing)."""
        made: dict[int, Any] = {}
        try:
            for ub in range(ctx.num_ubatches):
                self.views[ub] = ctx.get_workspace(float_workspace_bytes(self.case), ub)
                if ub not in self.int_workspaces:
                    made[ub] = self._int_workspace(ctx, ub)
        except BaseException:
            for alloc in made.values():
                ctx.free(alloc)
            raise
        self.int_workspaces.update(made)
        return list(made.values())

    def _int_workspace(self, ctx: Any, ubatch: int) -> Any:
        """The micro-batch's dedicated int workspace; its role tells the harness what it is for."""
        return ctx.allocate(INT_WORKSPACE, f"int workspace [ubatch {ubatch}]", role=Role.INT_WORKSPACE)

    def _drop(self, ctx: Any) -> None:
        for ub in list(self.int_workspaces):
            ctx.free(self.int_workspaces.pop(ub))

    def reserve_persistent_workspace(self, ctx: Any) -> Any:
        return ctx.lease(self._materialize(ctx), on_release=lambda: self._drop(ctx))

    def rebind(self, ctx: Any) -> None:
        self._materialize(ctx)

    def build(self, ctx: Any, batch: Any) -> None:
        if batch.ubatch not in self.int_workspaces:
            self.int_workspaces[batch.ubatch] = self._int_workspace(ctx, batch.ubatch)
        self.views[batch.ubatch] = ctx.get_workspace(float_workspace_bytes(self.case), batch.ubatch)
        ctx.plan_into(self.views[batch.ubatch])  # the harness judges what the plan lands in
        ctx.plan_into(self.int_workspaces[batch.ubatch])

    def bound_workspaces(self) -> list[BoundWorkspace]:
        """One entry per wrapper (here one per micro-batch): its float view and its int workspace."""
        out = []
        for ub, v in self.views.items():
            int_ws = self.int_workspaces.get(ub)
            out.append(BoundWorkspace(ub, "float workspace", v.ptr, v.nbytes, int_ws.ptr if int_ws else 0,
                                      int_ws.nbytes if int_ws else 0))
        return out


class LazyPagedAttentionBuilder(PagedAttentionBuilder):
    """The bug: nothing is materialized in the window, so the int workspace appears after KV sizing."""

    def reserve_persistent_workspace(self, ctx: Any) -> Any:
        return ctx.lease([])

    def rebind(self, ctx: Any) -> None:
        for ub in range(ctx.num_ubatches):
            self.views[ub] = ctx.get_workspace(float_workspace_bytes(self.case), ub)


def correct() -> Backend:
    return Backend(name="example-paged-attention", make_builders=lambda case: [PagedAttentionBuilder(case)],
                   version=__version__, description="the example backend")


def lazy() -> Backend:
    return Backend(name="example-paged-attention-lazy", make_builders=lambda case: [LazyPagedAttentionBuilder(case)],
                   version=__version__, description="the example backend with a lazy int workspace")


def backends() -> list[Backend]:
    """The entry point: both variants, so the verdict shows one passing and one failing."""
    return [correct(), lazy()]
