"""SimulatedCuda: unmodified torch.cuda code profiled on a CPU-only torch."""

import gc

import pytest

from pytest_kvprofile.units import GiB, MiB

torch = pytest.importorskip("torch")

from pytest_kvprofile.memory.device import DeviceOutOfMemory, SimDevice  # noqa: E402
from pytest_kvprofile.memory.torch_mode import SimulatedCuda  # noqa: E402


class FlashInferLikeBuilder:
    """Written for a real GPU; nothing here knows about the simulation."""

    def __init__(self) -> None:
        self.int_workspace = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        self.pin_int_workspace = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
        self.float_workspace = None

    def plan(self, num_tokens: int) -> None:
        if self.float_workspace is None:
            self.float_workspace = torch.zeros(num_tokens * 4096, dtype=torch.float32, device=self.int_workspace.device)

    def release(self) -> None:
        del self.int_workspace, self.pin_int_workspace
        self.float_workspace = None


@pytest.fixture
def dev() -> SimDevice:
    return SimDevice(name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB, num_sm=132, nontorch_bytes=GiB)


def test_builder_allocations_appear_and_disappear(dev: SimDevice) -> None:
    with SimulatedCuda(dev):
        dev.phase = "profile"
        builder = FlashInferLikeBuilder()
        live = dev.live_allocations()
        assert [(a.kind, a.nbytes, a.size) for a in live] == [
            ("device", 8 << 20, 8 << 20),
            ("pinned_host", 8 << 20, 8 << 20),
        ]
        owner = f"{__name__}.FlashInferLikeBuilder.__init__"
        assert all(a.owner == owner and a.tag == "torch.empty" and a.phase == "profile" for a in live)
        assert live[0].stack is not None and live[0].stack.startswith(__file__ + ":")
        assert builder.int_workspace.is_cuda and builder.int_workspace.device == torch.device("cuda", 0)
        assert builder.pin_int_workspace.is_pinned() and not builder.pin_int_workspace.is_cuda
        assert torch.cuda.memory_allocated() == 8 << 20
        assert torch.cuda.memory_reserved() == 20 * MiB  # 8 MiB < 10 MiB: a 20 MiB large-buffer segment
        dev.phase = "warmup"
        builder.plan(1024)
        float_ws = dev.live_allocations()[-1]
        assert ((float_ws.nbytes, float_ws.phase, float_ws.owner)
                == (1024 * 4096 * 4, "warmup", f"{__name__}.FlashInferLikeBuilder.plan"))
        builder.release()
        assert dev.live_allocations() == []
        assert dev.memory_allocated() == 0 and dev.host_allocated == 0
        assert torch.cuda.memory_reserved() > 0
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 0


def test_creation_paths(dev: SimDevice) -> None:
    with SimulatedCuda(dev) as sim:
        host = torch.arange(16, dtype=torch.float32)
        made = {
            "zeros": torch.zeros(4, 4, device="cuda"),
            "ones": torch.ones(8, device=torch.device("cuda", 0)),
            "full": torch.full((3,), 7.0, device="cuda:0"),
            "randn": torch.randn(5, device="cuda"),
            "to": host.to("cuda"),
            "to_kw": host.to(device="cuda", dtype=torch.float16),
            "cuda": host.cuda(),
            "tensor": torch.tensor([1, 2, 3], device="cuda"),
        }
        made["like"] = torch.empty_like(made["zeros"])
        made["op"] = made["ones"] * 2
        made["new"] = made["ones"].new_zeros(10)
        for name, t in made.items():
            assert sim.is_simulated(t), name
            assert sim.allocation_of(t).nbytes == t.untyped_storage().nbytes(), name
        assert not sim.is_simulated(host)
        assert torch.equal(made["cuda"], host) and made["cuda"].data_ptr() != host.data_ptr()
        view = made["zeros"][1:]
        assert sim.allocation_of(view) is sim.allocation_of(made["zeros"])
        back = made["ones"].cpu()
        assert not sim.is_simulated(back) and not back.is_cuda
        n = len(dev.live_allocations())
        assert made["ones"].to("cuda") is made["ones"]
        made["zeros"].add_(1)
        assert len(dev.live_allocations()) == n
        assert not sim.is_simulated(torch.empty(3))
        assert not sim.is_simulated(torch.empty(3, device="cpu"))
        del made, view, t
        gc.collect()
        assert dev.live_allocations() == []


