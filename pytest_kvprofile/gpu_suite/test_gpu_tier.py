"""GPU-tier tests: topology, the CUDA device adapter, the oracle against the real planner, and the
lifecycle with real FlashInfer wrappers. Every test needs --kvprofile-gpu and a CUDA device.

Cases come from the session's matrices, filtered to the GPU under test (sizing is per SM count);
``scripts/run_gpu_tier.sh`` generates a one-GPU matrix for the detected device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pytest

from pytest_kvprofile.gpu.cuda_device import MEM_GET_INFO_TOLERANCE
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.gpu.cuda_device import CudaDeviceFactory
    from pytest_kvprofile.gpu.sizing_probe import RouteProbe
    from pytest_kvprofile.gpu.topology import GpuTopology
    from pytest_kvprofile.matrix.cases import Case
    from pytest_kvprofile.plugin import FixtureParam
    from pytest_kvprofile.plugin.session import KvprofileSession

RecordProperty = Callable[[str, object], None]  # pytest's record_property fixture

pytestmark = pytest.mark.kvprofile_gpu


def _session(config: pytest.Config) -> KvprofileSession | None:
    from pytest_kvprofile.plugin.session import SESSION_KEY

    return config.stash.get(SESSION_KEY, None)


def _gpu_cases(config: pytest.Config) -> list[Case]:
    """The session's cases (already narrowed to this GPU by ``plugin/gpu.py``), one per layout."""
    state = _session(config)
    if state is None or state.tier != "gpu":
        return []
    seen, out = set(), []
    for case in state.runnable_cases:
        key = (case.model, case.tp, case.dcp, case.mtp, case.envelope)
        if key not in seen:
            seen.add(key)
            out.append(case)
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``gpu_case``/``route_probe`` indirectly, so the fixtures of those names still run
    (they skip on the CPU tier and fail clearly when no case targets this GPU)."""
    if not {"gpu_case", "route_probe"} & set(metafunc.fixturenames):
        return
    state = _session(metafunc.config)
    on_gpu = state is not None and state.tier == "gpu"
    cases = _gpu_cases(metafunc.config)
    none = pytest.param(None, id="no-case-for-this-gpu" if on_gpu else "cpu-tier")
    if "gpu_case" in metafunc.fixturenames:
        params = [pytest.param(c, id=c.id) for c in cases] or [none]
        metafunc.parametrize("gpu_case", params, indirect=True)
    if "route_probe" in metafunc.fixturenames:
        from pytest_kvprofile.gpu.sizing_probe import route_probes

        probes = [p for c in cases for p in route_probes(c)]
        metafunc.parametrize("route_probe", [pytest.param(p, id=p.id) for p in probes] or [none], indirect=True)


def _require(value: FixtureParam) -> FixtureParam:
    if value is None:
        pytest.fail("no case in the matrices fits the GPU under test (the header lists what was skipped and why): "
                    "pass the matrix that `python -m pytest_kvprofile.gpu.matrix_gen` writes for it", pytrace=False)
    return value


# -- topology and the device adapter ---------------------------------------------------------------

def test_topology_matches_catalog(gpu_topology: GpuTopology, record_property: RecordProperty) -> None:
    dev = gpu_topology.visible[0]
    record_property("gpu", gpu_topology.describe())
    assert dev.num_sm and dev.num_sm > 0 and dev.compute_capability is not None
    assert dev.catalog is not None, f"{dev.name!r} is not in the catalog (topology.py): add it or describe it inline"
    assert gpu_topology.mismatches(dev) == []


# Any: the session's CudaDeviceFactory, called here with no case (it reads none)
def test_cuda_device_figures_follow_torch(gpu_device_factory: Any) -> None:
    import torch

    dev = gpu_device_factory(None)
    free0, total = dev.mem_get_info()
    assert total == dev.total_memory and 0 <= dev.nontorch_bytes < total
    a = dev.allocate(64 * MiB + 1, owner="test", tag="one")
    assert a.size >= a.nbytes and a.size % 512 == 0
    assert dev.memory_allocated() - dev.start_allocated >= a.size
    free1, _ = dev.mem_get_info()
    grown = dev.memory_reserved() - dev.start_reserved
    assert abs((free0 - free1) - grown) <= MEM_GET_INFO_TOLERANCE, (
        f"the driver's free memory fell by {free0 - free1} B while torch reserved {grown} B")
    reserved = dev.memory_reserved()
    dev.free(a)
    assert dev.memory_reserved() == reserved, "a freed block stays cached (reserved) until empty_cache"
    dev.empty_cache()
    assert dev.memory_reserved() < reserved
    assert torch.cuda.memory_allocated() == dev.start_allocated
    dev.close()


# Any: the session's CudaDeviceFactory, called here with no case (it reads none)
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


ALLOCATOR_STEPS = (1, 600 << 10, MiB + 1, 8 * MiB, 12 * MiB + 1, 394 * MiB, 13 * MiB + 1)

ALLOCATOR_CHILD = r"""
import json, sys
import torch
from pytest_kvprofile.gpu.cuda_device import CudaDevice
from pytest_kvprofile.memory.device import SimDevice
real = CudaDevice(0)
sim = SimDevice(name=real.name, total_memory=real.total_memory, num_sm=real.num_sm, nontorch_bytes=real.nontorch_bytes)
worst, live = 0, []
def diff():
    return max(abs((real.memory_reserved() - real.start_reserved) - sim.memory_reserved()),
               abs((real.memory_allocated() - real.start_allocated) - sim.memory_allocated()))
