"""Fakes that cannot drift: every call the GPU code makes to FlashInfer, torch.cuda and NVML is
bound, before the fake runs it, to the installed library's own signature (``inspect.signature``),
so a renamed or misplaced argument fails here on CPU instead of on first contact with a GPU."""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from typing import Any

import pytest
from gpu_fakes import (
    FakeCuda,
    FakeFlashInfer,
    FakeNvml,
    FakeTorch,
    HybridCuda,
    HybridTorch,
)

flashinfer = pytest.importorskip("flashinfer")
pynvml = pytest.importorskip("pynvml")
import torch  # noqa: E402

from pytest_kvprofile.gpu.cuda_device import CudaDevice, CudaDeviceFactory  # noqa: E402
from pytest_kvprofile.gpu.topology import detect_topology  # noqa: E402
from pytest_kvprofile.units import MiB  # noqa: E402

_MISSING = object()
CUDA = torch.cuda  # the installed module, captured before any test swaps in a checked fake


class Checked:
    """``fake`` seen through ``real``'s API: an attribute ``real`` lacks is an error, a call is bound to
    ``real``'s signature first, and what a call to a real class returns is checked against that class."""

    def __init__(self, fake: Any, real: Any, name: str, calls: list[str]) -> None:
        self._fake, self._real, self._name, self._calls = fake, real, name, calls

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._fake, attr)
        real = inspect.getattr_static(self._real, attr, _MISSING)
        if real is _MISSING:
            raise AssertionError(f"{self._name}.{attr} does not exist in the installed library")
        real = getattr(self._real, attr)
        if not callable(value) or (inspect.isclass(value) and issubclass(value, BaseException)):
            return value
        method = inspect.isclass(self._real) and inspect.isfunction(inspect.getattr_static(self._real, attr))
        where = f"{self._name}.{attr}"

        def call(*args: Any, **kwargs: Any) -> Any:
            sig = inspect.signature(real)
            try:
                sig.bind(*((None,) if method else ()), *args, **kwargs)
            except TypeError as exc:
                raise AssertionError(f"{where}{sig} does not accept {args!r:.200} {kwargs!r:.200}: {exc}") from None
            self._calls.append(where)
            result = value(*args, **kwargs)
            if inspect.isclass(real) and result is not None and not isinstance(result, (int, str, tuple)):
                return Checked(result, real, real.__name__, self._calls)
            return result

        return call

    def __enter__(self) -> Any:
        return self._fake.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._fake.__exit__(*exc)

    def __getitem__(self, item: Any) -> Any:  # tensors pass through Checked when a fake returns them
        return self._fake[item]


def test_the_checker_rejects_a_wrong_keyword_and_a_missing_name() -> None:
    calls: list[str] = []
    fi = Checked(FakeFlashInfer(), flashinfer, "flashinfer", calls)
    buf = torch.empty(16, dtype=torch.uint8)
    with pytest.raises(AssertionError, match="does not accept"):
        fi.BatchDecodeWithPagedKVCacheWrapper(buf, "NHD", use_tensor_core=True, backend="fa2")
    cuda = Checked(FakeCuda(), CUDA, "torch.cuda", calls)
    with pytest.raises(AssertionError, match="does not accept"):
        cuda.mem_get_info(device=0, index=0)
    with pytest.raises(AssertionError, match="does not exist"):
        Checked(type("N", (), {"nvmlNoSuchCall": lambda self: 0})(), pynvml, "pynvml", calls).nvmlNoSuchCall()


