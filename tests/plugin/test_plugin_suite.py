"""The plugin end to end, through pytester: ids, header, summary, reports, selection.

Scheduling (serial, ``-p no:xdist``, ``-n 2``) is ``tests/acceptance/test_determinism.py``'s.
"""

import json

import pytest

from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS, MUTANT_CHECK_OPTIONS
from pytest_kvprofile.checks.catalog import CHECKS, checks_for
from pytest_kvprofile.contract.bug_classes import mutant_class

# the tiny matrix carries no resource, so the resource-capacity check has nothing to look at there; no stub
# has close(), so teardown_clean has nothing to judge
PROFILING_CHECKS = len([c for c in checks_for("profiling")
                        if c.name not in ("resource_capacity_honoured", "teardown_clean")])
LEGACY_CHECKS = len([c for c in checks_for("legacy") if c.name != "teardown_clean"])


def test_stubs_pass_and_the_header_and_summary_are_printed(pytester, suite_args):
    result = pytester.runpytest_subprocess(*suite_args, "-v", "-rs")
    result.assert_outcomes(passed=2 * 3 * PROFILING_CHECKS + 4 * 3 * LEGACY_CHECKS, skipped=1)
    result.stdout.fnmatch_lines([
        "kvprofile: tier cpu, matrices tiny.yaml (3 cases, 1 impossible), 6 backends",
        "*test_layout_is_possible[[]qwen3-8b-tp1-dcp2-mtp0-l40s-gmu0.98[]] SKIPPED*",
        "*test_lease_outlives_closing_measurement[[]stub-flashinfer-qwen3-8b-tp2-dcp1-mtp0-l40s-gmu0.98[]] PASSED*",
        "*kvprofile summary*",
        f"stub-flashinfer*3*{3 * PROFILING_CHECKS}*0*0*",
        "*impossible layout: dcp=2 must divide tp=1*",
    ])
    assert result.ret == 0


def test_k_selects_by_check_backend_and_layout(pytester, suite_args):
    result = pytester.runpytest(*suite_args, "-k", "lease_outlives and stub-hybrid and tp2", "--collect-only", "-q")
    lines = [ln for ln in result.stdout.lines if "::" in ln]
    assert lines == [
        "test_conformance.py::test_lease_outlives_closing_measurement[stub-hybrid-qwen3-8b-tp2-dcp1-mtp0-l40s-gmu0.98]",
        "test_conformance.py::test_lease_outlives_closing_measurement[stub-hybrid-qwen3-8b-tp2-dcp2-mtp0-l40s-gmu0.98]",
    ]


def _one_per_bug_class() -> list:
    """Every mutant; the first of each bug class in the plain run, the others in ``pytest -m slow``."""
    seen: set[int] = set()
    params = []
    for m in MUTANT_BACKENDS:
        marks = [pytest.mark.slow] if mutant_class(m.name) in seen else []
        seen.add(mutant_class(m.name))
        params.append(pytest.param(m.name, marks=marks, id=m.name))
    return params


@pytest.mark.parametrize("mutant", _one_per_bug_class())
def test_each_mutant_fails_with_a_message_naming_the_rule(pytester, suite_args, mutant):
    backend = next(m for m in MUTANT_BACKENDS if m.name == mutant)
    own = [c for c in CHECKS if mutant_class(backend.name) in c.bugs]
    budget = MUTANT_CHECK_OPTIONS[mutant].max_waste if mutant in MUTANT_CHECK_OPTIONS else None
    waste = ["--kvprofile-max-waste", f"{budget.amount:g}"] if budget else []  # judged under a waste budget
    result = pytester.runpytest(*suite_args, "--kvprofile-backend", mutant, "-q", *waste)
    assert result.ret == 1
    text = result.stdout.str()
    assert any(f"[{c.name}] {c.rule}" in text for c in own), text[-3000:]
    assert "Traceback" not in text


def test_json_report_and_update_hook(pytester, suite_args):
    pytester.makeconftest(
        """
def pytest_kvprofile_update_json(config, report):
    report["engine"] = {"name": "test-engine"}
"""
    )
    out = pytester.path / "report.json"
    result = pytester.runpytest(*suite_args, "--kvprofile-json", str(out), "--kvprofile-backend", "stub-flashinfer")
    assert result.ret == 0
    doc = json.loads(out.read_text())
    assert doc["engine"] == {"name": "test-engine"}
    assert doc["tier"] == "cpu" and doc["matrices"][0]["cases"] == 4
    assert doc["skipped_cases"][0]["case"] == "qwen3-8b-tp1-dcp2-mtp0-l40s-gmu0.98"
    budgets = [r["budget"] for r in doc["results"] if r.get("budget")]
    assert len(budgets) == 3 and all(b["kv_tokens"] > 0 and b["reservation_kv_tokens"] > 0 for b in budgets)
    assert {r["outcome"] for r in doc["results"]} == {"passed"}
    assert doc["summary"][0]["backend"] == "stub-flashinfer"


def test_expected_failures_are_strict_xfails_and_block_the_opt_in(pytester, suite_args):
    pytester.makeconftest(
        """
from pytest_kvprofile import Backend
from pytest_kvprofile.builtin.mutants import LazyWorkspaceBuilder

def pytest_kvprofile_backends(config):
    return Backend(
        name="known-lazy",
        make_builders=lambda case: [LazyWorkspaceBuilder(case)],
        expected_failures=(("persistent_memory_visible_at_closing", "wrappers are still created on first plan()"),
                           ("no_post_kv_overrun", "same"), ("lease_outlives_closing_measurement", "not broken")),
    )
"""
    )
    verdict = pytester.path / "verdict.json"
    result = pytester.runpytest(*suite_args, "--kvprofile-verdict", str(verdict), "-q")
    text = result.stdout.str()
    assert "XPASS(strict)" in text and result.ret == 1
    doc = json.loads(verdict.read_text())
    (b,) = doc["backends"]
    assert b["name"] == "known-lazy" and b["may_opt_in"] is False
    assert b["counts"]["xfailed"] >= 3
    assert any("expected failures declared" in r for r in b["reasons"])
    result.stdout.fnmatch_lines(["*kvprofile verdict*", "known-lazy: may NOT opt in*"])
