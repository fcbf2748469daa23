"""The mutant catalog: each builder differs from a correct stub by exactly one bug class of
docs/contract.md ("Bug classes").

Every check the suite ships must be shown to fail on the mutant that carries the bug it targets;
``tests/builtin/test_mutant_catalog.py`` runs the suite over this catalog and prints the catch table; what each mutant
fails over the default matrix is declared with it (``catches=``, gathered in ``EXPECTED_CATCHES``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from pytest_kvprofile.builtin.mutants_field import field_mutants
from pytest_kvprofile.builtin.process_state import (
    AFTER_KV,
    PER_ENGINE,
    ProcessWorkspaceBuilder,
    TorchProcessWorkspaceBuilder,
)
from pytest_kvprofile.builtin.stubs import (
    AUTOTUNE_SCRATCH_BYTES,
    GDN_WORKSPACE_BYTES,
    MODULE_GLOBAL_BYTES,
    EagerPrefillBuilder,
    FlashInferLikeBuilder,
    GDNLikeBuilder,
    MMPrefixLikeBuilder,
    TorchFlashInferLikeBuilder,
    TrtllmGenSizedBuilder,
    Wrapper,
    vllm_default_fixed_bytes,
    vllm_default_float_bytes,
    vllm_trtllm_workspace_bytes,
    with_role,
)
from pytest_kvprofile.checks.base import CheckOptions, WasteBudget
from pytest_kvprofile.contract.backends import Backend, EnginePolicy
from pytest_kvprofile.contract.protocol import Batch, BoundWorkspace, BuilderContext
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.workspace import WorkspaceLockedError
from pytest_kvprofile.sizing.case import for_case
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from torch import Tensor

    from pytest_kvprofile.contract.device import Allocation
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.contract.resources import PersistentResource
    from pytest_kvprofile.contract.workspace import ArenaView
    from pytest_kvprofile.matrix.cases import Case


class LazyWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 1: declares REQUIRED but leaves its wrappers (and int workspaces) to the first plan()."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        return ctx.lease([])


class LazyLargeBatchWrapperBuilder(FlashInferLikeBuilder):
    """Bug 1b: reserves its wrappers, but a separate wrapper for prefill/mixed batches of more than 8
    requests (a ragged-KV path) is created on the first such plan(), after KV sizing."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        key = ("ragged prefill", batch.ubatch)
        if batch.kind != "decode" and batch.num_reqs > 8 and key not in self.wrappers:
            self.wrappers[key] = self._new_wrapper(ctx, "ragged prefill", batch.ubatch)


class EarlyReleaseBuilder(FlashInferLikeBuilder):
    """Bug 2: releases its lease inside the profiling block, before the closing measurement."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        lease = super().reserve_persistent_workspace(ctx)
        lease.release()
        return lease


class NeverReleasedBuilder(FlashInferLikeBuilder):
    """Bug 3: its lease keeps the profiling wrappers alive forever (they leak into graph profiling)."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        wrappers = self._materialize(ctx)
        self.leaked = wrappers
        for key in [k for k, v in self.wrappers.items() if v in wrappers]:
            del self.wrappers[key]
        return ctx.lease(wrappers)


class GrowAfterLockBuilder(FlashInferLikeBuilder):
    """Bug 4a: sizes its float request from the live batch, so serving asks the locked arena to grow."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if not ctx.dummy and batch.kind == "prefill":
            ctx.get_workspace(self.float_bytes() + 2 * MiB, batch.ubatch)


class SwallowedGrowAfterLockBuilder(FlashInferLikeBuilder):
    """Bug 4c: like 4a, but catches the locked arena's refusal and plans into its own transient buffer."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if not ctx.dummy and batch.kind == "prefill":
            try:
                ctx.get_workspace(self.float_bytes() + 2 * MiB, batch.ubatch)
            except WorkspaceLockedError:
                fallback = ctx.allocate(2 * MiB, "fallback split-kv scratch")
                ctx.free(fallback)


class ReallocOnRebindBuilder(FlashInferLikeBuilder):
    """Bug 4b: rebind asks for a slightly larger arena, which reallocates (moves) it after KV sizing."""

    def rebind(self, ctx: BuilderContext) -> None:
        for ub in range(ctx.num_ubatches):
            ctx.get_workspace(ctx.workspace.size(ub) + 4096, ub)
        super().rebind(ctx)


class UbatchAliasBuilder(FlashInferLikeBuilder):
    """Bug 5: every micro-batch's wrapper is bound to micro-batch 0's arena."""

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> ArenaView:
        return ctx.get_workspace(self.float_bytes(), 0)


class SilentUbatchAliasBuilder(UbatchAliasBuilder):
    """Bug 5b: the same aliasing as 5, from a builder that does not report bound_workspaces() (it is optional)."""

    bound_workspaces = None  # type: ignore[assignment]  # the optional hook withdrawn: not reported


class TruthyDeclarationBuilder(FlashInferLikeBuilder):
    """Bug 6a: answers ``True`` instead of a ProfilingSupport member (fail-open under a truthiness test)."""

    def get_persistent_workspace_memory_profiling_support(self) -> Any:  # Any: True, the wrong type, is its bug
        return True


