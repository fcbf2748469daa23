"""GPU-tier tests: topology, the CUDA device adapter, the oracle against the real planner, and the
lifecycle with real FlashInfer wrappers. Every test needs --kvprofile-gpu and a CUDA device.

Cases come from the session's matrices, filtered to the GPU under test (sizing is per SM count);
``scripts/run_gpu_tier.sh`` generates a one-GPU matrix for the detected device.
"""

from __future__ import annotations

from typing import Any

import pytest
from pytest_kvprofile.units import MiB

pytestmark = pytest.mark.kvprofile_gpu


def _session(config: Any) -> Any:
    from pytest_kvprofile.plugin import SESSION_KEY

    return config.stash.get(SESSION_KEY, None)


def _detected_slug() -> str | None:
    """The catalog slug of this process's first visible GPU, from NVML (no CUDA context)."""
    from pytest_kvprofile.gpu.topology import TopologyError, detect_topology

    try:
        visible = detect_topology().visible
    except TopologyError:
        return None
    if not visible:
        return None
    cat = visible[0].catalog
    return cat.slug if cat is not None else None


def _gpu_cases(config: Any) -> list[Any]:
    state = _session(config)
    if state is None or state.tier != "gpu":
        return []
    slug = _detected_slug()
    seen, out = set(), []
    for case in state.runnable_cases:
        key = (case.model, case.tp, case.dcp, case.mtp, case.envelope)
        if case.gpu.slug == slug and key not in seen:
            seen.add(key)
            out.append(case)
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    cases = _gpu_cases(metafunc.config)
    on_gpu = _session(metafunc.config) is not None and _session(metafunc.config).tier == "gpu"
    none = pytest.param(None, id="no-case-for-this-gpu")
    if "gpu_case" in metafunc.fixturenames:
        params = [pytest.param(c, id=c.id) for c in cases] or [none if on_gpu else pytest.param(None, id="cpu-tier")]
        metafunc.parametrize("gpu_case", params)
    elif "route_probe" in metafunc.fixturenames:
        from pytest_kvprofile.gpu.sizing_probe import route_probes

        probes = [p for c in cases for p in route_probes(c)]
        params = [pytest.param(p, id=p.id) for p in probes] or [none if on_gpu else pytest.param(None, id="cpu-tier")]
        metafunc.parametrize("route_probe", params)


def _require(value: Any) -> Any:
    if value is None:
        pytest.fail("no case in the matrices targets the GPU under test: pass the matrix that "
                    "`python -m pytest_kvprofile.gpu.matrix_gen` writes for it", pytrace=False)
    return value


# -- topology and the device adapter ---------------------------------------------------------------

def test_topology_matches_catalog(gpu_topology: Any, record_property: Any) -> None:
    dev = gpu_topology.visible[0]
    record_property("gpu", gpu_topology.describe())
    assert dev.num_sm and dev.num_sm > 0 and dev.compute_capability is not None
    assert dev.catalog is not None, f"{dev.name!r} is not in the catalog (topology.py): add it or describe it inline"
    assert gpu_topology.mismatches(dev) == []


def test_cuda_device_figures_follow_torch(gpu_device_factory: Any) -> None:
    import torch

    dev = gpu_device_factory(None)
    free0, total = dev.mem_get_info()
    assert total == dev.total_memory and 0 <= dev.nontorch_bytes < total
    a = dev.allocate(64 * MiB + 1, owner="test", tag="one")
    assert a.size >= a.nbytes and a.size % 512 == 0
    assert dev.memory_allocated() - dev.start_allocated >= a.size
    free1, _ = dev.mem_get_info()
    assert free0 - free1 == dev.memory_reserved() - dev.start_reserved
    reserved = dev.memory_reserved()
    dev.free(a)
    assert dev.memory_reserved() == reserved, "a freed block stays cached (reserved) until empty_cache"
    dev.empty_cache()
    assert dev.memory_reserved() < reserved
    assert torch.cuda.memory_allocated() == dev.start_allocated
    dev.close()


def test_graph_pool_figures_match_snapshot(gpu_device_factory: Any) -> None:
    dev = gpu_device_factory(None)
    with dev.graph_capture() as pool:
        x = dev.allocate(30 * MiB, owner="test", tag="in graph")
        dev.free(x)
        y = dev.allocate(MiB, owner="test", tag="graph output")
    assert pool.reserved >= 30 * MiB and pool.high_water_reserved >= pool.reserved
    if pool.measured_reserved is not None:
        assert pool.measured_reserved == pool.reserved
    held = pool.reserved
    before = dev.memory_reserved()
    dev.free(y)
    dev.release_graph_pool(pool)
    assert pool.released and pool.reserved == 0
    assert dev.memory_reserved() <= before - held, "releasing the graphs must return the pool's segments"
    dev.close()


