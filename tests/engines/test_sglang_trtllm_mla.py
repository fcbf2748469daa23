"""SGLang's ``TRTLLMMLABackend`` (``--attention-backend trtllm_mla``, its MLA default on Blackwell) under the harness:
the host version of its block-table kernel, a B200 MLA case on SGLang's static path, and what SGLang refuses.

Without SGLang the tests that need it skip with the install command (scripts/install_sglang_cpu.sh)."""

from __future__ import annotations

import pytest
import torch

from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
from pytest_kvprofile.engines.sglang.post_capture import post_capture_gate
from pytest_kvprofile.engines.sglang.trtllm_mla import (
    SGLANG_TRTLLM_MLA_BACKENDS,
    HostFlashMlaKvIndices,
    SglangTrtllmMlaAdapter,
    trtllm_mla_refusal,
)
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.record import LEGACY
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.units import MiB

CASES = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
MLA_B200 = CASES["deepseek-v2-lite-mla-tp1-dcp1-mtp0-b200-gmu0.90-kvbf16"]
MLA_L40S = CASES["deepseek-v2-lite-mla-tp1-dcp1-mtp0-l40s-gmu0.90-kvbf16"]
QWEN_B200 = CASES["qwen3-8b-tp1-dcp1-mtp0-b200-gmu0.90"]
PAGE = 4


def test_the_host_block_table_writes_each_live_page_from_the_start_and_leaves_the_rest():
    req_to_token = (torch.arange(3).unsqueeze(1) * 1000 + torch.arange(64)).to(torch.int32)
    table = torch.full((2, 6), -1, dtype=torch.int32)
    launch = HostFlashMlaKvIndices()[(2, 1)]
    launch(req_to_token, torch.tensor([2, 1]), torch.tensor([9, 4]), None, table, 64, 6, PAGED_SIZE=PAGE)
    assert table[0].tolist() == [500, 501, 502, -1, -1, -1]  # cdiv(9, 4) = 3 pages of row 2: 2000 // 4, ...
    assert table[1].tolist() == [250, -1, -1, -1, -1, -1]
    launch(req_to_token, torch.tensor([1]), torch.tensor([4]), torch.tensor([8]), table, 64, 6, PAGED_SIZE=PAGE)
    assert table[0].tolist()[:2] == [252, 501]  # from kv_start_idx: slot 1008 // 4


@pytest.mark.usefixtures("sglang_flashinfer")
def test_sglangs_trtllm_mla_backend_runs_a_b200_mla_case_on_the_static_path():
    result = run_lifecycle(SGLANG_TRTLLM_MLA_BACKENDS[0], MLA_B200)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert result.path == LEGACY and failing_checks(result) == {}
        assert isinstance(adapter, SglangTrtllmMlaAdapter)
        assert type(adapter.builders[0]).__name__ == "TRTLLMMLABackend"
        assert adapter.runner is not None and adapter.runner.page_size == 64  # SGLang's resolved page size
        assert set(adapter.built) == {"prefill", "mixed", "decode"}
        assert not [p for p in result.plans if p.builder == adapter.name]  # trtllm-gen plans no FlashInfer route
        cost = post_kv_cost(result)
        assert cost is not None
        by_line = {s.source.split(" (builder", 1)[0]: s.nbytes for s in cost.sources}
        attention = "sglang/srt/layers/attention/"
        assert 384 * MiB in [n for src, n in by_line.items() if src.startswith(attention + "flashinfer_mla_backend")]
        assert 150 * MiB in [n for src, n in by_line.items() if src.startswith(attention + "trtllm_mla_backend")]
    finally:
        close_parts(result)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_sglang_refuses_trtllm_mla_off_blackwell_and_for_a_non_mla_model():
    off = trtllm_mla_refusal(MLA_L40S)
    assert off is not None and "only supported on Blackwell GPUs" in off
    mha = trtllm_mla_refusal(QWEN_B200)
    assert mha is not None and "trtllm_mla backend can only be used with MLA models." in mha
    assert trtllm_mla_refusal(MLA_B200) is None
    gate = post_capture_gate(MLA_B200, attention_backend="trtllm_mla")
    assert gate is not None and "(MLA)" in gate and "sglang-trtllm-mla's" in gate
