"""Topology detection and worker pinning, with a fake NVML and a fake torch.cuda."""

from __future__ import annotations

import pytest
from gpu_fakes import FakeCuda, FakeNvml

from pytest_kvprofile.gpu.matrix_gen import detected_gpu_entry, one_gpu_matrix
from pytest_kvprofile.gpu.pinning import (
    PinningError,
    apply_pinning,
    plan_pinning,
    worker_index,
)
from pytest_kvprofile.gpu.topology import (
    TopologyError,
    detect_topology,
    match_catalog,
    visible_nvml_indices,
)
from pytest_kvprofile.units import MiB


@pytest.mark.parametrize("name, mib, want", [
    ("NVIDIA H200", 143771, "H200"),
    ("NVIDIA L40S", 46068, "L40S"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, "RTX PRO 6000 Blackwell"),
    ("NVIDIA B200", 183359, "B200"),
    ("NVIDIA H100 80GB HBM3", 81559, "H100"),
    ("NVIDIA H100 PCIe", 81559, "H100 PCIe"),
    ("NVIDIA GeForce RTX 5090", 32607, "RTX 5090"),
])
def test_nvml_names_map_to_the_catalog(name, mib, want):
    assert match_catalog(name, mib * MiB).name == want


def test_unknown_or_mismatched_memory_is_not_matched():
    assert match_catalog("NVIDIA H100 NVL", 95830 * MiB) is None  # 94 GB is not the catalog's 80 GB H100
    assert match_catalog("NVIDIA H2000") is None  # a prefix must end on a word boundary
    assert match_catalog("NVIDIA") is None


def test_detects_devices_links_and_torch_properties():
    nvml = FakeNvml([("NVIDIA H200", "GPU-aaa", 143771 * MiB), ("NVIDIA H200", "GPU-bbb", 143771 * MiB),
                     ("NVIDIA H200", "GPU-ccc", 143771 * MiB)], links={(0, 1): "nvlink"})
    topo = detect_topology(nvml, FakeCuda(sm=132, cc=(9, 0), count=2), env={"CUDA_VISIBLE_DEVICES": "2,0"})
    assert topo.driver_version == "580.159.04" and topo.count == 3
    assert nvml.inits == 1 and nvml.shutdowns == 1
    assert topo.link(0, 1).kind == "nvlink" and topo.link(1, 2).kind == "pcie"
    assert "host-bridge" in topo.link(0, 2).detail
    assert [d.index for d in topo.visible] == [2, 0]
    assert topo.devices[1].cuda_index is None and topo.devices[1].num_sm is None
    assert topo.devices[2].num_sm == 132 and topo.devices[2].compute_capability == (9, 0)
    assert topo.interconnect(0) == "nvlink" and topo.interconnect(2) == "pcie"
    assert topo.spec(topo.devices[0]).name == "H200" and topo.mismatches(topo.devices[2]) == []


def test_no_torch_means_no_cuda_query():
    class Exploding:
        def __getattr__(self, name):
            raise AssertionError("torch.cuda must not be asked")

    topo = detect_topology(FakeNvml([("NVIDIA L40S", "GPU-x", 46068 * MiB)]), env={})
    assert topo.devices[0].num_sm is None and topo.devices[0].cuda_index == 0
    assert detected_gpu_entry(topo) == "L40S"


def test_unknown_gpu_needs_sm_count_and_is_described_inline():
    nvml = FakeNvml([("NVIDIA Future X1", "GPU-z", 200_000 * MiB)], nvlinks={0: 4})
    topo = detect_topology(nvml, env={})
    with pytest.raises(TopologyError, match="SM count is unknown"):
        topo.spec(topo.devices[0])
    topo = detect_topology(nvml, FakeCuda(sm=160, cc=(10, 3)), env={})
    entry = detected_gpu_entry(topo)
    assert entry == {"name": "NVIDIA Future X1", "num_sm": 160, "memory_gb": 209.715, "interconnect": "nvlink"}


def test_measured_sm_count_disagreeing_with_catalog_is_reported():
    topo = detect_topology(FakeNvml([("NVIDIA H200", "GPU-a", 143771 * MiB)]), FakeCuda(sm=114), env={})
    assert "114 SMs measured" in topo.mismatches(topo.devices[0])[0]


def test_nvml_failure_is_a_clear_error():
    with pytest.raises(TopologyError, match="NVML could not be initialized: Driver Not Loaded"):
        detect_topology(FakeNvml([], fail_init=True))


def test_p2p_unsupported_falls_back_to_common_ancestor():
    nvml = FakeNvml([("NVIDIA L40S", "GPU-a", 46068 * MiB), ("NVIDIA L40S", "GPU-b", 46068 * MiB)],
                    p2p_unsupported=True)
    link = detect_topology(nvml, env={}).link(0, 1)
    assert link.kind == "pcie" and "P2P status unavailable" in link.detail


@pytest.mark.parametrize("value, want", [
    (None, [0, 1, 2]), ("1", [1]), ("2,0", [2, 0]), ("GPU-bbb", [1]), ("bbb,0", [1, 0]),
    ("0,7,1", [0]), ("", []), ("0,0", [0]), ("MIG-1", []),
])
def test_visible_indices_follow_cuda_rules(value, want):
    assert visible_nvml_indices(value, ["GPU-aaa", "GPU-bbb", "GPU-ccc"]) == want


@pytest.mark.parametrize("worker, want", [("gw0", 0), ("gw12", 12), ("master", None), (None, None), ("gwx", None)])
def test_worker_index(worker, want):
    assert worker_index(worker) == want


def test_workers_get_one_gpu_each():
    pins = [plan_pinning({"PYTEST_XDIST_WORKER": f"gw{i}", "PYTEST_XDIST_WORKER_COUNT": "4"}, 4) for i in range(4)]
    assert [p.device for p in pins] == ["0", "1", "2", "3"]
    assert dict(pins[0].env)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert plan_pinning({}, 4) is None


def test_existing_visible_devices_are_respected():
    pin = plan_pinning({"PYTEST_XDIST_WORKER": "gw1", "CUDA_VISIBLE_DEVICES": "5, 7"}, 8)
    assert pin.device == "7"


def test_more_workers_than_gpus_is_refused():
    with pytest.raises(PinningError, match="-n 3 starts more GPU-tier workers than the 2 GPU"):
        plan_pinning({"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "3"}, 2)
    with pytest.raises(PinningError, match="no GPU to pin"):
        plan_pinning({"PYTEST_XDIST_WORKER": "gw0"}, 0)


def test_apply_writes_env_and_refuses_after_cuda_init():
    env = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    assert apply_pinning(env, 2).device == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(PinningError, match="CUDA was initialized"):
        apply_pinning({"PYTEST_XDIST_WORKER": "gw1"}, 2, cuda_initialized=True)


def test_one_gpu_matrix_keeps_layouts_and_replaces_gpus():
    base = {"name": "ci", "gpus": ["L40S", "B200"], "tp": [1, 4], "exclude": [{"tp": 1, "dcp": 2}, {"gpu": "L40S"}]}
    doc = one_gpu_matrix(base, "H200")
    assert doc["gpus"] == ["H200"] and doc["tp"] == [1, 4] and doc["name"] == "ci-on-h200"
    assert doc["exclude"] == [{"tp": 1, "dcp": 2}]


def test_nvlink_count_continues_past_a_missing_link():
    nvml = FakeNvml([("NVIDIA H200", "GPU-a", 143771 * MiB)], nvlinks={0: 18}, missing_links=frozenset({0, 5}))
    assert detect_topology(nvml, env={}).devices[0].nvlink_active == 16