class SelfReservingUnsupportedBuilder(MMPrefixLikeBuilder):
    """Bug 6b: declares UNSUPPORTED yet reserves persistent memory in the profile run as if opted in."""

    def dummy_run(self, ctx: BuilderContext) -> None:
        super().dummy_run(ctx)
        if ctx.profiling and not self.wrappers:
            self._materialize(ctx)


class NonIdempotentWarmupBuilder(FlashInferLikeBuilder):
    """Bug 7a: every warmup call adds another module-global buffer (an autotune cache that never hits)."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.caches: list[Allocation] = []

    def warmup(self, ctx: BuilderContext) -> None:
        scratch = ctx.allocate(64 * MiB, "autotune scratch")
        try:
            self.caches.append(ctx.allocate(MODULE_GLOBAL_BYTES, "module-global workspace"))
        finally:
            ctx.free(scratch)
        self.warmed = True


class RetuningWarmupBuilder(FlashInferLikeBuilder):
    """Bug 7c: warms up once, but every later call re-tunes a kernel with fresh transient scratch."""

    def warmup(self, ctx: BuilderContext) -> None:
        if self.warmed:
            probe = ctx.allocate(2 * MiB, "re-tune scratch")
            ctx.free(probe)
            return
        super().warmup(ctx)


class NonRetryableWarmupBuilder(FlashInferLikeBuilder):
    """Bug 7b: marks itself warmed before it has finished, so a failed warmup is never completed."""

    def warmup(self, ctx: BuilderContext) -> None:
        if self.warmed:
            return
        self.warmed = True
        scratch = ctx.allocate(64 * MiB, "autotune scratch")
        try:
            if self.module_global is None:
                self.module_global = ctx.allocate(MODULE_GLOBAL_BYTES, "module-global workspace")
        finally:
            ctx.free(scratch)


class PostKvLeakyWarmupBuilder(FlashInferLikeBuilder):
    """Bug 7d: tunes only against the final arena (after KV sizing), and a tuning allocation that fails leaks the
    scratch it already holds; the warmup inside the window does nothing, so only a probe after KV sizing sees it."""

    warmup_materializes_persistent = False

    def warmup(self, ctx: BuilderContext) -> None:
        if ctx.profiling or self.warmed:
            return
        scratch = ctx.allocate(AUTOTUNE_SCRATCH_BYTES, "autotune scratch")
        staging = ctx.allocate(8 * MiB, "autotune staging")
        ctx.free(staging)
        ctx.free(scratch)
        self.warmed = True


class ReleaseCallbackAllocatesBuilder(TorchFlashInferLikeBuilder):
    """Bug 1c (torch mode): the lease's release callback re-creates the decode plan cache for serving, after the
    closing measurement, from a callback the engine calls rather than from a builder method."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        made = self._materialize(ctx)

        def release() -> None:
            import torch

            self._drop(ctx, made)
            self.plan_cache = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")

        return ctx.lease(made, on_release=release)


class TorchLeakyRetryWarmupBuilder(TorchFlashInferLikeBuilder):
    """Bug 7e (torch mode): appends each tuned kernel's buffer before its scratch is allocated, so a warmup that
    fails part-way keeps a buffer the retry makes again (plain torch tensors: no ctx.allocate to follow)."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.tuned: list[Tensor] = []

    def warmup(self, ctx: BuilderContext) -> None:
        import torch

        if self.warmed:
            return
        self.tuned.append(torch.empty(MODULE_GLOBAL_BYTES, dtype=torch.uint8, device="cuda"))
        scratch = torch.empty(AUTOTUNE_SCRATCH_BYTES, dtype=torch.uint8, device="cuda")
        del scratch
        self.warmed = True


class GlobalAfterKvSizingBuilder(ProcessWorkspaceBuilder):
    """Bug 14: the process's trtllm-gen workspace (a module global) made on the first real plan, after KV sizing,
    as vLLM makes it on first forward today: no engine's KV sizing counted it."""

    when = AFTER_KV


class GlobalPerEngineBuilder(ProcessWorkspaceBuilder):
    """Bug 14b: the process's trtllm-gen workspace made again by every engine of the process, inside its window,
    replacing the global the first engine's wrappers still hold: that engine's KV sizing never saw the copy."""

    when = PER_ENGINE


class TorchGlobalAfterKvSizingBuilder(TorchProcessWorkspaceBuilder):
    """Bug 14 (torch mode): the trtllm-gen workspace kept in a module dict is made by ``build``, after KV sizing."""

    when = AFTER_KV


class TorchGlobalPerEngineBuilder(TorchProcessWorkspaceBuilder):
    """Bug 14b (torch mode): every engine caches a new trtllm-gen workspace in a module dict, inside its window."""

    when = PER_ENGINE


class FixedDefaultViewBuilder(FlashInferLikeBuilder):
    """Bug 11b: declares the planner's need, but its wrappers ask the arena for vLLM's fixed default
    (``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``, 394 MiB) "to be safe": the arena grows inside the window and KV
    sizing loses what the declaration never mentioned."""

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> ArenaView:
        return ctx.get_workspace(max(self.float_bytes(), vllm_default_fixed_bytes()), ubatch)


