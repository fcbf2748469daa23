"""SGLang's own FlashInferAttnBackend (the installed wheel, unmodified) under the harness: the stand-ins, the host
version of its index kernel, the backend driven on ci cases on SGLang's static path (everything it makes is after
the KV pool, attributed to SGLang's and FlashInfer's source lines), and the layouts the adapter refuses by name.

Without SGLang the tests that need it skip with the install command (scripts/install_sglang_cpu.sh)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
from pytest_kvprofile.contract.backends import BackendError, check_requirements
from pytest_kvprofile.engines.sglang import standins as ss
from pytest_kvprofile.engines.sglang.flashinfer import (
    DRAFT,
    SGLANG_BACKENDS,
    TARGET,
    HostKvIndices,
    SglangFlashInferAdapter,
    UnexpressibleSglangCase,
    check_expressible,
    engine_refusal,
    hf_config,
)
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.phases import POST_KV_PHASES
from pytest_kvprofile.lifecycle.record import LEGACY
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.units import MiB

CASES = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
QWEN_L40S = CASES["qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"]
LLAMA_FP8 = CASES["llama-3.1-8b-tp1-dcp1-mtp0-l40s-gmu0.90-kvfp8_e4m3"]
QWEN_MTP = CASES["qwen3-8b-tp1-dcp1-mtp1-l40s-gmu0.90"]
MLA_L40S = CASES["deepseek-v2-lite-mla-tp1-dcp1-mtp0-l40s-gmu0.90-kvbf16"]



# -- without SGLang --------------------------------------------------------------------------------------------------

def test_naming_the_backend_without_sglang_is_one_usage_error_naming_the_script(monkeypatch):
    backend = SGLANG_BACKENDS[0]
    assert backend.name == "sglang-flashinfer" and backend.requires == ("sglang",) and backend.torch_mode
    monkeypatch.setitem(sys.modules, "sglang", None)  # not importable, whether installed here or not
    with pytest.raises(BackendError, match=r"needs sglang, which is not installed; install it with "
                                           r"scripts/install_sglang_cpu\.sh"):
        check_requirements(backend)


def test_the_modules_import_neither_sglang_nor_a_standin():
    program = ("import sys, importlib\n"
               "for name in ('flashinfer', 'post_capture', 'trtllm_mha', 'trtllm_mla'):\n"
               "    importlib.import_module('pytest_kvprofile.engines.sglang.' + name).backends()\n"
               "print(sorted(n for n in sys.modules if n.split('.')[0] in ('sglang', 'triton', 'torchvision')))")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_host_index_kernel_packs_each_requests_row_as_the_triton_kernel():
    table = torch.arange(4 * 10, dtype=torch.int32).view(4, 10)
    rows = torch.tensor([2, 0, 3], dtype=torch.int64)
    lens = torch.tensor([3, 0, 5], dtype=torch.int64)
    starts = torch.tensor([1, 0, 4], dtype=torch.int32)
    indptr = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    out = torch.full((8,), -1, dtype=torch.int32)
    HostKvIndices()[(3, 1)](table, rows, lens, indptr, starts, out, table.stride(0))
    assert out.tolist() == [21, 22, 23, 34, 35, 36, 37, 38]
    pages = torch.tensor([[5, 7], [1, 2]], dtype=torch.int32)  # page-granular rows of 4-token pages
    out = torch.zeros(6, dtype=torch.int32)
    HostKvIndices()[(1,)](pages, torch.tensor([0]), torch.tensor([6]), torch.tensor([0, 6], dtype=torch.int32), None,
                          out, pages.stride(0), ENTRY_PAGE_SIZE=4)
    assert out.tolist() == [20, 21, 22, 23, 28, 29]


def test_the_config_names_the_architecture_sglang_branches_on():
    assert hf_config(QWEN_L40S)["architectures"] == ["Qwen3ForCausalLM"]  # SGLang's 512 MiB workspace
    assert hf_config(LLAMA_FP8)["architectures"] == ["LlamaForCausalLM"]
    assert hf_config(QWEN_L40S)["num_key_value_heads"] == QWEN_L40S.model.heads_kv


# -- with SGLang -----------------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("sglang_flashinfer")
def test_the_standins_are_undone_after_the_block():
    import sglang.srt.utils.common as common
    from sglang.srt.runtime_context import get_platform

    original = common.is_flashinfer_available
    environ = dict(os.environ)
    with ss.sglang_standins(QWEN_L40S.gpu) as module:
        assert module.BatchDecodeWithPagedKVCacheWrapper.__module__.startswith("flashinfer")
        assert common.is_flashinfer_available() is True
        assert get_platform().device_capability == QWEN_L40S.gpu.compute_capability
        assert isinstance(sys.modules.get("triton"), ss.StandinModule) or ss._real("triton")
    assert common.is_flashinfer_available is original
    assert not any(isinstance(m, ss.StandinModule) for m in list(sys.modules.values()))
    assert dict(os.environ) == environ


@pytest.mark.usefixtures("sglang_flashinfer")
@pytest.mark.parametrize(("case", "workspace_mib"), [(QWEN_L40S, 512), (LLAMA_FP8, 384)],
                         ids=["qwen3-bf16", "llama-fp8"])
def test_sglangs_backend_runs_a_ci_case_and_everything_it_makes_is_after_kv_sizing(case, workspace_mib):
    env_before = os.environ.get("SGLANG_FLASHINFER_WORKSPACE_SIZE")
    result = run_lifecycle(SGLANG_BACKENDS[0], case)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert result.path == LEGACY  # SGLang's backend declares nothing
        assert failing_checks(result) == {}
        assert isinstance(adapter, SglangFlashInferAdapter)
        assert set(adapter.built) == {"prefill", "mixed", "decode"}
        assert adapter.captured == [("DECODE", bs) for bs in sorted(adapter.config().capture_bs, reverse=True)]
        owned = [a for a in result.allocations if a.owner == adapter.name and a.kind == "device"]
        # the runner's pools before KV sizing (SGLang makes them with the KV cache); the backend's after
        assert {a.phase for a in owned if "flashinfer" in (a.stack or "")} <= set(POST_KV_PHASES)
        cost = post_kv_cost(result)
        assert cost is not None and cost.sources
        assert all(s.source.startswith(("sglang/", "flashinfer/")) for s in cost.sources), cost.sources
        top = cost.sources[0]
        assert top.source.startswith("sglang/srt/layers/attention/flashinfer_backend.py:") and "<lambda>" in top.source
        assert top.nbytes == workspace_mib * MiB  # get_buffer("flashinfer_workspace"), sized by the architecture
        graph_wrappers = [s for s in cost.sources if "build_for_capture" in s.source and s.nbytes >= MiB]
        assert sum(s.count for s in graph_wrappers) == len(adapter.captured)  # an int workspace per captured size
    finally:
        close_parts(result)
    assert os.environ.get("SGLANG_FLASHINFER_WORKSPACE_SIZE") == env_before  # SGLang's .set() did not leak
    assert adapter.builders == {} and adapter.runner is None


@pytest.mark.usefixtures("sglang_flashinfer")
@pytest.mark.parametrize(("case_id", "attention", "why"), [
    ("deepseek-v2-lite-mla-tp1-dcp1-mtp0-b200-gmu0.90-kvbf16", "flashinfer", "CuTe-DSL or trtllm-gen"),
    ("deepseek-v2-lite-mla-tp1-dcp1-mtp0-l40s-gmu0.90-kvbf16", "trtllm_mha", "can only be used with non-MLA models"),
    ("llama-3.1-8b-tp1-dcp1-mtp0-l40s-gmu0.90-kvnvfp4", "flashinfer",
     "SGLang rejects this layout: ValueError: TRTLLM MHA backend for decode is only supported on Hopper"),
], ids=["mla-sm100", "mla-trtllm-mha", "nvfp4-sm89"])
def test_a_refused_layout_names_why(case_id, attention, why):
    reason = engine_refusal(CASES[case_id], attention)
    assert reason is not None and case_id in reason and why in reason
    assert engine_refusal(QWEN_L40S) is None and engine_refusal(QWEN_MTP) is None and engine_refusal(MLA_L40S) is None


@pytest.mark.usefixtures("sglang_flashinfer")
def test_on_b200_the_ragged_prefill_plans_on_flashinfers_cutlass_fmha():
    """On SM100 SGLang makes its ragged prefill wrapper with FlashInfer's CUTLASS FMHA: its plan (the simulated
    GPU's host version of the plan kernel) carves no float workspace and allocates its own work lists."""
    result = run_lifecycle(SGLANG_BACKENDS[0], CASES["qwen3-8b-tp1-dcp1-mtp0-b200-gmu0.90"])
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert failing_checks(result) == {}
        assert adapter.builders[0].prefill_wrapper_ragged._backend == "cutlass"
        cost = post_kv_cost(result)
        assert cost is not None and any("fmha_varlen_plan" in s.source for s in cost.sources)
        assert {p.route for p in result.plans} == {"prefill", "decode"}  # FA2 paged prefill and decode
    finally:
        close_parts(result)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_an_mla_layout_runs_sglangs_mla_backend_as_its_registry_picks_it():
    """SGLang's attention registry makes ``FlashInferMLAAttnBackend`` for an MLA model (``use_mla_backend``): its own
    384 MiB workspace, FlashInfer's MLA wrapper per captured decode size, planned by FlashInfer's MLA planner."""
    result = run_lifecycle(SGLANG_BACKENDS[0], MLA_L40S)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert failing_checks(result) == {}
        model = adapter.config().model_config
        assert (model.kv_lora_rank, model.qk_rope_head_dim, model.v_head_dim) == (512, 64, 128)
        backend = adapter.builders[0]
        assert type(backend).__name__ == "FlashInferMLAAttnBackend"
        assert {p.route for p in result.plans} == {"mla"}
        roles = [role for role, _ in adapter.wrappers()]
        assert sum(r.startswith("cuda-graph decode") for r in roles) == len(adapter.config().capture_bs)
        cost = post_kv_cost(result)
        assert cost is not None
        top = cost.sources[0]
        assert top.source.startswith("sglang/srt/layers/attention/flashinfer_mla_backend.py:")
        assert top.nbytes == 384 * MiB
    finally:
        close_parts(result)


