"""The mutant catalog: each builder differs from a correct stub by exactly one bug class of docs/contract.md ("Bug classes").

Every check the suite ships must be shown to fail on the mutant that carries the bug it targets;
``tests/test_mutants.py`` runs the suite over this catalog and prints the catch table.
"""

from __future__ import annotations

from typing import Any

from pytest_kvprofile.builtin.stubs import (
    AUTOTUNE_SCRATCH_BYTES,
    MODULE_GLOBAL_BYTES,
    FlashInferLikeBuilder,
    MMPrefixLikeBuilder,
    TorchFlashInferLikeBuilder,
)
from pytest_kvprofile.checks.base import CheckOptions, WasteBudget
from pytest_kvprofile.contract.backends import Backend, EnginePolicy
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.workspace import WorkspaceLockedError
from pytest_kvprofile.sizing.case import for_case, vllm_default_float_bytes
from pytest_kvprofile.sizing.facts import VLLM_DEFAULT_FLOAT_BYTES
from pytest_kvprofile.units import MiB


class LazyWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 1: declares REQUIRED but leaves its wrappers (and int workspaces) to the first plan()."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        return ctx.lease([])


class LazyLargeBatchWrapperBuilder(FlashInferLikeBuilder):
    """Bug 1b: reserves its wrappers, but a separate wrapper for prefill/mixed batches of more than 8
    requests (a ragged-KV path) is created on the first such plan(), after KV sizing."""

    def build(self, ctx: BuilderContext, batch: Any) -> None:
        super().build(ctx, batch)
        key = ("ragged prefill", batch.ubatch)
        if batch.kind != "decode" and batch.num_reqs > 8 and key not in self.wrappers:
            self.wrappers[key] = self._new_wrapper(ctx, "ragged prefill", batch.ubatch)


class EarlyReleaseBuilder(FlashInferLikeBuilder):
    """Bug 2: releases its lease inside the profiling block, before the closing measurement."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        lease = super().reserve_persistent_workspace(ctx)
        lease.release()
        return lease


class NeverReleasedBuilder(FlashInferLikeBuilder):
    """Bug 3: its lease keeps the profiling wrappers alive forever (they leak into graph profiling)."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        wrappers = self._materialize(ctx)
        self.leaked = wrappers
        for key in [k for k, v in self.wrappers.items() if v in wrappers]:
            del self.wrappers[key]
        return ctx.lease(wrappers)


class GrowAfterLockBuilder(FlashInferLikeBuilder):
    """Bug 4a: sizes its float request from the live batch, so serving asks the locked arena to grow."""

    def build(self, ctx: BuilderContext, batch: Any) -> None:
        super().build(ctx, batch)
        if not ctx.dummy and batch.kind == "prefill":
            ctx.get_workspace(self.float_bytes() + 2 * MiB, batch.ubatch)


class SwallowedGrowAfterLockBuilder(FlashInferLikeBuilder):
    """Bug 4c: like 4a, but catches the locked arena's refusal and plans into its own transient buffer."""

    def build(self, ctx: BuilderContext, batch: Any) -> None:
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

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> Any:
        return ctx.get_workspace(self.float_bytes(), 0)


class SilentUbatchAliasBuilder(UbatchAliasBuilder):
    """Bug 5b: the same aliasing as 5, from a builder that does not report bound_workspaces() (it is optional)."""

    bound_workspaces = None


class TruthyDeclarationBuilder(FlashInferLikeBuilder):
    """Bug 6a: answers ``True`` instead of a ProfilingSupport member (fail-open under a truthiness test)."""

    def get_persistent_workspace_memory_profiling_support(self) -> Any:  # type: ignore[override]
        return True


class SelfReservingUnsupportedBuilder(MMPrefixLikeBuilder):
    """Bug 6b: declares UNSUPPORTED yet reserves persistent memory in the profile run as if opted in."""

    def dummy_run(self, ctx: BuilderContext) -> None:
        super().dummy_run(ctx)
        if ctx.profiling and not self.wrappers:
            self._materialize(ctx)