def test_allocator_model_matches_cuda(gpu_device_factory: Any, record_property: Any) -> None:
    """The simulated device's figures against the real allocator's, step by step (error in bytes)."""
    from pytest_kvprofile.memory.device import SimDevice

    real = gpu_device_factory(None)
    sim = SimDevice(name=real.name, total_memory=real.total_memory, num_sm=real.num_sm,
                    nontorch_bytes=real.nontorch_bytes)
    steps = [1, 600 << 10, MiB + 1, 8 * MiB, 12 * MiB + 1, 394 * MiB, 13 * MiB + 1]
    worst = 0
    live = []
    for n in steps:
        live.append((real.allocate(n, owner="t"), sim.allocate(n, owner="t")))
        worst = max(worst, abs((real.memory_reserved() - real.start_reserved) - sim.memory_reserved()),
                    abs((real.memory_allocated() - real.start_allocated) - sim.memory_allocated()))
    for r, s in live[::2]:
        real.free(r)
        sim.free(s)
    real.empty_cache()
    sim.empty_cache()
    worst = max(worst, abs((real.memory_reserved() - real.start_reserved) - sim.memory_reserved()))
    record_property("allocator_model_error_bytes", worst)
    real.close()
    assert worst == 0, f"the allocator model is off by {worst} bytes on this torch"


# -- the sizing oracle against the real planner ---------------------------------------------------

@pytest.fixture
def route_probe(request: pytest.FixtureRequest, gpu_topology: Any) -> Any:
    return _require(request.param)


@pytest.fixture
def gpu_case(request: pytest.FixtureRequest, gpu_topology: Any) -> Any:
    return _require(request.param)


def test_exact_oracle_bytes_plan_and_run(route_probe: Any, record_property: Any) -> None:
    from pytest_kvprofile.gpu.sizing_probe import plan_on_device

    err = plan_on_device(route_probe, route_probe.float_bytes)
    record_property("relative_error", err)
    record_property("float_bytes", route_probe.float_bytes)


def test_sixteen_bytes_short_overflows(route_probe: Any) -> None:
    from pytest_kvprofile.gpu.sizing_probe import SHORT_BY, expect_overflow

    if not route_probe.exact:
        pytest.skip(f"{route_probe.route}: the oracle gives a bound here, not the exact need ({route_probe.method})")
    message = expect_overflow(route_probe, route_probe.float_bytes - SHORT_BY)
    assert "Buffer overflow" in message


def test_workspace_size_api_agrees(route_probe: Any) -> None:
    from pytest_kvprofile.gpu.sizing_probe import api_workspace_size

    got = api_workspace_size(route_probe)
    if got is None:
        pytest.skip("this FlashInfer has no workspace_size() (added in 0.6.15)")
    if route_probe.exact:
        assert got == route_probe.float_bytes
    else:
        assert got <= route_probe.float_bytes


# -- the lifecycle with real FlashInfer wrappers ---------------------------------------------------

def test_lifecycle_real_flashinfer_passes_every_check(gpu_case: Any, gpu_device_factory: Any,
                                                     record_property: Any) -> None:
    from pytest_kvprofile.checks.catalog import checks_for
    from pytest_kvprofile.gpu.flashinfer_builders import gpu_backends
    from pytest_kvprofile.lifecycle.driver import run_lifecycle

    backend = gpu_backends()[0]
    result = run_lifecycle(backend, gpu_case, device_factory=gpu_device_factory)
    sim = run_lifecycle(backend.__class__(name="sim", make_builders=_stub_builders), gpu_case)
    gpu_device_factory.release(result)
    assert not result.errors, result.errors[0].describe()
    failures = {}
    for check in checks_for(result.path):
        if check.name == "warmup_retryable" and "device_factory" not in result.extra:
            continue  # its probe would re-run this CUDA builder on a simulated device (no factory recorded)
        if check.relevant(result.case, result.builders):
            violations = check.run(result)
            if violations:
                failures[check.name] = violations[0]
    if result.budget is not None and sim.budget is not None:
        record_property("budget_real", result.budget.as_dict())
        record_property("budget_sim", sim.budget.as_dict())
    assert failures == {}


def _stub_builders(case: Any) -> list[Any]:
    from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder

    return [FlashInferLikeBuilder(case)]


def test_lazy_mutant_is_caught_on_cuda(gpu_case: Any, gpu_device_factory: Any) -> None:
    from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME
    from pytest_kvprofile.gpu.flashinfer_builders import gpu_mutant_backends
    from pytest_kvprofile.lifecycle.driver import run_lifecycle

    result = run_lifecycle(gpu_mutant_backends()[0], gpu_case, device_factory=gpu_device_factory)
    gpu_device_factory.release(result)
    violations = CHECKS_BY_NAME["persistent_memory_visible_at_closing"].run(result)
    assert violations, "the lazy FlashInfer builder's post-KV wrappers went unnoticed on real hardware"
    assert "invisible to KV sizing" in violations[0]
