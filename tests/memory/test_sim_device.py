"""SimDevice: the ledger, OOM, fault injection, events and CUDA-graph pools."""

import pickle

import pytest

from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.matrix.gpus import lookup_gpu
from pytest_kvprofile.memory.device import Allocation, DeviceEvent, DeviceOutOfMemory, SimDevice
from pytest_kvprofile.units import GiB, MiB


@pytest.fixture
def dev() -> SimDevice:
    return SimDevice(name="sim-h100", total_memory=80 * GiB, num_sm=132, nontorch_bytes=GiB)


def test_from_gpu() -> None:
    gpu = lookup_gpu("H200")
    dev = SimDevice.from_gpu(gpu, nontorch_bytes=512 * MiB)
    assert (dev.name, dev.num_sm, dev.total_memory, dev.nontorch_bytes) == ("H200", 132, gpu.memory_bytes, 512 * MiB)
    assert dev.compute_capability == (9, 0)
    assert isinstance(dev, Device)


def test_mem_get_info_counts_nontorch_and_reserved(dev: SimDevice) -> None:
    assert dev.mem_get_info() == (79 * GiB, 80 * GiB)
    dev.allocate(1, owner="t")
    assert dev.mem_get_info() == (79 * GiB - 2 * MiB, 80 * GiB)


def test_ledger_records_owner_tag_phase(dev: SimDevice) -> None:
    dev.phase = "profile"
    a = dev.allocate(8 << 20, owner="FlashInferBuilder", tag="int_workspace")
    h = dev.allocate(8 << 20, owner="FlashInferBuilder", tag="int_workspace_host", pinned_host=True)
    assert isinstance(a, Allocation)
    assert (a.owner, a.tag, a.kind, a.pool, a.phase, a.alive) == (
        "FlashInferBuilder", "int_workspace", "device", "default", "profile", True)
    assert (h.kind, h.size) == ("pinned_host", 8 << 20)
    assert h.id > a.id
    assert dev.live_allocations() == [a, h]
    assert dev.memory_allocated() == 8 << 20  # pinned host memory is not device memory
    assert dev.host_allocated == 8 << 20
    dev.phase = "kv_alloc"
    dev.free(a)
    assert (a.alive, a.freed_phase) == (False, "kv_alloc")
    assert dev.live_allocations() == [h]
    dev.free(h)
    assert dev.host_allocated == 0


def test_allocation_is_plain_data(dev: SimDevice) -> None:
    import dataclasses

    a = dev.allocate(3 * MiB, owner="o", tag="t")
    dev.allocate(MiB, owner="o")
    data = dataclasses.asdict(a)
    assert data["size"] == 3 * MiB and data["owner"] == "o" and "_block" not in data
    assert pickle.loads(pickle.dumps(data)) == data


def test_double_free_names_owner(dev: SimDevice) -> None:
    a = dev.allocate(100, owner="arena", tag="float_ws")
    dev.free(a)
    with pytest.raises(ValueError, match=r"double free.*'arena'.*'float_ws'"):
        dev.free(a)


def test_free_on_other_device_rejected(dev: SimDevice) -> None:
    other = SimDevice(name="other", total_memory=GiB)
    a = other.allocate(100, owner="x")
    with pytest.raises(ValueError, match="does not belong"):
        dev.free(a)


def test_record_stacks_points_at_caller() -> None:
    dev = SimDevice(name="sim", total_memory=GiB, record_stacks=True)
    a = dev.allocate(1, owner="t")
    assert a.stack is not None
    assert a.stack.startswith(__file__ + ":") and a.stack.endswith("in test_record_stacks_points_at_caller")
    quiet = SimDevice(name="sim", total_memory=GiB)
    assert quiet.allocate(1, owner="t").stack is None


