"""Memory after free, uses per micro-batch and exception-safe reservations (issue 22, points 2, 3 and 5).

Each rule is shown both ways: a mutant with the bug fails its check from what the harness observed (no
``bound_workspaces()``), and a builder doing something legal but unusual passes.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile import Backend, WorkspaceManager, run_lifecycle
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS, ReservationKeepsPartialBuilder, TorchStaleArenaViewBuilder
from pytest_kvprofile.builtin.stubs import (
    STUB_BACKENDS,
    TORCH_STUB_BACKENDS,
    FlashInferLikeBuilder,
    GDNLikeBuilder,
    TorchFlashInferLikeBuilder,
)
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME, failing_checks
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.lifecycle import probe_reservation
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.memory.device import DeviceOutOfMemory, SimDevice
from pytest_kvprofile.units import MiB

BACKENDS = {b.name: b for b in (*STUB_BACKENDS, *TORCH_STUB_BACKENDS, *MUTANT_BACKENDS)}
USE_AFTER_FREE = "no_use_after_free"
UBATCH = "ubatch_arenas_disjoint"
RESERVATION = "reservation_exception_safe"


@pytest.fixture(scope="module")
def case() -> Case:
    """A ci case with two micro-batches (the ci envelope's ``num_ubatches``)."""
    found = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp4-dcp2-mtp0-b200-gmu0.98")
    assert found.envelope.num_ubatches == 2
    return found


def run(name_or_cls: str | type, case: Case) -> LifecycleResult:
    if isinstance(name_or_cls, str):
        return run_lifecycle(BACKENDS[name_or_cls], case)
    cls = name_or_cls
    return run_lifecycle(Backend(name=cls.__name__, make_builders=lambda c: [cls(c)],
                                 torch_mode=bool(getattr(cls, "torch_mode", False))), case)


def violations(result: LifecycleResult, check: str) -> list[str]:
    return CHECKS_BY_NAME[check].run(result)


# -- arena generations ------------------------------------------------------------------------------------------

def test_a_growth_or_close_retires_the_views_of_the_old_arena():
    device = SimDevice(name="test", total_memory=8 << 30, num_sm=132)
    mgr = WorkspaceManager(device, num_ubatches=2)
    first = mgr.get_workspace("fi", 10 * MiB, 0)
    same = mgr.get_workspace("fi", 4 * MiB, 0)
    assert first.generation == same.generation == 1 and mgr.is_current(first)
    device.phase = "profile_warmup"
    grown = mgr.get_workspace("gdn", 20 * MiB, 0)
    assert grown.generation == 2 and mgr.is_current(grown)
    assert not mgr.is_current(first) and mgr.retired == {(0, 1): "profile_warmup"}
    other = mgr.get_workspace("fi", MiB, 1)
    assert other.generation == 1 and mgr.is_current(other)
    assert first == first.__class__(0, first.ptr, first.nbytes, first.arena_size)  # generation is not identity
    mgr.close()
    assert not mgr.is_current(grown) and not mgr.is_current(other)


# -- use after free ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mutant-16a-plans-into-released-workspace", "mutant-16b-stale-view-after-growth",
                                  "mutant-16c-torch-stale-arena-view"])
def test_use_after_free_is_observed_without_bound_workspaces(name, case):
    result = run(name, case)
    found = violations(result, USE_AFTER_FREE)
    assert found, name
    first = found[0]
    assert "MiB (" in first and "bytes)" in first and "given back in phase" in first and " at " in first
    if name.endswith("released-workspace"):
        assert "'lease_release'" in first and "int workspace" in first and "ctx.plan_into" in first
    else:
        assert "'profile_warmup'" in first and "generation 1" in first
    if "torch" in name:
        assert "via Tensor." in first and "stubs.py" in first
    assert all("times)" in v for v in found)  # one line per distinct use, with its count


def test_correct_stubs_plan_into_live_memory_only(case):
    for name in ("stub-flashinfer", "stub-hybrid", "stub-flashinfer-torch"):
        result = run(name, case)
        assert result.uses == [] and not failing_checks(result), name


