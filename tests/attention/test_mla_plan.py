"""plan() of FlashInfer's MLA wrapper on a simulated GPU (issue 13, item 4: "MLA's planner too").

Inside ``simulated_gpu`` the batch MLA module loader is a host module whose ``plan`` is FlashInfer's own
``MLAPlan`` compiled for the host (``csrc/oracle.cu``). The code below uses FlashInfer's public API only
(``flashinfer.mla.BatchMLAPagedAttentionWrapper`` and the module loader ``flashinfer.mla.get_batch_mla_module``);
the float workspace a batch needs is found from the planner itself, by bisection over the host plan().
"""

from __future__ import annotations

import linecache
import math

import pytest
import torch

import pytest_kvprofile
from pytest_kvprofile import Role

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
OVERFLOW = r"Buffer overflow when allocating memory for .* Increase the workspace buffer size\."
CKV, KPE, PAGE = 512, 64, 64  # DeepSeek-style latent/rope widths
INT_WORKSPACE = 8 << 20  # FlashInfer's default int workspace, created by the FA backend in plan()

# (qo_lens, kv_lens, num_heads): a decode batch (one tile row per request, one-CTA clusters) and a
# mixed prefill batch (two-CTA clusters, long requests split across clusters).
BATCHES = {
    "decode": ([1, 1, 1, 1, 1, 1, 1, 1], [17, 900, 4096, 33, 128, 2000, 1, 64], 16),
    "prefill": ([1, 37, 5, 120], [100, 2000, 37, 4096], 128),
}


def _csr(qo_lens, kv_lens):
    pages = [math.ceil(k / PAGE) for k in kv_lens]
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    kv_indices = torch.randperm(int(kv_indptr[-1]), generator=torch.Generator().manual_seed(0)).to(torch.int32)
    return qo_indptr, kv_indptr, kv_indices, torch.tensor(kv_lens, dtype=torch.int32)


def _wrapper(float_bytes: int):
    import flashinfer

    ws = torch.empty(float_bytes, dtype=torch.uint8, device="cuda")
    return flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa2")


def _plan(w, batch, num_heads):
    qo_indptr, kv_indptr, kv_indices, kv_lens = batch
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, num_heads, CKV, KPE, PAGE, True, 1.0 / math.sqrt(CKV + KPE),
           torch.bfloat16, torch.bfloat16)


def _host_module():
    """The module FlashInfer's FA2 MLA backend loads (``flashinfer.mla.get_batch_mla_module``): here the host one."""
    import flashinfer.mla

    return flashinfer.mla.get_batch_mla_module("fa2", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32,
                                               CKV, KPE, False)