class TrtllmNoLseSlabBuilder(TrtllmGenSizedBuilder):
    """Bug 11e: every route on trtllm-gen, its workspace sized for the multi-CTA KV scratch alone. Under DCP the
    engine asks trtllm-gen for LSE, whose launcher carves the softmax-stats slab (heads x DCP x step tokens) first:
    the scratch gets less than it writes."""

    def trtllm_bytes(self) -> int:
        from pytest_kvprofile.sizing.trtllm import trtllm_need, trtllm_routes

        carve = trtllm_need(self.case, trtllm_routes(self.case, self._routes))[1]
        return carve.scratch_bytes if carve is not None else 0


class SyntheticInCaptureBuilder(FlashInferLikeBuilder):
    """Bug 9: builds the synthetic profile workspace in every dummy run, graph capture included."""

    def dummy_run(self, ctx: BuilderContext) -> None:
        if ctx.dummy:
            synthetic = ctx.allocate(self._synthetic_bytes(), "synthetic profile workspace")
            ctx.free(synthetic)


class SyntheticInCapturedBuildBuilder(FlashInferLikeBuilder):
    """Bug 9b: its plan builds a synthetic profiling workspace for every dummy batch, captured ones included."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if ctx.dummy:
            synthetic = ctx.allocate(self._synthetic_bytes(), "synthetic plan workspace")
            ctx.free(synthetic)


class DecodeHeuristicSizingBuilder(FlashInferLikeBuilder):
    """Bug 11: float workspace from a decode-shaped heuristic (16-row tiles keyed on max requests)."""

    def float_bytes(self) -> int:
        from pytest_kvprofile.sizing.rules import decode_shaped_heuristic

        h, env = self.case.heads, self.case.envelope
        return decode_shaped_heuristic(
            h.heads_q, h.heads_kv, self.case.model.head_dim, self.case.gpu.num_sm, env.max_num_seqs,
            tp=self.case.tp, head_dim_vo=self.case.model.dim_vo,
        )


class WrongVersionFormulaBuilder(FlashInferLikeBuilder):
    """Bug 12: float workspace from the FlashInfer 0.6.x formula, which ignores CUDA-graph padding on 0.7.x."""

    def float_bytes(self) -> int:
        from pytest_kvprofile.sizing.rules import formula_06x

        h = self.case.heads
        return formula_06x(h.heads_q, h.heads_kv, self.case.model.head_dim, self.case.gpu.num_sm,
                           head_dim_vo=self.case.model.dim_vo)


class TorchKeptAndRemadeBuilder(TorchFlashInferLikeBuilder):
    """Bug 3b (torch mode): releases its lease, but keeps the profiling wrappers alive in a side list and makes them
    again on rebind: the leased bytes exist twice after KV sizing (plain tensors: their tags never match)."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        self.profiling_wrappers = self._materialize(ctx)
        self.wrappers.clear()
        return ctx.lease(self.profiling_wrappers)


class TorchDataPtrAliasBuilder(TorchFlashInferLikeBuilder):
    """Bug 5c (torch mode): asks for every micro-batch's arena view but plans each wrapper into micro-batch 0's
    tensor, and reports its bound workspaces from ``data_ptr()``: only the pointers show the aliasing."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.float_tensors: dict[tuple[str, int], Any] = {}  # Any: arena tensors, never None in torch mode

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        wrapper = super()._new_wrapper(ctx, route, ubatch)
        self.float_tensors[(route, ubatch)] = ctx.get_workspace(self.float_bytes(), 0).tensor
        return wrapper

    def bound_workspaces(self) -> list[BoundWorkspace]:
        return [BoundWorkspace(ub, f"{route} float workspace", t.data_ptr(), t.numel())
                for (route, ub), t in self.float_tensors.items() if (route, ub) in self.wrappers]


class NeutralLateStateBuilder(GDNLikeBuilder):
    """Bug 6c: NEUTRAL, yet keeps a private state buffer made on its first batch after KV sizing, and frees it in
    ``close()``: the record must show it kept, however the run is torn down."""

    name = "gdn-late-state"

    def __init__(self, case: Case):
        super().__init__(case)
        self.state: Allocation | None = None

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if not ctx.dummy and not ctx.profiling and self.state is None:
            self.ctx, self.state = ctx, ctx.allocate(GDN_WORKSPACE_BYTES, "gdn conv state")

    def close(self) -> None:
        if self.state is not None:
            self.ctx.free(self.state)
            self.state = None


class TorchNeutralLateStateBuilder(GDNLikeBuilder):
    """Bug 6d (torch mode): 6c with a plain torch tensor, dropped in ``close()``."""

    name = "gdn-late-state-torch"
    torch_mode = True

    def __init__(self, case: Case):
        super().__init__(case)
        self.state: Tensor | None = None

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        import torch

        super().build(ctx, batch)
        if not ctx.dummy and not ctx.profiling and self.state is None:
            self.state = torch.empty(GDN_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")

    def close(self) -> None:
        self.state = None


class RaisingCloseBuilder(FlashInferLikeBuilder):
    """Bug 18a: ``close()`` raises (it tears down a wrapper that was never made)."""

    def close(self) -> None:
        raise RuntimeError("flashinfer.close(): no wrapper for route 'prefill-ragged'")


class DoubleFreeCloseBuilder(FlashInferLikeBuilder):
    """Bug 18b: ``close()`` frees every int workspace twice (once per wrapper, once per ubatch list)."""

    def rebind(self, ctx: BuilderContext) -> None:
        self.ctx = ctx
        super().rebind(ctx)

    def close(self) -> None:
        for w in self.wrappers.values():
            self.ctx.free(w.int_workspace)
        for w in self.wrappers.values():
            self.ctx.free(w.int_workspace)


class TorchDoubleFreeCloseBuilder(TorchFlashInferLikeBuilder):
    """Bug 18c (torch mode): keeps a raw ``caching_allocator_alloc`` buffer from its reservation and hands it back
    twice in ``close()``."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        import torch

        raw = torch.cuda.caching_allocator_alloc(MiB)
        try:
            lease = super().reserve_persistent_workspace(ctx)
        except BaseException:
            torch.cuda.caching_allocator_delete(raw)  # type: ignore[no-untyped-call]  # all or nothing: its bug is the double free in close() only
            raise
        self.raw = raw
        return lease

    def close(self) -> None:
        import torch

        torch.cuda.caching_allocator_delete(self.raw)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        torch.cuda.caching_allocator_delete(self.raw)  # type: ignore[no-untyped-call]