def test_cuda_api_answers_from_ledger(dev: SimDevice) -> None:
    with SimulatedCuda(dev):
        assert torch.cuda.is_available()
        assert torch.cuda.current_device() == 0
        props = torch.cuda.get_device_properties(0)
        assert (props.name, props.total_memory, props.multi_processor_count) == (dev.name, 80 * GiB, 132)
        t = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.mem_get_info() == dev.mem_get_info() == (79 * GiB - 100 * MiB, 80 * GiB)
        assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == 100 * MiB
        del t
        assert torch.cuda.max_memory_allocated() == 100 * MiB
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == 0
        assert torch.cuda.memory.memory_reserved() == 100 * MiB


def test_patches_restored_even_on_error(dev: SimDevice) -> None:
    names = ["mem_get_info", "memory_allocated", "is_available", "graph", "CUDAGraph", "get_device_properties"]
    before = {n: getattr(torch.cuda, n) for n in names}
    memory_before = torch.cuda.memory.mem_get_info
    with pytest.raises(KeyError):
        with SimulatedCuda(dev):
            assert torch.cuda.is_available()
            raise KeyError("boom")
    assert {n: getattr(torch.cuda, n) for n in names} == before
    assert torch.cuda.memory.mem_get_info is memory_before
    assert torch.cuda.is_available() is False  # this test suite runs on a CPU-only build
    assert not hasattr(torch.cuda.graphs, "mem_get_info")
    t = torch.ones(2)
    assert t.device.type == "cpu"


