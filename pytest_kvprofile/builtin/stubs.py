"""Correct CPU stub builders, modelled on vLLM's FlashInfer, GDN, mm-prefix and DCP builders.

They allocate through the BuilderContext, so every byte is attributed on the simulated device, and
they behave as the contract says; the mutant catalog (``mutants.py``) derives one bug from each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from pytest_kvprofile.attention.facts import FLASHINFER_INT_WORKSPACE_BYTES
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import (
    Batch,
    BoundWorkspace,
    BuilderContext,
    WorkspaceDeclaration,
)
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.matrix.engine_facts import engine_facts, workspace_rule
from pytest_kvprofile.sizing.case import (
    default_float_bytes,
    for_case,
    need_for_planned,
    need_for_routes,
    routes,
)
from pytest_kvprofile.sizing.trtllm import trtllm_need, trtllm_routes
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from torch import Tensor

    from pytest_kvprofile.contract.device import Allocation
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.contract.workspace import ArenaView
    from pytest_kvprofile.matrix.cases import Case

VLLM_DEFAULT_RULE = "vllm-default"  # vLLM's default float workspace, as its package names it (engines/vllm/facts.py)


def vllm_default_fixed_bytes() -> int:
    """vLLM's fixed default float workspace (``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``), from vLLM's registered
    facts."""
    return workspace_rule(VLLM_DEFAULT_RULE).fixed_bytes


def vllm_default_float_bytes(case: Case) -> int:
    """vLLM's default float workspace for the case's rank, grown with batched tokens as vLLM grows it. The open vLLM
    pull request reserves it on purpose: safe, and a cost in KV capacity."""
    return default_float_bytes(VLLM_DEFAULT_RULE, case)


def vllm_trtllm_workspace_bytes() -> int:
    """vLLM's one trtllm-gen workspace per process, from vLLM's registered facts."""
    return engine_facts("vllm").trtllm_workspace_bytes


# a buffer a stub keeps: a ledger Allocation in ctx mode (freed through ctx), a plain torch tensor in torch mode
# (written with torch calls); each mode's code uses it as its own
ModeBuffer: TypeAlias = Any

MODULE_GLOBAL_BYTES = 32 * MiB  # a trtllm-gen-like module-global workspace, created by kernel warmup
AUTOTUNE_SCRATCH_BYTES = 64 * MiB  # transient scratch of warmup's autotuning
GDN_WORKSPACE_BYTES = 16 * MiB


class WorkspaceOverflow(RuntimeError):
    """What FlashInfer's bump allocator raises when a plan does not fit the float workspace."""


@dataclass
class Wrapper:
    """A FlashInfer-like wrapper: a view into the float arena, its own int workspace and pinned mirror."""

    route: str
    ubatch: int
    float_ptr: int
    float_bytes: int
    int_workspace: ModeBuffer
    pinned_mirror: ModeBuffer
    int_ptr: int = 0  # the int workspace's ledger address and bytes, reported in bound_workspaces()
    int_nbytes: int = 0
    view: Any = None  # Any: the ArenaView the float workspace is, set on every wrapper made (None: default only)


