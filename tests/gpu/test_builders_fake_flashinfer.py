"""The real FlashInfer builders' protocol logic end to end on CPU: a fake ``flashinfer`` module that
plans with a bump allocator and runs exact attention, on CudaDevice over a hybrid fake torch.cuda."""

from __future__ import annotations

import sys

import pytest
from gpu_fakes import FakeFlashInfer, HybridCuda, HybridTorch

from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS, REAL_FLASHINFER_MUTANTS
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME, checks_for
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.gpu.cuda_device import CudaDeviceFactory
from pytest_kvprofile.gpu.sizing_probe import (
    SHORT_BY,
    api_workspace_size,
    expect_overflow,
    plan_on_device,
    route_probes,
)
from pytest_kvprofile.lifecycle.driver import run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix_text

CASES = load_matrix_text(
    "name: t\nenvelope: {max_num_seqs: 8, max_num_batched_tokens: 256, max_model_len: 2048, "
    "cuda_graph_sizes: [1, 2, 4, 8], num_ubatches: 2}\nmodels:\n  m: {heads_q: 8, heads_kv: 2, head_dim: 64, "
    "num_layers: 2, weights_gib: 1, hidden_size: 512}\ngpus: [H200]\ntp: [1]\nmtp: [0, 1]\ngmu: [0.9]\n",
    "inline.yaml").cases


def _factory(case):
    return CudaDeviceFactory(
        torch_mod=HybridTorch(HybridCuda(total=case.gpu.memory_bytes, nontorch=case.nontorch_bytes)))


def _failures(result, skip: tuple[str, ...] = ()):
    """Every applicable check but ``skip`` (the warmup-retry probe re-runs on the run's own device factory)."""
    out = {}
    for check in checks_for(result.path):
        if check.name not in skip and check.relevant(result.case, result.builders):
            violations = check.run(result)
            if violations:
                out[check.name] = violations
    return out


@pytest.fixture
def fake_fi(monkeypatch):
    fi = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    return fi


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_correct_builder_passes_every_check(fake_fi, case):
    factory = _factory(case)
    result = run_lifecycle(REAL_FLASHINFER_BACKENDS[0], case, device_factory=factory)
    assert not result.errors, result.errors[0].describe()
    builder = result.builders[0]
    assert len(builder.errors) == 4 and max(builder.errors) < 1e-2, "the warmup checked prefill and decode per ubatch"
    alive = [w for w in (ref() for ref in fake_fi.made) if w is not None]
    per_ubatch = 2 + len(case.envelope.decode_captures(case.mtp))  # prefill, decode, one per captured step
    assert len(alive) == len(fake_fi.made) == 2 * per_ubatch, "built once, inside the window, and kept"
    float_bufs = {w.float_buf.data_ptr() for w in alive}
    assert len(float_bufs) == 2, "one arena per micro-batch, shared by that micro-batch's wrappers"
    int_bufs = {w.int_buf.data_ptr() for w in alive}
    assert len(int_bufs) == len(alive), "every wrapper has its own int workspace, allocated through the context"
    int_allocs = [a for a in result.allocations if "int workspace" in a.tag]
    assert len(int_allocs) == len(alive) and {a.role for a in int_allocs} == {Role.INT_WORKSPACE}
    # The warmup-retry probe re-runs the whole warmup on fresh devices (seconds on CPU); its logic does
    # not depend on MTP, so it runs for the first case only.
    assert _failures(result, skip=("warmup_retryable",) if case.mtp else ()) == {}
    factory.release(result)
    assert builder.slots == {} and factory.last is None
    assert not [a for a in result.allocations if a.alive and a.owner == builder.name], "close() freed its buffers"


def test_a_corrupted_kernel_output_fails_the_warmup(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", FakeFlashInfer(corrupt=True))
    result = run_lifecycle(REAL_FLASHINFER_BACKENDS[0], CASES[0], device_factory=_factory(CASES[0]))
    assert result.aborted_in == "warmup"  # the engine's warmup after KV sizing: kernels run on the final arena
    assert result.errors[0].exc_type == "AttentionMismatch"
    assert "differs from the float32 reference" in result.errors[0].message
    live = [a for a in result.allocations if a.alive and "warmup test data" in a.tag]
    assert live == [], "the failed warmup's test data was freed"


def test_lazy_builder_is_caught(fake_fi):
    case = CASES[0]
    result = run_lifecycle(REAL_FLASHINFER_MUTANTS[0], case, device_factory=_factory(case))
    assert not result.errors, result.errors[0].describe()
    violations = CHECKS_BY_NAME["persistent_memory_visible_at_closing"].run(result)
    assert violations and "invisible to KV sizing" in violations[0] and "int workspace" in violations[0]


def test_sizing_probe_exact_short_and_api(monkeypatch):
    probe = route_probes(CASES[1])[0]
    fi = FakeFlashInfer(need=lambda route, layout: probe.float_bytes)
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    assert plan_on_device(probe, probe.float_bytes, device="cpu") < 1e-2
    assert "Increase the workspace buffer size" in expect_overflow(probe, probe.float_bytes - SHORT_BY, device="cpu")
    assert api_workspace_size(probe, device="cpu") == probe.float_bytes
    with pytest.raises(AssertionError, match="the oracle overstates"):
        expect_overflow(probe, probe.float_bytes, device="cpu")


def test_overflow_probe_rejects_other_errors(monkeypatch):
    probe = route_probes(CASES[0])[0]

    def broken(route, layout):
        raise RuntimeError("illegal memory access")

    monkeypatch.setitem(sys.modules, "flashinfer", FakeFlashInfer(need=broken))
    with pytest.raises(AssertionError, match="not FlashInfer's buffer overflow"):
        expect_overflow(probe, 16, device="cpu")
