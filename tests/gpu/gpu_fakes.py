"""Fakes of ``torch``/``torch.cuda`` and ``pynvml`` for testing the GPU tier's pure logic on CPU.

The fake CUDA allocator is the project's caching-allocator model, so tensors behave like torch's:
a block returns to the cache when its last tensor (or view) is garbage collected, graph captures
allocate from a private pool, and ``empty_cache`` releases free segments only.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from pytest_kvprofile.memory.allocator import CachingAllocator
from pytest_kvprofile.units import GiB

HOST_BASE = 0x7F00_0000_0000


class FakeOutOfMemoryError(RuntimeError):
    pass


class _Storage:
    def __init__(self, ptr: int, nbytes: int, release: Any = None) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        if release is not None:
            weakref.finalize(self, release)


class FakeTensor:
    """A 1-D uint8 tensor: a storage plus an offset; slicing shares the storage like torch views."""

    def __init__(self, storage: _Storage, offset: int, numel: int, device: str) -> None:
        self._storage = storage
        self._offset = offset
        self._numel = numel
        self.device = device
        self.dtype = "uint8"

    def data_ptr(self) -> int:
        return self._storage.ptr + self._offset if self._numel else 0

    def numel(self) -> int:
        return self._numel

    def __len__(self) -> int:
        return self._numel

    def __getitem__(self, item: slice) -> FakeTensor:
        start, stop, step = item.indices(self._numel)
        assert step == 1
        return FakeTensor(self._storage, self._offset + start, max(0, stop - start), self.device)


class FakeGraph:
    def __init__(self, cuda: FakeCuda) -> None:
        self._cuda = cuda
        self.pool = None
        self.resets = 0

    def reset(self) -> None:
        if self.pool is not None:
            self._cuda.allocator.release_graph_pool(self.pool, lazy=True, graphs=1)
            self.pool = None
        self.resets += 1


class FakeCuda:
    """``torch.cuda`` on the allocator model: one device, ``nontorch`` bytes taken by the context."""

    def __init__(self, *, total: int = 80 * GiB, nontorch: int = 512 << 20, name: str = "NVIDIA H200",
                 sm: int = 132, cc: tuple[int, int] = (9, 0), count: int = 1) -> None:
        self.total = total
        self.nontorch = nontorch
        self.name = name
        self.sm = sm
        self.cc = cc
        self.count = count
        self.allocator = CachingAllocator(self._can_reserve)
        self.OutOfMemoryError = FakeOutOfMemoryError
        self.CUDAGraph = lambda: FakeGraph(self)
        self._handles = 0
        self._pool_by_handle: dict[tuple[int, int], Any] = {}
        self.empty_cache_calls = 0
        self.captures = 0

    def _can_reserve(self, nbytes: int) -> bool:
        return self.allocator.reserved + self.nontorch + nbytes <= self.total

    def device_count(self) -> int:
        return self.count

    def get_device_properties(self, index: int) -> Any:
        return SimpleNamespace(name=self.name, multi_processor_count=self.sm, major=self.cc[0], minor=self.cc[1],
                               total_memory=self.total)

    def mem_get_info(self, index: int = 0) -> tuple[int, int]:
        return self.total - self.nontorch - self.allocator.reserved, self.total

    def memory_allocated(self, index: int = 0) -> int:
        return self.allocator.allocated

    def memory_reserved(self, index: int = 0) -> int:
        return self.allocator.reserved

    def max_memory_allocated(self, index: int = 0) -> int:
        return self.allocator.allocated_bytes[0].peak

    def max_memory_reserved(self, index: int = 0) -> int:
        return self.allocator.reserved_bytes[0].peak

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        self.allocator.reset_peak()

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1
        self.allocator.release_cached()

    def memory_stats(self, index: int = 0) -> dict[str, int]:
        return self.allocator.stats()

    def memory_snapshot(self) -> list[dict[str, Any]]:
        ids = {p.id: h for h, p in self._pool_by_handle.items()}
        out = []
        for seg in self.allocator.snapshot():
            seg = dict(seg, device=0, segment_pool_id=ids.get(seg["segment_pool_id"], (0, 0)))
            out.append(seg)
        return out

    def graph_pool_handle(self) -> tuple[int, int]:
        self._handles += 1
        handle = (0, self._handles)
        self._pool_by_handle[handle] = self.allocator.new_graph_pool(f"fake-pool-{self._handles}")
        return handle

    @contextmanager
    def graph(self, g: FakeGraph, pool: Any = None):
        self.empty_cache()  # torch.cuda.graph frees what it can before capturing
        gp = self._pool_by_handle[pool]
        gp.use_count += 1
        g.pool = gp
        self.allocator.capture_pool = gp
        self.captures += 1
        try:
            yield
        finally:
            self.allocator.capture_pool = None

    def alloc(self, nbytes: int) -> FakeTensor:
        if nbytes == 0:
            return FakeTensor(_Storage(0, 0), 0, 0, "cuda")
        block = self.allocator.malloc(nbytes)
        if block is None:
            raise FakeOutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
        allocator = self.allocator
        return FakeTensor(_Storage(block.ptr, nbytes, lambda: allocator.free(block)), 0, nbytes, "cuda")


class FakeTorch:
    """The slice of the ``torch`` module CudaDevice uses."""

    uint8 = "uint8"

    def __init__(self, cuda: FakeCuda | None = None) -> None:
        self.cuda = cuda or FakeCuda()
        self._backing = self.cuda  # what empty() allocates from, even when ``cuda`` is swapped for a checked view
        self._host = HOST_BASE
        self.pinned = 0

    def device(self, kind: str, index: int = 0) -> str:
        return f"{kind}:{index}"

    def empty(self, nbytes: int, dtype: Any = None, device: Any = None, pin_memory: bool = False) -> FakeTensor:
        if pin_memory:
            ptr = self._host
            self._host += max(nbytes, 512)
            self.pinned += 1
            return FakeTensor(_Storage(ptr, nbytes), 0, nbytes, "cpu")
        assert device is not None and str(device).startswith("cuda")
        return self._backing.alloc(nbytes)


class FakeNvml:
    """``pynvml``: devices given as (name, uuid, total bytes); links as {(a, b): "nvlink"|"pcie"}."""

    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    class NVMLError(Exception):
        pass

    def __init__(self, devices: list[tuple[str, str, int]], *, driver: str = "580.159.04",
                 links: dict[tuple[int, int], str] | None = None, nvlinks: dict[int, int] | None = None,
                 fail_init: bool = False, p2p_unsupported: bool = False,
                 missing_links: frozenset[int] = frozenset()) -> None:
        self.devices = devices
        self.driver = driver
        self.links = links or {}
        self.nvlinks = nvlinks or {}
        self.fail_init = fail_init
        self.p2p_unsupported = p2p_unsupported
        self.missing_links = missing_links  # link indices NVML answers "not supported" for
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return self.driver.encode()

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.devices[h][0]

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.devices[h][1]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        total = self.devices[h][2]
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        n = self.nvlinks.get(h, 0)
        if link in self.missing_links or link >= max(n, 1):
            raise self.NVMLError("Not Supported")
        return 1 if link < n else 0

    def _kind(self, a: int, b: int) -> str:
        return self.links.get((a, b)) or self.links.get((b, a)) or "pcie"

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, cap: int) -> int:
        if self.p2p_unsupported:
            raise self.NVMLError("Not Supported")
        assert cap == self.NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if self._kind(a, b) == "nvlink" else 4

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 0 if self._kind(a, b) == "nvlink" else 30


REAL_LIMIT = 256 << 20  # allocations up to this size get real (CPU) memory behind them


class HybridCuda(FakeCuda):
    """FakeCuda whose small allocations are real CPU uint8 tensors (so builders can compute on
    them); large ones (weights, KV cache) stay data-less. Figures still come from the model."""

    def alloc(self, nbytes: int) -> Any:
        import torch

        if nbytes == 0 or nbytes > REAL_LIMIT:
            return super().alloc(nbytes)
        block = self.allocator.malloc(nbytes)
        if block is None:
            raise FakeOutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
        t = torch.empty(nbytes, dtype=torch.uint8)
        allocator = self.allocator
        weakref.finalize(t, allocator.free, block)
        return t


class HybridTorch(FakeTorch):
    def __init__(self, cuda: FakeCuda | None = None) -> None:
        super().__init__(cuda or HybridCuda())


class FakeFlashInfer:
    """A ``flashinfer`` module stand-in: wrappers that plan with a bump allocator of ``need(layout)``
    float bytes (raising FlashInfer's overflow message when it does not fit) and run exact attention
    on CPU. ``corrupt=True`` makes run() return garbage, as an overflowed workspace would."""

    def __init__(self, need: Any = None, corrupt: bool = False) -> None:
        import importlib.util

        # The sizing oracle locates the installed FlashInfer through its spec: keep the real one.
        self.__spec__ = importlib.util.find_spec("flashinfer")
        self.need = need or (lambda route, layout: 1 << 20)
        self.corrupt = corrupt
        self.capturing: list[Any] | None = None  # a fake CUDA graph's ops while one is being captured
        self.made: list[Any] = []  # weak references to every wrapper constructed
        fake = self

        class _Wrapper:
            route = "prefill"

            def __init__(self, float_workspace_buffer: Any, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                         use_tensor_cores: bool = False, backend: str = "auto", **kw: Any) -> None:
                assert kv_layout == "NHD" and backend == "fa2"
                self.float_buf = float_workspace_buffer
                self.int_buf = None
                self.use_cuda_graph = use_cuda_graph
                self.tensor_cores = use_tensor_cores
                self.graph_buffers = kw
                self.layout = None
                fake.made.append(weakref.ref(self))  # weak: a real module keeps no wrapper alive

            def reset_workspace_buffer(self, float_buf: Any, int_buf: Any) -> None:
                self.float_buf, self.int_buf = float_buf, int_buf

            def _layout(self, args: tuple, kw: dict) -> Any:
                from pytest_kvprofile.attention.reference import paged_layout

                if self.route == "prefill":
                    qo, kv_indptr, indices, last = (a.tolist() for a in args[:4])
                    page = args[7]
                    qo_lens = [b - a for a, b in zip(qo, qo[1:])]
                else:
                    kv_indptr, indices, last = (a.tolist() for a in args[:3])
                    page = args[6]
                    qo_lens = [kw.get("q_len_per_req", 1)] * (len(kv_indptr) - 1)
                pages = [b - a for a, b in zip(kv_indptr, kv_indptr[1:])]
                kv_lens = [(p - 1) * page + lp for p, lp in zip(pages, last)]
                lay = paged_layout(qo_lens, kv_lens, page)
                object.__setattr__(lay, "kv_indices", tuple(indices))
                object.__setattr__(lay, "num_physical_pages", max(indices) + 1)
                return lay

            def workspace_size(self, *args: Any, **kw: Any) -> tuple[int, int]:
                return fake.need(self.route, self._layout(args, kw)), 8 << 20

            def plan(self, *args: Any, **kw: Any) -> None:
                lay = self._layout(args, kw)
                need = fake.need(self.route, lay)
                have = self.float_buf.numel()
                if need > have:
                    raise RuntimeError(
                        f"Buffer overflow when allocating memory for batch_prefill_tmp_v with size {need} and "
                        f"alignment 16, but only {have} bytes available in AlignedAllocator. Increase the "
                        "workspace buffer size.")
                self.layout = lay

            def run(self, q: Any, kv: Any, out: Any = None) -> Any:
                from pytest_kvprofile.attention.reference import reference_attention

                assert self.layout is not None, "run() before plan()"
                k, v = kv
                ref = reference_attention(q, k, v, self.layout, rows=max(self.layout.qo_lens))
                import torch

                res = torch.cat([ref[r] for r in range(self.layout.batch_size)]).to(q.dtype)
                if fake.corrupt:
                    res = torch.zeros_like(res)
                if fake.capturing is not None:  # replayed later against the plan current at replay time
                    fake.capturing.append(lambda: self.run(q, kv, out=out))
                if out is not None:
                    out.copy_(res)
                    return out
                return res

        class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
            route = "prefill"

        class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
            route = "decode"

        self.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
        self.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