class FlashInferCore:
    """The FlashInfer-like machinery without a support declaration (so, fail-closed, UNSUPPORTED).

    One wrapper per (route, micro-batch), each with a dedicated 8 MiB int workspace allocated when the
    wrapper is constructed; the float workspace is a view into the shared arena. Warmup autotunes with
    transient scratch and creates a module-global buffer once.
    """

    name = "flashinfer-untaught"
    warmup_materializes_persistent = True

    def __init__(self, case: Case):
        self.case = case
        self._routes = routes(case)
        self.wrappers: dict[tuple[str, int], Wrapper] = {}
        self.module_global: ModeBuffer = None
        self.warmed = False

    # -- sizing --------------------------------------------------------------------------------
    def float_bytes(self) -> int:
        """What this builder declares and asks the arena for."""
        return for_case(self.case).float_bytes

    def planner_need(self) -> int:
        """What FlashInfer's planner really carves for the envelope's worst batch (the oracle's answer)."""
        return for_case(self.case).float_bytes

    def int_bytes(self) -> int:
        """Each wrapper's dedicated int workspace: FlashInfer's default, which covers the planner's int bytes."""
        return FLASHINFER_INT_WORKSPACE_BYTES

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=self.float_bytes(), int_bytes=FLASHINFER_INT_WORKSPACE_BYTES)

    def routes(self) -> tuple[str, ...]:
        return self._routes

    # -- wrappers ------------------------------------------------------------------------------
    def _float_view(self, ctx: BuilderContext, ubatch: int) -> ArenaView:
        return ctx.get_workspace(self.float_bytes(), ubatch)

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        view = self._float_view(ctx, ubatch)
        int_ws = ctx.allocate(self.int_bytes(), f"{route} int workspace [ubatch {ubatch}]", role=Role.INT_WORKSPACE)
        try:
            mirror = ctx.allocate(self.int_bytes(), f"{route} int workspace pinned mirror [ubatch {ubatch}]",
                                  pinned_host=True, role=Role.PINNED_MIRROR)
        except BaseException:
            ctx.free(int_ws)  # a wrapper that fails to construct leaves nothing behind
            raise
        return Wrapper(route, ubatch, view.ptr, view.nbytes, int_ws, mirror, int_ws.ptr, int_ws.nbytes, view)

    def _drop(self, ctx: BuilderContext, wrappers: list[Wrapper]) -> None:
        for w in wrappers:
            ctx.free(w.int_workspace)
            ctx.free(w.pinned_mirror)
        for key in [k for k, v in self.wrappers.items() if any(v is w for w in wrappers)]:
            del self.wrappers[key]

    def _materialize(self, ctx: BuilderContext) -> list[Wrapper]:
        """Every route's wrapper for every micro-batch; all or nothing (a failure drops what was made, then raises)."""
        made: list[Wrapper] = []
        try:
            for route in self.routes():
                for ub in range(ctx.num_ubatches):
                    w = self._new_wrapper(ctx, route, ub)
                    self.wrappers[(route, ub)] = w
                    made.append(w)
        except BaseException:
            self._drop(ctx, made)
            raise
        return made

    def _wrapper_for(self, ctx: BuilderContext, batch: Batch) -> Wrapper:
        route = "decode" if batch.kind == "decode" and "decode" in self.routes() else "prefill"
        key = (route, batch.ubatch)
        w = self.wrappers.get(key)
        if w is None:  # the lazy path: what the legacy engine does on first plan()
            w = self._new_wrapper(ctx, route, batch.ubatch)
            self.wrappers[key] = w
        return w

    # -- the protocol --------------------------------------------------------------------------
    def rebind(self, ctx: BuilderContext) -> None:
        """Re-create the wrappers on the final arena (the profiling ones went with the lease)."""
        for route in self.routes():
            for ub in range(ctx.num_ubatches):
                if (route, ub) not in self.wrappers:
                    self.wrappers[(route, ub)] = self._new_wrapper(ctx, route, ub)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        w = self._wrapper_for(ctx, batch)
        need = self.planner_need()
        if need > w.float_bytes:
            raise WorkspaceOverflow(
                f"Buffer overflow when allocating memory for batch_prefill_tmp_v with size {need} and "
                f"alignment 16, but only {w.float_bytes} bytes available in AlignedAllocator. "
                "Increase the workspace buffer size."
            )
        self._plan(ctx, w)

    def _plan(self, ctx: BuilderContext, w: Wrapper) -> None:
        """The plan lands in the wrapper's int workspace and its float arena view: say so (ctx mode)."""
        ctx.plan_into(w.view)
        ctx.plan_into(w.int_workspace)

    def warmup(self, ctx: BuilderContext) -> None:
        if self.warmed:
            return
        scratch = ctx.allocate(AUTOTUNE_SCRATCH_BYTES, "autotune scratch")
        try:
            if self.module_global is None:
                self.module_global = ctx.allocate(MODULE_GLOBAL_BYTES, "module-global workspace")
        finally:
            ctx.free(scratch)
        self.warmed = True

    def dummy_run(self, ctx: BuilderContext) -> None:
        """The sparse/DCP path's synthetic workspace: profiled in ordinary dummy runs, never captured."""
        if ctx.dummy and not ctx.capturing:
            synthetic = ctx.allocate(self._synthetic_bytes(), "synthetic profile workspace")
            ctx.free(synthetic)

    def _synthetic_bytes(self) -> int:
        env = self.case.envelope
        return max(MiB, env.max_num_batched_tokens * self.case.heads.heads_q * 4)

    def bound_workspaces(self) -> list[BoundWorkspace]:
        return [
            BoundWorkspace(w.ubatch, f"{w.route} float workspace", w.float_ptr, w.float_bytes, w.int_ptr, w.int_nbytes)
            for w in self.wrappers.values()
        ]


