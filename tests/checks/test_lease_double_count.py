"""Freed then made again is not counted twice; kept and made again is (issue 21, point 6).

``lease_released_before_graph_profiling`` judges bytes: what the builder holds after the lease release (leased
memory it kept plus what it made again) against what the engine counted at the closing measurement. It used
to match tags, which refused a builder whose re-made wrappers share a tag with a wrapper it keeps, and missed
torch-mode builders, whose tags are method names.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile.attention.facts import FLASHINFER_INT_WORKSPACE_BYTES
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder, Wrapper
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME, failing_checks
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import BuilderContext
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing.case import routes

LEASE = "lease_released_before_graph_profiling"


class KeepPrefillBuilder(FlashInferLikeBuilder):
    """Correct: keeps its eager prefill wrappers (leased, so counted) for serving, frees the decode wrappers
    with the lease and makes them again on rebind. Every int workspace has the same tag."""

    name = "flashinfer-keep-prefill"

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        view = self._float_view(ctx, ubatch)
        int_ws = ctx.allocate(FLASHINFER_INT_WORKSPACE_BYTES, "int workspace", role=Role.INT_WORKSPACE)
        try:
            mirror = ctx.allocate(FLASHINFER_INT_WORKSPACE_BYTES, "int workspace mirror", pinned_host=True,
                                  role=Role.PINNED_MIRROR)
        except BaseException:
            ctx.free(int_ws)  # all or nothing, as the stub's wrappers (reservation_exception_safe)
            raise
        return Wrapper(route, ubatch, view.ptr, view.nbytes, int_ws, mirror, int_ws.ptr, int_ws.nbytes, view)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        wrappers = self._materialize(ctx)
        decode = [w for w in wrappers if w.route == "decode"]
        return ctx.lease(wrappers, on_release=lambda: self._drop(ctx, decode))


class KeepAllRemakeDecodeBuilder(KeepPrefillBuilder):
    """Buggy twin: the lease's release frees nothing, yet rebind makes the decode wrappers again."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        wrappers = self._materialize(ctx)
        self.profiling = wrappers
        for key in [k for k in self.wrappers if k[0] == "decode"]:
            del self.wrappers[key]
        return ctx.lease(wrappers)


def _backend(cls: type) -> Backend:
    return Backend(name=cls.__name__, make_builders=lambda c: [cls(c)], origin="test")


def _cases() -> list[Any]:
    cases = load_matrix("matrices/ci.yaml").cases
    return [c for c in cases if c.skip_reason is None and c.unsized_reason is None][::12]


def test_keeping_part_of_the_lease_and_remaking_what_was_freed_passes():
    for case in _cases():
        result = run_lifecycle(_backend(KeepPrefillBuilder), case)
        close_parts(result)
        kept = [a for a in result.allocations if a.owner == "flashinfer-keep-prefill" and a.kind == "device"
                and a.phase == "reservation" and a.freed_phase is None]
        assert kept, "the case must keep leased memory for the rule to matter"
        assert failing_checks(result) == {}, case.id


def test_keeping_the_lease_and_remaking_it_is_counted_twice():
    for case in [c for c in _cases() if "decode" in routes(c)]:  # it remakes decode wrappers: MLA plans none
        failed = failing_checks(run_lifecycle(_backend(KeepAllRemakeDecodeBuilder), case))
        assert "counted twice" in failed[LEASE][0] and "int workspace" in failed[LEASE][0]
        assert "persistent_memory_visible_at_closing" in failed  # both checks read the same bytes


@pytest.mark.parametrize("name", ["mutant-03-never-released", "mutant-03b-torch-kept-and-remade"])
def test_the_mutants_that_keep_and_remake_are_refused_in_ctx_and_torch_mode(name):
    backend = next(b for b in MUTANT_BACKENDS if b.name == name)
    failed = failing_checks(run_lifecycle(backend, _cases()[0]))
    assert "counted twice" in failed[LEASE][0]


class ReplacesLeasedIntWorkspaces(FlashInferLikeBuilder):
    """Legal (issue 37, point 4): before the closing measurement it swaps each leased 8 MiB int workspace for a
    16 MiB one and hands the new one to the lease; the bytes alive at the closing measurement cover the lease."""

    name = "replaces-leased"
    warmup_materializes_persistent = True

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        self.lease = super().reserve_persistent_workspace(ctx)
        return self.lease

    def warmup(self, ctx: BuilderContext) -> None:
        if ctx.profiling and not getattr(self, "swapped", False):
            self.swapped = True
            for w in self.wrappers.values():
                new = ctx.allocate(2 * self.int_bytes(), f"{w.route} int x2 [ubatch {w.ubatch}]",
                                   role=Role.INT_WORKSPACE)
                ctx.free(w.int_workspace)
                w.int_workspace, w.int_ptr, w.int_nbytes = new, new.ptr, new.nbytes
                self.lease.hold(new)
        super().warmup(ctx)


def test_leased_memory_replaced_inside_the_window_by_more_is_judged_by_bytes():
    case = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90")
    result = run_lifecycle(Backend(name="replaces-leased", make_builders=lambda c: [ReplacesLeasedIntWorkspaces(c)]),
                           case)
    assert CHECKS_BY_NAME["lease_outlives_closing_measurement"].run(result) == []
    early = run_lifecycle(next(b for b in MUTANT_BACKENDS if b.name == "mutant-02-early-release"), case)
    assert CHECKS_BY_NAME["lease_outlives_closing_measurement"].run(early)