def test_mtp_beyond_one_token_is_refused_naming_the_draft_decode_backend():
    case = dataclasses.replace(QWEN_MTP, mtp=2)
    with pytest.raises(UnexpressibleSglangCase, match="FlashInferMultiStepDraftBackend.*generate_draft_decode_kv"):
        check_expressible(case)
    check_expressible(QWEN_MTP)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_mtp_runs_sglangs_verify_graphs_and_a_draft_workers_backend():
    """MTP 1 as SGLang's EAGLE chain: the model runner's backend captures TARGET_VERIFY graphs (prefill wrappers with
    the verify mask, no decode graphs), the draft worker's own backend captures DRAFT_EXTEND_V2 graphs; both share
    SGLang's one float workspace, each has its own graph state."""
    result = run_lifecycle(SGLANG_BACKENDS[0], QWEN_MTP)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert failing_checks(result) == {}
        assert isinstance(adapter, SglangFlashInferAdapter)
        sizes = sorted(adapter.config().capture_bs, reverse=True)
        assert sizes == [c.num_reqs for c in QWEN_MTP.envelope.decode_captures(1)]  # requests of 2 tokens each
        assert [c for c in adapter.captured if c[0] == "TARGET_VERIFY"] == [("TARGET_VERIFY", bs) for bs in sizes]
        assert [c for c in adapter.captured if c[0] == "DRAFT_EXTEND_V2"] == [("DRAFT_EXTEND_V2", bs) for bs in sizes]
        assert len(adapter.captured) == 2 * len(sizes)
        roles = [role for role, _ in adapter.wrappers()]
        assert not any(r.startswith("cuda-graph decode") for r in roles)
        assert sum(r.startswith("cuda-graph verify") for r in roles) == len(sizes)
        assert sum(r.startswith("cuda-graph draft extend") for r in roles) == len(sizes)
        plans = [p for p in result.plans if p.cuda_graph]
        assert plans and all(p.route.startswith("prefill") for p in plans)  # verify and draft extend plan prefill
        cost = post_kv_cost(result)
        assert cost is not None
        workspace = [s for s in cost.sources if s.nbytes == 512 * MiB]
        assert len(workspace) == 1 and workspace[0].count == 1  # the draft backend shares it
        graph_state = [s for s in cost.sources if "init_cuda_graph_state" in s.source and s.nbytes >= 64 * MiB]
        assert sum(s.count for s in graph_state) == 2  # the KV indices of each worker's graphs
    finally:
        close_parts(result)
    assert adapter.builders == {} and adapter.runner is None


def test_the_draft_worker_is_one_more_builder_of_micro_batch_zero():
    adapter = SglangFlashInferAdapter(QWEN_MTP)
    assert adapter.builder_keys(0) == [TARGET, DRAFT] and adapter.builder_keys(1) == []
    assert adapter.ubatch_of(DRAFT) == 0 and "draft" in adapter.describe_key(DRAFT)
    assert SglangFlashInferAdapter(QWEN_L40S).builder_keys(0) == [TARGET]
