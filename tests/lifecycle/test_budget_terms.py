"""The engine's KV budget as terms (``contract/budget.py``): the lifecycle's snapshot points, the harness's own terms
and the plain formula's, and ``budget_counts_every_byte`` reading them against the ledger."""

from __future__ import annotations

import pytest

from pytest_kvprofile.builtin.mutants_field import FORK_POLICY, RUNNER_INIT_BUFFERS, UPSTREAM_POLICY
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
from pytest_kvprofile.checks.budget import uncounted_at_closing
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.budget import SNAPSHOT_POINTS, BudgetTerm
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.memory.budget import HARNESS_ENGINE

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None)
STUB = next(b for b in STUB_BACKENDS if b.name == "stub-flashinfer")


def test_a_term_counts_forward_between_two_snapshots_or_not_at_all():
    assert BudgetTerm("t", 1, "after_init", "closing").persistent
    assert not BudgetTerm("headroom", 1).persistent
    with pytest.raises(ValueError, match="both set or both None"):
        BudgetTerm("t", 1, "after_init")
    with pytest.raises(ValueError, match="not before"):
        BudgetTerm("t", 1, "closing", "baseline")


def test_the_run_marks_every_snapshot_point_in_order_and_the_harness_counts_every_byte():
    result = run_lifecycle(STUB, CASE)
    close_parts(result)
    marks = [result.snapshot_marks[p] for p in SNAPSHOT_POINTS]
    assert marks == sorted(marks) and marks[0] == 0 and marks[-1] <= len(result.allocations)
    terms = result.engine_terms
    assert terms is not None and result.window is not None and terms.engine == HARNESS_ENGINE
    assert terms.non_kv == result.window.non_kv  # the same arithmetic, as terms
    missed = uncounted_at_closing(result)
    assert missed.reserved == 0 and not missed.alive


def test_memory_made_before_the_engines_snapshot_is_in_no_term_and_named_by_that_snapshot():
    def run(policy):
        from pytest_kvprofile.builtin.mutants_field import RunnerInitBuffersBuilder

        backend = Backend("runner", lambda case: [RunnerInitBuffersBuilder(case)], policy=policy, torch_mode=True)
        result = run_lifecycle(backend, CASE)
        close_parts(result)
        return uncounted_at_closing(result)

    fork, upstream = run(FORK_POLICY), run(UPSTREAM_POLICY)
    assert {a.nbytes for a in fork.alive["after_init"]} == set(RUNNER_INIT_BUFFERS.values())
    assert all(a.phase == "setup" for a in fork.alive["after_init"])
    assert fork.reserved >= fork.alive_bytes == sum(RUNNER_INIT_BUFFERS.values())
    assert upstream.reserved == 0 and not upstream.alive


def test_a_legacy_path_model_is_judged_too():
    """The budget is the engine's, whichever path the builders take: a legacy-path run records the harness's terms."""
    backend = next(b for b in STUB_BACKENDS if b.name == "stub-untaught")
    result = run_lifecycle(backend, CASE)
    close_parts(result)
    assert result.path == "legacy" and result.engine_terms is not None and uncounted_at_closing(result).reserved == 0


def test_memory_an_earlier_run_left_on_the_device_is_not_owed_by_this_runs_terms():
    """A real GPU is not fresh: what an earlier case left reserved is before every snapshot of this run."""
    from pytest_kvprofile.builtin.mutants_field import RunnerInitBuffersBuilder
    from pytest_kvprofile.lifecycle.driver import make_device
    from pytest_kvprofile.units import MiB

    def used_device(case):
        device = make_device(case)
        device.allocate(64 * MiB, owner="an earlier case", tag="leftover")
        return device

    backend = Backend("runner", lambda case: [RunnerInitBuffersBuilder(case)], policy=UPSTREAM_POLICY, torch_mode=True)
    result = run_lifecycle(backend, CASE, used_device)
    close_parts(result)
    assert result.reserved_at_start >= 64 * MiB
    missed = uncounted_at_closing(result)
    assert missed.reserved == 0 and not missed.alive