class FlashInferLikeBuilder(FlashInferCore):
    """REQUIRED: materializes its wrappers (and so their int workspaces) inside the window."""

    name = "flashinfer"

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        wrappers = self._materialize(ctx)
        return ctx.lease(wrappers, on_release=lambda: self._drop(ctx, wrappers))


class GDNLikeBuilder:
    """NEUTRAL: no dedicated memory; its scratch is a view of the shared arena (GDN-like)."""

    name = "gdn"

    def __init__(self, case: Case):
        self.case = case
        self.views: dict[int, ArenaView] = {}

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.NEUTRAL

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=GDN_WORKSPACE_BYTES, int_bytes=0)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        self.views[batch.ubatch] = ctx.get_workspace(GDN_WORKSPACE_BYTES, batch.ubatch)

    def warmup(self, ctx: BuilderContext) -> None:
        for ub in range(ctx.num_ubatches):
            self.build(ctx, Batch("prefill", 1, 1, ubatch=ub))

    def bound_workspaces(self) -> list[BoundWorkspace]:
        return [BoundWorkspace(ub, "gdn scratch", v.ptr, v.nbytes) for ub, v in self.views.items()]


class MMPrefixLikeBuilder(FlashInferCore):
    """UNSUPPORTED: a dedicated mm-prefix wrapper that is not yet taught to reserve."""

    name = "mm-prefix"

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.UNSUPPORTED


class DCPLikeBuilder(FlashInferCore):
    """UNSUPPORTED: the DCP path, whose decode wrapper sees heads_q * dcp query heads."""

    name = "flashinfer-dcp"

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.UNSUPPORTED


class UntaughtBuilder(FlashInferCore):
    """A builder never taught the contract: it has no declaration at all."""

    name = "untaught"


def _builtin(name: str, description: str, *classes: type) -> Backend:
    def make(case: Case) -> list[Builder]:
        return [cls(case) for cls in classes]

    make.__qualname__ = f"make_{name.replace('-', '_')}"
    return Backend(name=name, make_builders=make, description=description, origin="builtin")


STUB_BACKENDS: tuple[Backend, ...] = (
    _builtin("stub-flashinfer", "FlashInfer-like builder alone (REQUIRED)", FlashInferLikeBuilder),
    _builtin("stub-hybrid", "FlashInfer-like + GDN-like (REQUIRED + NEUTRAL carried under the lease)",
             FlashInferLikeBuilder, GDNLikeBuilder),
    _builtin("stub-gdn", "GDN-like builder alone (all NEUTRAL: stays on the legacy path)", GDNLikeBuilder),
    _builtin("stub-mm-prefix", "FlashInfer-like + mm-prefix (UNSUPPORTED keeps the model legacy)",
             FlashInferLikeBuilder, MMPrefixLikeBuilder),
    _builtin("stub-dcp", "DCP-like builder (UNSUPPORTED)", DCPLikeBuilder),
    _builtin("stub-untaught", "a builder with no declaration (fail-closed: UNSUPPORTED)", UntaughtBuilder),
)


