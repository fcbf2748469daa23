"""Mutants of the workspaces a builder keeps beside the arena and of how it plans into them: bug classes 5 (a plan
into another micro-batch), 15 (the int workspace), 16 (a stale or released workspace) and 17 (a reservation that
fails halfway). Each declares itself with ``@mutant`` (``builtin/mutant_declarations.py``); ``builtin/mutants.py``
gathers the catalog.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pytest_kvprofile.builtin.mutant_declarations import mutant
from pytest_kvprofile.builtin.stubs import (
    FlashInferLikeBuilder,
    TorchFlashInferLikeBuilder,
    Wrapper,
    with_role,
)
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:

    from pytest_kvprofile.contract.device import Allocation
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.matrix.cases import Case


SMALL_INT_WORKSPACE_BYTES = 32 * 1024  # below what FlashInfer's planner writes for any case's plan


@mutant("mutant-15a-int-workspace-too-small", catches=("int_workspace_per_wrapper",))
class SmallIntWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 15a: declares FlashInfer's 8 MiB int workspace per wrapper but gives each wrapper 32 KiB, below what the
    planner writes for the case's plans."""

    def int_bytes(self) -> int:
        return SMALL_INT_WORKSPACE_BYTES


@mutant("mutant-15b-int-workspace-shared-by-wrappers", catches=("int_workspace_per_wrapper",))
class SharedIntWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 15b: one int workspace (and pinned mirror) for the builder: every wrapper, of every route and
    micro-batch, reuses the first wrapper's instead of owning one, so each plan overwrites the others'."""

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        first = next((w for w in self.wrappers.values() if w.int_workspace.alive), None)
        if first is None:
            return super()._new_wrapper(ctx, route, ubatch)
        view = self._float_view(ctx, ubatch)
        return replace(first, route=route, ubatch=ubatch, float_ptr=view.ptr, float_bytes=view.nbytes, view=view)

    def _drop(self, ctx: BuilderContext, wrappers: list[Wrapper]) -> None:
        for alloc in {id(a): a for w in wrappers for a in (w.int_workspace, w.pinned_mirror) if a.alive}.values():
            ctx.free(alloc)
        for key in [k for k, v in self.wrappers.items() if any(v is w for w in wrappers)]:
            del self.wrappers[key]


@mutant("mutant-15c-int-workspace-freed-early", catches=("int_workspace_per_wrapper", "no_post_kv_overrun",
        "no_use_after_free"))
class FreedIntWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 15c: frees each wrapper's int workspace as soon as the wrapper is set up ("the plan is on the host
    mirror"), while the wrapper keeps planning into it."""

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        w = super()._new_wrapper(ctx, route, ubatch)
        ctx.free(w.int_workspace)
        return w

    def _drop(self, ctx: BuilderContext, wrappers: list[Wrapper]) -> None:
        for w in wrappers:
            ctx.free(w.pinned_mirror)
        for key in [k for k, v in self.wrappers.items() if any(v is w for w in wrappers)]:
            del self.wrappers[key]


@mutant("mutant-15d-int-workspace-remade-after-capture", catches=("captured_memory_stays", "int_workspace_per_wrapper"))
class RemadeIntWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 15d: after its CUDA-graph wrapper is captured, the first serving plan of a captured step re-makes the
    wrapper's int workspace at the same size ("a fresh plan buffer"): the captured graph keeps the old pointer."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.captured: set[tuple[str, int]] = set()

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        w = self._wrapper_for(ctx, batch)
        key = (w.route, w.ubatch)
        if batch.cuda_graph and ctx.capturing:
            self.captured.add(key)
        elif batch.cuda_graph and key in self.captured:
            self.captured.discard(key)
            ctx.free(w.int_workspace)
            w.int_workspace = ctx.allocate(self.int_bytes(), f"{w.route} int workspace [ubatch {w.ubatch}]",
                                           role=Role.INT_WORKSPACE)
            w.int_ptr, w.int_nbytes = w.int_workspace.ptr, w.int_workspace.nbytes


