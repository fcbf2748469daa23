"""The GPU hook module's pytest_configure/sessionstart with fake configs (no CUDA, no xdist)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import pytest_kvprofile.plugin.gpu as hooks
from pytest_kvprofile.gpu.cuda_device import CudaDeviceFactory
from pytest_kvprofile.plugin import SESSION_KEY


def _config(gpu: bool, worker: bool, state=None):
    cfg = SimpleNamespace(option=SimpleNamespace(kvprofile_gpu=gpu), stash=pytest.Stash(), getini=lambda name: False)
    if worker:
        cfg.workerinput = {"workerid": "gw1"}
    if state is not None:
        cfg.stash[SESSION_KEY] = state
    return cfg


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(hooks, "_device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")


def test_worker_is_pinned_on_the_gpu_tier(two_gpus, monkeypatch):
    import os

    cfg = _config(gpu=True, worker=True)
    hooks.pytest_configure(cfg)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and cfg.stash[hooks.PIN_KEY].index == 1


def test_cpu_tier_and_controller_pin_nothing(two_gpus):
    import os

    hooks.pytest_configure(_config(gpu=False, worker=True))
    hooks.pytest_configure(_config(gpu=True, worker=False))
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_too_many_workers_is_a_usage_error(two_gpus, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    with pytest.raises(pytest.UsageError, match="-n 3 starts more GPU-tier workers than the 2 GPU"):
        hooks.pytest_configure(_config(gpu=True, worker=True))


def test_sessionstart_hands_the_factory_to_the_session(monkeypatch):
    monkeypatch.setattr(hooks, "controller_hardware", lambda: {"topology": "fake"})
    state = SimpleNamespace(tier="gpu", hardware=None)
    hooks.pytest_sessionstart(SimpleNamespace(config=_config(gpu=True, worker=False, state=state)))
    assert isinstance(state.device_factory, CudaDeviceFactory) and state.hardware == {"topology": "fake"}
    worker_state = SimpleNamespace(tier="gpu", hardware=None)
    hooks.pytest_sessionstart(SimpleNamespace(config=_config(gpu=True, worker=True, state=worker_state)))
    assert worker_state.hardware is None and isinstance(worker_state.device_factory, CudaDeviceFactory)
    cpu_state = SimpleNamespace(tier="cpu", hardware=None)
    hooks.pytest_sessionstart(SimpleNamespace(config=_config(gpu=False, worker=False, state=cpu_state)))
    assert not hasattr(cpu_state, "device_factory")
