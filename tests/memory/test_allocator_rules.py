"""The caching-allocator model against PyTorch's documented rounding and caching rules."""

import pytest

from pytest_kvprofile.memory.allocator import round_size, segment_size
from pytest_kvprofile.memory.device import SimDevice
from pytest_kvprofile.units import GiB, MiB

KiB = 1 << 10


@pytest.fixture
def dev() -> SimDevice:
    return SimDevice(name="sim", total_memory=80 * GiB, num_sm=132)


@pytest.mark.parametrize(
    "nbytes, rounded, segment",
    [
        (1, 512, 2 * MiB),
        (512, 512, 2 * MiB),
        (513, 1024, 2 * MiB),
        (MiB, MiB, 2 * MiB),
        (MiB + 1, MiB + 512, 20 * MiB),
        (10 * MiB - 512, 10 * MiB - 512, 20 * MiB),
        (10 * MiB - 1, 10 * MiB, 10 * MiB),
        (10 * MiB, 10 * MiB, 10 * MiB),
        (12 * MiB + 1, 12 * MiB + 512, 14 * MiB),
        (128 * MiB, 128 * MiB, 128 * MiB),
    ],
)
def test_rounding(nbytes: int, rounded: int, segment: int) -> None:
    assert round_size(nbytes) == rounded
    assert segment_size(rounded) == segment


def test_one_byte_reserves_small_segment(dev: SimDevice) -> None:
    a = dev.allocate(1, owner="t")
    assert (a.nbytes, a.size) == (1, 512)
    assert dev.memory_allocated() == 512
    assert dev.memory_reserved() == 2 * MiB
    assert dev.memory_stats()["requested_bytes.all.current"] == 1


def test_zero_bytes_reserve_nothing(dev: SimDevice) -> None:
    a = dev.allocate(0, owner="t", tag="empty")
    assert (a.ptr, a.size, a.alive) == (0, 0, True)
    assert dev.memory_reserved() == 0 and dev.live_allocations() == [a]
    dev.free(a)
    assert dev.live_allocations() == []


def test_just_over_one_mib_reserves_large_buffer(dev: SimDevice) -> None:
    a = dev.allocate(MiB + 1, owner="t")
    assert a.size == MiB + 512
    assert dev.memory_reserved() == 20 * MiB
    # The 19 MiB remainder is split off and serves the next mid-size request from the same segment.
    b = dev.allocate(8 * MiB, owner="t")
    assert dev.memory_reserved() == 20 * MiB
    assert b.ptr == a.ptr + a.size


def test_large_request_gets_own_rounded_segment(dev: SimDevice) -> None:
    dev.allocate(12 * MiB + 1, owner="t")
    assert dev.memory_reserved() == 14 * MiB
    assert dev.memory_allocated() == 12 * MiB + 512
    stats = dev.memory_stats()
    assert stats["segment.all.current"] == 1
    assert stats["segment.large_pool.current"] == 1
    # The 2 MiB - 512 B tail is > 1 MiB, so it is split off and cached as an inactive split block.
    assert stats["inactive_split_bytes.all.current"] == 2 * MiB - 512


def test_large_block_remainder_not_split_when_at_most_one_mib(dev: SimDevice) -> None:
    a = dev.allocate(13 * MiB + 1, owner="t")  # rounded 13 MiB + 512, segment 14 MiB, tail < 1 MiB
    assert a.size == 14 * MiB
    assert dev.memory_allocated() == 14 * MiB


def test_two_small_blocks_share_a_segment(dev: SimDevice) -> None:
    a = dev.allocate(600 * KiB, owner="t")
    b = dev.allocate(600 * KiB, owner="t")
    assert dev.memory_reserved() == 2 * MiB
    assert dev.memory_stats()["segment.small_pool.current"] == 1
    assert b.ptr == a.ptr + a.size
    c = dev.allocate(900 * KiB, owner="t")  # 800 KiB left: a new segment
    assert dev.memory_reserved() == 4 * MiB
    assert c.ptr >= a.ptr + 2 * MiB


