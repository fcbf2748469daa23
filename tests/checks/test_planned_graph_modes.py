"""The float need follows the CUDA-graph modes a builder plans (issue 51, item 7).

vLLM 0.33's builder plans prefill without CUDA graphs only, decode with and without. On qwen3-8b, L40S, TP 1 the
graph prefill plan needs 124.46 MiB, the plans vLLM makes 17.64 MiB. Torch mode observes the modes (each ``plan()``
with its wrapper's ``use_cuda_graph``); ctx mode reads them from ``ctx.get_workspace(route=, cuda_graph=)``.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile import Backend
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.stubs import ROUTE_STUB_BACKENDS
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME, failing_checks
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing.case import need_for_planned, need_for_routes
from pytest_kvprofile.units import MiB

CASES = [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None and c.unsized_reason is None]
CASE = next(c for c in CASES if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90")
TWIN = next(b for b in ROUTE_STUB_BACKENDS if b.name == "stub-eager-prefill")
MUTANT = next(b for b in MUTANT_BACKENDS if b.name == "mutant-11f-prefill-graph-into-eager-view")
CHECK = CHECKS_BY_NAME["workspace_covers_planner"]


def _failing(backend: Backend, case: Any) -> dict[str, list[str]]:
    result = run_lifecycle(backend, case)
    close_parts(result)
    return failing_checks(result)


def test_the_needs_of_the_report():
    assert round(need_for_routes(CASE, None)[0] / MiB, 2) == 124.46
    need, subs = need_for_planned(CASE, [("prefill", False), ("decode", None)])
    assert round(need / MiB, 2) == 17.64 and "prefill_cuda_graph" not in subs and "decode_tc_cuda_graph" in subs


def test_a_mode_the_case_does_not_size_stands_for_the_route():
    assert need_for_planned(CASE, [("prefill", True)])[0] == need_for_routes(CASE, ("prefill",))[0]


def test_the_eager_prefill_twin_passes_every_ci_case_and_one_alone():
    for case in CASES:
        assert _failing(TWIN, case) == {}, case.id
    assert _failing(TWIN, CASE) == {}


def test_graph_prefill_into_an_eager_view_is_refused_with_its_bytes():
    found = _failing(MUTANT, CASE)
    assert set(found) == {"workspace_covers_planner"}
    head = found["workspace_covers_planner"][0]
    assert "cuda_graph=False" in head and "prefill_cuda_graph" in head and "18493440 bytes" in head, head
    assert "short by 106.83 MiB" in head and "phase 'serving'" in head and "stubs.py:" in head, head
    refused = [c.id for c in CASES if "workspace_covers_planner" in _failing(MUTANT, c)]
    graph_costs_more = [c.id for c in CASES
                        if need_for_planned(c, [("prefill", True)])[0] > need_for_planned(c, [("prefill", False)])[0]]
    assert refused == graph_costs_more and len(refused) == 50


def test_cuda_graph_needs_a_route():
    class Asks:
        name = "asks"

        def reserve_persistent_workspace(self, ctx: Any) -> Any:
            ctx.get_workspace(MiB, 0, cuda_graph=False)
            return ctx.lease([])

        def get_persistent_workspace_memory_profiling_support(self) -> Any:
            from pytest_kvprofile import ProfilingSupport

            return ProfilingSupport.REQUIRED

    result = run_lifecycle(Backend(name="asks", make_builders=lambda c: [Asks()]), CASE)
    close_parts(result)
    assert any("give route= too" in e.message for e in result.errors)


def test_vllm_builder_sized_for_what_it_plans_passes():
    """Torch mode: vLLM's pull-request builder with its arena sized for the plans vLLM makes (eager prefill, decode
    with and without graphs) is accepted; every prefill plan it makes is observed without CUDA graphs."""
    pytest.importorskip("vllm")
    from pytest_kvprofile.engines.vllm.flashinfer import make_vllm_builders
    from pytest_kvprofile.engines.vllm.pull_request import backends, pull_request_builder

    exact = need_for_planned(CASE, [("prefill", False), ("decode", None)])[0]
    base: Any = pull_request_builder(True)

    class Exact(base):  # type: ignore[misc,valid-type]
        def _default_arena_bytes(self) -> int:
            return exact

    planned = next(b for b in backends() if b.name == "vllm-pr-planned")
    backend = Backend(name="vllm-pr-exact", make_builders=lambda c: make_vllm_builders(c, builder_cls=Exact),
                      torch_mode=True, policy=planned.policy, origin="test")
    result = run_lifecycle(backend, CASE)
    close_parts(result)
    assert {(p.route, p.cuda_graph) for p in result.plans if p.route == "prefill"} == {("prefill", False)}
    assert CHECK.run(result) == []
