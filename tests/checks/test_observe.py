"""Checks judge what a backend does, not what it reports (issue 12).

Each test drives a builder through the reference lifecycle on one CI case and reads the verdict of
one check: the harness's own observation (the views the manager handed out, the refusals it raised,
the method each allocation came from) decides, whatever the builder reports or catches.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pytest_kvprofile import Backend
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS, FlashInferLikeBuilder, GDNLikeBuilder
from pytest_kvprofile.checks.base import CheckOutcome
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.lifecycle.driver import LOCK_PROBE, LifecycleRun, make_device, run_lifecycle
from pytest_kvprofile.lifecycle.record import ProbeTarget
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.report.documents import verdict_document
from pytest_kvprofile.units import MiB

MUTANTS = {b.name: b for b in MUTANT_BACKENDS}
STUBS = {b.name: b for b in STUB_BACKENDS}


@pytest.fixture(scope="module")
def case() -> Any:
    return next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98")


def _only(backend: Any, case: Any) -> dict[str, list[str]]:
    return failing_checks(run_lifecycle(backend, case))


def _backend(name: str, *classes: type) -> Backend:
    return Backend(name=name, make_builders=lambda case: [cls(case) for cls in classes])


@pytest.mark.parametrize("mutant, check, words", [
    ("mutant-04c-swallowed-grow-after-lock", "arena_not_grown_after_lock",
     ["flashinfer in build()", "phase 'serving'", "ubatch 0", "bytes", "refused"]),
    ("mutant-09b-synthetic-in-captured-build", "no_synthetic_workspace_in_capture",
     ["flashinfer: 'synthetic plan workspace' 1.00 MiB", "from build()", "phase 'capture'"]),
    ("mutant-07c-warmup-retunes", "warmup_idempotent",
     ["flashinfer: 're-tune scratch' 2.00 MiB (2097152 bytes)", "from warmup()", "phase 'warmup_repeat'"]),
    ("mutant-05b-silent-ubatch-alias", "ubatch_arenas_disjoint",
     ["flashinfer build() building micro-batch 1", "micro-batch 0's float arena", "bytes)", "in _plan"]),
    ("mutant-01b-lazy-large-batch-wrapper", "persistent_memory_visible_at_closing",
     ["'ragged prefill int workspace [ubatch 0]' 8.00 MiB", "from build() in phase 'serving'"]),
])
def test_new_mutant_fails_exactly_its_check_naming_rule_owner_method_tag_bytes(case, mutant, check, words):
    failed = _only(MUTANTS[mutant], case)
    assert check in failed, failed
    message = failed[check][0]
    assert message.startswith(check) or check in message
    for word in words:
        assert word in message, message


def test_lazy_new_allocations_are_listed_before_rebind_recreations(case):
    message = _only(MUTANTS["mutant-01b-lazy-large-batch-wrapper"], case)["persistent_memory_visible_at_closing"][0]
    assert message.index("ragged prefill int workspace") < message.index("from rebind()")


@pytest.mark.parametrize("name", sorted(STUBS))
def test_correct_stubs_leave_no_refusal_and_ask_only_their_own_arena(case, name):
    result = run_lifecycle(STUBS[name], case)
    assert result.refusals == []
    assert all(g.for_ubatch in (None, g.ubatch) for g in result.grants)
    assert not failing_checks(result)


def test_the_engine_lock_probe_is_not_a_refusal_and_still_names_requester(case):
    result = run_lifecycle(STUBS["stub-flashinfer"], case)
    assert LOCK_PROBE in (result.lock_probe_error or "")
    assert all(r.requester != LOCK_PROBE for r in result.refusals)


class AsksOtherUbatchBuild(FlashInferLikeBuilder):
    """Correct (issue 51, item 14): every build also asks for micro-batch 0's view, but plans only into its own
    micro-batch's (``ctx.plan_into``); a request is not a use."""

    bound_workspaces = None

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        ctx.get_workspace(self.float_bytes(), 0)


