"""vLLM's own memory_profiling, run on the simulated device around the lifecycle's window, against the harness's
non-KV bytes on every ci case: the two differ by exactly the non-torch bytes vLLM leaves before its instance."""

from __future__ import annotations

import pytest

from pytest_kvprofile.builtin.stubs import STUB_BACKENDS, TORCH_STUB_BACKENDS
from pytest_kvprofile.engines.vllm.memory import NAME, VllmMemoryProfiling, non_kv_difference
from pytest_kvprofile.lifecycle.driver import make_device, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

pytestmark = pytest.mark.usefixtures("vllm_flashinfer")

CI_CASES = [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None
            and c.unsized_reason is None]
STUB = next(b for b in STUB_BACKENDS if b.name == "stub-flashinfer")


def _side_by_side(backend, case):
    observer = VllmMemoryProfiling()
    device = make_device(case)
    result = run_lifecycle(backend, case, lambda _c: device, observers=[observer])
    assert not result.errors, result.errors
    return result, observer, device


def _layouts(cases):
    """One case per (tp, dcp, mtp): the plain run's sample; the slow run takes every ci case."""
    seen: dict[tuple[int, int, int], object] = {}
    for case in cases:
        seen.setdefault((case.tp, case.dcp, case.mtp), case)
    return list(seen.values())


SAMPLE = _layouts(CI_CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=() if c in SAMPLE else pytest.mark.slow)
                                  for c in CI_CASES])
def test_vllm_memory_profiling_agrees_with_the_harness_on_every_ci_case(case):
    result, observer, device = _side_by_side(STUB, case)
    vllm_non_kv = result.observed_non_kv[NAME]
    assert result.window.non_kv - vllm_non_kv == non_kv_difference(device) == case.nontorch_bytes
    assert observer.result.transient_peak_headroom == result.window.transient_headroom
    assert observer.result.torch_peak_increase == result.window.peak_allocated - result.window.baseline_reserved


@pytest.mark.parametrize("backend", [*STUB_BACKENDS[:1], *TORCH_STUB_BACKENDS[:1]], ids=lambda b: b.name)
def test_vllm_memory_profiling_agrees_in_torch_mode_and_on_the_legacy_path(backend):
    case = CI_CASES[0]
    result, _observer, device = _side_by_side(backend, case)
    assert result.window.non_kv - result.observed_non_kv[NAME] == non_kv_difference(device)


def test_a_run_without_observers_records_none():
    assert run_lifecycle(STUB, CI_CASES[0]).observed_non_kv == {}