class TorchFlashInferLikeBuilder(FlashInferLikeBuilder):
    """REQUIRED, written with plain torch "cuda" tensors (torch mode): what an engine's builder looks like.

    The FlashInfer-like stub's behaviour, but nothing it keeps goes through ``ctx.allocate``: the simulated
    device serves and attributes its tensors, so the checks judge what the harness observes of plain torch
    code (release callbacks, retries, module state), not what a context was told. Dropping the last
    reference to a tensor frees it.
    """

    name = "flashinfer-torch"
    torch_mode = True

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        import torch

        view = self._float_view(ctx, ubatch)
        int_ws = torch.empty(self.int_bytes(), dtype=torch.uint8, device="cuda")
        mirror = torch.empty(self.int_bytes(), dtype=torch.uint8, pin_memory=True)
        int_ptr, int_nbytes = with_role(int_ws, Role.INT_WORKSPACE)
        with_role(mirror, Role.PINNED_MIRROR)
        return Wrapper(route, ubatch, view.ptr, view.nbytes, int_ws, mirror, int_ptr, int_nbytes, view)

    def _drop(self, ctx: BuilderContext, wrappers: list[Wrapper]) -> None:
        for key in [k for k, v in self.wrappers.items() if any(v is w for w in wrappers)]:
            del self.wrappers[key]

    def _plan(self, ctx: BuilderContext, w: Wrapper) -> None:
        """Plain torch writes, which the harness observes: the plan in the int workspace, partial outputs in the
        float arena view (what ``run()`` writes there)."""
        import torch

        w.int_workspace[:64].copy_(torch.arange(64, dtype=torch.uint8))
        if w.view.tensor is not None:  # an arena without tensors (a CUDA device's manager by default)
            w.view.tensor[:64].zero_()

    def warmup(self, ctx: BuilderContext) -> None:
        import torch

        if self.warmed:
            return
        scratch = torch.empty(AUTOTUNE_SCRATCH_BYTES, dtype=torch.uint8, device="cuda")
        if self.module_global is None:
            self.module_global = torch.empty(MODULE_GLOBAL_BYTES, dtype=torch.uint8, device="cuda")
        del scratch
        self.warmed = True

    def dummy_run(self, ctx: BuilderContext) -> None:
        import torch

        if ctx.dummy and not ctx.capturing:
            synthetic = torch.empty(self._synthetic_bytes(), dtype=torch.uint8, device="cuda")
            del synthetic


def with_role(tensor: Tensor, role: Role) -> tuple[int, int]:
    """Give a plain torch tensor's simulated allocation its role; its ledger address and bytes ((0, 0) off the
    simulator), which the wrapper reports in ``bound_workspaces()``."""
    from pytest_kvprofile.memory.torch_mode import assign_role

    alloc = assign_role(tensor, role)
    return (alloc.ptr, alloc.nbytes) if alloc is not None else (0, 0)


TORCH_STUB_BACKENDS: tuple[Backend, ...] = (
    Backend(name="stub-flashinfer-torch", make_builders=lambda case: [TorchFlashInferLikeBuilder(case)],
            description="the FlashInfer-like builder written with plain torch tensors (REQUIRED, torch mode)",
            origin="builtin", torch_mode=True),
)


class VllmDefaultArenaBuilder(FlashInferLikeBuilder):
    """REQUIRED, the open vLLM pull request's design: it reserves vLLM's default float arena on purpose,
    max(394 MiB, batched tokens x rank query heads x head dim x 16 B), and does not query per-plan sizes. Safe, since
    KV sizing sees it; the waste is reported, and refused only over ``--kvprofile-max-waste``."""

    name = "flashinfer-vllm-default"

    def float_bytes(self) -> int:
        return vllm_default_float_bytes(self.case)