def test_oom_message_and_attributes() -> None:
    dev = SimDevice(name="sim", total_memory=GiB, nontorch_bytes=100 * MiB)
    dev.phase = "warmup"
    dev.allocate(900 * MiB, owner="kv", tag="kv_cache")
    with pytest.raises(DeviceOutOfMemory) as info:
        dev.allocate(30 * MiB, owner="flashinfer", tag="int_workspace")
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.requested, err.owner, err.tag, err.phase) == (30 * MiB, "flashinfer", "int_workspace", "warmup")
    assert err.capacity == GiB and err.free == GiB - 100 * MiB - 900 * MiB
    msg = str(err)
    assert "Tried to allocate 30.00 MiB (owner 'flashinfer', tag 'int_workspace', phase 'warmup'" in msg
    assert "total capacity of 1024.00 MiB of which 24.00 MiB is free" in msg
    stats = dev.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1
    assert dev.memory_reserved() == 900 * MiB
    assert pickle.loads(pickle.dumps(err)).owner == "flashinfer"


def test_oom_boundary_is_exact() -> None:
    dev = SimDevice(name="sim", total_memory=64 * MiB, nontorch_bytes=4 * MiB)
    dev.allocate(60 * MiB, owner="t")  # exactly fills the device
    assert dev.mem_get_info()[0] == 0
    with pytest.raises(DeviceOutOfMemory):
        dev.allocate(1, owner="t")


def test_fail_after_is_one_shot(dev: SimDevice) -> None:
    dev.fail_after(2)
    dev.allocate(10, owner="a")
    dev.allocate(10, owner="b", pinned_host=True)
    with pytest.raises(DeviceOutOfMemory, match="injected") as info:
        dev.allocate(10, owner="c", tag="third")
    assert info.value.owner == "c" and info.value.injected
    dev.allocate(10, owner="d")
    assert [a.owner for a in dev.live_allocations()] == ["a", "b", "d"]
    assert dev.memory_stats()["num_ooms"] == 1


def test_events(dev: SimDevice) -> None:
    seen: list[DeviceEvent] = []
    unsubscribe = dev.subscribe(seen.append)
    dev.phase = "profile"
    a = dev.allocate(5 * MiB, owner="t")
    dev.free(a)
    dev.empty_cache()
    dev.fail_after(0)
    with pytest.raises(DeviceOutOfMemory):
        dev.allocate(1, owner="t")
    assert [e.kind for e in seen] == ["phase", "segment_alloc", "alloc", "free", "segment_free", "oom"]
    assert [e.seq for e in seen] == sorted(e.seq for e in seen)
    seg_alloc, alloc_ev, free_ev = seen[1], seen[2], seen[3]
    assert ((seg_alloc.nbytes, seg_alloc.reserved, seg_alloc.allocated, seg_alloc.pool)
            == (20 * MiB, 20 * MiB, 0, "default"))
    assert alloc_ev.alloc is a and alloc_ev.allocated == 5 * MiB and alloc_ev.phase == "profile"
    assert free_ev.allocated == 0 and free_ev.reserved == 20 * MiB
    assert seen[4].reserved == 0
    unsubscribe()
    dev.allocate(1, owner="t")
    assert len(seen) == 6


def test_events_of_the_kinds_asked_for_keep_the_sequence_numbers(dev: SimDevice) -> None:
    """A subscriber that asks for some kinds gets only those, numbered as if it had every event (the numbers count
    every event, asked for or not); the others are not built while nobody asks for them."""
    every: list[DeviceEvent] = []
    allocs: list[DeviceEvent] = []
    stop_allocs = dev.subscribe(allocs.append, kinds=("alloc",))
    a = dev.allocate(5 * MiB, owner="t")
    dev.free(a)
    stop_every = dev.subscribe(every.append)
    b = dev.allocate(5 * MiB, owner="t")  # from the cached segment
    dev.free(b)
    assert [e.kind for e in allocs] == ["alloc", "alloc"]
    assert [e.alloc for e in allocs] == [a, b]
    assert [e.kind for e in every] == ["alloc", "free"]
    assert allocs[1].seq == every[0].seq == allocs[0].seq + 2  # alloc, free (not asked for), alloc
    stop_every()
    stop_every()  # twice: a no-op
    dev.phase = "later"
    dev.allocate(1, owner="t")
    stop_allocs()
    dev.allocate(1, owner="t")
    assert len(every) == 2 and len(allocs) == 3


