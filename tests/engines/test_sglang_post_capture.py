"""SGLang's post-capture KV sizing path (``engines/sglang/post_capture.py``): its budget rule, its verdict on a correct
backend (SGLang's own), and the contract's checks refusing a backend that makes persistent memory after SGLang's
sizing point (the kind of OOM sglang#38596 reports).

Without SGLang the tests that need it skip with the install command (scripts/install_sglang_cpu.sh)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.checks.workspace import case_waste
from pytest_kvprofile.engines.sglang import standins as ss
from pytest_kvprofile.engines.sglang.post_capture import (
    POST_CAPTURE_ENV,
    SGLANG_POST_CAPTURE_BACKENDS,
    SglangPostCaptureAdapter,
    SglangTrtllmPostCaptureAdapter,
    post_capture_gate,
)
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.phases import POST_KV_PHASES, WINDOW_PHASES
from pytest_kvprofile.lifecycle.record import LEGACY, PROFILING
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.memory.budget import Budget
from pytest_kvprofile.units import GiB, MiB

CASES = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
QWEN_L40S = CASES["qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"]
QWEN_DCP2 = CASES["qwen3-8b-tp4-dcp2-mtp0-l40s-gmu0.90"]
QWEN_MTP = CASES["qwen3-8b-tp1-dcp1-mtp1-l40s-gmu0.90"]
BACKEND = SGLANG_POST_CAPTURE_BACKENDS[0]



def _budget(rule: str) -> Budget:
    return Budget(total=40 * GiB, gmu=0.9, weights=0, nontorch=0, persistent_workspace=0, persistent_reserved=0,
                  peak_activation=0, non_kv=0, graph_pool_estimate=0, graph_pool_high_water=0, available_kv=0,
                  kv_bytes_per_token=1, kv_tokens=0, reservation_kv_tokens=0, rule=rule)  # type: ignore[arg-type]


def test_the_post_capture_budget_keeps_the_rest_of_the_device_as_serving_headroom():
    assert _budget("profile").limit == 36 * GiB and "total x gmu" in _budget("profile").limit_text
    headroom = _budget("post_capture")
    assert headroom.limit == 40 * GiB and "serving headroom" in headroom.limit_text
    assert "mem_fraction_static 0.90" in headroom.lines()[0] and "4.00 GiB serving headroom" in headroom.lines()[0]
    assert BACKEND.policy.kv_sizing == "post_capture" and BACKEND.requires == ("sglang",)


# -- with SGLang -------------------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("sglang_flashinfer")
def test_sglangs_backend_passes_with_everything_made_before_the_sizing_point():
    """SGLang's order on this path: the backend, its graph state and every decode capture inside the window; after
    KV sizing only replays and per-step plans, whose tensors come from the serving headroom."""
    result = run_lifecycle(BACKEND, QWEN_L40S)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert result.path == PROFILING and result.budget is not None and result.budget.rule == "post_capture"
        assert failing_checks(result) == {}
        assert isinstance(adapter, SglangPostCaptureAdapter)
        # captured once, in the window
        assert adapter.captured == [("DECODE", bs) for bs in sorted(adapter.config().capture_bs, reverse=True)]
        flashinfer = [a for a in result.allocations if a.owner == adapter.name and a.kind == "device"
                      and "flashinfer" in (a.stack or "")]
        persistent = [a for a in flashinfer if a.freed_phase is None or a.freed_phase == "teardown"]
        late = [a for a in persistent if a.phase in POST_KV_PHASES]
        assert {a.phase for a in persistent} & set(WINDOW_PHASES)
        assert sum(a.nbytes for a in late) < MiB  # the last plans' index tensors, re-made every step
        waste = case_waste(result)
        assert waste is not None
        builder, = waste.builders
        assert builder.private_bytes == 512 * MiB  # SGLang's float workspace for a Qwen3 architecture
        assert 0 < builder.waste_bytes < 512 * MiB and waste.kv_tokens > 0  # a cost against the exact need
    finally:
        close_parts(result)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_a_buffer_made_on_the_first_request_after_the_sizing_point_is_refused(sglang_flashinfer):
    """A backend that makes a persistent buffer lazily, on its first extend: invisible to SGLang's post-capture
    sizing, so the lease-ordering check refuses it, naming the line."""

    class LazyScratch(sglang_flashinfer.FlashInferAttnBackend):  # type: ignore[misc, name-defined]
        def init_forward_metadata(self, forward_batch: Any) -> None:
            import torch

            if getattr(self, "scratch", None) is None:
                self.scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            super().init_forward_metadata(forward_batch)

    backend = dataclasses.replace(BACKEND, name="sglang-lazy-scratch",
                                  make_builders=lambda case: [SglangPostCaptureAdapter(case, builder_cls=LazyScratch)])
    result = run_lifecycle(backend, QWEN_L40S)
    try:
        failed = failing_checks(result)
        messages = failed.get("persistent_memory_visible_at_closing", [])
        assert messages, failed
        assert "64.00 MiB" in messages[0] and "init_forward_metadata" in messages[0]
        assert "step memory from the serving headroom" in messages[0]  # the per-step tensors are named apart
    finally:
        close_parts(result)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_with_mtp_the_draft_worker_is_made_and_captured_before_the_sizing_point(sglang_flashinfer):
    """SGLang sizes after the draft worker's capture too (scheduler.py: ``post_capture_resize_kv_pool(
    draft_runners=...)``): its own backend passes; one that makes its draft-extend scratch on the first served draft
    extend is refused, naming the call."""
    result = run_lifecycle(BACKEND, QWEN_MTP)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert result.path == PROFILING and failing_checks(result) == {}
        sizes = sorted(adapter.config().capture_bs, reverse=True)
        # the target worker made and captured, then the draft worker (SGLang's start-up order)
        assert adapter.captured == [("TARGET_VERIFY", bs) for bs in sizes] + [("DRAFT_EXTEND_V2", bs) for bs in sizes]
    finally:
        close_parts(result)

    class LazyDraftScratch(sglang_flashinfer.FlashInferAttnBackend):  # type: ignore[misc, name-defined]
        def init_forward_metadata(self, forward_batch: Any) -> None:
            import torch

            if forward_batch.forward_mode.is_draft_extend_v2() and getattr(self, "scratch", None) is None:
                self.scratch = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
            super().init_forward_metadata(forward_batch)

    lazy = dataclasses.replace(BACKEND, name="sglang-lazy-draft-scratch", make_builders=lambda case: [
        SglangPostCaptureAdapter(case, builder_cls=LazyDraftScratch)])
    result = run_lifecycle(lazy, QWEN_MTP)
    try:
        messages = failing_checks(result).get("persistent_memory_visible_at_closing", [])
        assert messages and "32.00 MiB" in messages[0] and "init_forward_metadata" in messages[0], messages
    finally:
        close_parts(result)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_where_sglang_does_not_size_after_capture_the_case_stays_on_the_static_path():
    reason = post_capture_gate(QWEN_DCP2)
    assert reason is not None and "post_capture_kv_sizing_planned" in reason and "dcp_size 2 != 1" in reason
    assert post_capture_gate(QWEN_L40S) is None
    result = run_lifecycle(BACKEND, QWEN_DCP2)
    try:
        assert result.path == LEGACY and result.resolution is not None
        assert result.resolution.engine_gate == reason
    finally:
        close_parts(result)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_server_args_resolve_as_on_the_cases_gpu():
    """SGLang's prefill CUDA-graph default is CUDA's (breakable), which its post-capture sizing needs; the opt-in is
    set only inside the block."""
    import os

    from sglang.srt.runtime_context import use_context

    from pytest_kvprofile.engines.sglang.flashinfer import make_sglang_engine

    adapter = SglangPostCaptureAdapter(QWEN_L40S)
    with ss.sglang_standins(QWEN_L40S.gpu):
        engine = make_sglang_engine(QWEN_L40S)
        with use_context(engine.context):
            from sglang.srt.runtime_context import get_exec

            assert get_exec().graph.cuda_graph_config.prefill.backend == "breakable"
    with adapter.standins():
        assert os.environ.get(POST_CAPTURE_ENV) == "1"
    assert POST_CAPTURE_ENV not in os.environ


@pytest.mark.usefixtures("sglang_flashinfer")
def test_trtllm_mha_on_the_post_capture_path_passes_and_its_unplanned_flashinfer_workspace_is_all_waste():
    """SGLang's Blackwell default carries FlashInfer's float workspace and never plans into it: the run observed
    every plan (torch mode), so no FlashInfer route is its, and the whole workspace is waste."""
    backend = next(b for b in SGLANG_POST_CAPTURE_BACKENDS if b.name == "sglang-trtllm-mha-post-capture")
    case = CASES["qwen3-8b-tp1-dcp1-mtp0-b200-gmu0.90"]
    assert backend.refuses_layout is not None and backend.refuses_layout(QWEN_L40S) is not None  # SGLang's own
    result = run_lifecycle(backend, case)
    try:
        assert result.path == PROFILING and failing_checks(result) == {}
        assert isinstance(result.builders[0], SglangTrtllmPostCaptureAdapter)
        waste = case_waste(result)
        assert waste is not None
        builder, = waste.builders
        assert builder.native == () and builder.trtllm == ("prefill", "decode")
        assert builder.private_bytes == builder.waste_bytes == 512 * MiB
    finally:
        close_parts(result)
