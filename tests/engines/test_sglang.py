"""SGLang's own FlashInferAttnBackend (the installed wheel, unmodified) under the harness: the stand-ins, the host
version of its index kernel, the backend driven on ci cases on SGLang's static path (everything it makes is after
the KV pool, attributed to SGLang's and FlashInfer's source lines), and the layouts the adapter refuses by name.

Without SGLang the tests that need it skip with the install command (scripts/install_sglang_cpu.sh)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
from pytest_kvprofile.contract.backends import BackendError, check_requirements
from pytest_kvprofile.engines import sglang_standins as ss
from pytest_kvprofile.engines.sglang_flashinfer import (
    SGLANG_BACKENDS,
    HostKvIndices,
    SglangFlashInferAdapter,
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



# -- without SGLang --------------------------------------------------------------------------------------------------

def test_naming_the_backend_without_sglang_is_one_usage_error_naming_the_script(monkeypatch):
    backend = SGLANG_BACKENDS[0]
    assert backend.name == "sglang-flashinfer" and backend.requires == ("sglang",) and backend.torch_mode
    monkeypatch.setitem(sys.modules, "sglang", None)  # not importable, whether installed here or not
    with pytest.raises(BackendError, match=r"needs sglang, which is not installed; install it with "
                                           r"scripts/install_sglang_cpu\.sh"):
        check_requirements(backend)


def test_the_modules_import_neither_sglang_nor_a_standin():
    program = ("import sys, pytest_kvprofile.engines.sglang_flashinfer as m; m.backends(); "
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
        assert adapter.captured == sorted(adapter.config().capture_bs, reverse=True)
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
@pytest.mark.parametrize(("case_id", "why"), [
    ("deepseek-v2-lite-mla-tp1-dcp1-mtp0-l40s-gmu0.90-kvbf16", "FlashInferMLAAttnBackend"),
    ("qwen3-8b-tp1-dcp1-mtp1-l40s-gmu0.90", "speculative decoding"),
    ("llama-3.1-8b-tp1-dcp1-mtp0-l40s-gmu0.90-kvnvfp4", "FP4"),
], ids=["mla", "mtp", "nvfp4"])
def test_a_refused_layout_names_why(case_id, why):
    reason = engine_refusal(CASES[case_id])
    assert reason is not None and case_id in reason and why in reason
    assert engine_refusal(QWEN_L40S) is None