class RefreshesViewsAfterGrowth(FlashInferLikeBuilder):
    """Legal, if unusual: asks for a larger arena inside the window, then re-makes its wrappers on the new one."""

    name = "refreshes-views"

    def warmup(self, ctx: BuilderContext) -> None:
        if ctx.profiling and not self.warmed:
            for ub in range(ctx.num_ubatches):
                ctx.get_workspace(self.float_bytes() + 2 * MiB, ub)
            kept = list(self.wrappers)
            self._drop(ctx, list(self.wrappers.values()))
            for route, ub in kept:
                self.wrappers[(route, ub)] = self._new_wrapper(ctx, route, ub)
        super().warmup(ctx)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        return ctx.lease(self._materialize(ctx))

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        for ub in range(ctx.num_ubatches):
            ctx.plan_into(ctx.get_workspace(self.float_bytes(), ub))  # a fresh view is never stale


def test_a_builder_that_refreshes_its_views_after_a_growth_passes(case):
    result = run(RefreshesViewsAfterGrowth, case)
    assert any(v.generation == 2 for p in result.phases for v in p.arena)  # the arena did grow
    assert violations(result, USE_AFTER_FREE) == []


class PlansIntoEveryUbatchInWarmup(FlashInferLikeBuilder):
    """Legal: warmup (not a build of one micro-batch) touches every micro-batch's arena."""

    name = "warms-every-ubatch"

    def warmup(self, ctx: BuilderContext) -> None:
        for w in self.wrappers.values():
            ctx.plan_into(w.view)
        super().warmup(ctx)


def test_a_warmup_that_touches_every_micro_batch_is_not_aliasing(case):
    result = run(PlansIntoEveryUbatchInWarmup, case)
    assert violations(result, UBATCH) == [] and violations(result, USE_AFTER_FREE) == []


class PlansIntoSomethingElse(FlashInferLikeBuilder):
    name = "plans-into-a-number"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        ctx.plan_into(12345)  # type: ignore[arg-type]


def test_plan_into_refuses_what_is_not_a_view_or_an_allocation(case):
    result = run(PlansIntoSomethingElse, case)
    assert result.errors and "ctx.plan_into() takes an ArenaView or an Allocation, not int" in result.errors[0].message


# -- writes per micro-batch -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mutant-05d-plans-into-other-ubatch", "mutant-05e-torch-writes-other-ubatch"])
def test_a_build_that_plans_into_another_micro_batch_fails_though_it_asked_for_both(name, case):
    result = run(name, case)
    assert {g.ubatch for g in result.grants} == {0, 1}  # the grants alone look right
    found = [v for v in violations(result, UBATCH) if "building micro-batch 1" in v]
    assert found and "micro-batch 0's float arena" in found[0] and "MiB (" in found[0], violations(result, UBATCH)
    assert violations(result, USE_AFTER_FREE) == []


# -- exception-safe reservation ---------------------------------------------------------------------------------

def test_a_reservation_that_keeps_what_it_made_leaks_and_holds_more_on_retry(case):
    found = violations(run("mutant-17a-reservation-keeps-partial", case), RESERVATION)
    assert any("a second reservation holds" in v and "against" in v and "extra" in v and "int workspace" in v
               for v in found), found


def test_a_torch_reservation_that_keeps_failed_attempts_is_caught(case):
    found = violations(run("mutant-17b-torch-reservation-keeps-partial", case), RESERVATION)
    assert any("each failed attempt leaks" in v and "stubs.py" in v for v in found), found


class KeepsPartialUntilTheRetry(TorchFlashInferLikeBuilder):
    """Legal (issue 37, point 1): a failed reservation keeps on ``self`` the wrappers it made (the most common real
    pattern); the retry replaces them, which frees them. What the failed attempt left held was made inside the
    window, so KV sizing sees it: reported as the check's ``retry_cost``, not refused."""

    name = "keeps-partial-until-retry"
    torch_mode = True
    _materialize = ReservationKeepsPartialBuilder._materialize  # mutant 17a's, legal with torch tensors


def test_what_a_failed_reservation_leaves_for_its_retry_to_replace_is_reported_not_refused(case):
    result = run(KeepsPartialUntilTheRetry, case)
    assert violations(result, RESERVATION) == []
    cost = CHECKS_BY_NAME[RESERVATION].details(result).retry_cost
    assert cost and any("left" in c and "held" in c and "stubs.py" in c for c in cost["left_held"]), cost


