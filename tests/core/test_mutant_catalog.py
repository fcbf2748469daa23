"""Every shipped check fails on the mutant carrying the bug it targets, on every default-matrix case,
and every correct stub passes everything there.

The sweep runs the lifecycle and checks as plain functions (about 40k lifecycle runs would be
too many pytest items); ``tests/test_plugin_suite.py`` shows the same verdicts through pytest.
"""

import pytest

from pytest_kvprofile.sizing.case import for_case
from pytest_kvprofile.checks.catalog import CHECKS, DEFAULT_WASTE_SLACK
from pytest_kvprofile.checks.sweep import catch_table, sweep
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS, WrongVersionFormulaBuilder
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS


@pytest.fixture(scope="module")
def default_cases():
    return [c for c in load_matrix(packaged_matrix("default")).cases if c.skip_reason is None]


@pytest.fixture(scope="module")
def mutant_sweeps(default_cases):
    return {s.backend: s for s in sweep(MUTANT_BACKENDS, default_cases)}


def test_every_correct_stub_passes_every_default_case(default_cases):
    for s in sweep(STUB_BACKENDS, default_cases):
        assert not s.failures, f"{s.backend}: {dict(s.failures)}; e.g. {next(iter(s.examples.values()))}"
        assert s.cases == len(default_cases)


def test_every_mutant_fails_a_check_for_its_own_bug_class(mutant_sweeps):
    by_name = {c.name: c for c in CHECKS}
    for backend in MUTANT_BACKENDS:
        s = mutant_sweeps[backend.name]
        own = [name for name in s.failures if backend.bug_class in by_name[name].bugs]
        assert own, f"{backend.name} (bug {backend.bug_class}) failed only {dict(s.failures)}"


def test_every_mutant_is_caught_on_every_case_where_its_bug_has_an_effect(mutant_sweeps, default_cases):
    cases = {c.id: c for c in default_cases}
    for backend in MUTANT_BACKENDS:
        s = mutant_sweeps[backend.name]
        if backend.name != "mutant-12-wrong-version-formula":
            assert s.caught_everywhere, f"{backend.name} escaped on {s.escaped[:5]} ({len(s.escaped)} cases)"
            continue
        for case_id in s.escaped:
            case = cases[case_id]
            excess = WrongVersionFormulaBuilder(case).float_bytes() - for_case(case).float_bytes
            assert 0 <= excess <= DEFAULT_WASTE_SLACK, (case_id, excess)


def test_every_check_is_shown_to_fail_on_a_mutant_of_its_bug_class(mutant_sweeps):
    bug_of = {b.name: b.bug_class for b in MUTANT_BACKENDS}
    for check in CHECKS:
        catchers = [name for name, s in mutant_sweeps.items() if s.failures[check.name] and bug_of[name] in check.bugs]
        assert catchers, f"no mutant of bug classes {check.bugs} fails {check.name}"


def test_catch_table_is_printed(mutant_sweeps, capsys):
    lines = catch_table(list(mutant_sweeps.values()))
    print("\n".join(lines))
    assert len(lines) == len(MUTANT_BACKENDS) + 2
