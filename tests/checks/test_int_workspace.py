"""Each wrapper's int workspace, judged from what the harness observes (issue 22.1), and the roles the allocations
of every built-in correct backend carry (issue 22, acceptance).

One CI case; the mutant catalog's tests sweep the default matrix and ``matrices/ci.yaml`` runs them all.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pytest_kvprofile import Backend, Role
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS, SharedIntWorkspaceBuilder
from pytest_kvprofile.builtin.stubs import (
    STUB_BACKENDS,
    TORCH_STUB_BACKENDS,
    FlashInferLikeBuilder,
    Wrapper,
)
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME, failing_checks
from pytest_kvprofile.contract.bug_classes import mutant_class
from pytest_kvprofile.contract.protocol import BoundWorkspace, BuilderContext
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing.case import routes

CHECK = "int_workspace_per_wrapper"
MUTANTS = {b.name: b for b in MUTANT_BACKENDS}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvprofile-example-backend"
# Other checks that legitimately catch an int workspace mutant too (its ctx.plan_into() of the freed workspace).
COLLATERAL = {"mutant-15c-int-workspace-freed-early": {"no_use_after_free"},
              "mutant-15d-int-workspace-remade-after-capture": {"captured_memory_stays"},
              "mutant-15h-torch-int-workspace-remade-after-capture": {"captured_memory_stays"}}


@pytest.fixture(scope="module")
def case() -> Any:
    return next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98")


def _backend(name: str, cls: type, torch_mode: bool = False) -> Backend:
    return Backend(name=name, make_builders=lambda case: [cls(case)], torch_mode=torch_mode)


def _roles(result: Any) -> Counter:
    return Counter((a.owner, a.role, a.kind) for a in result.allocations if a.role is not Role.OTHER)


@pytest.mark.parametrize("mutant, words", [
    ("mutant-15a-int-workspace-too-small", ["'prefill int workspace [ubatch 0]' 0.03 MiB (32768 bytes)",
                                            "for_case(case).routes[...].int_bytes",
                                            "declares 8.00 MiB (8388608 bytes)"]),
    ("mutant-15b-int-workspace-shared-by-wrappers", ["phase 'rebind'", "overlapping bytes of one int workspace",
                                                     "'prefill float workspace' (ubatch 1)"]),
    ("mutant-15c-int-workspace-freed-early", ["plans into an int workspace that is gone",
                                              "freed in phase 'rebind'"]),
    ("mutant-15d-int-workspace-remade-after-capture", ["freed in phase 'serving'", "from build() in phase 'serving'",
                                                       "'decode int workspace [ubatch 0]' 8.00 MiB"]),
    ("mutant-15e-torch-int-workspace-too-small", ["0.03 MiB (32768 bytes) x 4", "stubs.py:"]),
    ("mutant-15f-torch-int-workspace-shared-by-ubatches",
     ["overlapping bytes", "'prefill float workspace' (ubatch 0), 'prefill float workspace' (ubatch 1)"]),
    ("mutant-15g-torch-int-workspace-freed-early", ["gone at the end of phase 'rebind'"]),
    ("mutant-15h-torch-int-workspace-remade-after-capture", ["freed in phase 'serving'", "CUDA-graph capture on"]),
])
def test_an_int_workspace_mutant_fails_naming_owner_bytes_phase_and_line(case, mutant, words):
    failed = failing_checks(run_lifecycle(MUTANTS[mutant], case))
    assert CHECK in failed, failed
    # A moved int workspace moves the binding; one freed and still planned into is also a use after free.
    assert set(failed) <= {CHECK, "arena_stable_after_closing", *COLLATERAL.get(mutant, ())}, failed
    message = " ".join(failed[CHECK])
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("backend", [*STUB_BACKENDS, *TORCH_STUB_BACKENDS], ids=lambda b: b.name)
def test_correct_stubs_pass(case, backend):
    assert CHECK not in failing_checks(run_lifecycle(backend, case))


def test_the_check_is_in_the_catalog_for_its_bug_class():
    assert CHECKS_BY_NAME[CHECK].bugs == (15,)
    assert {b.name for b in MUTANT_BACKENDS if mutant_class(b.name) == 15} >= {
        "mutant-15a-int-workspace-too-small", "mutant-15e-torch-int-workspace-too-small"}


# -- legal but unusual: passes --------------------------------------------------------------------------------

class LargerIntWorkspaceBuilder(FlashInferLikeBuilder):
    """Gives each wrapper more int workspace than it declares: KV sizing sees it, nothing overflows."""

    def int_bytes(self) -> int:
        return 16 << 20


class UnreportedIntBuilder(FlashInferLikeBuilder):
    """Reports its wrappers' float ranges only (the int fields are optional)."""

    def bound_workspaces(self) -> list[BoundWorkspace]:
        return [BoundWorkspace(w.ubatch, w.route, w.float_ptr, w.float_bytes) for w in self.wrappers.values()]