class WrongUbatchBuild(AsksOtherUbatchBuild):
    """Reports nothing, but plans micro-batch 1's batches into micro-batch 0's arena view it asked for."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        ctx.plan_into(ctx.get_workspace(self.float_bytes(), 0))


def test_a_build_that_plans_into_another_ubatchs_arena_fails_whatever_it_reports(case):
    failed = _only(_backend("wrong-ubatch", WrongUbatchBuild), case)
    message = "\n".join(failed["ubatch_arenas_disjoint"])
    assert "micro-batch 1's plan lands in the arena micro-batch 0 uses" in message, message
    assert "ubatch_arenas_disjoint" not in failing_checks(run_lifecycle(_backend("asks", AsksOtherUbatchBuild), case))


class TransientPlanScratch(FlashInferLikeBuilder):
    """Correct: its plan makes the same small transient scratch for real and captured batches."""

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        ctx.free(ctx.allocate(4096, "plan scratch"))


class DummyRunAllocatesInCapture(FlashInferLikeBuilder):
    """Bug 9 from another method: warmup-like tuning in every dummy forward, capture included."""

    def dummy_run(self, ctx: BuilderContext) -> None:
        if ctx.capturing:
            ctx.free(ctx.allocate(MiB, "capture tuning"))


def test_plan_scratch_shared_with_serving_is_not_synthetic(case):
    assert "no_synthetic_workspace_in_capture" not in _only(_backend("plan-scratch", TransientPlanScratch), case)


def test_any_non_build_allocation_in_capture_fails_with_its_method(case):
    message = _only(_backend("tuning", DummyRunAllocatesInCapture), case)["no_synthetic_workspace_in_capture"][0]
    assert "flashinfer: 'capture tuning' 1.00 MiB" in message and "from dummy_run()" in message


def test_serving_sweeps_every_capture_size_power_of_two_and_ubatch(case):
    run = LifecycleRun(ProbeTarget(STUBS["stub-flashinfer"], case, make_device), make_device(case))
    batches = run._serving_batches()
    env = case.envelope
    captured = {(c.num_reqs, c.num_tokens) for c in env.decode_captures(case.mtp)}
    assert captured <= {(b.num_reqs, b.num_tokens) for b in batches if b.cuda_graph}
    for kind in ("prefill", "mixed", "decode"):
        reqs = {b.num_reqs for b in batches if b.kind == kind and not b.cuda_graph}
        assert {1 << k for k in range(env.max_num_seqs.bit_length())} <= reqs, kind
    assert batches == sorted(batches, key=lambda b: -b.num_tokens)
    result = run.run()
    built = {(c.builder, c.phase) for c in result.calls if c.method == "build"}
    assert ("flashinfer", "serving") in built
    served = [g for g in result.grants if g.phase == "serving"]
    assert not served or {g.ubatch for g in served} == set(range(env.num_ubatches))


def test_gdn_requests_per_ubatch_in_build_pass(case):
    assert not _only(_backend("hybrid", FlashInferLikeBuilder, GDNLikeBuilder), case)


def _session(declared: dict[str, str]) -> Any:
    backend = Backend(name="b", make_builders=lambda case: [])
    record = CheckOutcome("support_declaration", "b", "c", outcome="passed", nodeid="x")
    return SimpleNamespace(
        tier="cpu", hardware=None, settings=SimpleNamespace(max_waste=None), matrix_digest=lambda: "d",
        matrices=[], records=[record], backends=[backend],
        profiles={"b": SimpleNamespace(declared_support=declared, contract_api={})},
        planned=lambda backend: {"c": ["support_declaration"]}, refused_pairs=list, gated=lambda backend: [],
    )


@pytest.mark.parametrize("declared, may", [
    ({"flashinfer": "required"}, True),
    ({"flashinfer": "required", "gdn": "neutral"}, True),
    ({"gdn": "neutral"}, False),
    ({"flashinfer": "required", "mm-prefix": "unsupported"}, False),
    ({"untaught": "unsupported"}, False),
])
def test_no_opt_in_without_the_profiling_path(declared, may):
    doc = verdict_document(_session(declared))["backends"][0]
    assert doc["may_opt_in"] is may
    if not may:
        assert any(r.startswith("legacy path: nothing to opt in") for r in doc["reasons"]), doc["reasons"]


class _TransientInReserve(FlashInferLikeBuilder):
    """Correct: a staging buffer made and freed inside the reservation is not part of the lease."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        ctx.free(ctx.allocate(MiB, "zero-fill staging"))
        return super().reserve_persistent_workspace(ctx)


class _GDNKeepsCache(GDNLikeBuilder):
    """NEUTRAL, but keeps an autotune cache of its own from warmup."""

    warmup_materializes_persistent = True

    def warmup(self, ctx: BuilderContext) -> None:
        if not getattr(self, "cache", None):
            self.cache = ctx.allocate(16 * MiB, "gdn autotune cache")
        super().warmup(ctx)


def test_a_transient_of_the_reservation_is_not_leased(case):
    assert _only(_backend("staging", _TransientInReserve), case) == {}


def test_a_neutral_builder_that_keeps_memory_of_its_own_fails_its_declaration(case):
    failed = _only(_backend("hybrid-gdn-cache", FlashInferLikeBuilder, _GDNKeepsCache), case)
    message = failed["support_declaration"][0]
    assert "'gdn' declares NEUTRAL" in message and "'gdn autotune cache' 16.00 MiB" in message, message
    assert _only(STUBS["stub-hybrid"], case) == {}


@pytest.mark.parametrize("mutant, check, words", [
    ("mutant-01c-torch-release-callback-allocates", "persistent_memory_visible_at_closing",
     ["flashinfer-torch", "16.00 MiB", "from lease.release() in phase 'lease_release'"]),
    ("mutant-07d-post-kv-warmup-leaks", "warmup_retryable", ["after KV sizing", "'autotune scratch' 64.00 MiB"]),
    ("mutant-07d-post-kv-warmup-leaks", "no_post_kv_overrun",
     ["64.00 MiB cached after flashinfer: 'autotune scratch'"]),
    ("mutant-07e-torch-warmup-keeps-partial", "warmup_retryable", ["inside the profiling window", "extra 'warmup'"]),
    ("mutant-11c-short-native-route", "workspace_covers_planner", ["declares", "short by",
                                                                   "for routes prefill, prefill_cuda_graph"]),
    ("mutant-14c-torch-global-after-kv-sizing", "no_state_outlives_case",
     ["_WORKSPACES['trtllm-gen']", "32.00 MiB", "process_state.py", "after the closing measurement"]),
    ("mutant-14d-torch-global-per-engine", "no_state_outlives_case",
     ["_WORKSPACES['trtllm-gen']", "32.00 MiB", "process_state.py", "second engine"]),
])
def test_observed_mutant_fails_naming_what_the_harness_saw(case, mutant, check, words):
    failed = _only(MUTANTS[mutant], case)
    message = failed[check][0]
    for word in words:
        assert word in message, message
