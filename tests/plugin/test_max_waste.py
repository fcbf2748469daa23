"""``--kvprofile-max-waste`` and its ini twins through pytest: the waste section, the verdict's fields, the refusal
over a budget, and usage errors that name the option (issue 21.1)."""

from __future__ import annotations

import json

import pytest


def test_max_waste_option_fails_waste_over_it_and_is_reported(pytester, suite_args):
    """End to end: the terminal section and the verdict's waste fields; over the budget, a refusal."""
    args = [*suite_args, "--kvprofile-backend", "stub-vllm-default-arena",
            "-k", "workspace_covers_planner and tp1-dcp1", "--kvprofile-verdict", "v.json"]
    quiet = pytester.runpytest(*args)
    quiet.assert_outcomes(passed=1)
    quiet.stdout.fnmatch_lines(["*kvprofile workspace waste*", "stub-vllm-default-arena: workspace waste*"])
    backend = json.loads((pytester.path / "v.json").read_text())["backends"][0]
    assert backend["waste"][0]["bytes"] > 0 and backend["cost_reasons"][0].startswith("workspace waste")
    refused = pytester.runpytest(*args, "--kvprofile-max-waste", "64")
    refused.assert_outcomes(failed=1)
    refused.stdout.fnmatch_lines(["*over the waste budget of 64 MiB (--kvprofile-max-waste)*"])


@pytest.mark.parametrize(("ini", "option"), [("kvprofile_max_waste = lots", "ini option kvprofile_max_waste"),
                                             ("kvprofile_workspace_slack_mib = x", "kvprofile_workspace_slack_mib")])
def test_a_bad_budget_is_a_usage_error_naming_the_option(pytester, suite_args, ini, option):
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest(*suite_args, "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{option}*"])
    cli = pytester.runpytest(*suite_args, "--collect-only", "--kvprofile-max-waste", "5 GiB")
    cli.stderr.fnmatch_lines(["*--kvprofile-max-waste: expected MiB*"])


def test_the_deprecated_slack_ini_is_a_budget_in_mib(pytester, suite_args):
    pytester.makeini("[pytest]\nkvprofile_workspace_slack_mib = 64\n")
    result = pytester.runpytest(*suite_args, "--kvprofile-backend", "stub-vllm-default-arena",
                                "-k", "workspace_covers_planner and tp1-dcp1")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*over the waste budget of 64 MiB (ini option kvprofile_workspace_slack_mib)*"])


def test_the_ini_twin_takes_a_share_of_the_kv_pool(pytester, suite_args):
    pytester.makeini("[pytest]\nkvprofile_max_waste = 1%\n")
    result = pytester.runpytest(*suite_args, "--kvprofile-backend", "stub-vllm-default-arena",
                                "-k", "workspace_covers_planner and tp1-dcp1")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*over the waste budget of 1% of the KV pool (ini option kvprofile_max_waste)*"])
    lenient = pytester.runpytest(*suite_args, "--kvprofile-backend", "stub-vllm-default-arena",
                                 "-k", "workspace_covers_planner and tp1-dcp1", "--kvprofile-max-waste", "100000 tok")
    lenient.assert_outcomes(passed=1)  # the option wins over the ini
