"""The open vLLM pull request's reservation API under the suite (issue 32): recognized in every revision, driven in
its runner's order with vLLM's own WorkspaceManager, gated as its runner gates, and judged only for what it really
leaves invisible; a class that looks taught but cannot be driven is a usage error naming what it has."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pytest_kvprofile import Backend, run_lifecycle
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.engines.contract_api import UnusableContract
from pytest_kvprofile.engines.vllm.flashinfer import (
    TRI_STATE,
    TWO_PASS,
    VLLM_POLICY,
    ReservingVllmBuilder,
    engine_refusal,
    make_vllm_builders,
    reservation_api,
)
from pytest_kvprofile.engines.vllm.pull_request import backends, pull_request_builder
from pytest_kvprofile.lifecycle.driver import close_parts
from pytest_kvprofile.lifecycle.record import LEGACY, PROFILING
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

pytestmark = pytest.mark.usefixtures("profile_window_vllm")

CASES = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
MTP0 = "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"
BACKENDS = {b.name: b for b in backends()}


@pytest.fixture(scope="module")
def planned(vllm_flashinfer: Any) -> Any:
    result = run_lifecycle(BACKENDS["vllm-pr-planned"], CASES[MTP0])
    yield result
    close_parts(result)


@pytest.fixture(scope="module")
def unplanned(vllm_flashinfer: Any) -> Any:
    result = run_lifecycle(BACKENDS["vllm-pr-unplanned"], CASES[MTP0])
    yield result
    close_parts(result)


def test_the_tri_state_api_is_recognized_and_named_by_its_methods(vllm_flashinfer):
    cls = pull_request_builder(True)
    assert reservation_api(cls, CASES[MTP0]) == TRI_STATE
    part, = make_vllm_builders(CASES[MTP0], builder_cls=cls)
    assert isinstance(part, ReservingVllmBuilder) and "tri-state API (get_persistent_workspace_memory_profiling_" \
        "support / reserve_workspace_for_memory_profiling)" in part.contract_api
    assert "current" not in part.contract_api
    assert "reserve_workspace_for_memory_profiling()" in part.contract_api


def test_the_planning_builder_opts_in_on_the_profiling_path_with_vllms_manager(planned):
    assert planned.path == PROFILING and not planned.errors, planned.errors
    assert failing_checks(planned) == {}
    arena = [a for a in planned.allocations if a.owner == "workspace-manager" and a.phase == "reservation"]
    assert arena and all(a.nbytes >= 394 * 2**20 for a in arena)  # vLLM's default arena, from vLLM's manager
    lease, = planned.leases
    assert lease.lease.released
    part = planned.builders[0]
    assert part.builders  # fresh builders after KV sizing; the window's went with the lease
    made = {a.phase for a in planned.allocations if a.owner == part.name and a.nbytes >= 8 * 2**20}
    assert {"reservation", "rebind"} <= made  # int workspaces in the window, and again by the fresh builders


def test_its_unplanned_twin_is_refused_for_the_plan_buffers_alone_with_their_bytes_first(unplanned):
    assert unplanned.path == PROFILING
    failing = failing_checks(unplanned)
    assert set(failing) == {"persistent_memory_visible_at_closing"}, failing
    first = failing["persistent_memory_visible_at_closing"][0]
    head = first.split(". Made after KV sizing", 1)[0]
    assert "bytes invisible to KV sizing" in head and not re.search(r"(?<![0-9])0\.00 MiB", first) and MTP0 in head
    invisible = int(head.split(": ")[-1].split(" bytes invisible")[0].replace(",", ""))
    assert 0 < invisible < 10_000
    listed = first.split("still alive: ", 1)[1].split("; ")[0]
    assert "flashinfer/" in listed and "_plan" in listed and "8.00 MiB" not in listed  # the plan buffers lead


def test_a_speculative_decoding_case_is_a_legacy_case_with_the_runners_reason(vllm_flashinfer):
    case = CASES["qwen3-8b-tp1-dcp1-mtp1-l40s-gmu0.90"]
    result = run_lifecycle(BACKENDS["vllm-pr-planned"], case)
    try:
        assert result.path == LEGACY and result.resolution is not None
        assert "speculative decoding" in (result.resolution.engine_gate or "")
        assert not any(c.method == "reserve_persistent_workspace" for c in result.calls)
        assert "support_declaration" not in failing_checks(result)
    finally:
        close_parts(result)
    assert VLLM_POLICY.gate is not None and VLLM_POLICY.gate(CASES[MTP0]) is None


def test_the_two_pass_revision_is_driven_too(vllm_flashinfer):
    class TwoPassRevision(vllm_flashinfer.FlashInferMetadataBuilder):
        @classmethod
        def persistent_workspace_profiling_support(cls, vllm_config: Any, kv_cache_spec: Any) -> bool:
            return True

        def prepare_workspace_for_profiling(self, materialize: bool) -> None:
            self._get_workspace_buffer()
            if materialize:
                self._get_prefill_wrapper()

    assert reservation_api(TwoPassRevision, CASES[MTP0]) == TWO_PASS
    part, = make_vllm_builders(CASES[MTP0], builder_cls=TwoPassRevision)
    assert "two-pass API (persistent_workspace_profiling_support / prepare_workspace_for_profiling)" \
        in part.contract_api and "earlier" not in part.contract_api


def _contract_error(vllm_flashinfer: Any, attrs: dict[str, Any]) -> str:
    cls = type("HalfTaught", (vllm_flashinfer.FlashInferMetadataBuilder,), attrs)
    with pytest.raises(UnusableContract) as err:
        make_vllm_builders(CASES[MTP0], builder_cls=cls)
    return str(err.value)


def test_a_contract_looking_method_of_no_known_revision_is_a_usage_error_naming_it(vllm_flashinfer):
    message = _contract_error(vllm_flashinfer, {"reserve_persistent_workspace_v3": lambda self: 0})
    assert "reserve_persistent_workspace_v3" in message and "does not know" in message
    assert "reserve_workspace_for_memory_profiling()" in message  # what it could implement instead


def test_a_required_declaration_without_a_reservation_is_a_usage_error(vllm_flashinfer):
    declare = classmethod(lambda cls, config, spec: pull_request_builder(True)
                          .get_persistent_workspace_memory_profiling_support(config, spec))
    message = _contract_error(vllm_flashinfer, {"get_persistent_workspace_memory_profiling_support": declare})
    assert "declares REQUIRED" in message and "no reservation method" in message


def test_the_usage_error_stops_the_run_before_collection(pytester, vllm_flashinfer):
    pytester.makepyfile(half_taught="""
        from pytest_kvprofile import Backend
        from pytest_kvprofile.engines.vllm.flashinfer import make_vllm_builders
        from pytest_kvprofile.engines.vllm.standins import import_vllm_flashinfer

        def backends():
            base = import_vllm_flashinfer().FlashInferMetadataBuilder
            cls = type("HalfTaught", (base,), {"rebind_workspace_after_reservation": lambda self: None})
            return [Backend(name="half-taught", make_builders=lambda case: make_vllm_builders(case, builder_cls=cls),
                            torch_mode=True)]
    """)
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("--kvprofile", "--kvprofile-matrix", str(packaged_matrix("ci")),
                                          "--kvprofile-backend", "half_taught:backends", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*HalfTaught*rebind_workspace_after_reservation*"])
    assert "Traceback" not in result.stderr.str()


def test_the_verdict_names_the_revision_driven_and_the_gated_cases(pytester, vllm_flashinfer):
    import json

    matrix = pytester.makefile(".yaml", m="""
        name: m
        envelope: {max_num_seqs: 16, max_num_batched_tokens: 512, max_model_len: 2048, page_size: 16,
                   cuda_graph_sizes: [1, 2, 4, 8, 16], num_ubatches: 1, nontorch_mib: 512}
        models:
          qwen3-8b: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36, kv_dtype: bf16, weights_gib: 15.3,
                     hidden_size: 4096}
        gpus: [L40S]
        tp: [1]
        dcp: [1]
        mtp: [0, 1]
        gmu: [0.9]
    """)
    verdict = pytester.path / "verdict.json"
    result = pytester.runpytest_inprocess(
        "--kvprofile", "--kvprofile-matrix", str(matrix), "--kvprofile-backend",
        "pytest_kvprofile.engines.vllm.pull_request:backends", "-k", "vllm-pr-planned", "--kvprofile-verdict",
        str(verdict), "-p", "no:cacheprovider", "-q")
    assert result.ret == 0, result.stdout.str()[-3000:]
    doc = {b["name"]: b for b in json.loads(verdict.read_text())["backends"]}["vllm-pr-planned"]
    assert "pull request, tri-state API" in doc["contract_api"]["vllm-flashinfer"]
    gated, = doc["engine_gated"]
    assert "mtp1" in gated["case"] and "speculative decoding" in gated["reason"]


def test_metadata_and_plans_of_the_real_builder_are_not_refused(planned, unplanned):
    """The two false refusals the pull request's real code met: its pointer comparison on a stale arena view
    (metadata, not a use) and FlashInfer's own plan allocating while a CUDA-graph wrapper is first planned in
    capture (real traffic)."""
    for result in (planned, unplanned):
        failing = failing_checks(result)
        assert "no_use_after_free" not in failing and "no_synthetic_workspace_in_capture" not in failing, failing


def test_with_the_harness_manager_the_pull_requests_builder_reserves_nothing(vllm_flashinfer):
    """``--kvprofile-workspace-manager harness``: vLLM's manager is not initialised, so the pull request's builder
    reserves nothing (as it is written to), its wrappers appear after KV sizing and the suite refuses that; which is
    why vLLM's own manager is the default for vLLM's builders."""
    from pytest_kvprofile.registry import with_workspace_manager

    backend: Backend = with_workspace_manager(BACKENDS["vllm-pr-planned"], "harness")
    assert BACKENDS["vllm-pr-planned"].policy.workspace_manager == "vllm"
    result = run_lifecycle(backend, CASES[MTP0])
    try:
        assert result.path == PROFILING
        assert not [a for a in result.allocations if a.owner == "workspace-manager" and a.phase == "reservation"]
        assert "persistent_memory_visible_at_closing" in failing_checks(result)
    finally:
        close_parts(result)


@pytest.mark.slow
@pytest.mark.parametrize("cid", sorted(CASES))
def test_on_every_ci_case_the_planned_builder_passes_and_its_twin_fails_only_for_plan_buffers(cid, vllm_flashinfer):
    """The acceptance of issue 32 on the whole of ``matrices/ci.yaml``: ``vllm-pr-planned`` opts in (every check
    passes on every case its engine accepts); ``vllm-pr-unplanned`` fails ``persistent_memory_visible_at_closing``
    alone, and only where it takes the profiling path (no MTP, no DCP), for a few KB."""
    case = CASES[cid]
    if case.skip_reason is not None or engine_refusal(case) is not None:
        pytest.skip(case.skip_reason or engine_refusal(case))
    for name in ("vllm-pr-planned", "vllm-pr-unplanned"):
        result = run_lifecycle(BACKENDS[name], case)
        try:
            failing = failing_checks(result)
            profiling = case.mtp == 0 and case.dcp == 1
            assert result.path == (PROFILING if profiling else LEGACY), (name, result.resolution)
            if name == "vllm-pr-planned" or not profiling:
                assert failing == {}, (name, failing)
            else:
                assert set(failing) == {"persistent_memory_visible_at_closing"}, failing
                assert "bytes invisible to KV sizing" in failing["persistent_memory_visible_at_closing"][0]
        finally:
            close_parts(result)
