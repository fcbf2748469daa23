"""Non-builder owners of persistent memory: same contract, same checks, plus the capacity promise."""

import pytest

from pytest_kvprofile import Backend, ProfilingSupport, resolve_support, run_lifecycle
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.resources import DMAOutputWorkspace
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.resources import ResourceAdapter
from pytest_kvprofile.lifecycle.parts import model_parts
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

MUTANTS = {b.name: b for b in MUTANT_BACKENDS}


@pytest.fixture(scope="module")
def carrying():
    cases = [c for c in load_matrix(packaged_matrix("default")).cases
             if c.skip_reason is None and c.unsized_reason is None and c.resources]
    assert cases, "the default matrix carries the DMA workspace on PCIe TP>=4 cases"
    return cases


def test_pcie_tp4_cases_carry_the_dma_workspace_sized_from_its_shapes(carrying):
    case = carrying[0]
    assert case.gpu.interconnect == "pcie" and case.tp >= 4
    (dma,) = [p for p in model_parts(STUB_BACKENDS[0], case) if isinstance(p, ResourceAdapter)]
    assert dma.capacity_bytes == 8192 * 4096 * 2


@pytest.mark.parametrize("backend", STUB_BACKENDS, ids=[b.name for b in STUB_BACKENDS])
def test_the_correct_stub_carries_the_resource_and_passes(carrying, backend):
    """One carrying case per (GPU, TP); every carrying layout is in test_mutant_catalog's stub sweep."""
    top = max(c.gmu for c in carrying)
    cases = {(c.gpu.name, c.tp): c for c in carrying if c.gmu == top}
    assert len(cases) == 4, sorted(cases)
    for case in cases.values():
        result = run_lifecycle(backend, case)
        assert "dma-output-workspace" in result.builder_names(), (case.id, result.builder_names())
        assert not failing_checks(result), (case.id, failing_checks(result))


@pytest.mark.parametrize(
    "mutant, check, words",
    [
        ("mutant-13a-resource-lazy", "persistent_memory_visible_at_closing",
         ["'dma-output-workspace'", "64.00 MiB", "after KV sizing", "phase 'capture'"]),
        ("mutant-13b-resource-over-capacity", "resource_capacity_honoured",
         ["resource 'dma-output-workspace'", "64.00 MiB", "80.00 MiB", "phase 'reservation'"]),
        ("mutant-13c-resource-in-capture", "no_synthetic_workspace_in_capture",
         ["dma-output-workspace: 'dma staging buffer' 4.00 MiB", "phase 'capture'"]),
    ],
)
def test_resource_mutants_fail_naming_resource_bytes_and_phase(carrying, mutant, check, words):
    failed = failing_checks(run_lifecycle(MUTANTS[mutant], carrying[0]))
    assert check in failed, failed
    for word in words:
        assert word in failed[check][0], failed[check][0]


def test_an_unsupported_resource_keeps_the_model_legacy(carrying):
    class Unsupported(DMAOutputWorkspace):
        def get_persistent_workspace_memory_profiling_support(self):
            return ProfilingSupport.UNSUPPORTED

    backend = Backend(name="fi", make_builders=STUB_BACKENDS[0].make_builders,
                      make_resources=lambda case: [Unsupported(case, {})])
    res = resolve_support(model_parts(backend, carrying[0]))
    assert not res.enabled and "'dma-output-workspace' is UNSUPPORTED" in res.reason


def test_unknown_resource_kind_is_a_usage_error(pytester):
    path = pytester.makefile(".yaml", m="""
models:
  m: {heads_q: 8, heads_kv: 8, head_dim: 128, num_layers: 2, weights_gib: 1}
gpus: [L40S]
tp: [1]
resources:
  - {kind: nccl-window}
""")
    result = pytester.runpytest("--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(path))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*m.yaml: resources: unknown resource kind 'nccl-window'*"])
