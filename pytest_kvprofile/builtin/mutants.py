"""The mutant catalog: each builder differs from a correct stub by exactly one bug class of
docs/contract.md ("Bug classes").

Every check the suite ships must be shown to fail on the mutant that carries the bug it targets;
``tests/builtin/test_mutant_catalog.py`` runs the suite over this catalog and prints the catch table. Each mutant is
declared on its builder class: name (its bug class is the number in it), what it fails over the default matrix
(``catches=``), its policy and options (``@mutant``, ``builtin/mutant_declarations.py``). This module holds the
mutants of the lifecycle's order (bug classes 1 to 10, 14, 18) and gathers every family into the catalog:

| module | bug classes |
|---|---|
| ``mutants.py`` | 1-10, 12, 14, 18: the lifecycle's order, the declaration, warmup, capture, closing |
| ``mutants_workspaces.py`` | 5d-e, 15, 16, 17: int workspaces, stale views, half-made reservations |
| ``mutants_sizing.py`` | 1e, 11c-f, 19: workspaces sized short or over budget |
| ``mutants_field.py`` | the field incidents (issue 51), each beside its correct twin |
| ``resources.py`` | 13: the persistent resource |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_kvprofile.builtin.mutant_declarations import (
    DECLARED,
    OVERFLOWS_ITS_ARENA,
    WASTE_BUDGET,
    WASTE_OPTIONS,
    Mutant,
    mutant,
)
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
    FlashInferLikeBuilder,
    GDNLikeBuilder,
    MMPrefixLikeBuilder,
    TorchFlashInferLikeBuilder,
    TrtllmGenSizedBuilder,
    Wrapper,
    vllm_default_fixed_bytes,
)
from pytest_kvprofile.checks.base import CheckOptions
from pytest_kvprofile.contract.backends import Backend, EnginePolicy
from pytest_kvprofile.contract.protocol import Batch, BoundWorkspace, BuilderContext
from pytest_kvprofile.contract.workspace import WorkspaceLockedError
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from torch import Tensor

    from pytest_kvprofile.contract.device import Allocation
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.workspace import ArenaView
    from pytest_kvprofile.matrix.cases import Case


@mutant("mutant-01-lazy-workspace", catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing"))
class LazyWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 1: declares REQUIRED but leaves its wrappers (and int workspaces) to the first plan()."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        return ctx.lease([])


@mutant("mutant-01b-lazy-large-batch-wrapper", catches=("arena_stable_after_closing", "int_workspace_per_wrapper",
        "no_post_kv_overrun", "persistent_memory_visible_at_closing"))
class LazyLargeBatchWrapperBuilder(FlashInferLikeBuilder):
    """Bug 1b: reserves its wrappers, but a separate wrapper for prefill/mixed batches of more than 8
    requests (a ragged-KV path) is created on the first such plan(), after KV sizing."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        key = ("ragged prefill", batch.ubatch)
        if batch.kind != "decode" and batch.num_reqs > 8 and key not in self.wrappers:
            self.wrappers[key] = self._new_wrapper(ctx, "ragged prefill", batch.ubatch)


@mutant("mutant-02-early-release", catches=("lease_outlives_closing_measurement", "no_post_kv_overrun",
        "persistent_memory_visible_at_closing"))
class EarlyReleaseBuilder(FlashInferLikeBuilder):
    """Bug 2: releases its lease inside the profiling block, before the closing measurement."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        lease = super().reserve_persistent_workspace(ctx)
        lease.release()
        return lease


@mutant("mutant-03-never-released", catches=("lease_released_before_graph_profiling", "no_post_kv_overrun",
        "persistent_memory_visible_at_closing"))
class NeverReleasedBuilder(FlashInferLikeBuilder):
    """Bug 3: its lease keeps the profiling wrappers alive forever (they leak into graph profiling)."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        wrappers = self._materialize(ctx)
        self.leaked = wrappers
        for key in [k for k, v in self.wrappers.items() if v in wrappers]:
            del self.wrappers[key]
        return ctx.lease(wrappers)


@mutant("mutant-04a-grow-after-lock", catches=("arena_not_grown_after_lock", "arena_stable_after_closing",
        "int_workspace_per_wrapper", "no_post_kv_overrun", "no_use_after_free", "persistent_memory_visible_at_closing",
        "resource_capacity_honoured", "ubatch_arenas_disjoint", "warmup_idempotent"))