SMALL_INT_WORKSPACE_BYTES = 32 * 1024  # below what FlashInfer's planner writes for any case's plan


class SmallIntWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 15a: declares FlashInfer's 8 MiB int workspace per wrapper but gives each wrapper 32 KiB, below what the
    planner writes for the case's plans."""

    def int_bytes(self) -> int:
        return SMALL_INT_WORKSPACE_BYTES


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


class TorchSmallIntWorkspaceBuilder(TorchFlashInferLikeBuilder):
    """Bug 15e (torch mode): the torch-mode builder's wrappers get 32 KiB int workspaces against 8 MiB declared."""

    def int_bytes(self) -> int:
        return SMALL_INT_WORKSPACE_BYTES


class TorchSharedIntWorkspaceBuilder(TorchFlashInferLikeBuilder):
    """Bug 15f (torch mode): micro-batch 1's wrappers reuse micro-batch 0's int workspace tensors, so the two
    micro-batches' plans overwrite each other."""

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        first = self.wrappers.get((route, 0))
        if ubatch == 0 or first is None:
            return super()._new_wrapper(ctx, route, ubatch)
        view = self._float_view(ctx, ubatch)
        return replace(first, ubatch=ubatch, float_ptr=view.ptr, float_bytes=view.nbytes, view=view)


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
class PlansIntoOtherUbatchBuilder(FlashInferLikeBuilder):
    """Bug 5d: asks for every micro-batch's arena view, but plans every batch with micro-batch 0's wrapper, so
    micro-batch 1's plans land in micro-batch 0's arena (its grants and bound_workspaces() look right)."""

    def _wrapper_for(self, ctx: BuilderContext, batch: Batch) -> Wrapper:
        return super()._wrapper_for(ctx, Batch(batch.kind, batch.num_reqs, batch.num_tokens, batch.cuda_graph, 0))


class TorchWritesOtherUbatchBuilder(TorchFlashInferLikeBuilder):
    """Bug 5e (torch mode): the same as 5d with plain torch writes: every build writes micro-batch 0's arena
    tensor, whichever micro-batch it builds."""

    def _wrapper_for(self, ctx: BuilderContext, batch: Batch) -> Wrapper:
        return super()._wrapper_for(ctx, Batch(batch.kind, batch.num_reqs, batch.num_tokens, batch.cuda_graph, 0))


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


@dataclass(frozen=True)
class ExpectedCatch:
    """The checks one mutant fails over the default matrix (its bug class is the mutant's ``Backend.bug_class``):
    own-class checks with collateral ones (a lazily sized workspace also overruns after KV sizing, ...).
    ``tests/builtin/test_mutant_catalog.py`` proves each against the sweep (exactly, over every default case, in its
    slow sweep; a subset that holds an own-class check, in the plain run), and ``tests/acceptance/test_catalogs.py``
    holds the catch table of docs/checks.md to them."""

    backend: str
    checks: frozenset[str]


EXPECTED_CATCHES: dict[str, ExpectedCatch] = {}
"""Every mutant's expected catch, by name: each is declared with its mutant (``_mutant(..., catches=...)``)."""


def _expect(name: str, catches: tuple[str, ...]) -> None:
    if not catches or name in EXPECTED_CATCHES:
        raise ValueError(f"mutant {name!r}: no expected catch, or declared twice")
    EXPECTED_CATCHES[name] = ExpectedCatch(name, frozenset(catches))


def _mutant(name: str, bug: int, cls: type, policy: EnginePolicy | None = None,
            extra: tuple[Callable[[Case], Builder], ...] = (), *, catches: tuple[str, ...]) -> Backend:
    """A mutant of bug class ``bug`` and the checks it fails over the default matrix (``EXPECTED_CATCHES``)."""
    _expect(name, catches)

    def make(case: Case) -> list[Builder]:
        return [cls(case), *(e(case) for e in extra)]

    return Backend(
        name=name, make_builders=make, policy=policy or EnginePolicy(), description=(cls.__doc__ or "").strip(),
        origin="mutant", bug_class=bug, torch_mode=bool(getattr(cls, "torch_mode", False)),
    )