class RemakesBesideKeptRepeats(FlashInferLikeBuilder):
    """Bug: keeps what a failed attempt made on a list of its own, and the retry makes every wrapper again beside
    it; with one wrapper per site made before the failure (the 2nd of a repeated site), only a fault past the first
    occurrence shows it."""

    name = "remakes-beside-kept"

    def _materialize(self, ctx: BuilderContext) -> list[Any]:
        try:
            return ReservationKeepsPartialBuilder._materialize(self, ctx)
        except BaseException:
            self.__dict__.setdefault("kept", []).extend(self.wrappers.values())
            self.wrappers.clear()
            raise


def test_a_retry_that_makes_repeated_wrappers_again_beside_the_kept_ones_is_refused(case):
    found = violations(run(RemakesBesideKeptRepeats, case), RESERVATION)
    assert any("each failed attempt leaks" in v for v in found), found


def test_the_first_error_wins(case):
    found = violations(run("mutant-17c-cleanup-masks-first-error", case), RESERVATION)
    assert any("raised ValueError: double free" in v and "the first error wins" in v for v in found), found


class WrapsTheError(FlashInferLikeBuilder):
    """Legal: wraps the out-of-memory error in its own, chained with ``raise ... from``."""

    name = "wraps-the-error"

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        try:
            return super().reserve_persistent_workspace(ctx)
        except DeviceOutOfMemory as exc:
            raise RuntimeError("flashinfer: could not reserve its wrappers") from exc


def test_a_reservation_that_chains_its_first_error_and_leaks_nothing_passes(case):
    result = run(WrapsTheError, case)
    assert violations(result, RESERVATION) == []


def test_the_correct_stubs_reserve_all_or_nothing(case):
    for name in ("stub-flashinfer", "stub-flashinfer-torch", "stub-hybrid"):
        assert violations(run(name, case), RESERVATION) == [], name


def test_fault_points_are_bounded_by_distinct_sites():
    class A:
        def __init__(self, stack: str | None, nbytes: int, tag: str = "t") -> None:
            self.owner, self.kind, self.role = "b", "device", "other"
            self.stack, self.nbytes, self.tag = stack, nbytes, tag

    ctx_mode = [A(None, 8 * MiB, f"int [{i}]") for i in range(6)] + [A(None, MiB)]
    assert probe_reservation._fault_points(ctx_mode) == [0, 1, 6]  # tags differ, the site (role, bytes) does not
    torch_mode = [A("x.py:1", 8 * MiB), A("x.py:2", 4), A("x.py:1", 8 * MiB), A("x.py:2", 4), A("x.py:1", 8 * MiB)]
    assert probe_reservation._fault_points(torch_mode) == [0, 1, 2, 3, 4]  # each source line twice, and the last
    many = [A(f"x.py:{i}", 4) for i in range(30)]
    points = probe_reservation._fault_points(many)
    assert len(points) == probe_reservation.MAX_FAULT_POINTS and points[0] == 0 and points[-1] == 29  # bounded


def test_the_verdict_is_the_same_for_a_case_run_alone(case):
    """The probe's memo is per case without gmu: a case run after its twin or alone gets the same answer."""
    twin = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == case.id.replace("0.98", "0.90"))
    backend = BACKENDS["mutant-17a-reservation-keeps-partial"]
    after_twin = (failing_checks(run_lifecycle(backend, twin)), failing_checks(run_lifecycle(backend, case)))[1]
    probe_reservation._reservation_simulated.cache_clear()
    alone = failing_checks(run_lifecycle(backend, case))
    assert after_twin == alone and RESERVATION in alone


class ComparesStaleViewPointers(TorchStaleArenaViewBuilder):
    """Legal (issue 32): keeps its first views across the growth, reads only their metadata (the pull request's
    wrapper reset compares ``data_ptr()``), and writes into a fresh view."""

    name = "compares-stale-pointers"

    def _plan(self, ctx: BuilderContext, w: Any) -> None:
        stale = w.view.tensor
        fresh = ctx.get_workspace(self.float_bytes(), w.ubatch).tensor
        moved = (stale.data_ptr() != fresh.data_ptr() or stale.shape != fresh.shape or stale.stride() != fresh.stride()
                 or stale.numel() != fresh.numel() or stale.element_size() != 1 or stale.storage_offset() < 0
                 or stale.dtype != fresh.dtype or stale.device != fresh.device
                 or stale.untyped_storage().nbytes() < stale.numel())
        w.int_workspace[:64].copy_(torch_arange(64))
        fresh[:64].zero_()
        self.moved = getattr(self, "moved", False) or moved


