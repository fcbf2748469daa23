"""One test per conformance check, parametrized over every (backend, case) it applies to.

Ids read ``test_<check>[<backend>-<case>]``, so ``-k`` selects by check, backend, model, GPU or
layout. The lifecycle for a (backend, case) pair runs once and every check reads its result.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile.checks.catalog import CHECKS
from pytest_kvprofile.checks.workspace import case_waste
from pytest_kvprofile.lifecycle.record import LEGACY
from pytest_kvprofile.plugin.recorder import RECORD_KEY
from pytest_kvprofile.plugin.timeouts import call_with_timeout
from pytest_kvprofile.report.post_kv_cost import post_kv_cost
from pytest_kvprofile.report.summary import budget_record


def _make_test(check: Any) -> Any:
    def test(kvprofile_pair: Any, kvprofile_session: Any, request: pytest.FixtureRequest) -> None:
        backend, case = kvprofile_pair
        record: dict[str, Any] = {"check": check.name, "backend": backend.name, "case": case.id}
        request.node.user_properties.append((RECORD_KEY, record))
        result, violations = call_with_timeout(
            kvprofile_session.settings.timeout, f"{backend.name} / {check.name} / {case.id}",
            _run, kvprofile_session, backend, case, check,
        )
        if result is not None and result.budget is not None and check.name == "no_post_kv_overrun":
            record["budget"] = budget_record(result.budget, case.id)
        if result is not None and check.name == "workspace_covers_planner":
            waste = case_waste(result)
            if waste is not None:
                record["waste"] = waste.as_dict()
        if result is not None and result.path == LEGACY and check.name == "legacy_path_unchanged":
            cost = post_kv_cost(result)
            if cost is not None:
                record["legacy_cost"] = cost.as_dict()
        if violations:
            record["message"] = violations[0][:2000]
            text = "\n".join(f"- {v}" for v in violations)
            pytest.fail(f"[{check.name}] {check.rule}\nbackend {backend.name}, case {case.id}:\n{text}", pytrace=False)

    test.__name__ = test.__qualname__ = f"test_{check.name}"
    test.__doc__ = check.rule
    test.kvprofile_check = check.name
    return pytest.mark.kvprofile_check(check.name)(test)


def _run(session: Any, backend: Any, case: Any, check: Any) -> tuple[Any, list[str]]:
    result = session.result_for(backend, case)
    return result, check.run(result, session.settings.check_options)


for _check in CHECKS:
    globals()[f"test_{_check.name}"] = _make_test(_check)


def test_layout_is_possible(kvprofile_impossible_case: Any) -> None:
    """Impossible layouts are listed (and skipped) with their reason rather than silently dropped."""
    pytest.fail(f"{kvprofile_impossible_case.id} should have been skipped: {kvprofile_impossible_case.skip_reason}")


def test_engine_accepts_layout(kvprofile_refused_pair: Any) -> None:
    """Layouts a backend's engine refuses (``Backend.refuses_layout``) are listed, skipped with the engine's reason."""
    backend, case = kvprofile_refused_pair
    pytest.fail(f"{backend.name} / {case.id} should have been skipped: its engine refuses the layout")