class GrowAfterLockBuilder(FlashInferLikeBuilder):
    """Bug 4a: sizes its float request from the live batch, so serving asks the locked arena to grow."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if not ctx.dummy and batch.kind == "prefill":
            ctx.get_workspace(self.float_bytes() + 2 * MiB, batch.ubatch)


@mutant("mutant-04c-swallowed-grow-after-lock", catches=("arena_not_grown_after_lock",))
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


@mutant("mutant-04b-realloc-on-rebind", catches=("arena_stable_after_closing",))
class ReallocOnRebindBuilder(FlashInferLikeBuilder):
    """Bug 4b: rebind asks for a slightly larger arena, which reallocates (moves) it after KV sizing."""

    def rebind(self, ctx: BuilderContext) -> None:
        for ub in range(ctx.num_ubatches):
            ctx.get_workspace(ctx.workspace.size(ub) + 4096, ub)
        super().rebind(ctx)


@mutant("mutant-05-ubatch-alias", catches=("ubatch_arenas_disjoint",))
class UbatchAliasBuilder(FlashInferLikeBuilder):
    """Bug 5: every micro-batch's wrapper is bound to micro-batch 0's arena."""

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> ArenaView:
        return ctx.get_workspace(self.float_bytes(), 0)


@mutant("mutant-05b-silent-ubatch-alias", catches=("ubatch_arenas_disjoint",))
class SilentUbatchAliasBuilder(UbatchAliasBuilder):
    """Bug 5b: the same aliasing as 5, from a builder that does not report bound_workspaces() (it is optional)."""

    bound_workspaces = None  # type: ignore[assignment]  # the optional hook withdrawn: not reported


@mutant("mutant-06a-truthy-declaration", catches=("support_declaration",))
class TruthyDeclarationBuilder(FlashInferLikeBuilder):
    """Bug 6a: answers ``True`` instead of a ProfilingSupport member (fail-open under a truthiness test)."""

    def get_persistent_workspace_memory_profiling_support(self) -> Any:  # Any: True, the wrong type, is its bug
        return True


@mutant("mutant-06b-unsupported-reserves", first=FlashInferLikeBuilder, catches=("legacy_path_unchanged",))
class SelfReservingUnsupportedBuilder(MMPrefixLikeBuilder):
    """Bug 6b: declares UNSUPPORTED yet reserves persistent memory in the profile run as if opted in."""

    def dummy_run(self, ctx: BuilderContext) -> None:
        super().dummy_run(ctx)
        if ctx.profiling and not self.wrappers:
            self._materialize(ctx)


@mutant("mutant-07a-warmup-not-idempotent", catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing",
        "warmup_idempotent"))
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


@mutant("mutant-07c-warmup-retunes", catches=("warmup_idempotent",))
class RetuningWarmupBuilder(FlashInferLikeBuilder):
    """Bug 7c: warms up once, but every later call re-tunes a kernel with fresh transient scratch."""

    def warmup(self, ctx: BuilderContext) -> None:
        if self.warmed:
            probe = ctx.allocate(2 * MiB, "re-tune scratch")
            ctx.free(probe)
            return
        super().warmup(ctx)


@mutant("mutant-07b-warmup-not-retryable", catches=("warmup_retryable",))
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


@mutant("mutant-07d-post-kv-warmup-leaks", catches=("no_post_kv_overrun", "warmup_retryable"))
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


@mutant("mutant-01c-torch-release-callback-allocates", catches=("no_post_kv_overrun",
        "persistent_memory_visible_at_closing"))
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


@mutant("mutant-07e-torch-warmup-keeps-partial", catches=("warmup_retryable",))
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


@mutant("mutant-14a-global-after-kv-sizing", catches=("no_post_kv_overrun", "no_state_outlives_case",
        "persistent_memory_visible_at_closing"))
class GlobalAfterKvSizingBuilder(ProcessWorkspaceBuilder):
    """Bug 14: the process's trtllm-gen workspace (a module global) made on the first real plan, after KV sizing,
    as vLLM makes it on first forward today: no engine's KV sizing counted it."""

    when = AFTER_KV


@mutant("mutant-14b-global-per-engine", catches=("no_state_outlives_case", "reservation_exception_safe"))
class GlobalPerEngineBuilder(ProcessWorkspaceBuilder):
    """Bug 14b: the process's trtllm-gen workspace made again by every engine of the process, inside its window,
    replacing the global the first engine's wrappers still hold: that engine's KV sizing never saw the copy."""

    when = PER_ENGINE


@mutant("mutant-14c-torch-global-after-kv-sizing", catches=("no_post_kv_overrun", "no_state_outlives_case",
        "persistent_memory_visible_at_closing"))
class TorchGlobalAfterKvSizingBuilder(TorchProcessWorkspaceBuilder):
    """Bug 14 (torch mode): the trtllm-gen workspace kept in a module dict is made by ``build``, after KV sizing."""

    when = AFTER_KV


@mutant("mutant-14d-torch-global-per-engine", catches=("no_state_outlives_case", "reservation_exception_safe"))
class TorchGlobalPerEngineBuilder(TorchProcessWorkspaceBuilder):
    """Bug 14b (torch mode): every engine caches a new trtllm-gen workspace in a module dict, inside its window."""

    when = PER_ENGINE