for n in json.loads(sys.argv[1]):
    live.append((real.allocate(n, owner="t"), sim.allocate(n, owner="t")))
    worst = max(worst, diff())
for r, s in live[::2]:
    real.free(r)
    sim.free(s)
real.empty_cache()
sim.empty_cache()
worst = max(worst, diff())
print(json.dumps({"worst": worst, "start_reserved": real.start_reserved}))
"""


def test_allocator_model_matches_cuda(gpu_topology: GpuTopology, record_property: RecordProperty) -> None:
    """The simulated device's figures against the real allocator's, step by step (error in bytes).

    Run in a fresh process: the model starts from an empty allocator, and blocks other tests left
    cached in this one would make the comparison depend on test order."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", ALLOCATOR_CHILD, json.dumps(ALLOCATOR_STEPS)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    record_property("allocator_model_error_bytes", got["worst"])
    assert got["start_reserved"] == 0, "the fresh process's allocator was not empty at start"
    assert got["worst"] == 0, f"the allocator model is off by {got['worst']} bytes on this torch"


# -- the sizing oracle against the real planner ---------------------------------------------------

@pytest.fixture
def route_probe(request: pytest.FixtureRequest, gpu_topology: GpuTopology) -> FixtureParam:
    return _require(request.param)


@pytest.fixture
def gpu_case(request: pytest.FixtureRequest, gpu_topology: GpuTopology) -> FixtureParam:
    return _require(request.param)


def test_exact_oracle_bytes_plan_and_run(route_probe: RouteProbe, record_property: RecordProperty) -> None:
    from pytest_kvprofile.gpu.sizing_probe import plan_on_device

    err = plan_on_device(route_probe, route_probe.float_bytes)
    record_property("relative_error", err)
    record_property("float_bytes", route_probe.float_bytes)


def test_sixteen_bytes_short_overflows(route_probe: RouteProbe) -> None:
    from pytest_kvprofile.gpu.sizing_probe import SHORT_BY, expect_overflow

    if not route_probe.exact:
        pytest.skip(f"{route_probe.route}: the oracle gives a bound here, not the exact need ({route_probe.method})")
    message = expect_overflow(route_probe, route_probe.float_bytes - SHORT_BY)
    assert "Buffer overflow" in message


def test_workspace_size_api_agrees(route_probe: RouteProbe) -> None:
    from pytest_kvprofile.gpu.sizing_probe import api_workspace_size

    got = api_workspace_size(route_probe)
    if got is None:
        pytest.skip("this FlashInfer has no workspace_size() (added in 0.6.15)")
    if route_probe.exact:
        assert got == route_probe.float_bytes
    else:
        assert got <= route_probe.float_bytes


# -- the lifecycle with real FlashInfer wrappers ---------------------------------------------------