class TrtllmGenRoutesBuilder(FlashInferLikeBuilder):
    """REQUIRED, Blackwell as vLLM routes it: the routes not in ``NATIVE`` go to trtllm-gen, which plans into its own
    workspace (vLLM's one per process, 394 MiB), made inside the window with ``Role.TRTLLM_WORKSPACE``. Only the
    native routes have FA2 wrappers; their arena views name their route, so each is sized for its own route."""

    name = "flashinfer-trtllm-gen"
    NATIVE: tuple[str, ...] = ()

    def __init__(self, case: Case):
        super().__init__(case)
        self._routes = tuple(r for r in routes(case) if r in self.NATIVE)
        self._trtllm = tuple(r for r in routes(case) if r not in self.NATIVE)
        self._planning: str | None = None
        self.trtllm_workspace: Allocation | None = None

    def float_bytes(self) -> int:
        return need_for_routes(self.case, self._routes)[0]

    def trtllm_bytes(self) -> int:
        """The trtllm-gen workspace: vLLM's one per process (``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE``, 394 MiB)."""
        return vllm_trtllm_workspace_bytes()

    def planner_need(self) -> int:
        return self.float_bytes()

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        int_bytes = FLASHINFER_INT_WORKSPACE_BYTES if self._routes else 0
        return WorkspaceDeclaration(float_bytes=self.float_bytes(), int_bytes=int_bytes)

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        self._planning = route
        return super()._new_wrapper(ctx, route, ubatch)

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> ArenaView:
        return ctx.get_workspace(self.float_bytes(), ubatch, route=self._planning)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        """All or nothing: a trtllm-gen workspace made by a reservation that then fails is freed with it (it is the
        builder's, not process-wide state the retry could reuse)."""
        made = None
        if self._trtllm and self.trtllm_workspace is None:
            made = self.trtllm_workspace = ctx.allocate(self.trtllm_bytes(), "trtllm-gen workspace",
                                                        role=Role.TRTLLM_WORKSPACE)
        try:
            return super().reserve_persistent_workspace(ctx)
        except BaseException:
            if made is not None:
                self.trtllm_workspace = None
                ctx.free(made)
            raise

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        route = "decode" if batch.kind == "decode" else "prefill"
        if route in self._routes:
            super().build(ctx, batch)


class TrtllmGenSizedBuilder(TrtllmGenRoutesBuilder):
    """REQUIRED, correct (issue 51, item 4): every route on trtllm-gen, its workspace sized as FlashInfer's
    trtllm-gen launcher carves it for the case (``sizing.trtllm.trtllm_need``): the LSE slab under DCP (heads x DCP x
    step tokens) plus the multi-CTA KV scratch, MHA and MLA."""

    name = "flashinfer-trtllm-gen-sized"

    def trtllm_bytes(self) -> int:
        return trtllm_need(self.case, trtllm_routes(self.case, self._routes))[0]


class NativeDecodeBuilder(TrtllmGenRoutesBuilder):
    """REQUIRED: decode plans natively into an arena view sized for decode alone; prefill goes to trtllm-gen."""

    name = "flashinfer-native-decode"
    NATIVE = ("decode",)


class SplitMixedBuilder(TrtllmGenRoutesBuilder):
    """REQUIRED, correct under every README (issue 51, item 15): both routes native, each in views named for its
    route and sized for that route alone (the decode view for decode); a mixed batch is split, its decode part
    planned into the decode view and its prefill part into the prefill view, in one build."""

    name = "flashinfer-split-mixed"
    NATIVE = ("prefill", "decode")

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> ArenaView:
        return ctx.get_workspace(need_for_routes(self.case, (self._planning or "prefill",))[0], ubatch,
                                 route=self._planning)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        if batch.kind == "mixed" and "decode" in self.routes():  # (an MLA case plans no decode route here)
            self._plan(ctx, self.wrappers[("decode", batch.ubatch)])
            self._plan(ctx, self.wrappers[("prefill", batch.ubatch)])
        else:
            self._plan(ctx, self._wrapper_for(ctx, batch))


class SplitMixedTrtllmPrefillBuilder(NativeDecodeBuilder):
    """REQUIRED, correct (issue 51, item 15), Blackwell's split: decode native in views named ``route="decode"``, sized
    for decode alone; prefill on trtllm-gen. A mixed batch's decode part goes into the decode view, its prefill part
    to trtllm-gen, and the build says so (``ctx.plan_into(trtllm workspace)``)."""

    name = "flashinfer-split-mixed-trtllm"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        if batch.kind == "mixed" and "decode" in self.routes():
            self._plan(ctx, self.wrappers[("decode", batch.ubatch)])
            if self.trtllm_workspace is not None:
                ctx.plan_into(self.trtllm_workspace)
        else:
            super().build(ctx, batch)


