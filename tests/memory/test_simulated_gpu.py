"""simulated_gpu: the torch.cuda surface, FlashInfer's device caches, arena tensors (issue 13, items 1-2)."""

from __future__ import annotations

import pytest
import torch

import pytest_kvprofile
from pytest_kvprofile.contract.workspace import ArenaView, WorkspaceManager
from pytest_kvprofile.memory import simulated_gpu as sg
from pytest_kvprofile.memory.device import SimDevice
from pytest_kvprofile.memory.torch_mode import SimulatedCuda


def test_torch_cuda_surface_is_served_and_restored():
    before = torch.version.cuda
    with pytest_kvprofile.simulated_gpu("H100", flashinfer=False) as dev:
        assert torch.version.cuda == sg.SIMULATED_CUDA_VERSION
        assert torch.cuda.get_device_properties(0).multi_processor_count == 132
        s = torch.cuda.current_stream()
        assert s == torch.cuda.default_stream() and s.cuda_stream == 0
        side = torch.cuda.Stream()
        side.wait_stream(s)
        with torch.cuda.stream(side), torch.cuda.device(0):
            t = torch.empty(1000, device="cuda")
        t.record_stream(side)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        assert start.elapsed_time(end) == 0.0
        torch.cuda.nvtx.range_push("step")
        torch.cuda.nvtx.range_pop()
        ptr = torch.cuda.caching_allocator_alloc(4096)
        direct = [a for a in dev.live_allocations() if a.ptr == ptr]
        assert direct and direct[0].tag == "torch.cuda.caching_allocator_alloc"
        snap = torch.cuda.memory_snapshot()
        assert sum(seg["allocated_size"] for seg in snap) == dev.memory_allocated()
        torch.cuda.caching_allocator_delete(ptr)
        assert not direct[0].alive
        g = torch.Generator(device="cuda")
        assert isinstance(g, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
        assert torch.randn(4, generator=g.manual_seed(0), device="cuda").is_cuda
    assert torch.version.cuda == before
    assert not torch.cuda.is_available()
    with pytest.raises((RuntimeError, AssertionError, AttributeError)):
        torch.cuda.current_stream()


def test_total_memory_override_and_unknown_gpu():
    with pytest_kvprofile.simulated_gpu("L40S", total_memory=1 << 30, flashinfer=False) as dev:
        assert dev.total_memory == 1 << 30 and dev.num_sm == 142 and dev.compute_capability == (8, 9)
    with pytest.raises(KeyError, match="unknown GPU"):
        with pytest_kvprofile.simulated_gpu("Z9000", flashinfer=False):
            pass


def _sms_seen(gpus):
    import flashinfer.utils

    seen = []
    for gpu in gpus:
        with pytest_kvprofile.simulated_gpu(gpu):
            props = flashinfer.utils.get_device_properties(torch.device("cuda"))
            seen.append((props.multi_processor_count, flashinfer.utils.get_compute_capability(torch.device("cuda")),
                         flashinfer.utils.is_sm90a_supported(torch.device("cuda"))))
    return seen


def test_flashinfer_device_caches_answer_each_gpu():
    """Acceptance: an L40S case then an H100 case in one process see 142 then 132 SMs through FlashInfer."""
    assert _sms_seen(["L40S", "H100"]) == [(142, (8, 9), False), (132, (9, 0), True)]
    import flashinfer.utils

    assert flashinfer.utils.get_device_properties.cache_info().currsize == 0  # nothing leaks out of the block


def test_stale_caches_are_what_the_check_catches(monkeypatch):
    """Broken variant: without clearing FlashInfer's caches the H100 reports the L40S's 142 SMs."""
    monkeypatch.setattr(sg, "clear_flashinfer_caches", lambda: 0)
    seen = _sms_seen(["L40S", "H100"])
    import flashinfer.utils

    flashinfer.utils.get_device_properties.cache_clear()
    flashinfer.utils.get_compute_capability.cache_clear()
    flashinfer.utils.is_sm90a_supported.cache_clear()
    assert seen[1][0] == 142


def test_leaving_the_block_reads_no_lazy_library_proxy_flashinfer_exports():
    """``flashinfer.comm.cuda_ipc`` (imported by SGLang) exports ``cudart``, a proxy whose every attribute read loads
    libcudart; looking for FlashInfer's memoized functions read ``cache_info`` on it and leaving the block raised
    "libcudart is not loaded in the current process" on a CPU machine. The caches are still cleared."""
    pytest.importorskip("flashinfer")
    with pytest_kvprofile.simulated_gpu("L40S"):
        import flashinfer.comm.cuda_ipc as ipc
        import flashinfer.utils

        flashinfer.utils.get_device_properties(torch.device("cuda"))
        assert flashinfer.utils.get_device_properties.cache_info().currsize == 1
    assert ipc.cudart._library is None  # never loaded
    assert flashinfer.utils.get_device_properties.cache_info().currsize == 0


def test_other_jit_modules_are_refused_by_name():
    from types import SimpleNamespace

    import flashinfer.jit.core

    real = flashinfer.jit.core.JitSpec.build_and_load
    with pytest_kvprofile.simulated_gpu("H100"):
        with pytest.raises(sg.SimulatedDeviceUnsupported, match="some_gemm_module.*no host implementation"):
            flashinfer.jit.core.JitSpec.build_and_load(SimpleNamespace(name="some_gemm_module"))
    assert flashinfer.jit.core.JitSpec.build_and_load is real


def test_arena_views_are_tensors_in_torch_mode():
    with pytest_kvprofile.simulated_gpu("H100", flashinfer=False) as dev:
        mgr = WorkspaceManager(dev, num_ubatches=2)
        a = mgr.get_workspace("prefill", 1 << 20)
        b = mgr.get_workspace("decode", 1 << 19)
        assert a.tensor.dtype == torch.uint8 and a.tensor.is_cuda
        assert a.tensor.numel() == a.nbytes and b.tensor.numel() == b.nbytes
        assert a.tensor.untyped_storage().data_ptr() == b.tensor.untyped_storage().data_ptr()
        arena = [x for x in dev.live_allocations() if x.ptr == a.ptr]
        assert arena and arena[0].owner == "workspace-manager" and arena[0].nbytes == 1 << 20
        other = mgr.get_workspace("prefill", 1 << 20, ubatch=1)
        assert other.tensor.untyped_storage().data_ptr() != a.tensor.untyped_storage().data_ptr()
        snap = mgr.snapshot()
        assert snap[0].tensor.numel() == snap[0].arena_size
    assert ArenaView(0, a.ptr, a.nbytes, a.arena_size) == a  # the tensor takes no part in equality
    assert hash(ArenaView(0, a.ptr, a.nbytes, a.arena_size)) == hash(a)
    assert "tensor" not in repr(a)


def test_arena_tensor_on_request_in_ctx_mode():
    assert WorkspaceManager(SimDevice(name="H100", total_memory=80 << 30, num_sm=132)).get_workspace(
        "x", 4096).tensor is None
    dev = SimDevice(name="H100", total_memory=80 << 30, num_sm=132)
    mgr = WorkspaceManager(dev, arena_tensors=lambda: SimulatedCuda(dev))
    view = mgr.get_workspace("x", 4096)
    assert view.tensor is not None and view.tensor.numel() == 4096
    assert [x.nbytes for x in dev.live_allocations()] == [4096]
    mgr.close()
    assert not dev.live_allocations()


def test_the_old_boolean_arena_tensors_says_the_new_form():
    dev = SimDevice(name="H100", total_memory=80 << 30, num_sm=132)
    with pytest.raises(TypeError, match=r"arena_tensors=lambda: SimulatedCuda\(device\)"):
        WorkspaceManager(dev, arena_tensors=True)  # type: ignore[arg-type]


def test_the_simulated_gpu_has_no_cudnn_runtime():
    """FlashInfer's plan() asks on compute capability 10.0 whether cuDNN may serve a paged prefill; the CPU machine's
    cuDNN frontend raises when asked, a machine without cuDNN answers no, and so does the simulated B200."""
    pytest.importorskip("flashinfer")
    import flashinfer.prefill

    original = flashinfer.prefill._cudnn_supports_paged_auto
    with sg.simulated_gpu("B200"):
        assert flashinfer.prefill._cudnn_supports_paged_auto() is False
    assert flashinfer.prefill._cudnn_supports_paged_auto is original


LAZY = """
import sys
from pytest_kvprofile.memory import simulated_gpu as sg

with sg.simulated_gpu("B200"):
    assert "flashinfer" not in sys.modules  # entering costs no FlashInfer import
    import flashinfer.prefill  # the block's code imports it: patched as it arrives

    assert flashinfer.prefill._cudnn_supports_paged_auto() is False
    patched = flashinfer.prefill.get_batch_prefill_module
assert flashinfer.prefill._cudnn_supports_paged_auto is not sg._no_cudnn
assert flashinfer.prefill.get_batch_prefill_module is not patched  # undone on exit
assert not any(isinstance(f, sg._PatchOnImport) for f in sys.meta_path)
with sg.simulated_gpu("B200"):  # imported now: patched on entry
    assert flashinfer.prefill._cudnn_supports_paged_auto() is False
print("ok")
"""


def test_flashinfer_is_imported_only_by_code_that_uses_it_and_then_patched():
    """A torch-mode block that never imports FlashInfer does not pay its import (seconds); one that does gets the
    simulated GPU's FlashInfer all the same."""
    pytest.importorskip("flashinfer")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
