"""FlashInfer's float32 reference and its test data, on CPU: one reference for both tiers (the simulated device's
``run()`` and the GPU tier's checked kernels), checked against a naive attention written apart from it."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_kvprofile.attention.host_plan import paged_reference
from pytest_kvprofile.attention.reference import (
    attend,
    attention_error,
    paged_layout,
    random_inputs,
    reference_attention,
    scratch_bytes,
)
from pytest_kvprofile.attention.wrappers import plan_args


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


def test_the_simulated_run_and_the_gpu_reference_are_one_computation():
    """``host_plan.paged_reference`` (the simulated device's ``run()``) and ``reference_attention`` (the GPU tier's
    check) give the same rows for the same paged batch: both go through ``attend``."""
    lay = paged_layout([3, 2], [35, 7], 16, seed=3)
    data = random_inputs(lay, 4, 2, 8, 8, "cpu", seed=2)
    o = torch.zeros_like(data["out"], dtype=torch.float32)
    ints = {name: torch.tensor(getattr(lay, name), dtype=torch.int32)
            for name in ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len")}
    paged_reference(data["q"], data["k"], data["v"], ints["qo_indptr"], ints["kv_indptr"], ints["kv_indices"],
                    ints["last_page_len"], o, None, causal=True, layout=0, window_left=-1, logits_soft_cap=0.0,
                    sm_scale=None)
    ref = reference_attention(data["q"], data["k"], data["v"], lay, rows=16)
    assert torch.allclose(torch.cat([ref[0], ref[1]]), o, atol=1e-6)


def test_attend_masks_the_window_and_caps_the_logits():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((2, 2, 4), (6, 1, 4), (6, 1, 4)))
    full = attend(q, k, v, 6, scale=0.5)
    windowed = attend(q, k, v, 6, scale=0.5, window_left=0)  # each row sees only its own position
    assert torch.allclose(windowed[:, 0], v[4:6, 0], atol=1e-6) and not torch.allclose(full, windowed)
    capped = attend(q * 100, k, v, 6, scale=0.5, logits_soft_cap=1.0)
    assert not torch.allclose(capped, attend(q * 100, k, v, 6, scale=0.5))