class AsksEveryUbatchBuilder(FlashInferLikeBuilder):
    """REQUIRED, correct (issue 51, item 14): every build asks for every micro-batch's arena view at the arena's own
    size, and plans only into its own micro-batch's (a request is not a use)."""

    name = "flashinfer-asks-every-ubatch"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        for ub in range(ctx.num_ubatches):
            ctx.get_workspace(self.float_bytes(), ub)
        super().build(ctx, batch)


class EagerPrefillBuilder(TrtllmGenRoutesBuilder):
    """REQUIRED, correct (issue 51, item 7), vLLM 0.33's plans: prefill only without CUDA graphs, decode with and
    without. Each view names its route and, for prefill, its graph mode (``get_workspace(route="prefill",
    cuda_graph=False)``), sized for the sub-routes planned there. A batch the engine would capture that carries
    prefill is still planned eagerly, and the build says so
    (``ctx.plan_into(view, part=Batch(..., cuda_graph=False))``)."""

    name = "flashinfer-eager-prefill"
    NATIVE = ("prefill", "decode")

    def _graph(self, route: str | None) -> bool | None:
        return False if route == "prefill" else None

    def _view_bytes(self, route: str) -> int:
        return need_for_planned(self.case, [(route, self._graph(route))])[0]

    def float_bytes(self) -> int:
        return max(self._view_bytes(r) for r in self._routes)

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> ArenaView:
        route = self._planning or "prefill"
        return ctx.get_workspace(self._view_bytes(route), ubatch, route=route, cuda_graph=self._graph(route))

    def _part(self, batch: Batch) -> Batch:
        return Batch(batch.kind, batch.num_reqs, batch.num_tokens, False, batch.ubatch)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        w = self._wrapper_for(ctx, batch)
        ctx.plan_into(w.view, self._part(batch) if w.route == "prefill" else None)
        ctx.plan_into(w.int_workspace)


# Correct builders for the routes-and-waste rules, by name only (``--kvprofile-backend stub-trtllm-gen``): not
# in ``STUB_BACKENDS``, so the default run and ``stubs`` keep their backends.
ROUTE_STUB_BACKENDS: tuple[Backend, ...] = (
    _builtin("stub-vllm-default-arena", "the vLLM pull request's design: vLLM's default float arena (REQUIRED; "
             "waste reported, refused only over --kvprofile-max-waste)", VllmDefaultArenaBuilder),
    _builtin("stub-trtllm-gen", "every route on trtllm-gen: zero arena, the trtllm-gen workspace made in the window "
             "(REQUIRED)", TrtllmGenRoutesBuilder),
    _builtin("stub-trtllm-gen-sized", "every route on trtllm-gen, the workspace sized as FlashInfer's trtllm-gen "
             "launcher carves it (LSE slab under DCP, multi-CTA scratch; REQUIRED)", TrtllmGenSizedBuilder),
    _builtin("stub-native-decode", "decode native, sized for decode alone; prefill on trtllm-gen (REQUIRED)",
             NativeDecodeBuilder),
    _builtin("stub-split-mixed", "both routes native, each view sized for its route; a mixed batch split between "
             "them (REQUIRED)", SplitMixedBuilder),
    _builtin("stub-split-mixed-trtllm", "decode native, sized for decode alone; a mixed batch's prefill part on "
             "trtllm-gen (REQUIRED)", SplitMixedTrtllmPrefillBuilder),
    _builtin("stub-eager-prefill", "vLLM 0.33's plans: prefill without CUDA graphs, decode with and without; each "
             "view sized for the sub-routes planned into it (REQUIRED)", EagerPrefillBuilder),
    _builtin("stub-asks-every-ubatch", "asks every micro-batch's arena view in each build, plans into its own "
             "(REQUIRED)", AsksEveryUbatchBuilder),
)