@pytest.mark.parametrize("cls", [LargerIntWorkspaceBuilder, UnreportedIntBuilder])
def test_legal_int_workspace_patterns_pass(case, cls):
    assert failing_checks(run_lifecycle(_backend(cls.__name__, cls), case)) == {}


def test_what_close_frees_after_the_run_is_not_freed_before_the_end(case):
    from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS

    result = run_lifecycle(REAL_FLASHINFER_BACKENDS[0], case)
    close_parts(result)  # the session closes a run's parts before its checks read the record
    ints = [a for a in result.allocations if a.role is Role.INT_WORKSPACE]
    assert ints and all(not a.alive for a in ints)
    assert CHECK not in failing_checks(result)


# -- observed, whatever the builder reports --------------------------------------------------------------------

class SilentSharedIntWorkspaceBuilder(SharedIntWorkspaceBuilder):
    """Shares int workspaces between wrappers and reports no int ranges: the count still tells."""

    def bound_workspaces(self) -> list[BoundWorkspace]:
        return [BoundWorkspace(w.ubatch, w.route, w.float_ptr, w.float_bytes) for w in self.wrappers.values()]


class UnlabelledIntWorkspaceBuilder(FlashInferLikeBuilder):
    """Declares 8 MiB of int workspace per wrapper but never says which allocation it is."""

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        view = self._float_view(ctx, ubatch)
        int_ws = ctx.allocate(self.int_bytes(), f"{route} scratch [ubatch {ubatch}]")
        try:
            mirror = ctx.allocate(self.int_bytes(), f"{route} host scratch [ubatch {ubatch}]", pinned_host=True)
        except BaseException:
            ctx.free(int_ws)  # exception-safe, as the stub is: its one bug is the missing role
            raise
        return Wrapper(route, ubatch, view.ptr, view.nbytes, int_ws, mirror, view=view)


@pytest.mark.parametrize("cls, words", [
    (SilentSharedIntWorkspaceBuilder, ["4 wrappers", "1 other int workspace(s)"]),
    (UnlabelledIntWorkspaceBuilder, ["4 of them have no int workspace", "role=Role.INT_WORKSPACE", "int_ptr"]),
])
def test_wrappers_without_an_int_workspace_of_their_own_fail_whatever_they_report(case, cls, words):
    failed = failing_checks(run_lifecycle(_backend(cls.__name__, cls), case))
    assert set(failed) == {CHECK}, failed
    for word in words:
        assert word in failed[CHECK][0], failed[CHECK][0]


# -- roles ------------------------------------------------------------------------------------------------------

def test_the_ctx_and_torch_stubs_allocations_carry_roles(case):
    for backend in (STUB_BACKENDS[0], TORCH_STUB_BACKENDS[0]):
        result = run_lifecycle(backend, case)
        owner = result.builders[0].name
        roles = _roles(result)
        wrappers = len(routes(case)) * case.envelope.num_ubatches
        assert roles[(owner, Role.INT_WORKSPACE, "device")] == 2 * wrappers  # reservation, and again at rebind
        assert roles[(owner, Role.PINNED_MIRROR, "pinned_host")] == 2 * wrappers
        assert roles[("workspace-manager", Role.FLOAT_ARENA, "device")] == case.envelope.num_ubatches


def test_flashinfers_own_wrappers_give_their_buffers_roles_in_torch_mode(case):
    from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS

    result = run_lifecycle(REAL_FLASHINFER_BACKENDS[0], case)
    wrappers = sum(len(slot.wrappers()) for slot in result.builders[0].slots.values())
    roles = _roles(result)
    assert roles == Counter({("flashinfer", Role.INT_WORKSPACE, "device"): wrappers,
                             ("flashinfer", Role.PINNED_MIRROR, "pinned_host"): wrappers,
                             ("workspace-manager", Role.FLOAT_ARENA, "device"): case.envelope.num_ubatches})
    assert all("flashinfer/" in (a.stack or "") for a in result.allocations
               if a.role in (Role.INT_WORKSPACE, Role.PINNED_MIRROR))


def test_a_private_float_buffer_handed_to_a_wrapper_is_a_float_workspace_and_the_patch_is_undone():
    flashinfer = pytest.importorskip("flashinfer")
    import torch

    from pytest_kvprofile import simulated_gpu

    original = flashinfer.BatchDecodeWithPagedKVCacheWrapper.__init__
    with simulated_gpu("H100") as dev:
        ws = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        roles = {a.role for a in dev.live_allocations()}
        own = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        wrapper.reset_workspace_buffer(ws, own)
        assert dev.live_allocations()[-2].role is Role.INT_WORKSPACE  # the new int workspace; its mirror is last
    assert roles == {Role.FLOAT_WORKSPACE, Role.INT_WORKSPACE, Role.PINNED_MIRROR}
    assert flashinfer.BatchDecodeWithPagedKVCacheWrapper.__init__ is original