def test_graph_pool_stays_reserved_until_released(dev: SimDevice) -> None:
    dev.allocate(3 * MiB, owner="model")
    base_reserved = dev.memory_reserved()
    with dev.graph_capture() as pool:
        assert dev.capturing
        tmp = dev.allocate(30 * MiB, owner="graph", tag="activation")
        out = dev.allocate(MiB, owner="graph", tag="output")
        assert tmp.pool == out.pool == pool.id != "default"
        dev.free(tmp)  # freed during capture: back to the private pool, still reserved
    assert not dev.capturing
    assert pool.reserved == 30 * MiB + 2 * MiB
    assert pool.high_water_reserved == 32 * MiB
    assert pool.allocated == MiB and pool.high_water_allocated == 30 * MiB + MiB
    assert dev.memory_reserved() == base_reserved + 32 * MiB
    # Outside capture, the default pool does not reuse graph-pool blocks.
    outside = dev.allocate(30 * MiB, owner="kv")
    assert outside.pool == "default"
    dev.free(outside)
    dev.empty_cache()  # the live graph keeps its pool
    assert dev.memory_reserved() == base_reserved + 32 * MiB
    dev.release_graph_pool(pool)  # free segments go back; the one holding `out` stays
    assert dev.memory_reserved() == base_reserved + 2 * MiB
    dev.free(out)  # last block of a released pool: its segment is returned at once
    assert dev.memory_reserved() == base_reserved
    assert dev.graph_pools() == []


def test_graph_pool_lazy_release_like_torch(dev: SimDevice) -> None:
    with dev.graph_capture() as pool:
        dev.free(dev.allocate(40 * MiB, owner="g"))
    dev.release_graph_pool(pool, lazy=True)
    assert dev.memory_reserved() == 40 * MiB
    dev.empty_cache()
    assert dev.memory_reserved() == 0
    assert dev.graph_pools() == []


def test_fresh_pool_survives_empty_cache_before_capture(dev: SimDevice) -> None:
    pool = dev.new_graph_pool()
    dev.empty_cache()  # torch.cuda.graph empties the cache right before capture_begin(pool)
    with dev.graph_capture(pool) as same:
        dev.allocate(MiB, owner="g")
    assert same is pool and dev.graph_pools() == [pool]


def test_shared_pool_released_per_graph_or_all_at_once(dev: SimDevice) -> None:
    with dev.graph_capture() as pool:
        dev.free(dev.allocate(12 * MiB, owner="g1"))
    with dev.graph_capture(pool) as same:
        assert same is pool
        reused = dev.allocate(12 * MiB, owner="g2")
        dev.free(reused)
    assert pool.reserved == 12 * MiB  # second graph reused the first one's block
    assert pool.use_count == 2
    dev.release_graph_pool(pool, graphs=1)  # one of two graphs deleted: the pool stays
    assert dev.memory_reserved() == 12 * MiB
    dev.release_graph_pool(pool, graphs=1)
    assert dev.memory_reserved() == 0
    with pytest.raises(ValueError, match="released"):
        with dev.graph_capture(pool):
            pass
    dev.release_graph_pool(pool)  # idempotent
    with dev.graph_capture() as other:
        dev.free(dev.allocate(12 * MiB, owner="g"))
    with dev.graph_capture(other):
        pass
    dev.release_graph_pool(other)  # default: every graph using the pool is gone
    assert dev.memory_reserved() == 0


def test_capture_does_not_nest_and_restores_on_error(dev: SimDevice) -> None:
    with pytest.raises(KeyError):
        with dev.graph_capture():
            with pytest.raises(RuntimeError, match="nest"):
                with dev.graph_capture():
                    pass
            raise KeyError("boom")
    assert not dev.capturing


def test_oom_during_capture_does_not_release_cache() -> None:
    dev = SimDevice(name="sim", total_memory=100 * MiB)
    dev.free(dev.allocate(60 * MiB, owner="t"))
    with dev.graph_capture():
        with pytest.raises(DeviceOutOfMemory):
            dev.allocate(50 * MiB, owner="g")
    assert dev.memory_stats()["num_alloc_retries"] == 0
    assert dev.memory_reserved() == 60 * MiB


def test_peak_reset_covers_graph_pools(dev: SimDevice) -> None:
    with dev.graph_capture() as pool:
        dev.free(dev.allocate(30 * MiB, owner="g"))
    dev.reset_peak_memory_stats()
    assert pool.high_water_allocated == 0
    assert pool.high_water_reserved == 30 * MiB