@mutant("mutant-11b-fixed-default-view", options=WASTE_OPTIONS, catches=("no_post_kv_overrun",
        "workspace_covers_planner"))
class FixedDefaultViewBuilder(FlashInferLikeBuilder):
    """Bug 11b: declares the planner's need, but its wrappers ask the arena for vLLM's fixed default
    (``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``, 394 MiB) "to be safe": the arena grows inside the window and KV
    sizing loses what the declaration never mentioned."""

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> ArenaView:
        return ctx.get_workspace(max(self.float_bytes(), vllm_default_fixed_bytes()), ubatch)


@mutant("mutant-11e-trtllm-no-lse-slab", catches=("trtllm_workspace_covers_launcher",))
class TrtllmNoLseSlabBuilder(TrtllmGenSizedBuilder):
    """Bug 11e: every route on trtllm-gen, its workspace sized for the multi-CTA KV scratch alone. Under DCP the
    engine asks trtllm-gen for LSE, whose launcher carves the softmax-stats slab (heads x DCP x step tokens) first:
    the scratch gets less than it writes."""

    def trtllm_bytes(self) -> int:
        from pytest_kvprofile.sizing.trtllm import trtllm_need, trtllm_routes

        carve = trtllm_need(self.case, trtllm_routes(self.case, self._routes))[1]
        return carve.scratch_bytes if carve is not None else 0


@mutant("mutant-09-synthetic-in-capture", catches=("no_synthetic_workspace_in_capture",))
class SyntheticInCaptureBuilder(FlashInferLikeBuilder):
    """Bug 9: builds the synthetic profile workspace in every dummy run, graph capture included."""

    def dummy_run(self, ctx: BuilderContext) -> None:
        if ctx.dummy:
            synthetic = ctx.allocate(self._synthetic_bytes(), "synthetic profile workspace")
            ctx.free(synthetic)


@mutant("mutant-09b-synthetic-in-captured-build", catches=("no_synthetic_workspace_in_capture",))
class SyntheticInCapturedBuildBuilder(FlashInferLikeBuilder):
    """Bug 9b: its plan builds a synthetic profiling workspace for every dummy batch, captured ones included."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if ctx.dummy:
            synthetic = ctx.allocate(self._synthetic_bytes(), "synthetic plan workspace")
            ctx.free(synthetic)


@mutant("mutant-11-decode-heuristic-sizing", options=WASTE_OPTIONS, catches=("arena_not_grown_after_lock",
        "arena_stable_after_closing", "captured_memory_stays", "int_workspace_per_wrapper", "no_post_kv_overrun",
        "no_synthetic_workspace_in_capture", "no_use_after_free", "persistent_memory_visible_at_closing",
        "ubatch_arenas_disjoint", "warmup_idempotent", "workspace_covers_planner"))
class DecodeHeuristicSizingBuilder(FlashInferLikeBuilder):
    """Bug 11: float workspace from a decode-shaped heuristic (16-row tiles keyed on max requests)."""

    def float_bytes(self) -> int:
        from pytest_kvprofile.sizing.rules import decode_shaped_heuristic

        h, env = self.case.heads, self.case.envelope
        return decode_shaped_heuristic(
            h.heads_q, h.heads_kv, self.case.model.head_dim, self.case.gpu.num_sm, env.max_num_seqs,
            tp=self.case.tp, head_dim_vo=self.case.model.dim_vo,
        )


@mutant("mutant-12-wrong-version-formula", options=WASTE_OPTIONS, catches=OVERFLOWS_ITS_ARENA)
class WrongVersionFormulaBuilder(FlashInferLikeBuilder):
    """Bug 12: float workspace from the FlashInfer 0.6.x formula, which ignores CUDA-graph padding on 0.7.x."""

    def float_bytes(self) -> int:
        from pytest_kvprofile.sizing.rules import formula_06x

        h = self.case.heads
        return formula_06x(h.heads_q, h.heads_kv, self.case.model.head_dim, self.case.gpu.num_sm,
                           head_dim_vo=self.case.model.dim_vo)


@mutant("mutant-03b-torch-kept-and-remade", catches=("lease_released_before_graph_profiling", "no_post_kv_overrun",
        "persistent_memory_visible_at_closing"))
class TorchKeptAndRemadeBuilder(TorchFlashInferLikeBuilder):
    """Bug 3b (torch mode): releases its lease, but keeps the profiling wrappers alive in a side list and makes them
    again on rebind: the leased bytes exist twice after KV sizing (plain tensors: their tags never match)."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        self.profiling_wrappers = self._materialize(ctx)
        self.wrappers.clear()
        return ctx.lease(self.profiling_wrappers)


@mutant("mutant-05c-torch-data-ptr-alias", catches=("ubatch_arenas_disjoint",))
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


