"""Teardown errors count, and the record is immune to ``close()`` (issue 22, point 6).

The session closes a run's parts (``close_parts``) before its checks read the record. ``close()`` runs in
phase ``teardown`` on the run's device (inside the simulation again in torch mode); what it frees is marked
freed in ``teardown``, which checks read as alive at the end, and what it raises (a double free included)
fails ``teardown_clean``.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME, failing_checks
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import BuilderContext
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.phases import TEARDOWN
from pytest_kvprofile.matrix.schema import load_matrix
from pytest_kvprofile.plugin.session import Settings, build_session

CI = "matrices/ci.yaml"
MUTANTS = {b.name: b for b in MUTANT_BACKENDS}


class ClosingBuilder(FlashInferLikeBuilder):
    """Correct: frees what it holds in ``close()``, each allocation once."""

    name = "flashinfer-closing"

    def rebind(self, ctx: BuilderContext) -> None:
        self.ctx = ctx
        super().rebind(ctx)

    def close(self) -> None:
        self._drop(self.ctx, list(self.wrappers.values()))


def _case() -> Any:
    return next(c for c in load_matrix(CI).cases if c.skip_reason is None)


def _closed(backend: Backend) -> Any:
    result = run_lifecycle(backend, _case())
    close_parts(result)
    return result


def test_a_clean_close_passes_and_marks_what_it_frees_teardown():
    result = _closed(Backend(name="closing", make_builders=lambda c: [ClosingBuilder(c)], origin="test"))
    assert failing_checks(result) == {}
    assert any(a.freed_phase == TEARDOWN for a in result.allocations)
    close_parts(result)  # idempotent: close() runs once
    assert not result.errors


@pytest.mark.parametrize("name, says", [
    ("mutant-18a-close-raises", "RuntimeError"),
    ("mutant-18b-close-double-free", "double free of allocation"),
    ("mutant-18c-torch-close-double-free", "freed already: a double free"),
])
def test_a_raising_or_double_freeing_close_fails_teardown_clean(name, says):
    failed = failing_checks(_closed(MUTANTS[name]))
    assert set(failed) == {"teardown_clean"} and says in failed["teardown_clean"][0]


@pytest.mark.parametrize("name", ["mutant-06c-neutral-frees-late-state-in-close",
                                  "mutant-06d-torch-neutral-frees-late-state-in-close"])
def test_a_neutral_builder_freeing_late_state_in_close_still_fails_support_declaration(name):
    result = _closed(MUTANTS[name])
    late = [a for a in result.allocations if a.owner.startswith("gdn-late-state")]
    assert late and all(a.freed_phase == TEARDOWN for a in late)
    assert "declares NEUTRAL" in failing_checks(result)["support_declaration"][0]


def test_the_session_closes_before_its_checks_read_the_record():
    session = build_session(Settings(matrices=(CI,), backend_specs=("mutant-18a-close-raises",)), [], "cpu")
    backend, case = session.backends[0], session.runnable_cases[0]
    assert "teardown_clean" in session.classify(backend, case).checks
    result = session.result_for(backend, case)
    assert CHECKS_BY_NAME["teardown_clean"].run(result)