@mutant("mutant-15j-int-workspace-slices-too-small", catches=("int_workspace_per_wrapper",))
class SlicedIntWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 15j: declares and allocates FlashInfer's 8 MiB int workspace per wrapper, as one slab per micro-batch
    (``Role.INT_WORKSPACE``), but hands each wrapper a 32 KiB slice of it, below what the planner writes for one
    plan; ``bound_workspaces()`` reports each slice honestly."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.slabs: dict[int, Allocation] = {}

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        slab = self.slabs.get(ubatch)
        if slab is None or not slab.alive:
            slab = self.slabs[ubatch] = ctx.allocate(self.int_bytes() * len(self.routes()),
                                                     f"int workspace slab [ubatch {ubatch}]", role=Role.INT_WORKSPACE)
        view = self._float_view(ctx, ubatch)
        mirror = ctx.allocate(self.int_bytes(), f"{route} int workspace pinned mirror [ubatch {ubatch}]",
                              pinned_host=True, role=Role.PINNED_MIRROR)
        offset = self.routes().index(route) * SMALL_INT_WORKSPACE_BYTES
        return Wrapper(route, ubatch, view.ptr, view.nbytes, slab, mirror, slab.ptr + offset,
                       SMALL_INT_WORKSPACE_BYTES, view)

    def _drop(self, ctx: BuilderContext, wrappers: list[Wrapper]) -> None:
        for w in wrappers:
            ctx.free(w.pinned_mirror)
        for key in [k for k, v in self.wrappers.items() if any(v is w for w in wrappers)]:
            del self.wrappers[key]
        for ub, slab in list(self.slabs.items()):
            if slab.alive and not any(w.ubatch == ub for w in self.wrappers.values()):
                ctx.free(slab)


@mutant("mutant-15e-torch-int-workspace-too-small", catches=("int_workspace_per_wrapper",))
class TorchSmallIntWorkspaceBuilder(TorchFlashInferLikeBuilder):
    """Bug 15e (torch mode): the torch-mode builder's wrappers get 32 KiB int workspaces against 8 MiB declared."""

    def int_bytes(self) -> int:
        return SMALL_INT_WORKSPACE_BYTES


@mutant("mutant-15f-torch-int-workspace-shared-by-ubatches", catches=("int_workspace_per_wrapper",))
class TorchSharedIntWorkspaceBuilder(TorchFlashInferLikeBuilder):
    """Bug 15f (torch mode): micro-batch 1's wrappers reuse micro-batch 0's int workspace tensors, so the two
    micro-batches' plans overwrite each other."""

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        first = self.wrappers.get((route, 0))
        if ubatch == 0 or first is None:
            return super()._new_wrapper(ctx, route, ubatch)
        view = self._float_view(ctx, ubatch)
        return replace(first, ubatch=ubatch, float_ptr=view.ptr, float_bytes=view.nbytes, view=view)


@mutant("mutant-15g-torch-int-workspace-freed-early", catches=("int_workspace_per_wrapper", "no_post_kv_overrun"))
class TorchFreedIntWorkspaceBuilder(TorchFlashInferLikeBuilder):
    """Bug 15g (torch mode): each wrapper keeps only its int workspace's address (as a kernel argument would), not
    the tensor, so the tensor is freed at once and the wrapper plans into freed memory."""

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        w = super()._new_wrapper(ctx, route, ubatch)
        w.int_workspace = None
        return w

    def _plan(self, ctx: BuilderContext, w: Wrapper) -> None:
        """The plan goes to the int workspace's address (no tensor left to write through, so torch mode cannot see
        that write: ``int_workspace_per_wrapper`` judges the freed workspace); outputs go to the float view."""
        if w.view.tensor is not None:
            w.view.tensor[:64].zero_()


@mutant("mutant-15h-torch-int-workspace-remade-after-capture", catches=("arena_stable_after_closing",
        "captured_memory_stays", "int_workspace_per_wrapper"))