def test_lifecycle_real_flashinfer_passes_every_check(gpu_case: Case, gpu_device_factory: CudaDeviceFactory,
                                                     record_property: RecordProperty) -> None:
    from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS
    from pytest_kvprofile.checks.catalog import checks_for
    from pytest_kvprofile.lifecycle.driver import run_lifecycle

    backend = REAL_FLASHINFER_BACKENDS[0]
    _skip_refused(backend, gpu_case)
    result = run_lifecycle(backend, gpu_case, device_factory=gpu_device_factory)
    sim = run_lifecycle(backend.__class__(name="sim", make_builders=_stub_builders), gpu_case)
    gpu_device_factory.release(result)
    assert not result.errors, result.errors[0].describe()
    failures = {}
    for check in checks_for(result.path):
        if check.relevant(result.case, result.builders):
            violations = check.run(result)
            if violations:
                failures[check.name] = violations[0]
    if result.budget is not None and sim.budget is not None:
        record_property("budget_real", result.budget.as_dict())
        record_property("budget_sim", sim.budget.as_dict())
    assert failures == {}


def _skip_refused(backend: Backend, case: Case) -> None:
    """The real-wrapper builders plan FA2 prefill/decode wrappers: a layout they refuse (MLA) is skipped by name."""
    reason = backend.refuses_layout(case) if backend.refuses_layout is not None else None
    if reason is not None:
        pytest.skip(f"{backend.name}: {reason}")


def _stub_builders(case: Case) -> list[Builder]:
    from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder

    return [FlashInferLikeBuilder(case)]


def test_lazy_mutant_is_caught_on_cuda(gpu_case: Case, gpu_device_factory: CudaDeviceFactory) -> None:
    from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_MUTANTS
    from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME
    from pytest_kvprofile.lifecycle.driver import run_lifecycle

    _skip_refused(REAL_FLASHINFER_MUTANTS[0], gpu_case)
    result = run_lifecycle(REAL_FLASHINFER_MUTANTS[0], gpu_case, device_factory=gpu_device_factory)
    gpu_device_factory.release(result)
    violations = CHECKS_BY_NAME["persistent_memory_visible_at_closing"].run(result)
    assert violations, "the lazy FlashInfer builder's post-KV wrappers went unnoticed on real hardware"
    assert "invisible to KV sizing" in violations[0] and "int workspace" in violations[0]


# -- real kernels in real graphs ----------------------------------------------------------------

def test_captured_flashinfer_decode_replays_with_stable_arena(gpu_case: Case, record_property: RecordProperty) -> None:
    """The decode path as an engine captures it: FlashInfer's run() inside torch.cuda.graph for the
    largest and smallest decode captures of the case (``Envelope.decode_captures``: tokens, largest
    first), replayed with new inputs (and re-planned KV), each output against the float32 reference,
    on an arena whose pointer and size must not move across replays."""
    import torch

    from pytest_kvprofile.attention.reference import paged_layout
    from pytest_kvprofile.attention.wrappers import capture_decode_replays
    from pytest_kvprofile.sizing.case import decode_tensor_cores, for_case

    captures = gpu_case.envelope.decode_captures(gpu_case.mtp)
    if not captures:
        pytest.skip(f"{gpu_case.id} captures no decode step (no cuda_graph_sizes)")
    heads, env = gpu_case.heads, gpu_case.envelope
    if gpu_case.model.head_dim != gpu_case.model.dim_vo:
        pytest.skip("the decode wrapper takes one head_dim; this layout's decode is MLA-shaped")
    arena = torch.empty(max(for_case(gpu_case).float_bytes, 16), dtype=torch.uint8, device="cuda")
    ptr, size = arena.data_ptr(), arena.numel()
    q_len = 1 + gpu_case.mtp
    kv_len = min(env.max_model_len, 4096)
    for cap in {captures[0], captures[-1]}:
        layout = paged_layout([q_len] * cap.num_reqs, [kv_len] * cap.num_reqs, env.page_size, max_physical_pages=4096,
                              seed=cap.num_reqs)
        records = capture_decode_replays(arena, layout, heads_q=heads.heads_q_decode, heads_kv=heads.heads_kv,
                                         head_dim=gpu_case.model.head_dim, tensor_cores=decode_tensor_cores(gpu_case))
        record_property(f"replay_errors_{cap.num_tokens}_tokens", [r.relative_error for r in records])
        assert len(records) >= 3 and any(r.replanned for r in records)
        moved = [r for r in records if (r.arena_ptr, r.arena_bytes) != (ptr, size)]
        assert moved == [], f"the arena moved or resized across replays: {moved[0]} (was {ptr:#x}, {size} B)"