class ReadsStaleViewBytes(ComparesStaleViewPointers):
    """Its twin: reads the stale view's bytes (a sum) after comparing the pointers: a use after free."""

    name = "reads-stale-bytes"

    def _plan(self, ctx: BuilderContext, w: Any) -> None:
        super()._plan(ctx, w)
        w.view.tensor[:64].sum()


def torch_arange(n: int) -> Any:
    import torch

    return torch.arange(n, dtype=torch.uint8)


def test_reading_a_stale_views_metadata_is_not_a_use_and_reading_its_bytes_is(case):
    legal = run(ComparesStaleViewPointers, case)
    assert any(v.generation == 2 for p in legal.phases for v in p.arena)  # the arena grew under the kept views
    assert violations(legal, USE_AFTER_FREE) == []
    found = violations(run(ReadsStaleViewBytes, case), USE_AFTER_FREE)
    assert found and any("via Tensor.sum" in v for v in found), found


class KeepsWrappersAcrossTheRelease(FlashInferLikeBuilder):
    """Legal (issue 37, point 3): its lease keeps the wrappers it made (the release frees nothing), it holds their
    views while another builder grows the arena in the window, never plans with them, and asks again in rebind."""

    name = "keeps-views"

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        return ctx.lease(self._materialize(ctx))

    def rebind(self, ctx: BuilderContext) -> None:
        for w in self.wrappers.values():
            w.view = ctx.get_workspace(self.float_bytes(), w.ubatch)
            w.float_ptr, w.float_bytes = w.view.ptr, w.view.nbytes


class UsesItsHeldView(KeepsWrappersAcrossTheRelease):
    """Its twin: plans with the view it held across the growth, in the window's replay (a use after free)."""

    name = "uses-held-view"

    def dummy_run(self, ctx: BuilderContext) -> None:
        if ctx.phase == "profile_replay":
            for w in self.wrappers.values():
                ctx.plan_into(w.view)


class GrowsInTheWindow(GDNLikeBuilder):
    """NEUTRAL; its warmup inside the window asks for a larger view of every micro-batch's arena (a growth)."""

    name = "grows"
    warmup_materializes_persistent = True

    def warmup(self, ctx: BuilderContext) -> None:
        if ctx.profiling:
            for ub in range(ctx.num_ubatches):
                self.views[ub] = ctx.get_workspace(ctx.workspace.size(ub) + 4 * MiB, ub)


def test_a_view_held_across_a_growth_and_never_used_is_not_aliasing(case):
    for cls, bad in ((KeepsWrappersAcrossTheRelease, False), (UsesItsHeldView, True)):
        result = run_lifecycle(Backend(name=cls.name, make_builders=lambda c, cls=cls: [cls(c), GrowsInTheWindow(c)]),
                               case)
        assert any(v.generation == 2 for p in result.phases for v in p.arena)
        assert violations(result, UBATCH) == [], violations(result, UBATCH)
        assert bool(violations(result, USE_AFTER_FREE)) is bad


class RetryLeavesItDegraded(FlashInferLikeBuilder):
    """Bug: after a failed reservation it falls back to a lazy scratch buffer made in serving, even once the retry
    succeeded: the main run never shows it; the rest of the lifecycle after the retry does."""

    name = "retry-degrades"

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        try:
            return super().reserve_persistent_workspace(ctx)
        except DeviceOutOfMemory:
            self.degraded = True
            raise

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if getattr(self, "degraded", False) and ctx.phase == "serving" and not hasattr(self, "late"):
            self.late = ctx.allocate(4 * MiB, "fallback scratch")


def test_the_rest_of_the_lifecycle_after_a_retried_reservation_is_judged(case):
    result = run(RetryLeavesItDegraded, case)
    assert CHECKS_BY_NAME["persistent_memory_visible_at_closing"].run(result) == []  # the main run shows nothing
    found = violations(result, RESERVATION)
    assert any("and the engine retried it, the rest of the lifecycle fails persistent_memory_visible_at_closing"
               in v and "fallback scratch" in v for v in found), found
    assert violations(run("stub-flashinfer", case), RESERVATION) == []
