"""One test per conformance check, parametrized over every (backend, case) it applies to.

Ids read ``test_<check>[<backend>-<case>]``, so ``-k`` selects by check, backend, model, GPU or
layout. The lifecycle for a (backend, case) pair runs once and every check reads its result.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest

from pytest_kvprofile.checks.base import Check, CheckOutcome, JsonObject
from pytest_kvprofile.contract.backends import Backend, kv_sizing_mode
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.plugin.recorder import RECORD_KEY
from pytest_kvprofile.plugin.session import SESSION_KEY, KvprofileSession, suite_checks
from pytest_kvprofile.plugin.timeouts import call_with_timeout
from pytest_kvprofile.report.provenance import kv_sizing_json


def _make_test(check: Check) -> Callable[..., None]:
    def test(kvprofile_pair: tuple[Backend, Case], request: pytest.FixtureRequest) -> None:
        backend, case = kvprofile_pair
        session: KvprofileSession = request.config.stash[SESSION_KEY]  # not a fixture: one lookup less per item
        record = CheckOutcome(check=check.name, backend=backend.name, case=case.id)
        result: LifecycleResult | None = None
        try:
            result, violations = call_with_timeout(
                session.settings.timeout, f"{backend.name} / {check.name} / {case.id}",
                _run, session, backend, case, check,
            )
            record = dataclasses.replace(record, details=check.details(result))
            if violations:
                violations, frames = _in_author_code(result, violations, request.config.option.tbstyle)
                record = dataclasses.replace(record, message=violations[0][:2000])
                text = "\n".join(f"- {v}" for v in violations) + (f"\n{frames}" if frames else "")
                pytest.fail(f"[{check.name}] {check.rule}\nbackend {backend.name}, case {case.id}:\n{text}",
                            pytrace=False)
        finally:  # a failure, a timeout or an error is recorded too
            record = dataclasses.replace(record, kv_sizing=_kv_sizing(backend, case, result))
            request.node.user_properties.append((RECORD_KEY, record.to_json()))

    test.__name__ = test.__qualname__ = f"test_{check.name}"
    test.__doc__ = check.rule
    test.kvprofile_check = check.name  # type: ignore[attr-defined]
    return pytest.mark.kvprofile_check(check.name)(test)


def _in_author_code(result: LifecycleResult, violations: list[str], tbstyle: str) -> tuple[list[str], str]:
    """A violation that reports an exception of the author's code names the author's innermost frame and what to do;
    the traceback into the author's frames follows, as ``--tb`` asks (``plugin/author_frames.py``)."""
    from pytest_kvprofile.plugin.author_frames import render

    err = next((e for e in result.errors if not e.injected and e.traceback), None)
    if err is None or not any(err.describe() in v for v in violations):
        return violations, ""
    where, frames = render(err.traceback, tbstyle)
    if where is None:
        return violations, ""
    fix = (f"; raised at {where}: fix the error there (the lifecycle stopped in phase {err.phase!r}, so this check "
           "could not judge the case)")
    return [v + fix if err.describe() in v else v for v in violations], frames


def _kv_sizing(backend: Backend, case: Case, result: LifecycleResult | None) -> JsonObject | None:
    """Where the engine sized KV on the case (the run's record, else the backend's policy), for the verdict; None
    when the engine's own answer raised (the check's outcome says what went wrong)."""
    try:
        mode = result.kv_sizing if result is not None else kv_sizing_mode(backend.policy, case)
        return kv_sizing_json(str(mode.name), str(mode.rule), str(mode.reason))
    except Exception:  # noqa: BLE001 - the verdict then says the mode was not recorded
        return None


def _run(session: KvprofileSession, backend: Backend, case: Case, check: Check) -> tuple[LifecycleResult, list[str]]:
    result = session.result_for(backend, case)
    return result, check.run(result, session.check_options)


for _check in suite_checks():  # the run's registered checks: the built-ins, then any a plugin adds
    globals()[f"test_{_check.name}"] = _make_test(_check)


def test_layout_is_possible(kvprofile_impossible_case: Case) -> None:
    """Impossible layouts are listed (and skipped) with their reason rather than silently dropped."""
    pytest.fail(f"{kvprofile_impossible_case.id} should have been skipped: {kvprofile_impossible_case.skip_reason}")


def test_engine_accepts_layout(kvprofile_refused_pair: tuple[Backend, Case]) -> None:
    """Layouts a backend's engine refuses (``Backend.refuses_layout``) are listed, skipped with the engine's reason."""
    backend, case = kvprofile_refused_pair
    pytest.fail(f"{backend.name} / {case.id} should have been skipped: its engine refuses the layout")