class TorchRemadeIntWorkspaceBuilder(TorchFlashInferLikeBuilder):
    """Bug 15h (torch mode): after capture, the first serving plan of a captured step replaces the CUDA-graph
    wrapper's int workspace tensor with a new one of the same size; the old one is freed under the graph."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.captured: set[tuple[str, int]] = set()

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        import torch

        super().build(ctx, batch)
        w = self._wrapper_for(ctx, batch)
        key = (w.route, w.ubatch)
        if batch.cuda_graph and ctx.capturing:
            self.captured.add(key)
        elif batch.cuda_graph and key in self.captured:
            self.captured.discard(key)
            w.int_workspace = torch.empty(self.int_bytes(), dtype=torch.uint8, device="cuda")
            w.int_ptr, w.int_nbytes = with_role(w.int_workspace, Role.INT_WORKSPACE)
@mutant("mutant-05d-plans-into-other-ubatch", catches=("int_workspace_per_wrapper", "ubatch_arenas_disjoint"))
class PlansIntoOtherUbatchBuilder(FlashInferLikeBuilder):
    """Bug 5d: asks for every micro-batch's arena view, but plans every batch with micro-batch 0's wrapper, so
    micro-batch 1's plans land in micro-batch 0's arena (its grants and bound_workspaces() look right)."""

    def _wrapper_for(self, ctx: BuilderContext, batch: Batch) -> Wrapper:
        return super()._wrapper_for(ctx, Batch(batch.kind, batch.num_reqs, batch.num_tokens, batch.cuda_graph, 0))


@mutant("mutant-05e-torch-writes-other-ubatch", catches=("int_workspace_per_wrapper", "ubatch_arenas_disjoint"))
class TorchWritesOtherUbatchBuilder(TorchFlashInferLikeBuilder):
    """Bug 5e (torch mode): the same as 5d with plain torch writes: every build writes micro-batch 0's arena
    tensor, whichever micro-batch it builds."""

    def _wrapper_for(self, ctx: BuilderContext, batch: Batch) -> Wrapper:
        return super()._wrapper_for(ctx, Batch(batch.kind, batch.num_reqs, batch.num_tokens, batch.cuda_graph, 0))


@mutant("mutant-16a-plans-into-released-workspace", catches=("int_workspace_per_wrapper", "no_use_after_free"))
class PlansIntoReleasedWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 16a: its lease release frees the wrappers' int workspaces and pinned mirrors but keeps the wrappers, so
    rebind re-creates nothing and every plan after KV sizing lands in memory the release gave back."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        wrappers = self._materialize(ctx)

        def release() -> None:
            for w in wrappers:
                ctx.free(w.int_workspace)
                ctx.free(w.pinned_mirror)

        return ctx.lease(wrappers, on_release=release)


@mutant("mutant-16b-stale-view-after-growth", catches=("no_use_after_free",))
class StaleViewAfterGrowthBuilder(FlashInferLikeBuilder):
    """Bug 16b: keeps its wrappers after the lease (legal), but its in-window warmup asks the arena for 2 MiB more
    than it declared, so the arena grows and every wrapper keeps a view of the arena the growth gave back. It does not
    report bound_workspaces() (optional): only its uses show the stale views."""

    bound_workspaces = None  # type: ignore[assignment]  # the optional hook withdrawn: not reported

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        return ctx.lease(self._materialize(ctx))

    def warmup(self, ctx: BuilderContext) -> None:
        if ctx.profiling and not self.warmed:
            for ub in range(ctx.num_ubatches):
                ctx.get_workspace(self.float_bytes() + 2 * MiB, ub)
        super().warmup(ctx)


@mutant("mutant-16c-torch-stale-arena-view", catches=("no_use_after_free",))
class TorchStaleArenaViewBuilder(TorchFlashInferLikeBuilder):
    """Bug 16c (torch mode): 16b with plain torch: its wrappers keep the arena tensors they were given, the arena
    grows under them in warmup, and every build writes the old arena's storage (no bound_workspaces() either)."""

    bound_workspaces = None  # type: ignore[assignment]  # the optional hook withdrawn: not reported

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        return ctx.lease(self._materialize(ctx))

    def warmup(self, ctx: BuilderContext) -> None:
        if ctx.profiling and not self.warmed:
            for ub in range(ctx.num_ubatches):
                ctx.get_workspace(self.float_bytes() + 2 * MiB, ub)
        super().warmup(ctx)


