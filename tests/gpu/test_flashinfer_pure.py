"""The GPU builders' pure parts on CPU: page tables, the float32 reference, probes, protocol shape."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_kvprofile.contract.protocol import Batch
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.gpu.flashinfer_builders import (
    FlashInferCudaBuilder,
    LazyFlashInferCudaBuilder,
    gpu_backends,
    gpu_mutant_backends,
)
from pytest_kvprofile.gpu.reference import (
    attention_error,
    paged_layout,
    random_inputs,
    reference_attention,
    scratch_bytes,
    synthetic_lens,
)
from pytest_kvprofile.gpu.wrappers import plan_args
from pytest_kvprofile.matrix.schema import load_matrix_text

CASE = load_matrix_text(
    "name: t\nenvelope: {max_num_seqs: 8, max_num_batched_tokens: 512, max_model_len: 4096}\nmodels:\n"
    "  m: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 4, weights_gib: 2}\ngpus: [H200]\ntp: [1]\n"
    "mtp: [0, 1]\ngmu: [0.9]\n", "inline.yaml").cases


def test_paged_layout_indptrs_and_shared_physical_pages():
    lay = paged_layout([3, 1], [33, 16], 16, max_physical_pages=2)
    assert lay.qo_indptr == (0, 3, 4) and lay.kv_indptr == (0, 3, 4) and lay.last_page_len == (1, 16)
    assert lay.num_physical_pages == 2 and set(lay.kv_indices) == {0, 1} and len(lay.kv_indices) == 4
    with pytest.raises(ValueError, match="qo_len <= kv_len"):
        paged_layout([5], [4], 16)


def _naive(q, k, v, qo, kv, ps, indices):
    """Attention on contiguous K/V, written independently of the paged reference."""
    hq, hkv = q.shape[1], k.shape[2]
    out, qs, ks = [], 0, 0
    for ql, kl in zip(qo, kv):
        pages = indices[ks:ks + math.ceil(kl / ps)]
        kk = torch.cat([k[p] for p in pages])[:kl].float()
        vv = torch.cat([v[p] for p in pages])[:kl].float()
        for i in range(ql):
            pos = kl - ql + i
            row = []
            for h in range(hq):
                s = (kk[:pos + 1, h // (hq // hkv)] @ q[qs + i, h].float()) / math.sqrt(q.shape[2])
                row.append(torch.softmax(s, 0) @ vv[:pos + 1, h // (hq // hkv)])
            out.append(torch.stack(row))
        qs += ql
        ks += math.ceil(kl / ps)
    return torch.stack(out)


def test_reference_matches_naive_causal_gqa_attention():
    lay = paged_layout([3, 2], [35, 7], 16, seed=3)
    data = random_inputs(lay, 4, 2, 8, 8, "cpu", seed=1)
    ref = reference_attention(data["q"], data["k"], data["v"], lay, rows=16)
    naive = _naive(data["q"], data["k"], data["v"], lay.qo_lens, lay.kv_lens, 16, lay.kv_indices)
    full = torch.cat([ref[0], ref[1]])
    assert torch.allclose(full, naive, atol=1e-5)
    assert attention_error(naive.to(torch.bfloat16), ref, lay) < 1e-2


def test_error_catches_a_corrupted_output():
    lay = paged_layout([4], [64], 16)
    data = random_inputs(lay, 4, 4, 16, 16, "cpu")
    ref = reference_attention(data["q"], data["k"], data["v"], lay)
    bad = torch.cat([ref[0][:2], torch.zeros_like(ref[0][2:])]).to(torch.bfloat16)  # half the rows lost
    assert attention_error(bad, ref, lay) > 0.5
    nan = ref[0].clone().to(torch.bfloat16)
    nan[0, 0, 0] = float("nan")
    assert attention_error(nan, ref, lay) == float("inf")


def test_inputs_are_carved_from_one_scratch_buffer():
    lay = paged_layout([2, 1], [40, 17], 16)
    nbytes = scratch_bytes(lay, 4, 2, 8, 8)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    data = random_inputs(lay, 4, 2, 8, 8, "cpu", buffer=buf)
    base = buf.data_ptr()
    for t in data.values():
        assert base <= t.data_ptr() and t.data_ptr() + 2 * t.numel() <= base + nbytes
    assert float(data["q"].float().std()) > 0.5 and float(data["out"].float().abs().sum()) == 0


def test_plan_args_shapes():
    lay = paged_layout([2, 2], [20, 40], 16)
    args, kw = plan_args("decode", lay, 8, 2, 128, 128)
    assert args[3:] == (8, 2, 128, 16) and kw["q_len_per_req"] == 2
    args, kw = plan_args("prefill", lay, 8, 2, 128, 128)
    assert args[0].tolist() == [0, 2, 4] and kw["causal"] is True
    with pytest.raises(ValueError, match="one query length"):
        plan_args("decode", paged_layout([1, 2], [5, 5], 16), 8, 2, 128, 128)


def test_synthetic_lens():
    assert synthetic_lens(Batch("prefill", 3, 10), 4096) == ([4, 3, 3], [4, 3, 3])
    assert synthetic_lens(Batch("decode", 2, 4), 4096, 2) == ([2, 2], [1024, 1024])


def test_builders_declare_like_the_stub_without_touching_cuda():
    case = CASE[0]
    b = FlashInferCudaBuilder(case)
    assert b.get_persistent_workspace_memory_profiling_support() is ProfilingSupport.REQUIRED
    from pytest_kvprofile.sizing.case import for_case

    assert b.declared_workspace(case).float_bytes == for_case(case).float_bytes
    assert gpu_backends()[0].make_builders(case)[0].name == "flashinfer-cuda"
    lazy = gpu_mutant_backends()[0].make_builders(case)[0]
    assert isinstance(lazy, LazyFlashInferCudaBuilder) and lazy.warmup_materializes_persistent is False


def test_builder_on_the_simulated_device_says_it_needs_cuda():
    from pytest_kvprofile.lifecycle.driver import run_lifecycle

    result = run_lifecycle(gpu_backends()[0], CASE[0])
    assert result.aborted_in == "reservation"
    assert "needs a CUDA device (the GPU tier), not SimDevice" in result.errors[0].message


def test_route_probes_cover_prefill_and_decode():
    from pytest_kvprofile.gpu.sizing_probe import route_probes

    probes = route_probes(CASE[1])  # mtp=1: tensor-core decode with 2 query tokens per request
    routes = {p.route for p in probes}
    assert any(r.startswith("prefill") for r in routes) and any(r.startswith("decode_tc") for r in routes)
    assert sum(p.binding for p in probes) == 1
    for p in probes:
        assert p.float_bytes > 0 and len(p.qo_lens) == len(p.kv_lens)
        assert p.layout().num_physical_pages <= 4096
