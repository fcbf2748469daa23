"""The example backend's own tests, written on pytest-kvprofile's public fixtures.

One item per case of the selected matrices (``--kvprofile-matrix``), with the suite's case ids, so
``-k`` selects cases the same way; ``--kvprofile-gpu`` runs the same tests on the CUDA device.
"""

from __future__ import annotations

from kvprofile_example_backend import (
    LazyPagedAttentionBuilder,
    PagedAttentionBuilder,
    correct,
    lazy,
)

from pytest_kvprofile.sizing import for_case


def test_the_builder_passes_the_whole_lifecycle(kvprofile_case, kvprofile_run):
    kvprofile_run(correct()).assert_passes()


def test_its_lease_outlives_the_closing_measurement(kvprofile_case, kvprofile_run):
    run = kvprofile_run([PagedAttentionBuilder(kvprofile_case)])
    run.assert_passes("lease_outlives_closing_measurement", "lease_released_before_graph_profiling")
    (lease,) = [rec for rec in run.result.leases if rec.owner == "paged-attention"]  # cases may carry resources
    assert lease.allocation_ids and lease.lease.released
    assert "paged-attention" not in run.result.released_before_closing


def test_its_arena_pointer_is_stable_after_lock(kvprofile_case, kvprofile_workspace_manager):
    builder = PagedAttentionBuilder(kvprofile_case)
    need = builder.declared_workspace(kvprofile_case).float_bytes
    reserved = kvprofile_workspace_manager.reserve("engine", need)
    kvprofile_workspace_manager.lock()
    for ub, view in enumerate(reserved):
        again = kvprofile_workspace_manager.get_workspace(builder.name, need, ub)
        assert (again.ptr, again.arena_size) == (view.ptr, view.arena_size)
    assert kvprofile_workspace_manager.snapshot() == tuple(
        type(v)(v.ubatch, v.ptr, v.arena_size, v.arena_size) for v in reserved)


def test_its_declared_workspace_is_what_the_sizing_module_says(kvprofile_case):
    declared = PagedAttentionBuilder(kvprofile_case).declared_workspace(kvprofile_case)
    assert declared.float_bytes == for_case(kvprofile_case).float_bytes


def test_the_lazy_twin_is_caught(kvprofile_case, kvprofile_run):
    failures = kvprofile_run(lazy()).failures()
    assert "persistent_memory_visible_at_closing" in failures
    assert "int workspace [ubatch 0]" in failures["persistent_memory_visible_at_closing"][0]
    assert kvprofile_run([LazyPagedAttentionBuilder(kvprofile_case)]).failures() == failures
