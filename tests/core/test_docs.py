"""The README documents every shipped check, and its two commands are the ones .ci/run uses."""

from pathlib import Path

from pytest_kvprofile.checks.catalog import CHECKS

ROOT = Path(__file__).resolve().parents[2]


def test_readme_lists_every_check_with_its_bug_classes():
    readme = (ROOT / "README.md").read_text()
    for check in CHECKS:
        row = next((ln for ln in readme.splitlines() if ln.startswith(f"| `{check.name}` |")), None)
        assert row is not None, f"README has no row for {check.name}"
        assert ", ".join(map(str, check.bugs)) in row, row


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(ln.strip() for ln in readme.splitlines() if 'pip install torch==2.13.0 -e ".[test]"' in ln)
    assert test_command in ci
