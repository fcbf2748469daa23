"""Issue 51, item 2: vLLM's own KV budget arithmetic (``memory_profiling``) run against the ledger.

vLLM's code, fed the lifecycle's snapshots (``VllmBudget``), gives the same terms as its formula in plain Python
(``InstanceSnapshotBudget``) from either instance snapshot. From the fork's snapshot, taken after the model runner's
``__init__``, its terms miss the runner's 36 MiB, and ``budget_counts_every_byte`` refuses it; from upstream's, taken
before, they miss nothing. vLLM's own backends are judged with vLLM's arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest

from pytest_kvprofile.builtin.mutants_field import RUNNER_INIT_BUFFERS, RunnerInitBuffersBuilder
from pytest_kvprofile.checks.base import CheckOptions
from pytest_kvprofile.checks.budget import check_budget_counts_every_byte, uncounted_at_closing
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.backends import Backend, EnginePolicy
from pytest_kvprofile.contract.budget import BudgetArithmetic
from pytest_kvprofile.engines.vllm.flashinfer import VLLM_POLICY
from pytest_kvprofile.engines.vllm.memory import VllmBudget, vllm_budget
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.memory.budget import InstanceSnapshotBudget

CI_CASES = [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None
            and c.unsized_reason is None]
SAMPLE = [CI_CASES[0], next(c for c in CI_CASES if c.gpu.name == "B200" and c.tp > 1)]
RUNNER_BYTES = sum(RUNNER_INIT_BUFFERS.values())


def _runner_backend(budget: Callable[[], BudgetArithmetic]) -> Backend:
    return Backend("runner-init-buffers", lambda case: [RunnerInitBuffersBuilder(case)],
                   policy=EnginePolicy(budget=budget), torch_mode=True)


def _run(backend: Backend, case: Case):
    result = run_lifecycle(backend, case)
    close_parts(result)
    assert not result.errors, result.errors
    return result


@pytest.mark.parametrize("at", ["before_instance", "after_init"])
@pytest.mark.parametrize("case", SAMPLE, ids=lambda c: c.id)
def test_vllms_code_and_its_formula_give_the_same_terms(case, at):
    real = _run(_runner_backend(lambda: VllmBudget(at)), case).engine_terms
    plain = _run(_runner_backend(lambda: InstanceSnapshotBudget(at)), case).engine_terms
    assert real is not None and plain is not None
    assert [(t.name, t.nbytes, t.since, t.until) for t in real.terms] == \
        [(t.name, t.nbytes, t.since, t.until) for t in plain.terms]
    assert real.engine.startswith("vLLM 0.") and "memory_profiling" in real.engine


@pytest.mark.parametrize("case", SAMPLE, ids=lambda c: c.id)
def test_the_forks_snapshot_misses_the_runner_buffers_and_upstreams_does_not(case):
    fork = _run(_runner_backend(lambda: VllmBudget("after_init")), case)
    upstream = _run(_runner_backend(vllm_budget), case)
    missed = uncounted_at_closing(fork)
    assert missed.alive_bytes == RUNNER_BYTES and set(missed.alive) == {"after_init"}
    assert missed.reserved >= RUNNER_BYTES  # the segments the buffers sit in, free space included
    # vLLM's own figures: what the fork's total_consumed leaves out is what upstream's counts beyond it
    assert fork.engine_terms is not None and upstream.engine_terms is not None
    assert upstream.engine_terms.terms[0].nbytes - fork.engine_terms.terms[0].nbytes == missed.reserved
    assert fork.engine_terms.terms[0].name == upstream.engine_terms.terms[0].name == "total_consumed"
    assert uncounted_at_closing(upstream).reserved == 0 and not uncounted_at_closing(upstream).alive
    (message,) = check_budget_counts_every_byte(fork, CheckOptions())
    assert f"({RUNNER_BYTES} bytes) alive at the closing measurement" in message and "init_snapshot after_init" in \
        message and "__init__() in phase 'setup'" in message
    assert "budget_counts_every_byte" not in failing_checks(upstream)


def test_vllms_backends_are_judged_with_vllms_own_arithmetic():
    from pytest_kvprofile.registry import builtin_registry

    backend = builtin_registry().backends["vllm-flashinfer"]
    assert backend.policy.budget is vllm_budget and VLLM_POLICY.budget is vllm_budget
    result = run_lifecycle(backend, CI_CASES[0])
    close_parts(result)
    assert result.engine_terms is not None and "memory_profiling (init_snapshot before_instance)" in \
        result.engine_terms.engine
    assert uncounted_at_closing(result).reserved == 0
    assert "budget_counts_every_byte" not in failing_checks(result)


def test_the_fork_with_vllms_code_is_refused_on_the_ci_sample_and_its_twin_passes():
    fork = dataclasses.replace(_runner_backend(lambda: VllmBudget("after_init")), name="fork")
    twin = dataclasses.replace(_runner_backend(vllm_budget), name="twin")
    for case in SAMPLE:
        assert set(failing_checks(_run(fork, case))) == {"budget_counts_every_byte"}
        assert not failing_checks(_run(twin, case))
