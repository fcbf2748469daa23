"""``persistent_memory_visible_at_closing`` under an engine budget with a serving headroom (``post_capture``, SGLang):
a source line that made memory after KV sizing and freed some of it again makes step memory, and only the rest is
persistent. On records written here, so it holds without an engine installed."""

from __future__ import annotations

import dataclasses

from pytest_kvprofile.checks.base import CheckOptions
from pytest_kvprofile.checks.leases import check_persistent_memory_visible_at_closing, made_after_closing
from pytest_kvprofile.contract.backends import EnginePolicy, KvSizingRule
from pytest_kvprofile.contract.device import Allocation
from pytest_kvprofile.lifecycle.driver import make_device
from pytest_kvprofile.lifecycle.phases import RESERVATION, SERVING, Phase
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult, PhaseRecord, ProbeTarget
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.memory.budget import Budget
from pytest_kvprofile.units import GiB, MiB

CASE = load_matrix(packaged_matrix("ci")).cases[0]
STEP_LINE = "sglang/srt/layers/attention/flashinfer_backend.py:2251 in call_begin_forward"
LAZY_LINE = "sglang/srt/layers/attention/flashinfer_backend.py:9999 in init_forward_metadata"


@dataclasses.dataclass
class _Builder:
    name: str = "engine-backend"


def _alloc(i: int, nbytes: int, phase: Phase, line: str, freed: Phase | None = None) -> Allocation:
    return Allocation(id=i, ptr=i << 30, nbytes=nbytes, size=nbytes, owner="engine-backend", tag="build", kind="device",
                      pool="default", phase=phase, stack=f"{line} (builder call site adapter.py:1 in build)",
                      alive=freed is None, freed_phase=freed)


def _record(rule: KvSizingRule, lazy: bool) -> LifecycleResult:
    allocations = [
        _alloc(0, 512 * MiB, RESERVATION, "flashinfer_backend.py:459 in <lambda>"),
        _alloc(1, 32 * MiB, SERVING, STEP_LINE, freed=SERVING),  # a step's indices, replaced by the next plan
        _alloc(2, 128 << 10, SERVING, STEP_LINE),  # the last plan's, still held by its wrapper
    ]
    if lazy:
        allocations.append(_alloc(3, 64 * MiB, SERVING, LAZY_LINE))  # made once, on the first request, and kept
    budget = Budget(total=48 * GiB, gmu=0.9, weights=0, nontorch=0, persistent_workspace=0, persistent_reserved=0,
                    peak_activation=0, non_kv=0, graph_pool_estimate=0, graph_pool_high_water=0, available_kv=0,
                    kv_bytes_per_token=1, kv_tokens=0, reservation_kv_tokens=0, rule=rule)
    phases = [PhaseRecord(name, 0, 0, (), (), False) for name in ("closing_measurement", SERVING)]
    return LifecycleResult(backend="engine", case=CASE, probe=ProbeTarget(None, CASE, make_device),
                           policy=EnginePolicy(kv_sizing=rule), builders=[_Builder()], path=PROFILING,
                           allocations=allocations, phases=phases, budget=budget)


def test_under_a_serving_headroom_the_last_steps_tensors_are_step_memory():
    result = _record("post_capture", lazy=False)
    persistent, step = made_after_closing(result, "engine-backend", SERVING)
    assert persistent == [] and [a.id for a in step] == [2]
    assert check_persistent_memory_visible_at_closing(result, CheckOptions()) == []


def test_a_buffer_made_once_after_kv_sizing_is_persistent_even_with_a_headroom():
    failed = check_persistent_memory_visible_at_closing(_record("post_capture", lazy=True), CheckOptions())
    assert len(failed) == 1 and "64.00 MiB" in failed[0] and "init_forward_metadata" in failed[0]
    assert "step memory from the serving headroom" in failed[0] and "call_begin_forward" in failed[0]


def test_vllms_budget_has_no_step_memory():
    result = _record("profile", lazy=False)
    persistent, step = made_after_closing(result, "engine-backend", SERVING)
    assert [a.id for a in persistent] == [2] and step == []
    assert check_persistent_memory_visible_at_closing(result, CheckOptions())