def test_graph_capture_maps_to_private_pool(dev: SimDevice) -> None:
    with SimulatedCuda(dev):
        static_in = torch.zeros(1024, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            assert torch.cuda.is_current_stream_capturing()
            tmp = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
            out = static_in + 1
            del tmp
        assert not torch.cuda.is_current_stream_capturing()
        pool = g.pool()
        assert pool.reserved == 30 * MiB + 2 * MiB
        reserved = torch.cuda.memory_reserved()
        g.replay()
        del g  # torch releases the pool lazily: segments return at the next empty_cache
        gc.collect()
        assert torch.cuda.memory_reserved() == reserved
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 2 * MiB + 2 * MiB  # static_in's segment and out's
        del out
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 2 * MiB


def test_oom_is_a_torch_oom(dev: SimDevice) -> None:
    small = SimDevice(name="tiny", total_memory=64 * MiB)
    with SimulatedCuda(small):
        small.phase = "kv_alloc"
        with pytest.raises(torch.cuda.OutOfMemoryError) as info:
            torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
        assert isinstance(info.value, DeviceOutOfMemory)
        assert info.value.phase == "kv_alloc" and info.value.tag == "torch.empty"
        assert small.live_allocations() == []


def test_owner_resolver_and_scope(dev: SimDevice) -> None:
    def resolver(frame, api):
        self_obj = frame.f_locals.get("self")
        return (type(self_obj).__name__, "ws") if self_obj is not None else None

    with SimulatedCuda(dev, owner_resolver=resolver) as sim:
        b = FlashInferLikeBuilder()
        assert sim.allocation_of(b.int_workspace).owner == "FlashInferLikeBuilder"
        assert sim.allocation_of(b.int_workspace).tag == "ws"
        with sim.owner_scope("kv_cache", "layer0"):
            kv = torch.empty(4, device="cuda")
        assert (sim.allocation_of(kv).owner, sim.allocation_of(kv).tag) == ("kv_cache", "layer0")


def test_frees_after_exit_keep_ledger_consistent(dev: SimDevice) -> None:
    with SimulatedCuda(dev):
        t = torch.empty(10, device="cuda")
    assert len(dev.live_allocations()) == 1
    del t
    assert dev.live_allocations() == []


def test_modules_views_and_nesting(dev: SimDevice) -> None:
    other = SimDevice(name="other", total_memory=GiB)
    with SimulatedCuda(dev) as sim:
        lin = torch.nn.Linear(16, 16).cuda()
        assert lin.weight.is_cuda and sim.is_simulated(lin.weight) and sim.is_simulated(lin.bias)
        out = lin(torch.ones(4, 16, device="cuda"))
        assert out.device.type == "cuda" and sim.allocation_of(out).nbytes == 4 * 16 * 4
        assert sim.is_simulated(torch.nn.Linear(8, 8, device="cuda").weight)
        idx = torch.arange(10, device="cuda")
        assert idx.get_device() == 0 and torch.ones(3).get_device() == -1
        assert sim.is_simulated(torch.ones(3).to(idx))
        values, indices = torch.ones(4, device="cuda").max(0)
        assert sim.is_simulated(values) and sim.is_simulated(indices)
        with SimulatedCuda(other) as inner:
            t = torch.empty(5, device="cuda")
            assert inner.is_simulated(t) and not sim.is_simulated(t)
            assert torch.cuda.get_device_name() == "other"
        assert torch.cuda.get_device_name() == dev.name
    assert len(other.live_allocations()) == 1


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_a_zeroed_workspace_costs_host_memory_only_where_it_is_written(dev: SimDevice) -> None:
    with SimulatedCuda(dev):
        before = _rss()
        ws = torch.zeros(256 * MiB, dtype=torch.uint8, device="cuda")
        assert _rss() - before < 32 * MiB  # untouched zero pages, no fill
        assert dev.memory_allocated() >= 256 * MiB and ws.is_cuda
        ws[:MiB].fill_(7)
        assert int(ws[:MiB].sum()) == 7 * MiB and int(ws[MiB:2 * MiB].sum()) == 0
        like = torch.zeros_like(ws.view(torch.int32))
        assert like.dtype is torch.int32 and like.shape == (64 * MiB,) and like.is_cuda
        assert ws.new_zeros((2, MiB)).is_cuda
        del ws, like
        gc.collect()
        assert dev.memory_allocated() < MiB


def test_calls_on_live_storages_record_only_what_they_create(dev: SimDevice) -> None:
    with SimulatedCuda(dev) as sim:
        x = torch.zeros(64, dtype=torch.int32, device="cuda")
        uses: list[str] = []
        sim.on_use = lambda alloc, api: uses.append(api)
        count = len(dev.live_allocations())
        x[3:9].add_(1)
        x.copy_(x.flip(0))  # flip makes one tensor, freed at once
        assert len(dev.live_allocations()) == count and not uses
        y = x - 1
        assert sim.allocation_of(y) is not None and len(dev.live_allocations()) == count + 1
        from pytest_kvprofile.contract.roles import Role
        from pytest_kvprofile.memory.torch_mode import assign_role

        assign_role(x, Role.INT_WORKSPACE)
        x[0:4].zero_()
        assert uses == ["Tensor.__getitem__", "Tensor.zero_"]
        alloc = sim.allocation_of(y)
        dev.free(alloc)  # the ledger gave it back while the tensor lives: every touch is a use of freed memory
        uses.clear()
        y.add_(1)
        assert uses == ["Tensor.add_"]


def test_no_host_address_reads_as_a_simulated_one(dev: SimDevice) -> None:
    """A data_ptr() that maps to no live simulated storage (a pointer a builder kept past its tensor) stays outside
    the ledger's addresses: every mapping of this process lies below the simulated device and pinned-host ranges."""
    from pytest_kvprofile.memory.allocator import DEVICE_ADDRESS_BASE
    from pytest_kvprofile.memory.device import HOST_ADDRESS_BASE

    with SimulatedCuda(dev) as sim:
        kept = torch.zeros(64 * MiB, dtype=torch.uint8, device="cuda")
        dangling = kept.data_ptr()
        del kept
        gc.collect()
        assert sim.simulated_ptr(dangling) is None
        fresh = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        assert all(not (a.ptr <= dangling < a.ptr + a.nbytes) for a in dev.live_allocations())
        assert sim.allocation_of(fresh) is not None
    with open("/proc/self/maps") as maps:
        ends = [int(line.split("-", 1)[1].split()[0], 16) for line in maps if "[vsyscall]" not in line]
    highest = max(ends)  # the kernel's vsyscall page (x86-64) is mapped into every process above user space
    assert highest <= min(DEVICE_ADDRESS_BASE, HOST_ADDRESS_BASE)
