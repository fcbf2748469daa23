"""FlashInfer's CUTLASS sm100 FMHA plan on the host (``attention/host_cutlass.py``): the plan kernel's greedy
schedule on hand-computed batches, and FlashInfer's own ``fmha_varlen_plan`` through it on a simulated B200."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pytest_kvprofile.attention.host_cutlass import blackwell_fmha_plan, fmha_cutlass_loader  # noqa: E402


def test_each_tile_goes_to_the_least_loaded_bucket_lowest_first():
    # one head; requests of 3 and 1 query tiles (tile 2), KV 10 and 4; not causal: every tile costs its KV length
    plan = blackwell_fmha_plan([0, 5, 7], [0, 10, 14], qo_tile_size=2, num_heads=1, num_buckets=2, causal=False)
    # tiles taken last first: r0 t2 -> b0 (10), r0 t1 -> b1 (10), r0 t0 -> b0 (20), r1 t0 -> b1 (14)
    assert plan.work_indptr == [0, 2, 4]
    assert plan.qo_tile_indices == [2, 0, 1, 0] and plan.batch_indices == [0, 0, 0, 1]
    assert plan.head_indices == [0, 0, 0, 0]


def test_causal_tiles_cost_the_keys_before_them():
    # causal: the last tile costs all 10 keys, the one before it 10 - 2, the first 10 - 4
    plan = blackwell_fmha_plan([0, 5], [0, 10], qo_tile_size=2, num_heads=2, num_buckets=2, causal=True)
    # head 0: t2 -> b0 (10), t1 -> b1 (8), t0 -> b1 (14); head 1: t2 -> b0 (20), t1 -> b1 (22), t0 -> b0 (26)
    assert plan.work_indptr == [0, 3, 6]
    assert list(zip(plan.qo_tile_indices, plan.head_indices)) == [(2, 0), (2, 1), (0, 1), (1, 0), (0, 0), (1, 1)]


def test_the_kernel_schedules_at_most_one_bucket_per_thread():
    with pytest.raises(ValueError, match="257 buckets; the plan kernel schedules 1 to 256"):
        blackwell_fmha_plan([0, 1], [0, 1], 256, 1, 257, True)


def test_the_loader_serves_sm100_and_refuses_elsewhere_as_flashinfer_does():
    class Device:
        num_sm = 148
        compute_capability = (10, 0)

    assert callable(fmha_cutlass_loader(Device())(torch.bfloat16).plan)
    Device.compute_capability = (12, 0)
    with pytest.raises(ValueError, match="CUTLASS FMHA requires SM100a"):
        fmha_cutlass_loader(Device())(torch.bfloat16)


def test_flashinfers_varlen_plan_runs_on_a_simulated_b200():
    pytest.importorskip("flashinfer")
    from flashinfer import prefill

    from pytest_kvprofile.memory.simulated_gpu import simulated_gpu

    with simulated_gpu("B200", flashinfer=True):
        qo = torch.tensor([0, 300, 301], dtype=torch.int32, device="cuda")
        kv = torch.tensor([0, 4096, 4097], dtype=torch.int32, device="cuda")
        bf16 = torch.bfloat16
        module = prefill.get_fmha_module(bf16, bf16, bf16, torch.int32, 128, 128, 0, False, False, qo.device)
        work_indptr, tiles, heads, batches = prefill.fmha_varlen_plan(module, qo, kv, 8, True)
        indptr = work_indptr.cpu().tolist()
        assert len(indptr) == 149 and indptr[-1] == 8 * (2 + 1)  # 2 tiles of 256 + 1 per head, 148 CTAs
        items = sorted(zip(heads.cpu()[:indptr[-1]].tolist(), batches.cpu()[:indptr[-1]].tolist(),
                           tiles.cpu()[:indptr[-1]].tolist()))
        assert items == sorted((h, b, t) for h in range(8) for b, n in ((0, 2), (1, 1)) for t in range(n))
        with pytest.raises(NotImplementedError, match="CUTLASS sm100 FMHA run"):
            module.run()
