"""Issue 51, items 18 and 6: each shown both ways, the backend with the mechanism refused with a headline that names
the cause, its correct twin accepted, on the ci cases and on one case run alone."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS, REAL_FLASHINFER_MUTANTS
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing.case import sizable_refusal

BACKENDS = {b.name: b for b in (*MUTANT_BACKENDS, *STUB_BACKENDS, *REAL_FLASHINFER_BACKENDS, *REAL_FLASHINFER_MUTANTS)}
CI = [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None and sizable_refusal(c) is None]
ALONE = next(c for c in CI if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90")


def _failed(name: str, case: Any) -> dict[str, list[str]]:
    result = run_lifecycle(BACKENDS[name], case)
    close_parts(result)
    return failing_checks(result)


# -- 18: a private float buffer per wrapper, the arena reported -------------------------------------------------

PRIVATE = "mutant-05f-flashinfer-private-float-reported-as-arena"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_wrappers_over_private_buffers_reported_as_the_arena_are_refused_from_the_plans():
    failed = _failed(PRIVATE, ALONE)
    assert set(failed) == {"ubatch_arenas_disjoint"}, failed
    head = failed["ubatch_arenas_disjoint"][0]
    assert "BatchPrefillWithPagedKVCacheWrapper" in head and "130510848 bytes" in head, head
    assert "flashinfer_real.py:" in head and "phase 'reservation'" in head and "bound_workspaces() reports none" in head
    assert _failed("flashinfer", ALONE) == {}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_wrappers_over_private_buffers_are_refused_on_every_ci_case():
    for case in CI:
        if BACKENDS[PRIVATE].refuses_layout(case):
            continue
        assert "ubatch_arenas_disjoint" in _failed(PRIVATE, case), case.id
        assert _failed("flashinfer", case) == {}, case.id


# -- 6: late memory reported whole, with the phase it was made in --------------------------------------------

SCRATCH = "mutant-01e-graph-profiling-scratch"


def test_a_scratch_first_made_in_graph_profiling_is_reported_whole_with_its_phase():
    failed = _failed(SCRATCH, ALONE)
    head = failed["persistent_memory_visible_at_closing"][0]
    assert "76.00 MiB (79691776 bytes) invisible to KV sizing (made in phase 'graph_profiling'" in head, head
    assert "Made after the closing measurement and still alive: flashinfer: 'graph scratch'" in head


def test_the_scratch_is_refused_on_every_ci_case_and_its_twin_accepted():
    for case in CI:
        failed = _failed(SCRATCH, case)
        assert "79691776 bytes" in failed["persistent_memory_visible_at_closing"][0], case.id
        assert _failed("stub-flashinfer", case) == {}, case.id


def test_the_legacy_cost_counts_memory_made_in_graph_profiling():
    from pytest_kvprofile import Backend
    from pytest_kvprofile.builtin.mutants import GraphProfilingScratchBuilder

    class Legacy(GraphProfilingScratchBuilder):
        def get_persistent_workspace_memory_profiling_support(self) -> Any:
            from pytest_kvprofile import ProfilingSupport

            return ProfilingSupport.UNSUPPORTED

    result = run_lifecycle(Backend(name="legacy", make_builders=lambda c: [Legacy(c)]), ALONE)
    close_parts(result)
    cost = post_kv_cost(result)
    assert cost is not None
    scratch = [s for s in cost.sources if "graph scratch" in s.tags]
    assert scratch and scratch[0].nbytes == 79691776 and scratch[0].phases == ("graph_profiling",)
    assert "made in phase 'graph_profiling'" in cost.describe()
