"""Mutants that size the float workspace wrong for the planner: bug classes 11 (a route sized short) and 19 (an arena
over its budget), and 1e (a scratch made in graph profiling). Each declares itself with ``@mutant``
(``builtin/mutant_declarations.py``); ``builtin/mutants.py`` gathers the catalog.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_kvprofile.builtin.mutant_declarations import OVERFLOWS_ITS_ARENA, WASTE_OPTIONS, mutant
from pytest_kvprofile.builtin.stubs import (
    EagerPrefillBuilder,
    FlashInferLikeBuilder,
    TorchFlashInferLikeBuilder,
    Wrapper,
    vllm_default_fixed_bytes,
    vllm_default_float_bytes,
    vllm_trtllm_workspace_bytes,
)
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.sizing.case import for_case
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:

    from pytest_kvprofile.contract.device import Allocation
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.workspace import ArenaView
    from pytest_kvprofile.matrix.cases import Case


class _VllmDefaultArena:
    """The open vLLM pull request's arena size (``builtin.stubs.vllm_default_float_bytes``), for a FlashInfer-like
    stub."""

    case: Case

    def float_bytes(self) -> int:
        return vllm_default_float_bytes(self.case)


@mutant("mutant-19a-vllm-default-arena-over-budget", options=WASTE_OPTIONS, catches=("workspace_covers_planner",))
class VllmDefaultArenaOverBudgetBuilder(_VllmDefaultArena, FlashInferLikeBuilder):
    """Bug 19a (only under a waste budget): vLLM's default arena, max(394 MiB, tokens x heads x dim x 16 B), where
    the planned routes need a fraction of it; safe, but over a project's ``--kvprofile-max-waste``."""


@mutant("mutant-19b-torch-vllm-default-arena-over-budget", options=WASTE_OPTIONS, catches=("workspace_covers_planner",))
class TorchVllmDefaultArenaOverBudgetBuilder(_VllmDefaultArena, TorchFlashInferLikeBuilder):
    """Bug 19b (torch mode, only under a waste budget): 19a written with plain torch tensors."""


@mutant("mutant-19c-unused-trtllm-workspace", options=WASTE_OPTIONS, catches=("workspace_covers_planner",))
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


@mutant("mutant-19d-private-float-workspace", options=WASTE_OPTIONS, catches=("workspace_covers_planner",))
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


@mutant("mutant-11c-short-native-route", catches=OVERFLOWS_ITS_ARENA)
class ShortNativeRouteBuilder(_PrefillSizedForDecode, FlashInferLikeBuilder):
    """Bug 11c: a native prefill route planned into an arena view sized for the decode route only."""


@mutant("mutant-11d-torch-short-native-route", catches=OVERFLOWS_ITS_ARENA)
class TorchShortNativeRouteBuilder(_PrefillSizedForDecode, TorchFlashInferLikeBuilder):
    """Bug 11d (torch mode): 11c written with plain torch tensors."""


@mutant("mutant-11f-prefill-graph-into-eager-view", catches=("workspace_covers_planner",))
class PrefillGraphIntoEagerViewBuilder(EagerPrefillBuilder):
    """Bug 11f: asks for its prefill view for plans without CUDA graphs (``get_workspace(route="prefill",
    cuda_graph=False)``) and sizes it so, yet plans the prefill batches the engine captures into it as they come, with
    graphs: FlashInfer's CUDA-graph prefill plan pads to every query tile and overflows the view."""

    def _part(self, batch: Batch) -> Batch:
        return batch


GRAPH_SCRATCH_BYTES = 76 * MiB  # the incident's scratch (issue 51, item 6)


@mutant("mutant-01e-graph-profiling-scratch", catches=("no_synthetic_workspace_in_capture",
        "persistent_memory_visible_at_closing"))
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
