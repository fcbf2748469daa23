"""A pure-Python model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp).

Profiling decisions are made on *reserved* bytes (what ``cudaMemGetInfo`` sees), not on the bytes a
tensor asks for, so the simulated device must round, segment, split, cache and coalesce the way
PyTorch does. What is modelled and what is not is listed in ``docs/simulated-device.md``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Callable

# Constants from c10/cuda/CUDACachingAllocator.cpp.
MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request is rounded up to a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: requests <= 1 MiB come from the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: segment size for the small pool
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment size for large requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests >= this get a segment of their own
ROUND_LARGE = 2 << 20  # kRoundLarge: those segments are rounded up to a multiple of 2 MiB
MIN_MAX_SPLIT_SIZE = LARGE_BUFFER  # max_split_size_mb below 20 is refused by PyTorch's allocator config

# Simulated addresses: monotonic segments, so a reallocated segment always changes pointer. They start above every
# user-space host address (x86-64 and AArch64 hand processes addresses below 2**47): in torch mode a device tensor's
# data_ptr() is a host address, and one that maps to no live simulated storage (a dangling pointer a builder kept)
# must never read as a ledger address.
USER_SPACE_END = 1 << 47
DEVICE_ADDRESS_BASE = USER_SPACE_END
SEGMENT_ALIGNMENT = 2 << 20

_ALL, _SMALL, _LARGE = 0, 1, 2
_POOL_NAMES = ("all", "small_pool", "large_pool")


def round_size(nbytes: int) -> int:
    """Block size for a request: a multiple of 512 B, at least 512 B (``round_size``)."""
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def segment_size(size: int) -> int:
    """Bytes ``cudaMalloc``-ed for a new segment serving a rounded block (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class Segment:
    """One simulated ``cudaMalloc``: a contiguous range owned by one pool, split into blocks."""

    __slots__ = ("id", "ptr", "size", "small", "pool")

    def __init__(self, id: int, ptr: int, size: int, small: bool, pool: "MemPool") -> None:
        self.id = id
        self.ptr = ptr
        self.size = size
        self.small = small
        self.pool = pool

    def __repr__(self) -> str:
        return f"Segment(id={self.id}, ptr={self.ptr:#x}, size={self.size}, pool={self.pool.id!r})"


class Block:
    """A piece of a segment; neighbours are linked so frees can coalesce."""

    __slots__ = ("ptr", "size", "requested", "allocated", "prev", "next", "segment")

    def __init__(self, ptr: int, size: int, segment: Segment) -> None:
        self.ptr = ptr
        self.size = size
        self.requested = 0
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.segment = segment

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        return f"Block(ptr={self.ptr:#x}, size={self.size}, {state})"


class _FreeList:
    """Free blocks of one size class, ordered by (size, address) for best-fit search."""

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        insort(self.keys, (block.size, block.ptr))
        self.blocks[block.ptr] = block

    def remove(self, block: Block) -> None:
        keys = self.keys
        del keys[bisect_left(keys, (block.size, block.ptr))]
        del self.blocks[block.ptr]

    def best_fit(self, size: int) -> Block | None:
        keys = self.keys
        i = bisect_left(keys, (size, 0))
        if i == len(keys):
            return None
        return self.blocks[keys[i][1]]

    def whole_segments_from(self, size: int) -> list[Block]:
        """Free blocks of at least ``size`` that are a whole segment, largest first."""
        keys = self.keys
        found = [self.blocks[ptr] for _, ptr in keys[bisect_left(keys, (size, 0)):]]
        return [b for b in reversed(found) if not b.is_split]


class MemPool:
    """A set of segments with their own free lists: the default pool or a CUDA-graph private pool."""

    def __init__(self, id: str) -> None:
        self.id = id
        self.small = _FreeList()
        self.large = _FreeList()
        self.segments: dict[int, Segment] = {}
        self.reserved = 0
        self.high_water_reserved = 0
        self.allocated = 0
        self.high_water_allocated = 0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(id={self.id!r}, reserved={self.reserved}, "
            f"allocated={self.allocated}, high_water_reserved={self.high_water_reserved})"
        )


class GraphPool(MemPool):
    """A CUDA-graph private pool: its segments stay reserved after capture until every graph using it
    is released (``use_count`` reaches 0, like ``releasePool``)."""

    def __init__(self, id: str) -> None:
        super().__init__(id)
        self.use_count = 0
        self.released = False


class _Stat:
    """One torch statistic: current, peak, cumulative allocated and freed."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def inc(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def dec(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount


def _add(stats: tuple[_Stat, _Stat, _Stat], idx: int, amount: int) -> None:
    """``_Stat.inc`` on the all-pools entry and on pool ``idx``'s (torch counts both), in one call: it runs on every
    malloc and free."""
    a = stats[_ALL]
    a.current += amount
    a.allocated += amount
    if a.current > a.peak:
        a.peak = a.current
    b = stats[idx]
    b.current += amount
    b.allocated += amount
    if b.current > b.peak:
        b.peak = b.current


def _sub(stats: tuple[_Stat, _Stat, _Stat], idx: int, amount: int) -> None:
    """``_Stat.dec`` on the all-pools entry and on pool ``idx``'s."""
    a = stats[_ALL]
    a.current -= amount
    a.freed += amount
    b = stats[idx]
    b.current -= amount
    b.freed += amount


def _stat_array() -> tuple[_Stat, _Stat, _Stat]:
    return (_Stat(), _Stat(), _Stat())


SegmentCallback = Callable[[str, Segment], None]


class CachingAllocator:
    """The allocator proper. ``can_reserve(nbytes)`` plays ``cudaMalloc``: it answers whether the
    device has room for one more segment of that size.

    ``malloc`` returns ``None`` when the request cannot be served even after releasing the cache;
    the caller raises (it knows the owner and phase for the message).
    """

    def __init__(self, can_reserve: Callable[[int], bool], on_segment: SegmentCallback | None = None) -> None:
        self.can_reserve = can_reserve
        self.on_segment = on_segment
        self.default_pool = MemPool("default")
        self.graph_pools: dict[str, GraphPool] = {}
        self.capture_pool: GraphPool | None = None
        self.active_blocks: dict[int, Block] = {}
        self._next_ptr = DEVICE_ADDRESS_BASE
        self._next_segment_id = 0
        self.allocated_bytes = _stat_array()
        self.requested_bytes = _stat_array()
        self.reserved_bytes = _stat_array()
        self.inactive_split_bytes = _stat_array()
        self.allocation = _stat_array()
        self.segment = _stat_array()
        self.inactive_split = _stat_array()
        self.oversize_allocations = _Stat()
        self.oversize_segments = _Stat()
        self.max_split_size: int | None = None  # PYTORCH_CUDA_ALLOC_CONF max_split_size_mb; None: unlimited
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

    # -- figures -------------------------------------------------------------------------------------

    @property
    def reserved(self) -> int:
        return self.reserved_bytes[_ALL].current

    @property
    def allocated(self) -> int:
        return self.allocated_bytes[_ALL].current

    def reset_peak(self) -> None:
        """Set every peak to its current value (``resetPeakStats``)."""
        for arr in self._all_arrays().values():
            for stat in arr:
                stat.peak = stat.current
        for stat in (self.oversize_allocations, self.oversize_segments):
            stat.peak = stat.current
        for pool in (self.default_pool, *self.graph_pools.values()):
            pool.high_water_reserved = pool.reserved
            pool.high_water_allocated = pool.allocated

    def _all_arrays(self) -> dict[str, tuple[_Stat, _Stat, _Stat]]:
        return {
            "active": self.allocation,
            "active_bytes": self.allocated_bytes,
            "allocated_bytes": self.allocated_bytes,
            "allocation": self.allocation,
            "inactive_split": self.inactive_split,
            "inactive_split_bytes": self.inactive_split_bytes,
            "requested_bytes": self.requested_bytes,
            "reserved_bytes": self.reserved_bytes,
            "segment": self.segment,
        }

    def stats(self) -> dict[str, int]:
        """The flat dict ``torch.cuda.memory_stats()`` returns, sorted by key like torch's.

        There are no streams, so a block is active exactly when it is allocated."""
        out: dict[str, int] = {}
        for name, arr in self._all_arrays().items():
            for idx, pool_name in enumerate(_POOL_NAMES):
                stat = arr[idx]
                prefix = f"{name}.{pool_name}."
                out[prefix + "allocated"] = stat.allocated
                out[prefix + "current"] = stat.current
                out[prefix + "freed"] = stat.freed
                out[prefix + "peak"] = stat.peak
        out["max_split_size"] = -1 if self.max_split_size is None else self.max_split_size
        out["num_alloc_retries"] = self.num_alloc_retries
        out["num_device_alloc"] = self.num_device_alloc
        out["num_device_free"] = self.num_device_free
        out["num_ooms"] = self.num_ooms
        out["num_sync_all_streams"] = 0
        for name, stat in (("oversize_allocations", self.oversize_allocations),
                           ("oversize_segments", self.oversize_segments)):
            for field in ("allocated", "current", "freed", "peak"):
                out[f"{name}.{field}"] = getattr(stat, field)
        return dict(sorted(out.items()))

    def set_max_split_size(self, nbytes: int | None) -> None:
        """``max_split_size_mb``: blocks of at least this size are never split, and requests below it never take
        one, so large freed blocks stay whole and releasable (None: unlimited, PyTorch's default)."""
        if nbytes is not None and nbytes < MIN_MAX_SPLIT_SIZE:
            raise ValueError(f"max_split_size must be at least {MIN_MAX_SPLIT_SIZE >> 20} MiB, got {nbytes} bytes")
        self.max_split_size = nbytes

    def _oversize(self, size: int) -> bool:
        return self.max_split_size is not None and size >= self.max_split_size

    def segments(self) -> list[Segment]:
        """Every reserved segment, in address order."""
        segs = list(self.default_pool.segments.values())
        for pool in self.graph_pools.values():
            segs.extend(pool.segments.values())
        return sorted(segs, key=lambda s: s.ptr)

    def _first_block(self, segment: Segment) -> Block:
        block = self.active_blocks.get(segment.ptr)
        if block is None:
            pool = segment.pool
            block = (pool.small if segment.small else pool.large).blocks[segment.ptr]
        return block

    def snapshot(self) -> list[dict[str, object]]:
        """Segments and their blocks, shaped like a subset of ``torch.cuda.memory_snapshot()``."""
        out: list[dict[str, object]] = []
        for seg in self.segments():
            blocks: list[dict[str, object]] = []
            allocated = 0
            block: Block | None = self._first_block(seg)
            while block is not None:
                allocated += block.size if block.allocated else 0
                blocks.append(
                    {
                        "address": block.ptr,
                        "size": block.size,
                        "requested_size": block.requested,
                        "state": "active_allocated" if block.allocated else "inactive",
                    }
                )
                block = block.next
            out.append(
                {
                    "address": seg.ptr,
                    "total_size": seg.size,
                    "allocated_size": allocated,
                    "segment_type": "small" if seg.small else "large",
                    "segment_pool_id": seg.pool.id,
                    "blocks": blocks,
                }
            )
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by property tests)."""
        reserved = allocated = 0
        free_seen = 0
        for seg in self.segments():
            reserved += seg.size
            block: Block | None = self._first_block(seg)
            assert block is not None and block.prev is None, f"{seg}: first block has a predecessor"
            end = seg.ptr
            while block is not None:
                assert block.segment is seg, f"{block} linked into the wrong segment"
                assert block.ptr == end, f"{seg}: gap or overlap at {block}"
                end += block.size
                if block.allocated:
                    allocated += block.size
                else:
                    assert block.next is None or block.next.allocated, f"{seg}: uncoalesced free blocks"
                    free_list = seg.pool.small if seg.small else seg.pool.large
                    assert free_list.blocks.get(block.ptr) is block, f"{block} missing from its free list"
                    free_seen += 1
                block = block.next
            assert end == seg.ptr + seg.size, f"{seg}: blocks do not tile the segment"
        listed = sum(len(p.small.blocks) + len(p.large.blocks) for p in (self.default_pool, *self.graph_pools.values()))
        assert listed == free_seen, f"free lists hold {listed} blocks, segments {free_seen}"
        assert reserved == self.reserved, f"reserved {self.reserved} != segment sum {reserved}"
        assert allocated == self.allocated, f"allocated {self.allocated} != block sum {allocated}"

    # -- malloc / free -------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> Block | None:
        """Serve a request from the capture pool (while capturing) or the default pool."""
        size = round_size(nbytes)
        pool = self.capture_pool or self.default_pool
        small = size <= SMALL_SIZE
        free_list = pool.small if small else pool.large
        block = self._free_block(free_list, size)
        if block is not None:
            free_list.remove(block)
            if block.is_split:
                self._inactive_split(block, -1)
        else:
            alloc_size = segment_size(size)
            block = self._new_segment(alloc_size, small, pool)
            if block is None and not small and self._release_oversize(pool, size):
                block = self._new_segment(alloc_size, small, pool)
            if block is None and self.capture_pool is None:
                # release_cached_blocks() then alloc_block(isRetry=true); not allowed while capturing.
                self.release_cached()
                self.num_alloc_retries += 1
                block = self._new_segment(alloc_size, small, pool)
            if block is None:
                self.num_ooms += 1
                return None
        remaining_size = block.size - size
        if remaining_size >= MIN_BLOCK_SIZE if small else (remaining_size > SMALL_SIZE and not self._oversize(size)):
            remaining = block
            block = Block(remaining.ptr, size, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size = remaining_size
            free_list.add(remaining)
            self._inactive_split(remaining, 1)
        block.allocated = True
        block.requested = nbytes
        if self._oversize(block.size):
            self.oversize_allocations.inc(1)
        self.active_blocks[block.ptr] = block
        idx = _SMALL if small else _LARGE
        bsize = block.size
        _add(self.allocated_bytes, idx, bsize)
        _add(self.requested_bytes, idx, nbytes)
        _add(self.allocation, idx, 1)
        pool.allocated += bsize
        if pool.allocated > pool.high_water_allocated:
            pool.high_water_allocated = pool.allocated
        return block

    def free(self, block: Block) -> None:
        """Return a block to its segment's pool, coalescing with free neighbours (``free_block``)."""
        segment = block.segment
        pool = segment.pool
        small = segment.small
        idx = _SMALL if small else _LARGE
        bsize = block.size
        _sub(self.allocated_bytes, idx, bsize)
        _sub(self.requested_bytes, idx, block.requested)
        _sub(self.allocation, idx, 1)
        pool.allocated -= bsize
        if self._oversize(bsize):
            self.oversize_allocations.dec(1)
        del self.active_blocks[block.ptr]
        block.allocated = False
        block.requested = 0
        free_list = pool.small if small else pool.large
        prev = block.prev
        if prev is not None and not prev.allocated:
            free_list.remove(prev)
            self._inactive_split(prev, -1)
            block.ptr = prev.ptr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated:
            free_list.remove(nxt)
            self._inactive_split(nxt, -1)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        free_list.add(block)
        if block.prev is not None or block.next is not None:
            self._inactive_split(block, 1)
        elif isinstance(pool, GraphPool) and pool.released:
            self._release_segment(block)

    def _free_block(self, free_list: _FreeList, size: int) -> Block | None:
        """``get_free_block``: the best fit, except that with a split limit a request below it never takes an
        oversize block, and one above it takes none larger than itself plus 20 MiB (the non-split rounding)."""
        block = free_list.best_fit(size)
        if block is None or self.max_split_size is None:
            return block
        if size < self.max_split_size and block.size >= self.max_split_size:
            return None
        if size >= self.max_split_size and block.size >= size + LARGE_BUFFER:
            return None
        return block

    def _release_oversize(self, pool: MemPool, size: int) -> bool:
        """``release_available_cached_blocks``: with a split limit, before dropping the whole cache, release one
        cached oversize segment large enough for the request, or else the largest ones until enough is free."""
        if self.max_split_size is None or self.capture_pool is not None:
            return False
        want = max(size, self.max_split_size)
        candidates = pool.large.whole_segments_from(self.max_split_size)
        fits = [b for b in candidates if b.size >= want]
        if fits:
            self._release_segment(min(fits, key=lambda b: (b.size, b.ptr)))
            return True
        released = 0
        for block in candidates:
            if released >= want:
                break
            self._release_segment(block)
            released += block.size
        return released >= want

    def _inactive_split(self, block: Block, sign: int) -> None:
        idx = _SMALL if block.segment.small else _LARGE
        if sign > 0:
            _add(self.inactive_split_bytes, idx, block.size)
            _add(self.inactive_split, idx, 1)
        else:
            _sub(self.inactive_split_bytes, idx, block.size)
            _sub(self.inactive_split, idx, 1)

    # -- segments ------------------------------------------------------------------------------------

    def _new_segment(self, size: int, small: bool, pool: MemPool) -> Block | None:
        if not self.can_reserve(size):
            return None
        ptr = self._next_ptr
        self._next_ptr += -(-size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        self._next_segment_id += 1
        segment = Segment(self._next_segment_id, ptr, size, small, pool)
        pool.segments[ptr] = segment
        pool.reserved += size
        if pool.reserved > pool.high_water_reserved:
            pool.high_water_reserved = pool.reserved
        idx = _SMALL if small else _LARGE
        _add(self.reserved_bytes, idx, size)
        _add(self.segment, idx, 1)
        if self._oversize(size):
            self.oversize_segments.inc(1)
        self.num_device_alloc += 1
        if self.on_segment is not None:
            self.on_segment("segment_alloc", segment)
        return Block(ptr, size, segment)

    def _release_segment(self, block: Block) -> None:
        """``cudaFree`` a segment whose single block is free."""
        segment = block.segment
        pool = segment.pool
        (pool.small if segment.small else pool.large).remove(block)
        del pool.segments[segment.ptr]
        pool.reserved -= segment.size
        idx = _SMALL if segment.small else _LARGE
        _sub(self.reserved_bytes, idx, segment.size)
        _sub(self.segment, idx, 1)
        if self._oversize(segment.size):
            self.oversize_segments.dec(1)
        self.num_device_free += 1
        if isinstance(pool, GraphPool) and pool.released and not pool.segments:
            self.graph_pools.pop(pool.id, None)
        if self.on_segment is not None:
            self.on_segment("segment_free", segment)

    def _release_pool(self, pool: MemPool) -> None:
        for free_list in (pool.small, pool.large):
            for block in [b for b in free_list.blocks.values() if b.prev is None and b.next is None]:
                self._release_segment(block)

    def release_cached(self) -> None:
        """``release_cached_blocks``: free every fully-free segment of the default pool and of
        graph pools nobody uses any more. Segments of live graph pools stay reserved."""
        self._release_pool(self.default_pool)
        for pool in list(self.graph_pools.values()):
            if pool.use_count <= 0:
                self._release_pool(pool)

    # -- graph pools ---------------------------------------------------------------------------------

    def new_graph_pool(self, id: str) -> GraphPool:
        pool = GraphPool(id)
        self.graph_pools[id] = pool
        return pool

    def release_graph_pool(self, pool: GraphPool, *, lazy: bool = False, graphs: int | None = None) -> None:
        """``graphs`` graphs using ``pool`` are gone (``None``: all of them). At use_count 0 the pool
        becomes freeable: its free segments are released now (or, with ``lazy``, at the next
        ``release_cached`` as torch's ``releasePool`` does), and segments still holding live blocks
        are released when those blocks are freed."""
        pool.use_count = 0 if graphs is None else max(pool.use_count - graphs, 0)
        if pool.use_count > 0:
            return
        if not lazy:
            pool.released = True
            self._release_pool(pool)
            if not pool.segments:
                self.graph_pools.pop(pool.id, None)
