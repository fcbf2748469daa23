"""Issue 51, item 2, for SGLang: its own KV budget arithmetic (``get_available_gpu_memory`` before the model loads and
at its post-capture sizing point) run against the ledger.

SGLang's budget is a free-memory measurement: the pool is ``free - pre_model_load_memory x (1 - mem_fraction_static)``.
What was made after its first snapshot and is alive at its sizing point is in ``resident``; what was made before is
outside its base. So ``budget_counts_every_byte`` finds nothing to refuse, wherever the first snapshot is taken: the
tests show SGLang's real code measuring the ledger's bytes, and a late snapshot missing none (vLLM's does: 10c).
Without SGLang these tests skip with the install command."""

from __future__ import annotations

from typing import Callable

import pytest

from pytest_kvprofile.builtin.mutants_field import RUNNER_INIT_BUFFERS, RunnerInitBuffersBuilder
from pytest_kvprofile.checks.base import CheckOptions
from pytest_kvprofile.checks.budget import check_budget_counts_every_byte, uncounted_at_closing
from pytest_kvprofile.contract.backends import Backend, EnginePolicy
from pytest_kvprofile.contract.budget import BudgetArithmetic
from pytest_kvprofile.engines.sglang.budget import SglangBudget, sglang_budget
from pytest_kvprofile.engines.sglang.post_capture import SGLANG_POST_CAPTURE_BACKENDS
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

CASES = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
QWEN_L40S = CASES["qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"]
RUNNER_BYTES = sum(RUNNER_INIT_BUFFERS.values())

pytestmark = pytest.mark.usefixtures("sglang_flashinfer")


def _run(backend: Backend, case: Case) -> LifecycleResult:
    result = run_lifecycle(backend, case)
    close_parts(result)
    assert not result.errors, result.errors
    return result


def _runner_backend(budget: Callable[[], BudgetArithmetic]) -> Backend:
    return Backend("runner-init-buffers", lambda case: [RunnerInitBuffersBuilder(case)],
                   policy=EnginePolicy(budget=budget), torch_mode=True)


def test_sglangs_post_capture_backends_are_judged_by_sglangs_own_arithmetic():
    backend = SGLANG_POST_CAPTURE_BACKENDS[0]
    assert backend.policy.budget is sglang_budget
    result = _run(backend, QWEN_L40S)
    terms = result.engine_terms
    assert terms is not None and terms.engine.startswith("SGLang 0.")
    assert "compute_post_capture_kv_resize" in terms.engine
    resident = {t.name: t for t in terms.terms}["resident"]
    # what the window made and kept (the backend's workspaces, its graph state) is in SGLang's resident term
    assert resident.nbytes >= result.window.closing_reserved - result.reserved_at_start > 0
    assert uncounted_at_closing(result).alive == {}
    assert check_budget_counts_every_byte(result, CheckOptions()) == []


def test_a_first_snapshot_taken_late_still_counts_every_byte():
    """Unlike vLLM's (bug 10c), SGLang's base is free memory: what was made before its first snapshot is outside the
    base, so a fork that takes it after the runner's constructor shrinks the pool, and misses nothing."""
    late = _run(_runner_backend(lambda: SglangBudget("after_init", engine="an SGLang fork")), QWEN_L40S)
    assert uncounted_at_closing(late).alive == {}
    assert check_budget_counts_every_byte(late, CheckOptions()) == []
    terms = late.engine_terms
    assert terms is not None and terms.engine == "an SGLang fork"
    outside = {t.name: t for t in terms.terms}["outside_pre_model_load"]
    assert (outside.since, outside.until) == ("device_start", "after_init") and outside.nbytes >= RUNNER_BYTES


def test_sglangs_own_snapshot_point_counts_the_runners_buffers():
    upstream = _run(_runner_backend(sglang_budget), QWEN_L40S)
    assert uncounted_at_closing(upstream).alive == {}
    assert check_budget_counts_every_byte(upstream, CheckOptions()) == []
    terms = upstream.engine_terms
    assert terms is not None
    assert {t.name: t for t in terms.terms}["resident"].nbytes >= RUNNER_BYTES