class NonIdempotentWarmupBuilder(FlashInferLikeBuilder):
    """Bug 7a: every warmup call adds another module-global buffer (an autotune cache that never hits)."""

    def __init__(self, case: Any):
        super().__init__(case)
        self.caches: list[Any] = []

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

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        made = self._materialize(ctx)

        def release() -> None:
            import torch

            self._drop(ctx, made)
            self.plan_cache = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")

        return ctx.lease(made, on_release=release)


class TorchLeakyRetryWarmupBuilder(TorchFlashInferLikeBuilder):
    """Bug 7e (torch mode): appends each tuned kernel's buffer before its scratch is allocated, so a warmup that
    fails part-way keeps a buffer the retry makes again (plain torch tensors: no ctx.allocate to follow)."""

    def __init__(self, case: Any):
        super().__init__(case)
        self.tuned: list[Any] = []

    def warmup(self, ctx: BuilderContext) -> None:
        import torch

        if self.warmed:
            return
        self.tuned.append(torch.empty(MODULE_GLOBAL_BYTES, dtype=torch.uint8, device="cuda"))
        scratch = torch.empty(AUTOTUNE_SCRATCH_BYTES, dtype=torch.uint8, device="cuda")
        del scratch
        self.warmed = True


_SHARED_WORKSPACES: dict[str, Any] = {}  # module state: what mutant 14 keeps across cases


