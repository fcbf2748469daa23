"""``engines/sglang/trtllm_mha.py``: SGLang's ``TRTLLMHAAttnBackend`` (its MHA default on Blackwell) on the simulated
GPU: the host versions of its two Triton kernels, a B200 case run to the end with its cost by source line (the
unused FlashInfer workspace beside its own), and SGLang's own refusal where trtllm_mha does not run.

Without SGLang the tests that need it skip with the install command (scripts/install_sglang_cpu.sh)."""

from __future__ import annotations

import pytest
import torch

from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
from pytest_kvprofile.contract.backends import layout_refusal
from pytest_kvprofile.engines.sglang.trtllm_mha import (
    SGLANG_TRTLLM_MHA_BACKENDS,
    SglangTrtllmMhaAdapter,
    host_graph_metadata,
    host_page_table,
    trtllm_refusal,
)
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.record import LEGACY
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.units import MiB

CASES = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
QWEN_B200 = CASES["qwen3-8b-tp1-dcp1-mtp0-b200-gmu0.90"]
QWEN_L40S = CASES["qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"]
QWEN_B200_MTP = CASES["qwen3-8b-tp1-dcp1-mtp1-b200-gmu0.90"]
PAGE = 4



def _pool() -> tuple[torch.Tensor, torch.Tensor]:
    """A request pool whose row r holds slots 1000 r, 1000 r + 1, ...; requests on rows 2 and 1."""
    req_to_token = (torch.arange(3).unsqueeze(1) * 1000 + torch.arange(64)).to(torch.int32)
    return req_to_token, torch.tensor([2, 1])


def test_the_host_page_table_writes_each_live_page_as_the_kernel_and_leaves_the_rest():
    req_to_token, rows = _pool()
    table = torch.full((2, 8), -7, dtype=torch.int32)
    host_page_table(req_to_token, rows, torch.tensor([9, 4], dtype=torch.int32), table, PAGE)
    assert table[0].tolist() == [500, 501, 502, -7, -7, -7, -7, -7]  # cdiv(9, 4) = 3 pages of row 2: 2000 // 4, ...
    assert table[1].tolist() == [250, -7, -7, -7, -7, -7, -7, -7]
    with pytest.raises(NotImplementedError, match="sliding-window"):
        host_page_table(req_to_token, rows, torch.tensor([1, 1]), table, PAGE, full_to_swa=torch.zeros(1))


def test_the_host_graph_metadata_is_the_fused_kernels_update():
    req_to_token, rows = _pool()
    seqlens, cu_k = torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    cu_q, table = torch.zeros(3, dtype=torch.int32), torch.zeros((2, 8), dtype=torch.int32)
    host_graph_metadata(req_pool_indices=rows, seq_lens=torch.tensor([8, 3]), req_to_token=req_to_token,
                        cache_seqlens=seqlens, cu_seqlens_k=cu_k, page_table=table, bs=2, seqlen_offset=1,
                        max_seq_pages=2, page_size=PAGE, cu_seqlens_q=cu_q, q_stride=3, q_mode=2)
    assert seqlens.tolist() == [9, 4] and cu_k.tolist() == [0, 9, 13] and cu_q.tolist() == [0, 3, 6]
    assert table[0].tolist()[:3] == [500, 501, 0]  # max_seq_pages bounds the row
    host_graph_metadata(req_pool_indices=rows, seq_lens=torch.tensor([1, 1]), req_to_token=req_to_token,
                        cache_seqlens=seqlens, cu_seqlens_k=cu_k, page_table=None, bs=2, seqlen_offset=0,
                        max_seq_pages=2, page_size=PAGE, cu_seqlens_q=cu_q, qlens=torch.tensor([2, 5]), q_mode=1,
                        skip_page_table=True)
    assert cu_q.tolist() == [0, 2, 7] and cu_k.tolist() == [0, 1, 2]


@pytest.mark.usefixtures("sglang_flashinfer")
def test_sglangs_trtllm_backend_runs_a_b200_case_with_both_workspaces_after_kv_sizing():
    result = run_lifecycle(SGLANG_TRTLLM_MHA_BACKENDS[0], QWEN_B200)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert result.path == LEGACY and failing_checks(result) == {}
        assert isinstance(adapter, SglangTrtllmMhaAdapter)
        assert type(adapter.builders[0]).__name__ == "TRTLLMHAAttnBackend"
        assert set(adapter.built) == {"prefill", "mixed", "decode"}
        assert not [p for p in result.plans if p.builder == adapter.name]  # trtllm-gen plans no FlashInfer route
        cost = post_kv_cost(result)
        assert cost is not None
        by_line = {s.source.split(" (builder", 1)[0]: s.nbytes for s in cost.sources}
        attention = "sglang/srt/layers/attention/"
        flashinfer = [n for src, n in by_line.items() if src.startswith(attention + "flashinfer_backend")]
        own = [n for src, n in by_line.items() if src.startswith(attention + "trtllm_mha_backend")]
        assert 512 * MiB in flashinfer and 512 * MiB in own  # the unused FlashInfer arena, and trtllm-gen's own
    finally:
        close_parts(result)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_with_mtp_both_workers_run_trtllm_mha_through_the_host_graph_metadata():
    """MTP 1 on B200: the model runner's and the draft worker's ``TRTLLMHAAttnBackend``, their verify and
    draft-extend graphs through ``update_trtllm_mha_graph_metadata`` (host version: the verify window as
    ``seqlen_offset``, the draft-extend queries strided); SGLang's workspaces are each made once per process."""
    result = run_lifecycle(SGLANG_TRTLLM_MHA_BACKENDS[0], QWEN_B200_MTP)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert failing_checks(result) == {}
        assert [type(b).__name__ for b in adapter.builders.values()] == ["TRTLLMHAAttnBackend"] * 2
        modes = {mode for mode, _ in adapter.captured}
        assert modes == {"TARGET_VERIFY", "DRAFT_EXTEND_V2"}
        cost = post_kv_cost(result)
        assert cost is not None
        big = [s for s in cost.sources if s.nbytes == 512 * MiB]
        assert len(big) == 2 and all(s.count == 1 for s in big)  # FlashInfer's and trtllm-gen's, shared
    finally:
        close_parts(result)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_an_fp4_cache_reads_sglangs_own_kv_quantization_method():
    """An NVFP4 cache: the KV pool answers SGLang's ``NVFP4KVCacheMethod``, made as its KV-cache configurator makes
    it. The plugin refuses the B200 case as unsized (every backend: trtllm-gen only), so it is driven here directly."""
    case = CASES["llama-3.1-8b-tp1-dcp1-mtp0-b200-gmu0.90-kvnvfp4"]
    reason = layout_refusal(SGLANG_TRTLLM_MHA_BACKENDS[0], case)
    assert reason is not None and "unsized by the suite" in reason and trtllm_refusal(case) is None
    result = run_lifecycle(SGLANG_TRTLLM_MHA_BACKENDS[0], case)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert failing_checks(result) == {}
        method = adapter.builders[0].kv_cache_quant_method
        assert type(method).__name__ == "NVFP4KVCacheMethod" and method.k_scales_float == [1.0] * 32
        assert adapter.runner.token_to_kv_pool.get_kv_cache_quant_method() is method
    finally:
        close_parts(result)


@pytest.mark.usefixtures("sglang_flashinfer")
def test_sglang_refuses_trtllm_mha_where_it_does_not_run():
    reason = trtllm_refusal(QWEN_L40S)
    assert reason is not None and "requires Hopper (SM90), Blackwell (SM100), or SM120" in reason
    assert trtllm_refusal(QWEN_B200) is None
