"""Random allocate/free/empty_cache/capture sequences keep the allocator's bookkeeping exact."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_kvprofile.memory.device import DeviceOutOfMemory, SimDevice
from pytest_kvprofile.units import MiB

sizes = st.one_of(
    st.integers(0, 4096),
    st.integers(4096, 2 * MiB),
    st.integers(2 * MiB, 40 * MiB),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), sizes),
        st.tuples(st.just("free"), st.integers(0, 10_000)),
        st.tuples(st.just("empty_cache"), st.just(0)),
        st.tuples(st.just("capture"), st.integers(0, 3)),
        st.tuples(st.just("release"), st.integers(0, 10)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_bookkeeping_invariants(ops: list[tuple[str, int]]) -> None:
    dev = SimDevice(name="sim", total_memory=256 * MiB, nontorch_bytes=8 * MiB)
    live = []
    pools = []
    for op, arg in ops:
        if op == "alloc":
            try:
                live.append(dev.allocate(arg, owner="t"))
            except DeviceOutOfMemory:
                pass
        elif op == "free" and live:
            dev.free(live.pop(arg % len(live)))
        elif op == "empty_cache":
            dev.empty_cache()
        elif op == "capture":
            with dev.graph_capture() as pool:
                for i in range(arg):
                    try:
                        a = dev.allocate((i + 1) * 3 * MiB, owner="g")
                    except DeviceOutOfMemory:
                        break
                    if i % 2:
                        dev.free(a)
                    else:
                        live.append(a)
            pools.append(pool)
        elif op == "release" and pools:
            dev.release_graph_pool(pools.pop(arg % len(pools)))
        dev.allocator.check_invariants()
        assert dev.memory_reserved() + dev.nontorch_bytes <= dev.total_memory
        assert dev.memory_allocated() == sum(a.size for a in live)
        assert dev.max_memory_reserved() >= dev.memory_reserved()
        spans = sorted((a.ptr, a.end) for a in live)
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    for a in live:
        dev.free(a)
    for pool in pools:
        dev.release_graph_pool(pool)
    dev.empty_cache()
    dev.allocator.check_invariants()
    assert dev.memory_reserved() == 0 and dev.memory_allocated() == 0
    assert dev.memory_stats()["requested_bytes.all.current"] == 0