@mutant("mutant-17a-reservation-keeps-partial", catches=("reservation_exception_safe",))
class ReservationKeepsPartialBuilder(FlashInferLikeBuilder):
    """Bug 17a: a reservation that fails part-way keeps the wrappers it already made; the engine's second
    reservation makes them all again, so it holds more than a clean one (and the first ones leak)."""

    def _materialize(self, ctx: BuilderContext) -> list[Wrapper]:
        made = []
        for route in self.routes():
            for ub in range(ctx.num_ubatches):
                self.wrappers[(route, ub)] = self._new_wrapper(ctx, route, ub)
                made.append(self.wrappers[(route, ub)])
        return made


@mutant("mutant-04d-remakes-captured-index-buffers", catches=("captured_memory_stays",))
class RemakesCapturedIndexBuffersBuilder(FlashInferLikeBuilder):
    """Bug 4 (a captured pointer moves): each CUDA-graph decode wrapper's fixed index buffer, made in the window and
    planned into at capture, is made again at the same size on the first serving step; the captured graph still
    reads the old one."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        wrappers = self._materialize(ctx)
        self.index: dict[int, Allocation] = {}
        try:
            for ub in range(ctx.num_ubatches):
                self.index[ub] = ctx.allocate(1 << 20, f"graph decode index buffer [ubatch {ub}]")
        except BaseException:  # all or nothing, as the stub: its one bug is the re-make after capture
            for made in self.index.values():
                ctx.free(made)
            self._drop(ctx, wrappers)
            raise
        return ctx.lease([*wrappers, *self.index.values()])

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if batch.cuda_graph and batch.kind == "decode":
            if ctx.phase == "serving" and not getattr(self, "remade", False):
                self.remade = True
                for ub, old in self.index.items():
                    ctx.free(old)
                    self.index[ub] = ctx.allocate(1 << 20, f"graph decode index buffer [ubatch {ub}]")
            ctx.plan_into(self.index[batch.ubatch])


@mutant("mutant-17b-torch-reservation-keeps-partial", catches=("reservation_exception_safe",))
class TorchReservationKeepsPartialBuilder(TorchFlashInferLikeBuilder):
    """Bug 17b (torch mode): 17a with plain torch tensors: a failed reservation's wrappers are kept in a list of
    failed attempts that nothing clears, so they stay referenced beside the ones the second reservation makes: each
    failed attempt leaks. (Keeping them only until the retry replaces them is legal:
    that memory was made inside the window, and the retry frees it.)"""

    def _materialize(self, ctx: BuilderContext) -> list[Wrapper]:
        try:
            return ReservationKeepsPartialBuilder._materialize(self, ctx)  # type: ignore[arg-type]  # 17a's steps, on the same attributes
        except BaseException:
            self.__dict__.setdefault("failed_attempts", []).extend(self.wrappers.values())
            raise


@mutant("mutant-17c-cleanup-masks-first-error", catches=("reservation_exception_safe",))
class CleanupMasksErrorBuilder(FlashInferLikeBuilder):
    """Bug 17c: a reservation that fails frees what it made twice (by hand, then through its drop helper); the
    double free it raises replaces the out-of-memory error, so the engine reports the wrong failure."""

    def _materialize(self, ctx: BuilderContext) -> list[Wrapper]:
        made: list[Wrapper] = []
        try:
            for route in self.routes():
                for ub in range(ctx.num_ubatches):
                    self.wrappers[(route, ub)] = self._new_wrapper(ctx, route, ub)
                    made.append(self.wrappers[(route, ub)])
        except BaseException:
            for w in made:
                ctx.free(w.int_workspace)
            self._drop(ctx, made)
            raise
        return made