def test_free_caches_and_empty_cache_releases(dev: SimDevice) -> None:
    blocks = [dev.allocate(n, owner="t") for n in (1, 600 * KiB, 5 * MiB, 64 * MiB)]
    reserved = dev.memory_reserved()
    assert reserved == 2 * MiB + 20 * MiB + 64 * MiB
    for b in blocks:
        dev.free(b)
    assert dev.memory_allocated() == 0
    assert dev.memory_reserved() == reserved  # cached, still reserved
    assert dev.mem_get_info()[0] == 80 * GiB - reserved
    dev.empty_cache()
    assert dev.memory_reserved() == 0
    assert dev.mem_get_info() == (80 * GiB, 80 * GiB)
    stats = dev.memory_stats()
    assert stats["num_device_alloc"] == 3 and stats["num_device_free"] == 3


def test_empty_cache_keeps_partly_used_segments(dev: SimDevice) -> None:
    a = dev.allocate(600 * KiB, owner="t")
    b = dev.allocate(600 * KiB, owner="t")
    dev.free(a)
    dev.empty_cache()
    assert dev.memory_reserved() == 2 * MiB
    dev.free(b)
    dev.empty_cache()
    assert dev.memory_reserved() == 0


def test_coalescing_reuses_whole_segment(dev: SimDevice) -> None:
    parts = [dev.allocate(4 * MiB, owner="t") for _ in range(4)]  # all in one 20 MiB segment
    assert dev.memory_reserved() == 20 * MiB
    for p in (parts[1], parts[3], parts[0], parts[2]):
        dev.free(p)
    assert dev.memory_stats()["inactive_split_bytes.all.current"] == 0
    big = dev.allocate(19 * MiB, owner="t")  # fits only if the segment coalesced back to 20 MiB
    assert dev.memory_reserved() == 20 * MiB
    assert big.ptr == parts[0].ptr
    assert big.size == 20 * MiB  # 1 MiB tail is not > 1 MiB: not split


def test_best_fit_prefers_smallest_block(dev: SimDevice) -> None:
    big = dev.allocate(64 * MiB, owner="t")
    small = dev.allocate(12 * MiB, owner="t")
    dev.free(big)
    dev.free(small)
    again = dev.allocate(11 * MiB, owner="t")
    assert again.ptr == small.ptr


def test_peak_and_reset(dev: SimDevice) -> None:
    a = dev.allocate(100 * MiB, owner="t")
    dev.free(a)
    assert dev.max_memory_allocated() == 100 * MiB
    assert dev.max_memory_reserved() == 100 * MiB
    dev.empty_cache()
    dev.allocate(10 * MiB, owner="t")
    dev.reset_peak_memory_stats()
    assert dev.max_memory_allocated() == 10 * MiB
    assert dev.max_memory_reserved() == 10 * MiB
    assert dev.memory_stats()["allocated_bytes.all.peak"] == 10 * MiB


def test_memory_stats_keys_match_torch(dev: SimDevice) -> None:
    dev.allocate(3 * MiB, owner="t")
    stats = dev.memory_stats()
    for key in (
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "active_bytes.all.current",
        "requested_bytes.all.current",
        "num_alloc_retries",
        "num_ooms",
        "segment.all.current",
        "allocation.all.current",
        "inactive_split_bytes.all.current",
    ):
        assert key in stats
    assert list(stats) == sorted(stats)
    assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"] == 3 * MiB
    assert stats["allocated_bytes.large_pool.current"] == 3 * MiB
    assert stats["allocated_bytes.small_pool.current"] == 0


def test_oom_retry_releases_cache_first() -> None:
    dev = SimDevice(name="sim", total_memory=100 * MiB)
    a = dev.allocate(60 * MiB, owner="t")
    dev.free(a)
    b = dev.allocate(70 * MiB, owner="t")  # fits only once the cached 60 MiB segment is released
    assert dev.memory_reserved() == 70 * MiB
    stats = dev.memory_stats()
    assert stats["num_alloc_retries"] == 1
    assert stats["num_ooms"] == 0
    assert b.alive


