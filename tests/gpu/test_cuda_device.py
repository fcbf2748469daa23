"""CudaDevice's logic on a fake torch.cuda backed by the caching-allocator model."""

from __future__ import annotations

import gc

import pytest
from gpu_fakes import FakeCuda, FakeTorch, HybridCuda, HybridTorch

from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.gpu.cuda_device import CudaDevice, CudaDeviceFactory
from pytest_kvprofile.lifecycle.driver import run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix_text
from pytest_kvprofile.memory.allocator import round_size, segment_size
from pytest_kvprofile.memory.device import DeviceOutOfMemory
from pytest_kvprofile.units import GiB, MiB


def make(**kw):
    torch = FakeTorch(FakeCuda(**kw))
    return CudaDevice(0, torch_mod=torch), torch


def test_is_a_device_and_measures_nontorch_at_start():
    torch = FakeTorch(FakeCuda(total=80 * GiB, nontorch=700 * MiB))
    keep = torch.cuda.alloc(3 * MiB)  # torch memory from before: reserved, not non-torch
    dev = CudaDevice(0, torch_mod=torch)
    assert isinstance(dev, Device)
    assert dev.nontorch_bytes == 700 * MiB and dev.name == "NVIDIA H200" and dev.num_sm == 132
    assert dev.start_reserved == segment_size(round_size(3 * MiB)) > 0
    del keep


def test_allocation_sizes_and_free_keeps_reserved():
    dev, _ = make()
    a = dev.allocate(MiB + 1, owner="b", tag="x")
    seg = segment_size(round_size(MiB + 1))
    assert a.size == round_size(MiB + 1) > MiB + 1 and dev.memory_reserved() == seg
    assert dev.view(a.ptr + 16, 100).data_ptr() == a.ptr + 16
    dev.free(a)
    assert not a.alive and a.freed_phase == "init" and dev.memory_allocated() == 0
    assert dev.memory_reserved() == seg
    dev.empty_cache()
    assert dev.memory_reserved() == 0
    with pytest.raises(ValueError, match="double free"):
        dev.free(a)
    with pytest.raises(ValueError, match="no live device allocation"):
        dev.view(a.ptr, 1)


def test_events_phases_pinned_host_and_fault_injection():
    dev, torch = make()
    seen = []
    unsub = dev.subscribe(seen.append)
    dev.phase = "warmup"
    h = dev.allocate(5000, owner="b", tag="mirror", pinned_host=True)
    assert h.kind == "pinned_host" and h.size == 8192 and dev.host_allocated == 8192 and torch.pinned == 1
    dev.fail_after(1)
    dev.allocate(10, owner="b")
    with pytest.raises(DeviceOutOfMemory, match="injected by fail_after") as exc:
        dev.allocate(10, owner="b", tag="t")
    assert exc.value.phase == "warmup"
    unsub()
    assert [e.kind for e in seen] == ["phase", "alloc", "alloc", "oom"]
    assert seen[2].allocated == dev.memory_allocated()


def test_real_oom_becomes_device_oom():
    dev, _ = make(total=GiB, nontorch=0)
    with pytest.raises(DeviceOutOfMemory, match="owner 'kv-cache', tag 'kv cache'"):
        dev.allocate(2 * GiB, owner="kv-cache", tag="kv cache")


def test_graph_capture_measures_pool_from_inside_the_capture():
    dev, torch = make()
    cached = dev.allocate(30 * MiB, owner="m")
    dev.free(cached)  # cached: torch.cuda.graph empties it on entry
    with dev.graph_capture() as pool:
        assert dev.capturing
        x = dev.allocate(30 * MiB, owner="m", tag="tmp")
        assert x.pool == pool.id
        dev.free(x)
        y = dev.allocate(MiB, owner="m", tag="out")
        dev.empty_cache()  # ignored while capturing
    assert not dev.capturing and torch.cuda.captures == 1
    assert pool.reserved == pool.high_water_reserved == pool.measured_reserved == dev.memory_reserved()
    with dev.graph_capture(pool):
        pass
    assert pool.use_count == 2
    with pytest.raises(RuntimeError, match="do not nest"), dev.graph_capture(pool):
        with dev.graph_capture(pool):
            pass
    dev.free(y)
    dev.release_graph_pool(pool)
    assert pool.released and pool.reserved == 0 and dev.memory_reserved() == 0
    with pytest.raises(ValueError, match="released"), dev.graph_capture(pool):
        pass


def test_lazy_release_waits_for_empty_cache():
    dev, _ = make()
    with dev.graph_capture() as pool:
        dev.free(dev.allocate(4 * MiB, owner="m"))
    dev.release_graph_pool(pool, lazy=True)
    assert dev.memory_reserved() == pool.reserved > 0
    dev.empty_cache()
    assert dev.memory_reserved() == 0


def test_close_collects_garbage_only_when_a_cycle_still_holds_device_memory(monkeypatch):
    """A tensor only a reference cycle keeps is freed by close(); a clean close skips the 0.2 s collection."""
    collections = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or collect(*a))
    dev = CudaDevice(0, torch_mod=HybridTorch(HybridCuda()))
    dev.free(dev.allocate(MiB, owner="b", tag="freed"))
    dev.close()
    assert collections == [] and dev.memory_allocated() == 0
    cycle: list = [dev.tensor(dev.allocate(MiB, owner="b", tag="in a cycle"))]
    cycle.append(cycle)
    del cycle
    gc.disable()  # the cycle must outlive this test's own allocations until close()
    try:
        held = dev.memory_allocated()
        dev.close()
    finally:
        gc.enable()
    assert held > 0 and len(collections) == 1 and dev.memory_allocated() == 0


def test_run_lifecycle_runs_unchanged_on_the_adapter():
    """The whole lifecycle (stub builders) on CudaDevice over the fake torch: same checks as on SimDevice."""
    from pytest_kvprofile.checks.catalog import failing_checks

    matrix = load_matrix_text(
        "name: t\nenvelope: {max_num_seqs: 8, max_num_batched_tokens: 512, max_model_len: 4096, "
        "cuda_graph_sizes: [1, 2, 4, 8]}\nmodels:\n  m: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 4, "
        "weights_gib: 2, hidden_size: 4096}\ngpus: [H200]\ntp: [1]\ngmu: [0.9]\n", "inline.yaml")
    case = matrix.cases[0]
    torch = FakeTorch(FakeCuda(total=case.gpu.memory_bytes, nontorch=case.nontorch_bytes))
    factory = CudaDeviceFactory(torch_mod=torch)
    backend = next(b for b in STUB_BACKENDS if b.name == "stub-flashinfer")
    result = run_lifecycle(backend, case, device_factory=factory)
    sim = run_lifecycle(backend, case)
    assert not result.errors
    assert result.budget.kv_tokens == sim.budget.kv_tokens
    assert result.graph_pool_high_water == sim.graph_pool_high_water > 0
    failures = failing_checks(result)
    failures.pop("warmup_retryable", None)  # its probe builds fresh simulated devices, not this factory's
    assert failures == {}
    factory.release(result)
    assert torch.cuda.memory_reserved() == 0 and factory.last is None