class _PlainFlashInfer(FlashInferLikeBuilder):
    """The correct stub, used where the bug lives in the engine integration rather than the builder."""


_OVERFLOWS_ITS_ARENA = (
    "arena_not_grown_after_lock", "arena_stable_after_closing", "captured_memory_stays", "int_workspace_per_wrapper",
    "no_post_kv_overrun", "no_synthetic_workspace_in_capture", "no_use_after_free",
    "persistent_memory_visible_at_closing", "resource_capacity_honoured", "ubatch_arenas_disjoint", "warmup_idempotent",
    "workspace_covers_planner",
)
"""What a float workspace sized too small fails: the arena grows when a batch overflows it, so every check of the arena
and of what it holds follows, besides the sizing check."""

MUTANT_BACKENDS: tuple[Backend, ...] = (
    _mutant("mutant-01-lazy-workspace", 1, LazyWorkspaceBuilder,
            catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing")),
    _mutant("mutant-01b-lazy-large-batch-wrapper", 1, LazyLargeBatchWrapperBuilder,
            catches=(
                "arena_stable_after_closing", "int_workspace_per_wrapper", "no_post_kv_overrun",
                "persistent_memory_visible_at_closing",
            )),
    _mutant("mutant-01c-torch-release-callback-allocates", 1, ReleaseCallbackAllocatesBuilder,
            catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing")),
    _mutant("mutant-02-early-release", 2, EarlyReleaseBuilder,
            catches=(
                "lease_outlives_closing_measurement", "no_post_kv_overrun", "persistent_memory_visible_at_closing",
            )),
    _mutant("mutant-03-never-released", 3, NeverReleasedBuilder,
            catches=(
                "lease_released_before_graph_profiling", "no_post_kv_overrun", "persistent_memory_visible_at_closing",
            )),
    _mutant("mutant-04a-grow-after-lock", 4, GrowAfterLockBuilder,
            catches=(
                "arena_not_grown_after_lock", "arena_stable_after_closing", "int_workspace_per_wrapper",
                "no_post_kv_overrun", "no_use_after_free", "persistent_memory_visible_at_closing",
                "resource_capacity_honoured", "ubatch_arenas_disjoint", "warmup_idempotent",
            )),
    _mutant("mutant-04b-realloc-on-rebind", 4, ReallocOnRebindBuilder,
            catches=("arena_stable_after_closing",)),
    _mutant("mutant-04c-swallowed-grow-after-lock", 4, SwallowedGrowAfterLockBuilder,
            catches=("arena_not_grown_after_lock",)),
    _mutant("mutant-04d-remakes-captured-index-buffers", 4, RemakesCapturedIndexBuffersBuilder,
            catches=("captured_memory_stays",)),
    _mutant("mutant-05-ubatch-alias", 5, UbatchAliasBuilder,
            catches=("ubatch_arenas_disjoint",)),
    _mutant("mutant-05b-silent-ubatch-alias", 5, SilentUbatchAliasBuilder,
            catches=("ubatch_arenas_disjoint",)),
    _mutant("mutant-06a-truthy-declaration", 6, TruthyDeclarationBuilder,
            catches=("support_declaration",)),
    _mutant("mutant-06b-unsupported-reserves", 6, FlashInferLikeBuilder, extra=(SelfReservingUnsupportedBuilder,),
            catches=("legacy_path_unchanged",)),
    _mutant("mutant-07a-warmup-not-idempotent", 7, NonIdempotentWarmupBuilder,
            catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing", "warmup_idempotent")),
    _mutant("mutant-07b-warmup-not-retryable", 7, NonRetryableWarmupBuilder,
            catches=("warmup_retryable",)),
    _mutant("mutant-07c-warmup-retunes", 7, RetuningWarmupBuilder,
            catches=("warmup_idempotent",)),
    _mutant("mutant-07d-post-kv-warmup-leaks", 7, PostKvLeakyWarmupBuilder,
            catches=("no_post_kv_overrun", "warmup_retryable")),
    _mutant("mutant-07e-torch-warmup-keeps-partial", 7, TorchLeakyRetryWarmupBuilder,
            catches=("warmup_retryable",)),
    _mutant("mutant-08-profile-once", 8, _PlainFlashInfer, EnginePolicy(replay_after_warmup=False),
            catches=("no_post_kv_overrun", "profile_replayed_after_warmup")),
    _mutant("mutant-09-synthetic-in-capture", 9, SyntheticInCaptureBuilder,
            catches=("no_synthetic_workspace_in_capture",)),
    _mutant("mutant-09b-synthetic-in-captured-build", 9, SyntheticInCapturedBuildBuilder,
            catches=("no_synthetic_workspace_in_capture",)),
    _mutant("mutant-10-graph-gross-minus-retained", 10, _PlainFlashInfer,
            EnginePolicy(graph_estimate="gross_minus_retained"),
            catches=("graph_pool_full_high_water", "no_post_kv_overrun")),
    _mutant("mutant-10b-graph-pool-not-accounted", 10, _PlainFlashInfer, EnginePolicy(graph_estimate="none"),
            catches=("graph_pool_full_high_water", "no_post_kv_overrun")),
    _mutant("mutant-11-decode-heuristic-sizing", 11, DecodeHeuristicSizingBuilder,
            catches=(
                "arena_not_grown_after_lock", "arena_stable_after_closing", "captured_memory_stays",
                "int_workspace_per_wrapper", "no_post_kv_overrun", "no_synthetic_workspace_in_capture",
                "no_use_after_free", "persistent_memory_visible_at_closing", "ubatch_arenas_disjoint",
                "warmup_idempotent", "workspace_covers_planner",
            )),
    _mutant("mutant-11b-fixed-default-view", 11, FixedDefaultViewBuilder,
            catches=("no_post_kv_overrun", "workspace_covers_planner")),
    _mutant("mutant-11e-trtllm-no-lse-slab", 11, TrtllmNoLseSlabBuilder,
            catches=("trtllm_workspace_covers_launcher",)),
    _mutant("mutant-12-wrong-version-formula", 12, WrongVersionFormulaBuilder,
            catches=_OVERFLOWS_ITS_ARENA),
    _mutant("mutant-14a-global-after-kv-sizing", 14, GlobalAfterKvSizingBuilder,
            catches=("no_post_kv_overrun", "no_state_outlives_case", "persistent_memory_visible_at_closing")),
    _mutant("mutant-14b-global-per-engine", 14, GlobalPerEngineBuilder,
            catches=("no_state_outlives_case", "reservation_exception_safe")),
    _mutant("mutant-14c-torch-global-after-kv-sizing", 14, TorchGlobalAfterKvSizingBuilder,
            catches=("no_post_kv_overrun", "no_state_outlives_case", "persistent_memory_visible_at_closing")),
    _mutant("mutant-14d-torch-global-per-engine", 14, TorchGlobalPerEngineBuilder,
            catches=("no_state_outlives_case", "reservation_exception_safe")),
    _mutant("mutant-03b-torch-kept-and-remade", 3, TorchKeptAndRemadeBuilder,
            catches=(
                "lease_released_before_graph_profiling", "no_post_kv_overrun", "persistent_memory_visible_at_closing",
            )),
    _mutant("mutant-05c-torch-data-ptr-alias", 5, TorchDataPtrAliasBuilder,
            catches=("ubatch_arenas_disjoint",)),
    _mutant("mutant-06c-neutral-frees-late-state-in-close", 6, FlashInferLikeBuilder, extra=(NeutralLateStateBuilder,),
            catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing", "support_declaration")),
    _mutant("mutant-06d-torch-neutral-frees-late-state-in-close", 6, TorchFlashInferLikeBuilder,
            extra=(TorchNeutralLateStateBuilder,),
            catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing", "support_declaration")),
    _mutant("mutant-18a-close-raises", 18, RaisingCloseBuilder,
            catches=("teardown_clean",)),
    _mutant("mutant-18b-close-double-free", 18, DoubleFreeCloseBuilder,
            catches=("teardown_clean",)),
    _mutant("mutant-18c-torch-close-double-free", 18, TorchDoubleFreeCloseBuilder,
            catches=("teardown_clean",)),
    _mutant("mutant-15a-int-workspace-too-small", 15, SmallIntWorkspaceBuilder,
            catches=("int_workspace_per_wrapper",)),
    _mutant("mutant-15b-int-workspace-shared-by-wrappers", 15, SharedIntWorkspaceBuilder,
            catches=("int_workspace_per_wrapper",)),
    _mutant("mutant-15c-int-workspace-freed-early", 15, FreedIntWorkspaceBuilder,
            catches=("int_workspace_per_wrapper", "no_post_kv_overrun", "no_use_after_free")),
    _mutant("mutant-15d-int-workspace-remade-after-capture", 15, RemadeIntWorkspaceBuilder,
            catches=("captured_memory_stays", "int_workspace_per_wrapper")),
    _mutant("mutant-15j-int-workspace-slices-too-small", 15, SlicedIntWorkspaceBuilder,
            catches=("int_workspace_per_wrapper",)),
    _mutant("mutant-15e-torch-int-workspace-too-small", 15, TorchSmallIntWorkspaceBuilder,
            catches=("int_workspace_per_wrapper",)),
    _mutant("mutant-15f-torch-int-workspace-shared-by-ubatches", 15, TorchSharedIntWorkspaceBuilder,
            catches=("int_workspace_per_wrapper",)),
    _mutant("mutant-15g-torch-int-workspace-freed-early", 15, TorchFreedIntWorkspaceBuilder,
            catches=("int_workspace_per_wrapper", "no_post_kv_overrun")),
    _mutant("mutant-15h-torch-int-workspace-remade-after-capture", 15, TorchRemadeIntWorkspaceBuilder,
            catches=("arena_stable_after_closing", "captured_memory_stays", "int_workspace_per_wrapper")),
    _mutant("mutant-05d-plans-into-other-ubatch", 5, PlansIntoOtherUbatchBuilder,
            catches=("int_workspace_per_wrapper", "ubatch_arenas_disjoint")),
    _mutant("mutant-05e-torch-writes-other-ubatch", 5, TorchWritesOtherUbatchBuilder,
            catches=("int_workspace_per_wrapper", "ubatch_arenas_disjoint")),
    _mutant("mutant-16a-plans-into-released-workspace", 16, PlansIntoReleasedWorkspaceBuilder,
            catches=("int_workspace_per_wrapper", "no_use_after_free")),
    _mutant("mutant-16b-stale-view-after-growth", 16, StaleViewAfterGrowthBuilder,
            catches=("no_use_after_free",)),
    _mutant("mutant-16c-torch-stale-arena-view", 16, TorchStaleArenaViewBuilder,
            catches=("no_use_after_free",)),
    _mutant("mutant-17a-reservation-keeps-partial", 17, ReservationKeepsPartialBuilder,
            catches=("reservation_exception_safe",)),
    _mutant("mutant-17b-torch-reservation-keeps-partial", 17, TorchReservationKeepsPartialBuilder,
            catches=("reservation_exception_safe",)),
    _mutant("mutant-17c-cleanup-masks-first-error", 17, CleanupMasksErrorBuilder,
            catches=("reservation_exception_safe",)),
)


def _resource_mutant(name: str, cls: type, *, catches: tuple[str, ...]) -> Backend:
    _expect(name, catches)
    from pytest_kvprofile.builtin.resources import DEFAULT_PARAMS

    def make(case: Case) -> list[Builder]:
        return [FlashInferLikeBuilder(case)]

    def resources(case: Case) -> list[PersistentResource]:
        carried = [dict(r.params) for r in case.resources if r.kind == "dma-output-workspace"]
        return [cls(case, carried[0] if carried else DEFAULT_PARAMS)]

    return Backend(name=name, make_builders=make, make_resources=resources, description=(cls.__doc__ or "").strip(),
                   origin="mutant", bug_class=13)


def _resource_mutants() -> tuple[Backend, ...]:
    from pytest_kvprofile.builtin.resources import (
        CaptureStagingDMAOutputWorkspace,
        LazyDMAOutputWorkspace,
        OversizedDMAOutputWorkspace,
        WarmupMadeDMAOutputWorkspace,
    )

    return (
        _resource_mutant("mutant-13a-resource-lazy", LazyDMAOutputWorkspace,
                         catches=(
                             "no_post_kv_overrun", "no_synthetic_workspace_in_capture",
                             "persistent_memory_visible_at_closing",
                         )),
        _resource_mutant("mutant-13b-resource-over-capacity", OversizedDMAOutputWorkspace,
                         catches=("resource_capacity_honoured",)),
        _resource_mutant("mutant-13c-resource-in-capture", CaptureStagingDMAOutputWorkspace,
                         catches=("no_synthetic_workspace_in_capture",)),
        _resource_mutant("mutant-13d-resource-made-in-late-warmup", WarmupMadeDMAOutputWorkspace,
                         catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing")),
    )


MUTANT_BACKENDS = MUTANT_BACKENDS + _resource_mutants() + field_mutants(_mutant)


class _VllmDefaultArena:
    """The open vLLM pull request's arena size (``builtin.stubs.vllm_default_float_bytes``), for a FlashInfer-like
    stub."""

    case: Case

    def float_bytes(self) -> int:
        return vllm_default_float_bytes(self.case)


class VllmDefaultArenaOverBudgetBuilder(_VllmDefaultArena, FlashInferLikeBuilder):
    """Bug 19a (only under a waste budget): vLLM's default arena, max(394 MiB, tokens x heads x dim x 16 B), where
    the planned routes need a fraction of it; safe, but over a project's ``--kvprofile-max-waste``."""


class TorchVllmDefaultArenaOverBudgetBuilder(_VllmDefaultArena, TorchFlashInferLikeBuilder):
    """Bug 19b (torch mode, only under a waste budget): 19a written with plain torch tensors."""


class UnusedTrtllmWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 19c (only under a waste budget): every route plans natively into the arena, yet the reservation also makes
    vLLM's 394 MiB trtllm-gen workspace, which no route of the case uses."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        workspace = ctx.allocate(vllm_trtllm_workspace_bytes(), "trtllm-gen workspace", role=Role.TRTLLM_WORKSPACE)
        try:
            lease = super().reserve_persistent_workspace(ctx)
        except BaseException:
            ctx.free(workspace)  # all or nothing: its bug is the waste only
            raise
        self.trtllm_workspace = workspace
        return lease


class PrivateFloatWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 19d (only under a waste budget): each wrapper keeps vLLM's default float workspace of its own
    (``Role.FLOAT_WORKSPACE``) beside the arena view it asks for; KV sizing sees it, the need comparison must too."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.private: dict[int, Allocation] = {}

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        w = super()._new_wrapper(ctx, route, ubatch)
        try:
            self.private[id(w)] = ctx.allocate(vllm_default_fixed_bytes(),
                                               f"{route} private float workspace [ubatch {ubatch}]",
                                               role=Role.FLOAT_WORKSPACE)
        except BaseException:
            super()._drop(ctx, [w])  # a wrapper that fails to construct leaves nothing behind: its bug is the waste
            raise
        return w

    def _drop(self, ctx: BuilderContext, wrappers: list[Wrapper]) -> None:
        for w in wrappers:
            buf = self.private.pop(id(w), None)
            if buf is not None:
                ctx.free(buf)
        super()._drop(ctx, wrappers)


class _PrefillSizedForDecode:
    """Plans every route natively, naming each view's route, but sizes every view for the case's smallest planner
    sub-route (the decode step; eager prefill where decode is not FA2), as if the larger routes went to trtllm-gen:
    the largest plan overflows the view FlashInfer's planner writes into."""

    case: Case

    def float_bytes(self) -> int:
        return min(r.float_bytes for r in for_case(self.case).routes.values())

    # Any: a Wrapper from the builder this mixin is mixed into, whose super() mypy cannot see
    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Any:
        self._planning = route
        return super()._new_wrapper(ctx, route, ubatch)  # type: ignore[misc]

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> ArenaView:
        return ctx.get_workspace(self.float_bytes(), ubatch, route=self._planning)


class ShortNativeRouteBuilder(_PrefillSizedForDecode, FlashInferLikeBuilder):
    """Bug 11c: a native prefill route planned into an arena view sized for the decode route only."""


class TorchShortNativeRouteBuilder(_PrefillSizedForDecode, TorchFlashInferLikeBuilder):
    """Bug 11d (torch mode): 11c written with plain torch tensors."""


class PrefillGraphIntoEagerViewBuilder(EagerPrefillBuilder):
    """Bug 11f: asks for its prefill view for plans without CUDA graphs (``get_workspace(route="prefill",
    cuda_graph=False)``) and sizes it so, yet plans the prefill batches the engine captures into it as they come, with
    graphs: FlashInfer's CUDA-graph prefill plan pads to every query tile and overflows the view."""

    def _part(self, batch: Batch) -> Batch:
        return batch


GRAPH_SCRATCH_BYTES = 76 * MiB  # the incident's scratch (issue 51, item 6)


class GraphProfilingScratchBuilder(FlashInferLikeBuilder):
    """Bug 1e: keeps a 76 MiB scratch it first makes in a dummy forward outside the window (graph profiling, after the
    closing measurement), while the lease release frees what the closing measurement saw of its wrappers: the net
    growth at KV sizing is smaller than the scratch, and only the serving phases show all of it."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.scratch: Allocation | None = None

    def dummy_run(self, ctx: BuilderContext) -> None:
        super().dummy_run(ctx)
        if self.scratch is None and ctx.dummy and not ctx.profiling:
            self.scratch = ctx.allocate(GRAPH_SCRATCH_BYTES, "graph scratch")


BUDGET_MUTANT_BACKENDS: tuple[Backend, ...] = (
    _mutant("mutant-19a-vllm-default-arena-over-budget", 19, VllmDefaultArenaOverBudgetBuilder,
            catches=("workspace_covers_planner",)),
    _mutant("mutant-19b-torch-vllm-default-arena-over-budget", 19, TorchVllmDefaultArenaOverBudgetBuilder,
            catches=("workspace_covers_planner",)),
    _mutant("mutant-19c-unused-trtllm-workspace", 19, UnusedTrtllmWorkspaceBuilder,
            catches=("workspace_covers_planner",)),
    _mutant("mutant-19d-private-float-workspace", 19, PrivateFloatWorkspaceBuilder,
            catches=("workspace_covers_planner",)),
)
# Waste is refused only over a budget, so the mutants whose bug can be an oversized workspace are judged under one:
# two micro-batch arenas x one 2 MiB caching-allocator block, the slack sizing mutants were judged with before.
WASTE_BUDGET = WasteBudget(4.0)
MUTANT_CHECK_OPTIONS: dict[str, CheckOptions] = {
    name: CheckOptions(max_waste=WASTE_BUDGET)
    for name in ("mutant-11-decode-heuristic-sizing", "mutant-11b-fixed-default-view",
                 "mutant-12-wrong-version-formula", *(b.name for b in BUDGET_MUTANT_BACKENDS))
}
MUTANT_BACKENDS = MUTANT_BACKENDS + (
    _mutant("mutant-11c-short-native-route", 11, ShortNativeRouteBuilder,
            catches=_OVERFLOWS_ITS_ARENA),
    _mutant("mutant-11d-torch-short-native-route", 11, TorchShortNativeRouteBuilder,
            catches=_OVERFLOWS_ITS_ARENA),
    _mutant("mutant-01e-graph-profiling-scratch", 1, GraphProfilingScratchBuilder,
            catches=("no_synthetic_workspace_in_capture", "persistent_memory_visible_at_closing")),
    _mutant("mutant-11f-prefill-graph-into-eager-view", 11, PrefillGraphIntoEagerViewBuilder,
            catches=("workspace_covers_planner",)),
    *BUDGET_MUTANT_BACKENDS,
)


def check_options_for(backend: Backend) -> CheckOptions:
    """The options a mutant is judged under: a waste budget for the budget mutants, the defaults otherwise."""
    return MUTANT_CHECK_OPTIONS.get(getattr(backend, "name", ""), CheckOptions())