@mutant("mutant-06c-neutral-frees-late-state-in-close", first=FlashInferLikeBuilder, catches=("no_post_kv_overrun",
        "persistent_memory_visible_at_closing", "support_declaration"))
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


@mutant("mutant-06d-torch-neutral-frees-late-state-in-close", first=TorchFlashInferLikeBuilder,
        catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing", "support_declaration"))
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


@mutant("mutant-18a-close-raises", catches=("teardown_clean",))
class RaisingCloseBuilder(FlashInferLikeBuilder):
    """Bug 18a: ``close()`` raises (it tears down a wrapper that was never made)."""

    def close(self) -> None:
        raise RuntimeError("flashinfer.close(): no wrapper for route 'prefill-ragged'")


@mutant("mutant-18b-close-double-free", catches=("teardown_clean",))
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


@mutant("mutant-18c-torch-close-double-free", catches=("teardown_clean",))
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


@mutant("mutant-08-profile-once", policy=EnginePolicy(replay_after_warmup=False), catches=("no_post_kv_overrun",
        "profile_replayed_after_warmup"))
@mutant("mutant-10-graph-gross-minus-retained", policy=EnginePolicy(graph_estimate="gross_minus_retained"),
        catches=("graph_pool_full_high_water", "no_post_kv_overrun"))
@mutant("mutant-10b-graph-pool-not-accounted", policy=EnginePolicy(graph_estimate="none"),
        catches=("graph_pool_full_high_water", "no_post_kv_overrun"))
class _PlainFlashInfer(FlashInferLikeBuilder):
    """The correct stub, used where the bug lives in the engine integration rather than the builder."""


# -- the catalog ---------------------------------------------------------------------------------------------------
# Importing a family module runs its declarations; the field mutants and the resource mutants declare theirs too.
from pytest_kvprofile.builtin import mutants_field, mutants_sizing, mutants_workspaces, resources  # noqa: E402
from pytest_kvprofile.builtin.mutants_sizing import GraphProfilingScratchBuilder  # noqa: E402
from pytest_kvprofile.builtin.mutants_workspaces import (  # noqa: E402
    SMALL_INT_WORKSPACE_BYTES,
    ReservationKeepsPartialBuilder,
    SharedIntWorkspaceBuilder,
    TorchStaleArenaViewBuilder,
)

__all__ = ["BUDGET_MUTANT_BACKENDS", "EXPECTED_CATCHES", "MUTANTS", "MUTANT_BACKENDS", "MUTANT_CHECK_OPTIONS",
           "SMALL_INT_WORKSPACE_BYTES", "WASTE_BUDGET", "ExpectedCatch", "GraphProfilingScratchBuilder",
           "LazyWorkspaceBuilder", "ReservationKeepsPartialBuilder", "SharedIntWorkspaceBuilder",
           "TorchStaleArenaViewBuilder", "WrongVersionFormulaBuilder", "check_options_for"]


@dataclass(frozen=True)
class ExpectedCatch:
    """The checks one mutant fails over the default matrix (its bug class is the number in its name): own-class
    checks with collateral ones (a lazily sized workspace also overruns after KV sizing, ...).
    ``tests/builtin/test_mutant_catalog.py`` proves each against the sweep (exactly, over every default case, in its
    slow sweep; a subset that holds an own-class check, in the plain run), and ``tests/acceptance/test_catalogs.py``
    holds the catch table of docs/checks.md to them."""

    backend: str
    checks: frozenset[str]


_FAMILIES = (mutants_field, mutants_sizing, mutants_workspaces, resources)  # declared on import, above
MUTANTS: tuple[Mutant, ...] = tuple(DECLARED[name] for name in sorted(DECLARED))
"""Every mutant, by name: each declared on its builder class (``@mutant``, ``builtin/mutant_declarations.py``)."""
MUTANT_BACKENDS: tuple[Backend, ...] = tuple(m.backend for m in MUTANTS)
EXPECTED_CATCHES: dict[str, ExpectedCatch] = {m.name: ExpectedCatch(m.name, m.catches) for m in MUTANTS}
"""Every mutant's expected catch, by name: each is declared with its mutant (``@mutant(..., catches=...)``)."""
BUDGET_MUTANT_BACKENDS: tuple[Backend, ...] = tuple(m.backend for m in MUTANTS if m.bug_class == 19)
MUTANT_CHECK_OPTIONS: dict[str, CheckOptions] = {m.name: m.options for m in MUTANTS if m.options is not None}
"""The options a mutant other than the default is judged under (``@mutant(..., options=...)``)."""


def check_options_for(backend: Backend) -> CheckOptions:
    """The options a mutant is judged under: a waste budget for the budget mutants, the defaults otherwise."""
    return MUTANT_CHECK_OPTIONS.get(getattr(backend, "name", ""), CheckOptions())