def _host_plan(float_bytes: int, batch, num_heads):
    qo_indptr, kv_indptr, _, kv_lens = batch
    float_ws = torch.empty(float_bytes, dtype=torch.uint8, device="cuda")
    int_ws = torch.empty(INT_WORKSPACE, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(INT_WORKSPACE, dtype=torch.uint8, pin_memory=True)
    return _host_module().plan(float_ws, int_ws, pinned, qo_indptr, kv_indptr, kv_lens, num_heads, CKV, True)


def _fits(float_bytes: int, batch, num_heads) -> bool:
    try:
        _host_plan(float_bytes, batch, num_heads)
    except RuntimeError as exc:
        assert "Buffer overflow" in str(exc), exc
        return False
    return True


def _minimal_float_bytes(batch, num_heads) -> int:
    """Bisection over the host MLAPlan: the fewest float workspace bytes it plans the batch in."""
    lo, hi = 0, 256 << 20  # lo never fits (the planner carves partial_o), hi always does
    assert _fits(hi, batch, num_heads)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fits(mid, batch, num_heads) else (mid, hi)
    return hi


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_plan_at_the_planners_bytes_fits_and_16_fewer_overflows(name):
    qo_lens, kv_lens, num_heads = BATCHES[name]
    with pytest_kvprofile.simulated_gpu("H100"):
        batch = _csr(qo_lens, kv_lens)
        need = _minimal_float_bytes(batch, num_heads)
        assert need == _minimal_float_bytes(batch, num_heads)  # stable from one bisection to the next
        w = _wrapper(need)
        _plan(w, batch, num_heads)  # the wrapper plans at exactly the planner's bytes
        info = list(w._plan_info)
        with pytest.raises(RuntimeError, match=OVERFLOW):  # MLAPlan's own message, from the host module
            _host_plan(need - 16, batch, num_heads)
        # The wrapper's Python preflight mirrors MLAPlan's float carve and refuses first, naming the same bytes.
        with pytest.raises(ValueError, match=f"fa2 MLA needs {need} float workspace bytes"):
            _plan(_wrapper(need - 16), batch, num_heads)
    assert len(info) == 18
    num_blks_x, num_blks_y = info[0], info[1]
    assert num_blks_x * num_blks_y == 132  # the simulated H100's SMs, in clusters of num_blks_x
    assert need == info[17] + 2 * num_blks_y * num_blks_x * 64 * 4  # partial_lse ends the float carve
    assert need == 17_369_088  # 2 x 132 SMs x 64 rows x (512 bf16 + 1 fp32): the same for both batches
    with pytest_kvprofile.simulated_gpu("H100"):  # and again on a fresh simulated device
        assert _minimal_float_bytes(_csr(qo_lens, kv_lens), num_heads) == need


def test_int_workspace_created_in_plan_is_in_the_ledger_with_flashinfers_line():
    qo_lens, kv_lens, num_heads = BATCHES["prefill"]
    with pytest_kvprofile.simulated_gpu("H100") as dev:
        batch = _csr(qo_lens, kv_lens)
        w = _wrapper(64 << 20)
        before = {a.id for a in dev.live_allocations()}
        _plan(w, batch, num_heads)
        new = [a for a in dev.live_allocations() if a.id not in before]
    int_ws = [a for a in new if a.kind == "device" and a.nbytes == INT_WORKSPACE]
    mirror = [a for a in new if a.kind == "pinned_host" and a.nbytes == INT_WORKSPACE]
    assert len(int_ws) == 1 and len(mirror) == 1, [(a.nbytes, a.kind, a.stack) for a in new]
    for alloc in (int_ws[0], mirror[0]):
        filename, lineno = alloc.stack.split(" in ")[0].rsplit(":", 1)
        assert "flashinfer/mla/" in filename, alloc.stack
        assert "torch.empty(" in linecache.getline(filename, int(lineno)), alloc.stack  # FlashInfer's own line
        assert alloc.owner.startswith("flashinfer.mla."), alloc.owner
    assert (int_ws[0].role, mirror[0].role) == (Role.INT_WORKSPACE, Role.PINNED_MIRROR)  # given when plan() makes them


def test_plan_info_is_mlaplans_for_the_simulated_sm_count():
    qo_lens, kv_lens, num_heads = BATCHES["decode"]
    seen = {}
    for gpu in ("H100", "L40S"):
        with pytest_kvprofile.simulated_gpu(gpu) as dev:
            w = _wrapper(64 << 20)
            _plan(w, _csr(qo_lens, kv_lens), num_heads)
            seen[gpu] = (dev.num_sm, list(w._plan_info))
    for gpu, (sms, info) in seen.items():
        assert info[0] == 1 and info[1] == sms, gpu  # one-CTA clusters, one per SM


def test_run_is_refused_by_name():
    from pytest_kvprofile.memory.simulated_gpu import SimulatedDeviceUnsupported

    qo_lens, kv_lens, num_heads = BATCHES["prefill"]
    with pytest_kvprofile.simulated_gpu("H100"):
        batch = _csr(qo_lens, kv_lens)
        w = _wrapper(64 << 20)
        _plan(w, batch, num_heads)
        pages, rows = int(batch[1][-1]), sum(qo_lens)
        q_nope = torch.zeros(rows, num_heads, CKV, dtype=torch.bfloat16, device="cuda")
        q_pe = torch.zeros(rows, num_heads, KPE, dtype=torch.bfloat16, device="cuda")
        ckv = torch.zeros(pages, PAGE, CKV, dtype=torch.bfloat16, device="cuda")
        kpe = torch.zeros(pages, PAGE, KPE, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(SimulatedDeviceUnsupported, match="MLA run"):
            w.run(q_nope, q_pe, ckv, kpe)