class ModuleGlobalWorkspaceBuilder(TorchFlashInferLikeBuilder):
    """Bug 14 (torch mode): a trtllm-gen-like workspace kept in a module global, made inside the window by the first
    case a process runs and reused, never allocated again, by every later one."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        import torch

        if "trtllm-gen" not in _SHARED_WORKSPACES:
            _SHARED_WORKSPACES["trtllm-gen"] = torch.zeros(MODULE_GLOBAL_BYTES, dtype=torch.uint8, device="cuda")
        return super().reserve_persistent_workspace(ctx)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        _SHARED_WORKSPACES["trtllm-gen"][:64].zero_()


class FixedDefaultViewBuilder(FlashInferLikeBuilder):
    """Bug 11b: declares the planner's need, but its wrappers ask the arena for vLLM's fixed default
    (``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``, 394 MiB) "to be safe": the arena grows inside the window and KV
    sizing loses what the declaration never mentioned."""

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> Any:
        return ctx.get_workspace(max(self.float_bytes(), 394 * MiB), ubatch)


class SyntheticInCaptureBuilder(FlashInferLikeBuilder):
    """Bug 9: builds the synthetic profile workspace in every dummy run, graph capture included."""

    def dummy_run(self, ctx: BuilderContext) -> None:
        if ctx.dummy:
            synthetic = ctx.allocate(self._synthetic_bytes(), "synthetic profile workspace")
            ctx.free(synthetic)


class SyntheticInCapturedBuildBuilder(FlashInferLikeBuilder):
    """Bug 9b: its plan builds a synthetic profiling workspace for every dummy batch, captured ones included."""

    def build(self, ctx: BuilderContext, batch: Any) -> None:
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


def _mutant(name: str, bug: int, cls: type, policy: EnginePolicy | None = None, extra: tuple = ()) -> Backend:
    def make(case: Any) -> list[Any]:
        return [cls(case), *(e(case) for e in extra)]

    return Backend(
        name=name, make_builders=make, policy=policy or EnginePolicy(), description=(cls.__doc__ or "").strip(),
        origin="mutant", bug_class=bug, torch_mode=bool(getattr(cls, "torch_mode", False)),
    )


class _PlainFlashInfer(FlashInferLikeBuilder):
    """The correct stub, used where the bug lives in the engine integration rather than the builder."""


MUTANT_BACKENDS: tuple[Backend, ...] = (
    _mutant("mutant-01-lazy-workspace", 1, LazyWorkspaceBuilder),
    _mutant("mutant-01b-lazy-large-batch-wrapper", 1, LazyLargeBatchWrapperBuilder),
    _mutant("mutant-01c-torch-release-callback-allocates", 1, ReleaseCallbackAllocatesBuilder),
    _mutant("mutant-02-early-release", 2, EarlyReleaseBuilder),
    _mutant("mutant-03-never-released", 3, NeverReleasedBuilder),
    _mutant("mutant-04a-grow-after-lock", 4, GrowAfterLockBuilder),
    _mutant("mutant-04b-realloc-on-rebind", 4, ReallocOnRebindBuilder),
    _mutant("mutant-04c-swallowed-grow-after-lock", 4, SwallowedGrowAfterLockBuilder),
    _mutant("mutant-05-ubatch-alias", 5, UbatchAliasBuilder),
    _mutant("mutant-05b-silent-ubatch-alias", 5, SilentUbatchAliasBuilder),
    _mutant("mutant-06a-truthy-declaration", 6, TruthyDeclarationBuilder),
    _mutant("mutant-06b-unsupported-reserves", 6, FlashInferLikeBuilder, extra=(SelfReservingUnsupportedBuilder,)),
    _mutant("mutant-07a-warmup-not-idempotent", 7, NonIdempotentWarmupBuilder),
    _mutant("mutant-07b-warmup-not-retryable", 7, NonRetryableWarmupBuilder),
    _mutant("mutant-07c-warmup-retunes", 7, RetuningWarmupBuilder),
    _mutant("mutant-07d-post-kv-warmup-leaks", 7, PostKvLeakyWarmupBuilder),
    _mutant("mutant-07e-torch-warmup-keeps-partial", 7, TorchLeakyRetryWarmupBuilder),
    _mutant("mutant-08-profile-once", 8, _PlainFlashInfer, EnginePolicy(replay_after_warmup=False)),
    _mutant("mutant-09-synthetic-in-capture", 9, SyntheticInCaptureBuilder),
    _mutant("mutant-09b-synthetic-in-captured-build", 9, SyntheticInCapturedBuildBuilder),
    _mutant("mutant-10-graph-gross-minus-retained", 10, _PlainFlashInfer,
            EnginePolicy(graph_estimate="gross_minus_retained")),
    _mutant("mutant-11-decode-heuristic-sizing", 11, DecodeHeuristicSizingBuilder),
    _mutant("mutant-11b-fixed-default-view", 11, FixedDefaultViewBuilder),
    _mutant("mutant-12-wrong-version-formula", 12, WrongVersionFormulaBuilder),
    _mutant("mutant-14-module-global-workspace", 14, ModuleGlobalWorkspaceBuilder),
)


def _resource_mutant(name: str, cls: type) -> Backend:
    from pytest_kvprofile.builtin.resources import DEFAULT_PARAMS

    def make(case: Any) -> list[Any]:
        return [FlashInferLikeBuilder(case)]

    def resources(case: Any) -> list[Any]:
        carried = [dict(r.params) for r in case.resources if r.kind == "dma-output-workspace"]
        return [cls(case, carried[0] if carried else DEFAULT_PARAMS)]

    return Backend(name=name, make_builders=make, make_resources=resources, description=(cls.__doc__ or "").strip(),
                   origin="mutant", bug_class=13)


def _resource_mutants() -> tuple[Backend, ...]:
    from pytest_kvprofile.builtin.resources import (
        CaptureStagingDMAOutputWorkspace,
        LazyDMAOutputWorkspace,
        OversizedDMAOutputWorkspace,
    )

    return (
        _resource_mutant("mutant-13a-resource-lazy", LazyDMAOutputWorkspace),
        _resource_mutant("mutant-13b-resource-over-capacity", OversizedDMAOutputWorkspace),
        _resource_mutant("mutant-13c-resource-in-capture", CaptureStagingDMAOutputWorkspace),
    )


MUTANT_BACKENDS = MUTANT_BACKENDS + _resource_mutants()


class _VllmDefaultArena:
    """The open vLLM pull request's arena size (``sizing.case.vllm_default_float_bytes``), for a FlashInfer-like stub."""

    case: Any

    def float_bytes(self) -> int:
        return vllm_default_float_bytes(self.case)


