"""The retried reservation is judged by every check of the run, a project's registered ones included (issue 53):
``reservation_exception_safe`` runs ``CheckOptions.checks`` on the retried run, the built-in catalog when empty."""

from __future__ import annotations

from pytest_kvprofile import CHECKS, Check, CheckOptions, LifecycleResult
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None)
SAFE = CHECKS_BY_NAME["reservation_exception_safe"]


MAIN: list[LifecycleResult] = []  # the case's own run; every other run the check sees is a probe's


def _only_the_main_run(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """A project's rule that only a run other than the case's own breaks: the retried reservation's."""
    return [] if any(result is main for main in MAIN) else ["a run other than the case's own"]


RETRY_ONLY = Check("acme_main_run_only", "the case's own run only", "profiling", "teardown", (17,), _only_the_main_run)


def _reserving_backend():
    for backend in STUB_BACKENDS:
        result = run_lifecycle(backend, CASE)
        try:
            if any(result.alloc_origin.get(a.id) == "reserve_persistent_workspace" for a in result.allocations):
                return backend, result
        finally:
            close_parts(result)
    raise AssertionError("no stub backend reserves on the first ci case")


def test_a_registered_check_judges_the_retried_reservation():
    backend, _ = _reserving_backend()
    result = run_lifecycle(backend, CASE)
    MAIN[:] = [result]
    try:
        assert RETRY_ONLY.run(result) == []  # the main run passes the project's check
        assert SAFE.run(result, CheckOptions()) == []  # the built-in catalog alone: the project's check unseen
        found = SAFE.run(result, CheckOptions(checks=(*CHECKS, RETRY_ONLY)))
    finally:
        close_parts(result)
    assert found and all("fails acme_main_run_only" in v for v in found), found
    assert "after its reservation failed at allocation #" in found[0]
