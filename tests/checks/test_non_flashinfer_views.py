"""Issue 51, item 9: not every arena user is FlashInfer. ``workspace_covers_planner`` sizes the views FlashInfer plans
into (a view named for a route, a view ``ctx.plan_into`` targets, every view of a builder that does not tell its
plans) and not another kernel's view of the shared arena; a builder that shows no FlashInfer at all is not sized by
its planner (``builtin/mutants_field.py``'s 04e and its twin, on every ci case in ``tests/lifecycle``)."""

from __future__ import annotations

from typing import Any

from pytest_kvprofile.builtin.mutants_field import FIELD_TWINS
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.checks.workspace import builder_waste, flashinfer_views, shows_flashinfer
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing.case import for_case
from pytest_kvprofile.units import MiB

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90")
SIDE = 8 * MiB  # a side kernel's scratch beyond FlashInfer's need, taken from the same arena, never planned into


class WithSideKernel(FlashInferLikeBuilder):
    """The correct stub, whose builds also give a non-FlashInfer kernel a larger view of the arena (asked in the
    reservation, before lock, and declared): FlashInfer plans only into its own views (``ctx.plan_into``)."""

    def declared_workspace(self, case: Any) -> Any:
        decl = super().declared_workspace(case)
        return type(decl)(float_bytes=self.float_bytes() + SIDE, int_bytes=decl.int_bytes)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        for ub in range(ctx.num_ubatches):
            ctx.get_workspace(self.float_bytes() + SIDE, ub)
        return super().reserve_persistent_workspace(ctx)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        ctx.get_workspace(self.float_bytes() + SIDE, batch.ubatch)  # the side kernel's scratch, a use of its own


class ShortBesideSideKernel(WithSideKernel):
    """Plans FlashInfer into views 1 MiB short of its planner's need; the side kernel's larger view would cover it."""

    def float_bytes(self) -> int:
        return for_case(self.case).float_bytes - MiB

    def planner_need(self) -> int:
        return self.float_bytes()  # what it believes; FlashInfer's planner carves 1 MiB more


def _run(cls: type) -> Any:
    backend = Backend(name=cls.__name__, make_builders=lambda case: [cls(case)], origin="builtin")
    result = run_lifecycle(backend, CASE)
    close_parts(result)
    return result


def test_another_kernels_view_is_neither_sized_nor_counted_as_flashinfer_waste():
    result = _run(WithSideKernel)
    assert failing_checks(result) == {}
    views = flashinfer_views(result, "flashinfer")
    assert views and max(g.nbytes for g in views) < max(g.nbytes for g in result.grants)
    # its declaration, which holds the side scratch too, still counts whole on each micro-batch
    assert builder_waste(result, "flashinfer").float_waste == SIDE * CASE.envelope.num_ubatches


def test_a_short_flashinfer_view_is_refused_though_a_larger_view_of_another_kernel_covers_it():
    failed = failing_checks(_run(ShortBesideSideKernel))
    text = " ".join(failed.get("workspace_covers_planner", []))
    assert "plans every route of the case (the views name none) into arena views of at most" in text, failed
    assert "short by 1.00 MiB" in text


def test_a_builder_showing_no_flashinfer_is_not_sized_by_its_planner():
    twin = next(b for b in FIELD_TWINS if b.name == "twin-04e-declares-continuation-scratch")
    result = run_lifecycle(twin, CASE)
    close_parts(result)
    assert result.grants and not shows_flashinfer(result, "turboquant")
    assert flashinfer_views(result, "turboquant") == []
    waste = builder_waste(result, "turboquant")
    assert (waste.native, waste.sized, waste.arena_bytes, waste.waste_bytes) == ((), (), 0, 0)
    assert failing_checks(result) == {}