class VllmDefaultArenaOverBudgetBuilder(_VllmDefaultArena, FlashInferLikeBuilder):
    """Bug 15a (only under a waste budget): vLLM's default arena, max(394 MiB, tokens x heads x dim x 16 B), where
    the planned routes need a fraction of it; safe, but over a project's ``--kvprofile-max-waste``."""


class TorchVllmDefaultArenaOverBudgetBuilder(_VllmDefaultArena, TorchFlashInferLikeBuilder):
    """Bug 15b (torch mode, only under a waste budget): 15a written with plain torch tensors."""


class UnusedTrtllmWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 15c (only under a waste budget): every route plans natively into the arena, yet the reservation also makes
    vLLM's 394 MiB trtllm-gen workspace, which no route of the case uses."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        self.trtllm_workspace = ctx.allocate(VLLM_DEFAULT_FLOAT_BYTES, "trtllm-gen workspace",
                                             role=Role.TRTLLM_WORKSPACE)
        return super().reserve_persistent_workspace(ctx)


class PrivateFloatWorkspaceBuilder(FlashInferLikeBuilder):
    """Bug 15d (only under a waste budget): each wrapper keeps vLLM's default float workspace of its own
    (``Role.FLOAT_WORKSPACE``) beside the arena view it asks for; KV sizing sees it, the need comparison must too."""

    def __init__(self, case: Any):
        super().__init__(case)
        self.private: dict[int, Any] = {}

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Any:
        w = super()._new_wrapper(ctx, route, ubatch)
        self.private[id(w)] = ctx.allocate(VLLM_DEFAULT_FLOAT_BYTES, f"{route} private float workspace [ubatch {ubatch}]",
                                           role=Role.FLOAT_WORKSPACE)
        return w

    def _drop(self, ctx: BuilderContext, wrappers: list[Any]) -> None:
        for w in wrappers:
            buf = self.private.pop(id(w), None)
            if buf is not None:
                ctx.free(buf)
        super()._drop(ctx, wrappers)


class _PrefillSizedForDecode:
    """Plans every route natively, naming each view's route, but sizes every view for the case's smallest planner
    sub-route (the decode step; eager prefill where decode is not FA2), as if the larger routes went to trtllm-gen:
    the largest plan overflows the view FlashInfer's planner writes into."""

    case: Any

    def float_bytes(self) -> int:
        return min(r.float_bytes for r in for_case(self.case).routes.values())

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Any:
        self._planning = route
        return super()._new_wrapper(ctx, route, ubatch)  # type: ignore[misc]

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> Any:
        return ctx.get_workspace(self.float_bytes(), ubatch, route=self._planning)


class ShortNativeRouteBuilder(_PrefillSizedForDecode, FlashInferLikeBuilder):
    """Bug 11c: a native prefill route planned into an arena view sized for the decode route only."""


class TorchShortNativeRouteBuilder(_PrefillSizedForDecode, TorchFlashInferLikeBuilder):
    """Bug 11d (torch mode): 11c written with plain torch tensors."""


BUDGET_MUTANT_BACKENDS: tuple[Backend, ...] = (
    _mutant("mutant-15a-vllm-default-arena-over-budget", 15, VllmDefaultArenaOverBudgetBuilder),
    _mutant("mutant-15b-torch-vllm-default-arena-over-budget", 15, TorchVllmDefaultArenaOverBudgetBuilder),
    _mutant("mutant-15c-unused-trtllm-workspace", 15, UnusedTrtllmWorkspaceBuilder),
    _mutant("mutant-15d-private-float-workspace", 15, PrivateFloatWorkspaceBuilder),
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
    _mutant("mutant-11c-short-native-route", 11, ShortNativeRouteBuilder),
    _mutant("mutant-11d-torch-short-native-route", 11, TorchShortNativeRouteBuilder),
    *BUDGET_MUTANT_BACKENDS,
)


def check_options_for(backend: Any) -> CheckOptions:
    """The options a mutant is judged under: a waste budget for the budget mutants, the defaults otherwise."""
    return MUTANT_CHECK_OPTIONS.get(getattr(backend, "name", ""), CheckOptions())
