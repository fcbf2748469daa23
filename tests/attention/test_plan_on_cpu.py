"""plan()/run() of FlashInfer's own wrappers on a simulated GPU (issue 13, items 3-4, acceptance).

The wrapper code below uses FlashInfer's public API only; the float workspace is exactly
``pytest_kvprofile.sizing`` bytes for the route's worst batch, then 16 bytes fewer.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import pytest_kvprofile
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # FlashInfer's cutlass-dsl imports
OVERFLOW = r"Buffer overflow when allocating memory for .* Increase the workspace buffer size\."


def _case(case_id: str, kv_dtype: str = "bf16"):
    """A packaged matrix's case, its KV cache in ``kv_dtype``; an MHA layout (``mha-...``) made here."""
    if case_id == "mha-32x128-h100":  # group 1: the CUDA-core decode occupancy, and so its split, follow the dtype
        from pytest_kvprofile.matrix.cases import Envelope, layout_case
        from pytest_kvprofile.matrix.gpus import lookup_gpu
        from pytest_kvprofile.matrix.models import ModelSpec

        model = ModelSpec("mha-32x128", heads_q=32, heads_kv=32, head_dim=128, num_layers=32, kv_dtype=kv_dtype)
        return layout_case(model, lookup_gpu("H100"), 1, 1, 0, Envelope())
    for name in ("default", "l40s"):
        for case in load_matrix(packaged_matrix(name)).cases:
            if case.id == case_id:
                return dataclasses.replace(case, model=dataclasses.replace(case.model, kv_dtype=kv_dtype))
    raise LookupError(case_id)


def _worst(case, route: str):
    res = pytest_kvprofile.sizing.for_case(case)
    rs = res.routes[route]
    qo, kv, graph = rs.worst_batch
    return rs, list(qo), list(kv), bool(graph)


def _paged(qo_lens, kv_lens, page_size):
    pages = [math.ceil(k / page_size) for k in kv_lens]
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([k - (p - 1) * page_size for k, p in zip(kv_lens, pages)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    indices = torch.randperm(int(kv_indptr[-1]), generator=gen).to(torch.int32)
    return qo_indptr, kv_indptr, indices, last


def _wrapper(kind: str, float_bytes: int, tensor_cores: bool, graph: bool, qo_indptr, kv_indptr, indices, last):
    import flashinfer

    buf = torch.empty(float_bytes, dtype=torch.uint8, device="cuda")
    kw = {}
    if kind == "prefill":
        if graph:
            kw = dict(qo_indptr_buf=qo_indptr.to("cuda"), paged_kv_indptr_buf=kv_indptr.to("cuda"),
                      paged_kv_indices_buf=indices.to("cuda"), paged_kv_last_page_len_buf=last.to("cuda"))
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(buf, "NHD", use_cuda_graph=graph, backend="fa2", **kw)
    if graph:
        kw = dict(paged_kv_indptr_buffer=kv_indptr.to("cuda"), paged_kv_indices_buffer=indices.to("cuda"),
                  paged_kv_last_page_len_buffer=last.to("cuda"))
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(buf, "NHD", use_cuda_graph=graph,
                                                         use_tensor_cores=tensor_cores, **kw)


def _plan(w, kind, rs, case, qo_lens, batch):
    qo_indptr, kv_indptr, indices, last = batch
    hd, page = case.model.head_dim, case.envelope.page_size
    dt = dict(q_data_type=torch.bfloat16, kv_data_type=getattr(torch, case.fa2_kv_torch_dtype("test")))
    if kind == "prefill":
        w.plan(qo_indptr, kv_indptr, indices, last, rs.heads_q, rs.heads_kv, hd, page, causal=True, **dt)
    else:
        extra = {"q_len_per_req": qo_lens[0]} if qo_lens[0] > 1 else {}
        w.plan(kv_indptr, indices, last, rs.heads_q, rs.heads_kv, hd, page, **dt, **extra)


def _reference(q, k, v, qo_lens, kv_lens, kv_indptr, indices, page, causal):
    outs, start = [], 0
    group = q.shape[1] // k.shape[2]
    for b, (n, kl) in enumerate(zip(qo_lens, kv_lens)):
        pages = indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        kb = k[pages].reshape(-1, k.shape[2], k.shape[3])[:kl].float().repeat_interleave(group, 1)
        vb = v[pages].reshape(-1, v.shape[2], v.shape[3])[:kl].float().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + n].float(), kb) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.arange(kl)[None] > torch.arange(n)[:, None] + kl - n, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vb))
        start += n
    return torch.cat(outs)