def test_a_trtllm_gen_wrappers_float_buffer_is_the_trtllm_gen_workspace():
    flashinfer = pytest.importorskip("flashinfer")
    import torch

    from pytest_kvprofile import simulated_gpu

    with simulated_gpu("B200") as dev:
        ws = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
        flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", backend="trtllm-gen")
        assert dev.live_allocations()[0].role is Role.TRTLLM_WORKSPACE


def test_the_example_backends_int_workspaces_carry_their_role(case, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from kvprofile_example_backend import correct

    result = run_lifecycle(correct(), case)
    assert failing_checks(result) == {}
    assert _roles(result)[("paged-attention", Role.INT_WORKSPACE, "device")] == 2 * case.envelope.num_ubatches


# -- observed rather than reported (issue 37, point 2) ----------------------------------------------------------

class ReportsPointersWithoutRoles(FlashInferLikeBuilder):
    """Correct, written before roles: each wrapper's own int workspace, no role, reported as int_ptr/int_nbytes."""

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> Wrapper:
        view = self._float_view(ctx, ubatch)
        int_ws = ctx.allocate(self.int_bytes(), f"{route} int [ubatch {ubatch}]")
        mirror = ctx.allocate(self.int_bytes(), f"{route} host int [ubatch {ubatch}]", pinned_host=True)
        return Wrapper(route, ubatch, view.ptr, view.nbytes, int_ws, mirror, int_ws.ptr, int_ws.nbytes, view)


class SlicesOneSlab(FlashInferLikeBuilder):
    """Correct: one slab of int workspace, a disjoint slice per wrapper, each reported by its pointer."""

    def _materialize(self, ctx: BuilderContext) -> list[Any]:
        keys = [(route, ub) for route in self.routes() for ub in range(ctx.num_ubatches)]
        self.slab = ctx.allocate(self.int_bytes() * len(keys), "int slab", role=Role.INT_WORKSPACE)
        made = []
        for i, (route, ub) in enumerate(keys):
            view = self._float_view(ctx, ub)
            w = Wrapper(route, ub, view.ptr, view.nbytes, self.slab, None,
                        self.slab.ptr + i * self.int_bytes(), self.int_bytes(), view)
            self.wrappers[(route, ub)] = made.append(w) or w
        return made

    def rebind(self, ctx: BuilderContext) -> None:
        if not self.wrappers:
            self._materialize(ctx)

    def _drop(self, ctx: BuilderContext, wrappers: list[Any]) -> None:
        for key in [k for k, v in self.wrappers.items() if any(v is w for w in wrappers)]:
            del self.wrappers[key]
        if not self.wrappers:
            ctx.free(self.slab)


class OverlappingSlices(SlicesOneSlab):
    """Bug: slices of one slab that overlap (each a slice of half its width further): plans overwrite each other."""

    def _materialize(self, ctx: BuilderContext) -> list[Any]:
        made = super()._materialize(ctx)
        for i, w in enumerate(made):
            w.int_ptr = self.slab.ptr + i * (self.int_bytes() // 2)
        return made


def test_a_reported_int_ptr_counts_whatever_its_role(case):
    assert CHECK not in failing_checks(run_lifecycle(_backend("pointers", ReportsPointersWithoutRoles), case))


def test_disjoint_slices_of_one_slab_are_legal_and_overlapping_ones_are_not(case):
    legal = run_lifecycle(_backend("slices", SlicesOneSlab), case)
    assert CHECK not in failing_checks(legal), failing_checks(legal).get(CHECK)
    failed = failing_checks(run_lifecycle(_backend("overlaps", OverlappingSlices), case))
    assert CHECK in failed and "overlapping bytes of one int workspace" in failed[CHECK][0], failed


class Ubatch1PlansIntoUbatch0Int(FlashInferLikeBuilder):
    """Bug (issue 37, point 2): each wrapper reports its own int workspace, but micro-batch 1's builds plan into
    micro-batch 0's (ctx.plan_into tells the harness)."""

    def _plan(self, ctx: BuilderContext, w: Wrapper) -> None:
        ctx.plan_into(w.view)
        ctx.plan_into(self.wrappers[(w.route, 0)].int_workspace)


def test_an_int_workspace_planned_into_by_two_micro_batches_is_shared(case):
    failed = failing_checks(run_lifecycle(_backend("u1-into-u0", Ubatch1PlansIntoUbatch0Int), case))
    assert CHECK in failed and any("micro-batches [0, 1] plan into one int workspace" in m for m in failed[CHECK])
    assert CHECK not in failing_checks(run_lifecycle(_backend("own", FlashInferLikeBuilder), case))