def test_live_allocations_never_overlap(dev: SimDevice) -> None:
    import random

    rng = random.Random(7)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            dev.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(1, 40 * MiB)])
            live.append(dev.allocate(size, owner="t"))
        if rng.random() < 0.02:
            dev.empty_cache()
    spans = sorted((a.ptr, a.end) for a in dev.live_allocations())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert dev.memory_allocated() == sum(a.size for a in live)
    segs = dev.segments()
    assert sum(s.size for s in segs) == dev.memory_reserved()
    for a in live:
        assert any(s.ptr <= a.ptr and a.end <= s.ptr + s.size for s in segs)
    for a in list(live):
        dev.free(a)
    dev.empty_cache()
    assert dev.memory_reserved() == 0
    assert dev.memory_stats()["inactive_split_bytes.all.current"] == 0


# -- max_split_size (PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb, which vLLM scopes to 20 over the profile run) ----
def test_without_a_split_limit_a_small_request_is_carved_from_a_freed_large_block(dev: SimDevice) -> None:
    big = dev.allocate(512 * MiB, owner="t")
    dev.free(big)
    small = dev.allocate(3 * MiB, owner="t")
    assert small.ptr == big.ptr  # the 512 MiB segment is now pinned by 3 MiB
    dev.empty_cache()
    assert dev.memory_reserved() == 512 * MiB
    assert dev.memory_stats()["max_split_size"] == -1


def test_a_split_limit_keeps_large_freed_blocks_whole_and_releasable(dev: SimDevice) -> None:
    dev.allocator.set_max_split_size(20 * MiB)
    big = dev.allocate(512 * MiB, owner="t")
    assert dev.memory_stats()["oversize_allocations.current"] == 1
    assert dev.memory_stats()["oversize_segments.current"] == 1
    dev.free(big)
    small = dev.allocate(3 * MiB, owner="t")
    assert small.ptr != big.ptr  # a request below the limit never takes an oversize block
    dev.empty_cache()
    assert dev.memory_reserved() == 20 * MiB  # the 512 MiB segment went back; the 3 MiB one's segment stays
    stats = dev.memory_stats()
    assert stats["max_split_size"] == 20 * MiB
    # the 20 MiB segment (kLargeBuffer) serving 3 MiB is itself at the limit, as PyTorch counts it
    assert (stats["oversize_allocations.current"], stats["oversize_segments.current"]) == (0, 1)
    assert stats["oversize_segments.peak"] == 2


def test_a_large_request_takes_an_oversize_block_only_within_twenty_mib(dev: SimDevice) -> None:
    dev.allocator.set_max_split_size(20 * MiB)
    a = dev.allocate(100 * MiB, owner="t")
    dev.free(a)
    near = dev.allocate(90 * MiB, owner="t")
    assert near.ptr == a.ptr and near.size == 100 * MiB  # within 20 MiB: taken whole, not split
    dev.free(near)
    far = dev.allocate(60 * MiB, owner="t")
    assert far.ptr != a.ptr  # 40 MiB too large: a segment of its own


def test_a_split_limit_releases_cached_oversize_segments_before_the_whole_cache() -> None:
    dev = SimDevice(name="sim", total_memory=1 * GiB, num_sm=132)
    dev.allocator.set_max_split_size(20 * MiB)
    keep = dev.allocate(MiB // 2, owner="t")  # a small segment that stays cached
    olds = [dev.allocate(300 * MiB, owner="t") for _ in range(3)]
    for a in olds:
        dev.free(a)
    dev.free(keep)
    retries = dev.memory_stats()["num_alloc_retries"]
    b = dev.allocate(400 * MiB, owner="t")  # needs two of the cached 300 MiB segments released
    assert b.size == 400 * MiB
    assert dev.memory_stats()["num_alloc_retries"] == retries  # no full cache flush
    assert dev.memory_reserved() == 300 * MiB + 400 * MiB + 2 * MiB


def test_the_split_limit_is_at_least_twenty_mib(dev: SimDevice) -> None:
    with pytest.raises(ValueError, match="at least 20 MiB"):
        dev.allocator.set_max_split_size(8 * MiB)