CASES = [
    ("qwen3-8b-tp1-dcp1-mtp0-h100-gmu0.90", "prefill", "prefill", False),
    ("qwen3-8b-tp1-dcp1-mtp0-h100-gmu0.90", "decode_tc", "decode", True),
    ("gemma-2-9b-hd256-tp1-dcp1-mtp0-h100-gmu0.90", "decode_cc", "decode", False),
    ("mha-32x128-h100", "decode_cc", "decode", False),
]
KV_DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4")  # NVFP4: FA2 on packed uint8 (H100)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("case_id,route,kind,tensor_cores", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_plan_at_sized_bytes_fits_and_16_fewer_overflows(case_id, route, kind, tensor_cores, kv_dtype):
    case = _case(case_id, kv_dtype)
    rs, qo_lens, kv_lens, graph = _worst(case, route)
    assert rs.float_bytes > 0
    page = case.envelope.page_size
    with pytest_kvprofile.simulated_gpu(case.gpu):
        batch = _paged(qo_lens, kv_lens, page)
        w = _wrapper(kind, rs.float_bytes, tensor_cores, graph, *batch)
        _plan(w, kind, rs, case, qo_lens, batch)
        short = _wrapper(kind, rs.float_bytes - 16, tensor_cores, graph, *batch)
        with pytest.raises(RuntimeError, match=OVERFLOW):
            _plan(short, kind, rs, case, qo_lens, batch)


@pytest.mark.parametrize("kind,tensor_cores,qo", [("prefill", False, [5, 1, 17]), ("decode", True, [1, 1, 1]),
                                                   ("decode", False, [1, 1, 1])])
def test_run_matches_a_float32_reference(kind, tensor_cores, qo):
    kv_lens, page, hq, hkv, hd = [40, 3, 33], 16, 8, 2, 128
    with pytest_kvprofile.simulated_gpu("L40S"):
        qo_indptr, kv_indptr, indices, last = batch = _paged(qo, kv_lens, page)
        w = _wrapper(kind, 64 << 20, tensor_cores, False, *batch)
        dt = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        if kind == "prefill":
            w.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, hd, page, causal=True, **dt)
        else:
            w.plan(kv_indptr, indices, last, hq, hkv, hd, page, **dt)
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(sum(qo), hq, hd, generator=gen, device="cuda").bfloat16()
        k = torch.randn(int(kv_indptr[-1]), page, hkv, hd, generator=gen, device="cuda").bfloat16()
        v = torch.randn(int(kv_indptr[-1]), page, hkv, hd, generator=gen, device="cuda").bfloat16()
        out = w.run(q, (k, v))
        ref = _reference(q, k, v, qo, kv_lens, kv_indptr, indices, page, causal=kind == "prefill")
        assert out.is_cuda and out.shape == ref.shape
        assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)
        wrong = _reference(q, k, v, qo, kv_lens, kv_indptr, indices.flip(0), page, causal=kind == "prefill")
        assert not torch.allclose(out.float(), wrong, atol=2e-2, rtol=2e-2)  # a wrong page table shows


def test_unsupported_backend_names_itself():
    import flashinfer

    from pytest_kvprofile.memory.simulated_gpu import SimulatedDeviceUnsupported

    with pytest_kvprofile.simulated_gpu("H100"):
        qo_indptr, kv_indptr, indices, last = _paged([4], [20], 16)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                           "NHD", backend="fa3")
        with pytest.raises(SimulatedDeviceUnsupported, match="'fa3'"):
            w.plan(qo_indptr, kv_indptr, indices, last, 8, 2, 128, 16, causal=True)


def test_plan_info_is_the_planners_for_the_simulated_sm_count():
    """The same batch plans differently on 142 and 132 SMs, and as the sizing oracle plans it for each."""
    import flashinfer

    from pytest_kvprofile.attention.oracle import get_oracle, indptrs

    qo_lens, kv_lens, page, hq, hkv, hd = [7], [60000], 16, 32, 1, 128
    infos = {}
    for gpu, sms in (("L40S", 142), ("H100", 132)):
        with pytest_kvprofile.simulated_gpu(gpu):
            qo_indptr, kv_indptr, indices, last = _paged(qo_lens, kv_lens, page)
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD", backend="fa2")
            w.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, hd, page, causal=True)
            infos[gpu] = list(w._plan_info)
        oracle = get_oracle()
        oracle.set_device(sms, 9 if gpu == "H100" else 8, 0 if gpu == "H100" else 9)
        qo, kv = indptrs(qo_lens, kv_lens, page)
        oracle.prefill_raw(qo, kv, hq, hkv, hd, hd, page, False, materialize=True, float_capacity=256 << 20)
        assert infos[gpu][:2] == list(oracle._info)[:2], gpu  # padded batch size and total rows
    assert infos["L40S"][0] != infos["H100"][0]


def test_a_layout_whose_fp8_need_differs_is_sized_for_its_dtype():
    """MHA decode on CUDA cores: one-byte KV doubles the kernel's occupancy bound, so the split batch, and the
    float workspace, grow; sizing it as bf16 would leave FlashInfer's plan() short."""
    bf16, fp8 = (pytest_kvprofile.sizing.for_case(_case("mha-32x128-h100", d)) for d in ("bf16", "fp8_e4m3"))
    assert fp8.kv_dtype_bytes == 1 and bf16.kv_dtype_bytes == 2
    assert fp8.routes["decode_cc"].float_bytes > bf16.routes["decode_cc"].float_bytes
    assert fp8.routes["decode_cc"].blocks_per_sm == 2 * bf16.routes["decode_cc"].blocks_per_sm
