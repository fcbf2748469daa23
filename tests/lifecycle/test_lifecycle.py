"""The reference lifecycle: phase order, budget arithmetic and what it records."""

import pytest

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.lifecycle.driver import run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

STUBS = {b.name: b for b in STUB_BACKENDS}


@pytest.fixture(scope="module")
def case():
    cases = load_matrix(packaged_matrix("ci")).cases
    return next(c for c in cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98")


def test_profiling_path_runs_the_phases_in_design_order(case):
    r = run_lifecycle(STUBS["stub-flashinfer"], case)
    assert r.path == "profiling" and not r.errors
    assert [p.name for p in r.phases] == [
        lc.SETUP, lc.BASELINE, lc.RESERVATION, lc.PROFILE_RUN, lc.PROFILE_WARMUP, lc.PROFILE_REPLAY, lc.CLOSING,
        lc.LEASE_RELEASE, lc.GRAPH_PROFILING, lc.KV_SIZING, lc.REBIND, lc.WARMUP, lc.CAPTURE, lc.LOCK, lc.SERVING,
        lc.WARMUP_REPEAT,
    ]


def test_legacy_path_skips_reservation_warmup_replay_and_release(case):
    r = run_lifecycle(STUBS["stub-mm-prefix"], case)
    names = [p.name for p in r.phases]
    assert r.path == "legacy"
    for phase in (lc.RESERVATION, lc.PROFILE_WARMUP, lc.PROFILE_REPLAY, lc.LEASE_RELEASE):
        assert phase not in names
    assert not any(m == "reserve_persistent_workspace" for _, _, m in r.calls)


def test_budget_follows_the_engine_arithmetic(case):
    r = run_lifecycle(STUBS["stub-flashinfer"], case)
    b, w = r.budget, r.window
    assert w.non_kv == w.baseline_reserved + w.consumed + w.transient_headroom + w.nontorch
    assert b.available_kv == (int(b.total * b.gmu) - b.non_kv - b.graph_pool_estimate) // (2 << 20) * (2 << 20)
    assert b.kv_tokens == b.available_kv // b.kv_bytes_per_token
    assert b.graph_pool_estimate == r.graph_pool_high_water > 0
    assert r.post_kv_peak_used <= b.limit
    assert b.reservation_kv_tokens > 0


def test_the_lease_holds_the_int_workspaces_until_release(case):
    r = run_lifecycle(STUBS["stub-flashinfer"], case)
    (lease,) = r.leases
    held = [a for a in r.allocations if a.id in lease.allocation_ids]
    device_ints = [a for a in held if a.kind == "device" and "int workspace" in a.tag]
    assert len(device_ints) == 4  # prefill + decode wrappers for two micro-batches
    assert {a.nbytes for a in device_ints} == {8 << 20}
    assert {a.freed_phase for a in held} == {lc.LEASE_RELEASE}
    assert lease.lease.released


def test_every_correct_stub_passes_every_check(case):
    for backend in STUB_BACKENDS:
        assert failing_checks(run_lifecycle(backend, case)) == {}, backend.name


def test_a_factory_that_raises_is_recorded_not_raised(case):
    class Broken:
        name = "broken"
        policy = None

        def make_builders(self, case):
            raise RuntimeError("no such GPU")

    r = run_lifecycle(Broken(), case)
    assert r.aborted_in == lc.SETUP
    assert "no such GPU" in r.errors[0].describe() and "broken" in r.errors[0].who
    assert "no such GPU" in failing_checks(r)["support_declaration"][0]


def test_lazy_workspace_on_l40s_at_098_fails_with_an_overrun_report_naming_the_int_workspace():
    from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS

    cases = {c.id: c for c in load_matrix(packaged_matrix("default")).cases}
    case = cases["gemma-2-9b-hd256-tp8-dcp1-mtp0-l40s-gmu0.98"]
    lazy = run_lifecycle(MUTANT_BACKENDS[0], case)
    report = failing_checks(lazy)["no_post_kv_overrun"][0]
    assert "over total x gmu" in report
    assert ("flashinfer: 'prefill int workspace [ubatch 0]' 8.00 MiB (8388608 bytes) from rebind() in phase 'rebind'"
            in report)
    assert "would have to give up" in report and "KV tokens" in report
    mirrors = [a for a in lazy.allocations if a.kind == "pinned_host" and a.phase == "rebind"]
    assert len(mirrors) == 4 and {a.nbytes for a in mirrors} == {8 << 20}, "pinned mirrors are in the ledger"
    correct = run_lifecycle(STUBS["stub-flashinfer"], case)
    assert failing_checks(correct) == {}
    assert correct.budget.reservation_kv_tokens > 0
    assert f"the reservation costs {correct.budget.reservation_kv_tokens} tokens" in " ".join(correct.budget.lines())
