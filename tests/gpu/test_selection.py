"""Which cases the GPU tier runs on the detected GPU (pure, fake topologies), and the CUDA-init guard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gpu_fakes import FakeCuda, FakeNvml

import pytest_kvprofile.plugin.gpu as hooks
from pytest_kvprofile.gpu.selection import (
    OTHER_SM_COUNT,
    WEIGHTS_DO_NOT_FIT,
    DeviceFacts,
    device_facts,
    select_cases,
)
from pytest_kvprofile.gpu.topology import TopologyError, detect_topology
from pytest_kvprofile.matrix.schema import load_matrix_text, packaged_matrix
from pytest_kvprofile.units import GiB, MiB

H200 = ("NVIDIA H200", "GPU-a", 143771 * MiB)


def _default_cases():
    from pytest_kvprofile.matrix.schema import load_matrix

    return load_matrix(packaged_matrix("default")).cases


def test_default_matrix_on_an_h200_keeps_only_its_own_sm_count_and_fitting_weights():
    cases = _default_cases()
    facts = device_facts(detect_topology(FakeNvml([H200]), env={}))
    assert facts == DeviceFacts("NVIDIA H200", 132, 143771 * MiB)
    sel = select_cases(cases, facts)
    assert sel.run and len(sel.run) + len(sel.skipped) == len(cases)
    assert all(c.gpu.num_sm == 132 for c in sel.run)
    assert all(c.weights_bytes + c.nontorch_bytes < c.gmu * facts.memory_bytes for c in sel.run)
    kinds = {kind for _, kind, _ in sel.skipped}
    assert OTHER_SM_COUNT in kinds
    summary = "\n".join(sel.summary())
    assert f"running {len(sel.run)} of {len(cases)} cases on NVIDIA H200 (132 SMs" in summary
    assert "other SM count" in summary and "this GPU has 132" in summary


def test_weights_that_do_not_fit_are_skipped_with_the_figures():
    cases = load_matrix_text(
        "name: t\nenvelope: {max_num_seqs: 8, max_num_batched_tokens: 256, max_model_len: 2048}\nmodels:\n"
        "  big: {heads_q: 64, heads_kv: 8, head_dim: 128, num_layers: 80, weights_gib: 140}\n"
        "  small: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 4, weights_gib: 2}\n"
        "gpus: [H200]\ntp: [1, 2]\ngmu: [0.9]\n", "inline.yaml").cases
    sel = select_cases(cases, DeviceFacts("NVIDIA H200", 132, 143771 * MiB))
    ran = {(c.model.name, c.tp) for c in sel.run}
    assert ran == {("small", 1), ("small", 2), ("big", 2)}
    [(case, kind, reason)] = sel.skipped
    assert (case.model.name, case.tp, kind) == ("big", 1, WEIGHTS_DO_NOT_FIT)
    assert "weights 140.0 GiB per rank" in reason and "0.9 x 140.4 GiB" in reason
    assert sel.as_dict()["skipped"][0]["kind"] == WEIGHTS_DO_NOT_FIT


def test_measured_sm_count_wins_and_an_unknown_gpu_without_it_is_an_error():
    nvml = FakeNvml([("NVIDIA Future X1", "GPU-z", 200 * GiB)])
    with pytest.raises(TopologyError, match="matrix_gen --torch"):
        device_facts(detect_topology(nvml, env={}))
    assert device_facts(detect_topology(nvml, FakeCuda(sm=160), env={})).num_sm == 160
    with pytest.raises(pytest.UsageError, match="cannot tell which cases fit this GPU"):
        hooks.select_for_this_gpu([], detect_topology(nvml, env={}))


def test_configure_narrows_the_session_to_this_gpu(monkeypatch):
    cases = _default_cases()
    state = SimpleNamespace(tier="gpu", cases=list(cases))
    from pytest_kvprofile.plugin import SESSION_KEY

    cfg = SimpleNamespace(option=SimpleNamespace(kvprofile_gpu=True), stash=pytest.Stash(), getini=lambda n: False)
    cfg.stash[SESSION_KEY] = state
    monkeypatch.setattr("pytest_kvprofile.gpu.topology.detect_topology",
                        lambda: detect_topology(FakeNvml([H200]), env={}))
    hooks.pytest_configure(cfg)
    assert state.cases and {c.gpu.num_sm for c in state.cases} == {132}
    assert cfg.stash[hooks.SELECTION_KEY].skipped


class _Driver:
    def __init__(self, rc: int) -> None:
        self.rc = rc
        self.modes: list[int] = []

    def __call__(self, name: str, mode: int = 0) -> "_Driver":
        self.modes.append(mode)
        return self

    def cuDeviceGetCount(self, ptr: object) -> int:
        return self.rc


@pytest.mark.parametrize("maps, rc, want", [
    ("7f00 r-xp /usr/lib/libc.so.6\n", 0, False),  # libcuda never loaded: nothing ran cuInit
    ("7f00 r-xp /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n", hooks.CUDA_ERROR_NOT_INITIALIZED, False),
    ("7f00 r-xp /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n", 0, True),  # is_available() ran cuInit
])
def test_driver_initialized_sees_cuinit_without_torch_init(maps, rc, want):
    driver = _Driver(rc)
    assert hooks.driver_initialized(maps, driver) is want
    if "libcuda" in maps:
        import os

        assert driver.modes == [os.RTLD_NOLOAD | os.RTLD_LOCAL], "the guard must never load libcuda itself"


def test_cuda_initialized_guard_asks_the_driver_when_torch_is_not_initialized(monkeypatch):
    monkeypatch.setattr(hooks, "driver_initialized", lambda: True)
    assert hooks._cuda_initialized() is True
    monkeypatch.setattr(hooks, "driver_initialized", lambda: False)
    assert hooks._cuda_initialized() is False