def test_builders_probe_and_graph_replay_call_flashinfer_as_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_kvprofile.attention.reference import paged_layout
    from pytest_kvprofile.attention.wrappers import capture_decode_replays
    from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS, REAL_FLASHINFER_MUTANTS
    from pytest_kvprofile.gpu.sizing_probe import (
        SHORT_BY,
        api_workspace_size,
        expect_overflow,
        route_probes,
    )
    from pytest_kvprofile.lifecycle.driver import run_lifecycle
    from pytest_kvprofile.matrix.schema import load_matrix_text

    calls: list[str] = []
    cases = load_matrix_text(
        "name: t\nenvelope: {max_num_seqs: 8, max_num_batched_tokens: 256, max_model_len: 2048, "
        "cuda_graph_sizes: [1, 2, 4, 8], num_ubatches: 2}\nmodels:\n  m: {heads_q: 8, heads_kv: 2, head_dim: 64, "
        "num_layers: 2, weights_gib: 1, hidden_size: 512}\ngpus: [H200]\ntp: [1]\nmtp: [0, 1]\ngmu: [0.9]\n",
        "inline.yaml").cases
    for case in cases:
        fake = FakeFlashInfer()
        monkeypatch.setitem(sys.modules, "flashinfer", Checked(fake, flashinfer, "flashinfer", calls))
        for backend in (*REAL_FLASHINFER_BACKENDS, *REAL_FLASHINFER_MUTANTS[: 2 * (case.mtp == 0)]):
            cuda = HybridCuda(total=case.gpu.memory_bytes, nontorch=case.nontorch_bytes)
            torch_mod = HybridTorch(cuda)
            torch_mod.cuda = Checked(cuda, CUDA, "torch.cuda", calls)
            result = run_lifecycle(backend, case, device_factory=CudaDeviceFactory(torch_mod=torch_mod))
            assert not result.errors, result.errors[0].describe()
        probe = route_probes(case)[0]
        fake.need = lambda route, layout, need=probe.float_bytes: need
        expect_overflow(probe, probe.float_bytes - SHORT_BY, device="cpu")
        assert api_workspace_size(probe, device="cpu") == probe.float_bytes
        fake.need = lambda route, layout: 1 << 16
        _fake_graph_runtime(monkeypatch, fake, calls)
        q_len = 1 + case.mtp
        layout = paged_layout([q_len] * 4, [300] * 4, 16)
        records = capture_decode_replays(torch.empty(1 << 20, dtype=torch.uint8), layout, heads_q=8, heads_kv=2,
                                         head_dim=64, tensor_cores=case.mtp > 0)
        assert len(records) == 4 and max(r.relative_error for r in records) < 1e-2
    for name in ("BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper.plan",
                 "BatchDecodeWithPagedKVCacheWrapper.run", "reset_workspace_buffer", "workspace_size",
                 "torch.cuda.graph", "CUDAGraph.replay", "torch.cuda.memory_reserved"):
        assert any(name in c for c in calls), f"{name} was never called through the checker"


def _fake_graph_runtime(monkeypatch: pytest.MonkeyPatch, fake_fi: FakeFlashInfer, calls: list[str]) -> None:
    """torch.cuda's stream and graph API on CPU: a captured run() is replayed against the current plan."""

    class Stream:
        def wait_stream(self, stream: Any) -> None:
            pass

    class Graph:
        def __init__(self) -> None:
            self.ops: list[Any] = []

        def replay(self) -> None:
            for op in self.ops:
                op()

        def reset(self) -> None:
            self.ops = []

    @contextmanager
    def graph(cuda_graph: Any, pool: Any = None, stream: Any = None) -> Any:
        fake_fi.capturing = cuda_graph._fake.ops
        try:
            yield
        finally:
            fake_fi.capturing = None

    @contextmanager
    def stream(s: Any) -> Any:
        yield

    fake_cuda = type("FakeCudaGraphs", (), {
        "Stream": Stream, "CUDAGraph": Graph, "graph": staticmethod(graph), "stream": staticmethod(stream),
        "current_stream": staticmethod(lambda device=None: Stream()),
        "synchronize": staticmethod(lambda device=None: None),
    })()
    monkeypatch.setattr(torch, "cuda", Checked(fake_cuda, CUDA, "torch.cuda", calls))


def test_cuda_device_calls_torch_cuda_as_installed() -> None:
    calls: list[str] = []
    cuda = FakeCuda()
    torch_mod = FakeTorch(cuda)
    torch_mod.cuda = Checked(cuda, CUDA, "torch.cuda", calls)
    dev = CudaDevice(0, torch_mod=torch_mod)
    a = dev.allocate(3 * MiB, owner="t")
    with dev.graph_capture() as pool:
        dev.free(dev.allocate(MiB, owner="t"))
    dev.free(a)
    dev.release_graph_pool(pool)
    dev.reset_peak_memory_stats()
    dev.max_memory_allocated(), dev.max_memory_reserved(), dev.memory_stats(), dev.segments()
    dev.close()
    assert {"torch.cuda.mem_get_info", "torch.cuda.graph", "torch.cuda.graph_pool_handle", "CUDAGraph.reset",
            "torch.cuda.memory_snapshot", "torch.cuda.get_device_properties"} <= set(calls)


def test_topology_calls_nvml_as_installed() -> None:
    calls: list[str] = []
    fake = FakeNvml([("NVIDIA H200", "GPU-a", 143771 * MiB), ("NVIDIA H200", "GPU-b", 143771 * MiB)],
                    links={(0, 1): "nvlink"}, nvlinks={0: 18, 1: 18})
    topo = detect_topology(Checked(fake, pynvml, "pynvml", calls), Checked(FakeCuda(count=2), CUDA,
                                                                            "torch.cuda", calls), env={})
    assert topo.count == 2 and topo.devices[0].nvlink_active == 18
    assert {"pynvml.nvmlDeviceGetNvLinkState", "pynvml.nvmlDeviceGetP2PStatus", "pynvml.nvmlDeviceGetMemoryInfo",
            "torch.cuda.get_device_properties", "torch.cuda.device_count"} <= set(calls)
