"""Issue 51, items 17, 13, 14, 15, 8 and 10: each shown both ways, a backend with the mechanism refused with a
headline that names the cause, its correct twin accepted, on every ci case (ctx mode; the real-FlashInfer pair on one
case here, on every ci case in the slow test) and on one case run alone."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile import Backend, Role
from pytest_kvprofile.builtin.flashinfer_real import (
    REAL_FLASHINFER_BACKENDS,
    REAL_FLASHINFER_MUTANTS,
    RealFlashInferBuilder,
    _ledger_range,
)
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS, SMALL_INT_WORKSPACE_BYTES
from pytest_kvprofile.builtin.stubs import (
    ROUTE_STUB_BACKENDS,
    STUB_BACKENDS,
    TORCH_STUB_BACKENDS,
    FlashInferLikeBuilder,
    NativeDecodeBuilder,
    SplitMixedTrtllmPrefillBuilder,
    TorchFlashInferLikeBuilder,
    Wrapper,
    with_role,
)
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.checks.evidence import fmt_batch
from pytest_kvprofile.contract.backends import GRAPH_ESTIMATES, BackendError, EnginePolicy
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.report.sweep import sweep
from pytest_kvprofile.sizing.case import for_case, need_for_routes, sizable_refusal

BACKENDS = {b.name: b for b in (*MUTANT_BACKENDS, *STUB_BACKENDS, *ROUTE_STUB_BACKENDS, *TORCH_STUB_BACKENDS,
                                 *REAL_FLASHINFER_BACKENDS, *REAL_FLASHINFER_MUTANTS)}
ALONE = "glm-4-9b-32q2kv-tp1-dcp1-mtp0-b200-gmu0.90"  # prefill's need far above decode's: the split matters


def _ci() -> list[Any]:
    """The 62 ci cases the suite sizes (the B200's two NVFP4 cases are trtllm-gen's, refused by name)."""
    return [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None and sizable_refusal(c) is None]


def _case(case_id: str = ALONE) -> Any:
    return next(c for c in _ci() if c.id == case_id)


def _failed(backend: Any, case: Any) -> dict[str, list[str]]:
    result = run_lifecycle(backend, case)
    close_parts(result)
    return failing_checks(result)


def _ci_sweep(backend: Any) -> Any:
    return sweep([backend], _ci())[0]


def _backend(name: str, cls: type) -> Backend:
    return Backend(name=name, make_builders=lambda case: [cls(case)])


# -- 17: each wrapper's int workspace against the planner's int need ---------------------------------------------

def test_int_workspace_slices_below_the_planners_int_need_are_refused_on_every_ci_case():
    bad = _ci_sweep(BACKENDS["mutant-15j-int-workspace-slices-too-small"])
    assert bad.cases == 62 and not bad.escaped and set(bad.failures) == {"int_workspace_per_wrapper"}
    good = _ci_sweep(BACKENDS["stub-flashinfer"])
    assert good.cases == 62 and len(good.escaped) == 62


def test_an_int_workspace_slice_is_refused_alone_with_the_bytes_and_the_routes_need():
    case = _case()
    need = max(r.int_bytes for r in for_case(case).routes.values())
    failed = _failed(BACKENDS["mutant-15j-int-workspace-slices-too-small"], case)
    message = " ".join(failed["int_workspace_per_wrapper"])
    assert f"({SMALL_INT_WORKSPACE_BYTES} bytes)" in message and f"({need} bytes)" in message, message
    assert "int workspace slab [ubatch 0]" in message and "Give each wrapper at least" in message
    assert _failed(BACKENDS["stub-flashinfer"], case) == {}


class TorchSlicedInt(TorchFlashInferLikeBuilder):
    """17 in torch mode: one 16 MiB int slab tensor per micro-batch, each wrapper a 32 KiB slice of it (reported)."""

    name = "torch-sliced-int"

    def __init__(self, case: Any) -> None:
        super().__init__(case)
        self.slabs: dict[int, Any] = {}

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        import torch

        slab = self.slabs.get(ubatch)
        if slab is None:
            slab = self.slabs[ubatch] = torch.empty(2 * self.int_bytes(), dtype=torch.uint8, device="cuda")
            with_role(slab, Role.INT_WORKSPACE)
        view = self._float_view(ctx, ubatch)
        offset = self.routes().index(route) * SMALL_INT_WORKSPACE_BYTES
        piece = slab[offset:offset + SMALL_INT_WORKSPACE_BYTES]
        mirror = torch.empty(self.int_bytes(), dtype=torch.uint8, pin_memory=True)
        return Wrapper(route, ubatch, view.ptr, view.nbytes, piece, mirror, *_ledger_range(piece), view)

    def _drop(self, ctx: BuilderContext, wrappers: list[Wrapper]) -> None:
        super()._drop(ctx, wrappers)
        for ub in [u for u in self.slabs if not any(w.ubatch == u for w in self.wrappers.values())]:
            del self.slabs[ub]


class RealSmallInt(RealFlashInferBuilder):
    """17 with FlashInfer's own wrappers: each handed a 32 KiB int workspace (``reset_workspace_buffer``)."""

    name = "real-small-int"

    def _give_int_workspaces(self, ctx: BuilderContext, slot: Any) -> None:
        import torch

        ws = self._arena_tensor(ctx, slot.arena)
        for _, w in slot.wrappers():
            w.reset_workspace_buffer(ws, torch.empty(SMALL_INT_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda"))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_small_int_workspaces_in_torch_mode_are_refused_naming_the_source_line():
    case = _case(REAL_CASE)
    sliced = Backend(name="sliced", make_builders=lambda c: [TorchSlicedInt(c)], torch_mode=True)
    message = " ".join(_failed(sliced, case)["int_workspace_per_wrapper"])
    assert "(32768 bytes)" in message and "test_issue51.py" in message and "in _new_wrapper" in message, message
    real = Backend(name="real", make_builders=lambda c: [RealSmallInt(c)], torch_mode=True)
    failed = _failed(real, case)
    assert set(failed) == {"int_workspace_per_wrapper"}, failed
    message = " ".join(failed["int_workspace_per_wrapper"])
    assert "(32768 bytes)" in message and "in _give_int_workspaces" in message, message
    assert _failed(BACKENDS["stub-flashinfer-torch"], case) == {}


# -- 13: two wrappers planning into one int workspace, seen from the plans ------------------------------------

REAL_CASE = "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_decode_plan_into_the_prefill_wrappers_int_workspace_is_refused_from_the_plans():
    case = _case(REAL_CASE)
    failed = _failed(BACKENDS["mutant-15k-flashinfer-decode-plans-into-prefill-int"], case)
    assert set(failed) == {"int_workspace_per_wrapper"}, failed
    message = " ".join(failed["int_workspace_per_wrapper"])
    assert "BatchDecodeWithPagedKVCacheWrapper" in message and "BatchPrefillWithPagedKVCacheWrapper" in message
    assert "flashinfer/prefill.py" in message and "whatever bound_workspaces() reports" in message, message
    assert _failed(BACKENDS["flashinfer"], case) == {}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_decode_plan_into_the_prefill_wrappers_int_workspace_is_refused_on_every_ci_case():
    bad = _ci_sweep(BACKENDS["mutant-15k-flashinfer-decode-plans-into-prefill-int"])
    good = _ci_sweep(BACKENDS["flashinfer"])
    assert bad.cases == good.cases > 0 and not bad.escaped and len(good.escaped) == good.cases


# -- 14: a request is not a use ------------------------------------------------------------------------------

class PlansIntoEveryUbatch(FlashInferLikeBuilder):
    """Asks for every micro-batch's view in each build and plans into micro-batch 0's too: a use, refused."""

    name = "flashinfer"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        views = [ctx.get_workspace(self.float_bytes(), ub) for ub in range(ctx.num_ubatches)]
        super().build(ctx, batch)
        ctx.plan_into(views[0])


def test_asking_every_ubatchs_view_and_planning_into_its_own_passes_on_every_ci_case():
    good = _ci_sweep(BACKENDS["stub-asks-every-ubatch"])
    assert good.cases == 62 and len(good.escaped) == 62
    bad = _ci_sweep(_backend("plans-into-every-ubatch", PlansIntoEveryUbatch))
    assert not bad.escaped and set(bad.failures) == {"ubatch_arenas_disjoint"}


def test_a_plan_into_another_ubatchs_view_is_refused_alone_naming_the_use():
    case = _case()
    message = " ".join(_failed(_backend("bad", PlansIntoEveryUbatch), case)["ubatch_arenas_disjoint"])
    assert "micro-batch 1's plan lands in the arena micro-batch 0 uses" in message and "asked for" not in message
    assert _failed(BACKENDS["stub-asks-every-ubatch"], case) == {}


# -- 15: a mixed batch may be split ----------------------------------------------------------------------------

class MixedIntoDecodeView(NativeDecodeBuilder):
    """A prefill fallback: the whole mixed batch planned into the view named route="decode", prefill on trtllm-gen
    but never used by it."""

    name = "mixed-into-decode-view"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        if batch.kind == "mixed" and "decode" in self.routes():
            self._plan(ctx, self.wrappers[("decode", batch.ubatch)])
        else:
            super().build(ctx, batch)


class SaysDecodePart(NativeDecodeBuilder):
    """The split said with ``plan_into(part=)``: the decode requests of a mixed batch into the decode view."""

    name = "says-decode-part"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        if batch.kind == "mixed" and "decode" in self.routes():
            decode_reqs = max(1, batch.num_reqs // 2)
            part = Batch("decode", decode_reqs, decode_reqs * (1 + self.case.mtp), batch.cuda_graph, batch.ubatch)
            ctx.plan_into(self.wrappers[("decode", batch.ubatch)].view, part=part)
        else:
            super().build(ctx, batch)


class SaysPrefillPart(NativeDecodeBuilder):
    """A prefill fallback said outright: the prefill part of a mixed batch into the decode view."""

    name = "says-prefill-part"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        if batch.kind == "mixed" and "decode" in self.routes():
            part = Batch("prefill", 1, batch.num_tokens, batch.cuda_graph, batch.ubatch)
            ctx.plan_into(self.wrappers[("decode", batch.ubatch)].view, part=part)
        else:
            super().build(ctx, batch)


def _split_matters(case: Any) -> bool:
    """The case's decode view is short for its prefill need (where sending prefill there overflows)."""
    decode_need, decode_subs = need_for_routes(case, ("decode",))
    return bool(decode_subs) and need_for_routes(case, ("prefill",))[0] > decode_need


@pytest.mark.parametrize("name", ["stub-split-mixed", "stub-split-mixed-trtllm"])
def test_a_split_mixed_batch_passes_on_every_ci_case(name):
    good = _ci_sweep(BACKENDS[name])
    assert good.cases == 62 and len(good.escaped) == 62, good.failures


def test_a_prefill_fallback_into_a_decode_view_stays_refused_on_every_ci_case_where_it_overflows():
    cases = _ci()
    matters = {c.id for c in cases if _split_matters(c)}
    assert len(matters) == 54  # every non-MLA ci case: the 54 the earlier README's split backend was refused on
    for cls in (MixedIntoDecodeView, SaysPrefillPart):
        s = sweep([_backend(cls.name, cls)], cases)[0]
        assert set(s.escaped) == {c.id for c in cases} - matters, (cls.name, s.escaped)
        assert set(s.failures) == {"workspace_covers_planner"}, (cls.name, s.failures)
    said = sweep([_backend(SaysDecodePart.name, SaysDecodePart)], cases)[0]
    assert len(said.escaped) == 62, said.examples


def test_the_split_and_the_fallback_told_apart_on_one_case_alone():
    case = _case()
    message = " ".join(_failed(_backend("fallback", MixedIntoDecodeView), case)["workspace_covers_planner"])
    assert "plans mixed batches (prefill) into an arena view named route='decode'" in message, message
    assert "ctx.plan_into(view, part=Batch('decode', ...))" in message
    message = " ".join(_failed(_backend("said", SaysPrefillPart), case)["workspace_covers_planner"])
    assert "the prefill part of mixed batches (prefill)" in message, message
    for cls in (SaysDecodePart, SplitMixedTrtllmPrefillBuilder):
        assert _failed(_backend(cls.name, cls), case) == {}, cls.name
    assert _failed(BACKENDS["stub-split-mixed"], case) == {}


# -- 8: the batch of the route that decides ---------------------------------------------------------------------

class ShortDecodeView(NativeDecodeBuilder):
    """Decode-only, its view 1 MiB short of decode's need."""

    name = "short-decode-view"

    def float_bytes(self) -> int:
        return need_for_routes(self.case, ("decode",))[0] - (1 << 20)


def test_the_sizing_message_names_the_batch_of_the_deciding_route():
    case = _case()
    need = for_case(case)
    decode_need, subs = need_for_routes(case, ("decode",))
    decides = max(subs, key=lambda r: need.routes[r].float_bytes)
    assert need.routes[decides].worst_batch != need.worst_batch  # the case's overall worst is a prefill batch
    message = " ".join(_failed(_backend("short", ShortDecodeView), case)["workspace_covers_planner"])
    assert f"decided by {decides}, worst batch {fmt_batch(need.routes[decides].worst_batch)}" in message, message
    assert fmt_batch(need.worst_batch) not in message


# -- 10: the engine's CUDA-graph accounting ----------------------------------------------------------------------

def test_an_unknown_graph_estimate_is_a_usage_error_naming_the_known_ones():
    with pytest.raises(BackendError) as info:
        EnginePolicy(graph_estimate="gross-minus-retained")
    text = str(info.value)
    assert "'gross-minus-retained'" in text and all(repr(g) in text for g in GRAPH_ESTIMATES)
    assert GRAPH_ESTIMATES == ("high_water", "gross_minus_retained", "none")


def test_graphs_not_accounted_at_all_is_refused_with_its_cost():
    case = _case()
    failed = _failed(BACKENDS["mutant-10b-graph-pool-not-accounted"], case)
    message = " ".join(failed["graph_pool_full_high_water"])
    assert "graph_estimate='none'" in message and "tokens per rank" in message and "MiB" in message, message
    assert _failed(BACKENDS["stub-flashinfer"], case) == {}
    s = _ci_sweep(BACKENDS["mutant-10b-graph-pool-not-accounted"])
    assert not s.escaped and s.failures["graph_pool_full_high_water"] == 62
