"""Everything a run can name registers through ``pytest_kvprofile_register``: the built-ins as a third party does.

A ``conftest.py`` adds a check (the suite makes its test, after the built-in ones, and its failure fails the run and
the verdict), a group of backends, and a shared arena manager; the registry the plugin builds through the hook is the
one the CLI builds without pytest; ``registry.py`` imports no built-in backend module.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import pytest_kvprofile
from pytest_kvprofile.checks.catalog import CHECKS
from pytest_kvprofile.contract.backends import BackendError
from pytest_kvprofile.registry import Registry, builtin_plugins, builtin_registry, resolve_backends

PACKAGE = Path(pytest_kvprofile.__file__).resolve().parent

CONFTEST = '''
import dataclasses

from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
from pytest_kvprofile.checks.base import Check
from pytest_kvprofile.contract.workspace import ManagerKind, WorkspaceManager


def _one_ubatch(result, options):
    """Fails a case with more than one micro-batch: a rule a project adds for itself."""
    return ["two micro-batches"] if result.case.envelope.num_ubatches > 1 else []


def pytest_kvprofile_register(registry):
    registry.add_checks(Check("acme_single_ubatch", "one micro-batch only", "profiling", "teardown", (1,), _one_ubatch))
    registry.add_backends(*(dataclasses.replace(b, name="acme-" + b.name) for b in STUB_BACKENDS[:2]), group="acme")
    registry.add_workspace_manager(ManagerKind("acme", None, lambda device, n: WorkspaceManager(device, n)))
'''


@pytest.fixture
def registering(pytester):
    pytester.makeconftest(CONFTEST)
    return pytester


def test_a_registered_check_becomes_a_suite_test_after_the_built_ins_and_can_fail(registering, suite_args):
    result = registering.runpytest(*suite_args, "--kvprofile-backend", "acme", "--collect-only", "-q")
    ids = [ln for ln in result.outlines if "::test_" in ln]
    checks = [c for c in dict.fromkeys(ln.split("::test_")[1].split("[")[0] for ln in ids) if c != "layout_is_possible"]
    assert checks[-1] == "acme_single_ubatch" and checks[:-1] == [c for c in CHECKS_NAMES if c in checks]
    assert {ln.split("[")[1].split("-")[0] for ln in ids if "layout_is_possible" not in ln} == {"acme"}

    verdict = registering.path / "verdict.json"
    run = registering.runpytest(*suite_args, "--kvprofile-backend", "acme", "-k", "acme_single_ubatch or "
                                "lease_outlives", f"--kvprofile-verdict={verdict}")
    outcomes = run.parseoutcomes()
    assert outcomes["failed"] == outcomes["passed"]  # the project's check fails every case (2 ubatches), the other not
    doc = json.loads(verdict.read_text())
    assert [b["may_opt_in"] for b in doc["backends"]] == [False, False]
    workers = registering.runpytest_subprocess(*suite_args, "--kvprofile-backend", "acme", "-k", "acme_single_ubatch",
                                               "-n", "2")  # each worker registers it before it imports the suite
    assert workers.parseoutcomes().get("failed") == outcomes["failed"] and "passed" not in workers.parseoutcomes()


CHECKS_NAMES = [c.name for c in CHECKS]


def test_a_registered_group_and_manager_are_named_like_the_built_ins(registering, suite_args):
    result = registering.runpytest(*suite_args, "--kvprofile-backend", "acme", "--kvprofile-workspace-manager", "acme",
                                   "-k", "arena_stable")
    outcomes = result.parseoutcomes()
    # 3 possible layouts x the group's 2 backends for the check -k keeps; the other checks' tests are deselected
    assert outcomes["passed"] == 6 and not {"failed", "errors", "skipped"} & set(outcomes)
    collected = registering.runpytest(*suite_args, "--kvprofile-backend", "acme", "--collect-only", "-q")
    assert outcomes["deselected"] == collected.parseoutcomes()["tests"] - 6
    typo = registering.runpytest(*suite_args, "--kvprofile-workspace-manager", "acne")
    assert typo.ret == pytest.ExitCode.USAGE_ERROR
    typo.stderr.fnmatch_lines(["*--kvprofile-workspace-manager: unknown manager 'acne' (known: harness, vllm, acme)*"])


def test_the_plugin_registers_the_built_ins_as_the_cli_does(pytester):
    """The registry built through pytest's hook equals the one built without it, order included."""
    pytester.makeconftest('''
import json

def pytest_sessionstart(session):
    from pytest_kvprofile.plugin.session import SESSION_KEY
    reg = session.config.stash[SESSION_KEY].registry
    print("REG " + json.dumps([list(reg.backends), reg.groups, reg.default_group, [c.name for c in reg.checks],
                               list(reg.managers)]))
''')
    result = pytester.runpytest("-s", "-p", "no:cacheprovider", "--kvprofile", "--co", "-q")
    line = next(ln for ln in result.outlines if ln.startswith("REG "))
    ref = builtin_registry()
    assert json.loads(line[4:]) == [list(ref.backends), ref.groups, ref.default_group, [c.name for c in ref.checks],
                                    list(ref.managers)]
    assert [c.name for c in ref.checks] == [c.name for c in CHECKS] and ref.default_group == "stubs"


def test_names_are_registered_once():
    reg = builtin_registry()
    with pytest.raises(BackendError, match="two backends are registered as 'stub-flashinfer'"):
        reg.add_backends(__import__("dataclasses").replace(reg.backends["stub-flashinfer"]))
    with pytest.raises(BackendError, match="group 'stubs' has the name of a registered backend|backend 'stubs'"):
        reg.add_backends(__import__("dataclasses").replace(reg.backends["stub-flashinfer"], name="stubs"))
    with pytest.raises(ValueError, match="two checks are registered as 'warmup_idempotent'"):
        reg.add_checks(next(c for c in CHECKS if c.name == "warmup_idempotent"))
    with pytest.raises(ValueError, match="two workspace managers are registered as 'vllm'"):
        reg.add_workspace_manager(reg.managers["vllm"])


def test_an_empty_registry_names_nothing_and_runs_no_default():
    reg = Registry()
    assert resolve_backends([], entry_points=False, registry=reg) == []
    with pytest.raises(BackendError, match="no backend or group has that name"):
        resolve_backends(["stubs"], entry_points=False, registry=reg)


def test_the_registry_keeps_no_list_of_built_ins():
    """``registry.py`` names the package's plugins (``builtin_plugins``) and no module of theirs."""
    tree = ast.parse((PACKAGE / "registry.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    inner = {m for m in imported if m.startswith(("pytest_kvprofile.builtin.", "pytest_kvprofile.engines."))}
    assert not inner, inner
    assert [p.__name__ for p in builtin_plugins()] == [
        "pytest_kvprofile.checks.catalog", "pytest_kvprofile.builtin", "pytest_kvprofile.engines.sglang",
        "pytest_kvprofile.engines.vllm"]
    assert all(callable(getattr(p, "pytest_kvprofile_register", None)) for p in builtin_plugins())


def test_a_name_registered_twice_is_one_usage_error_naming_the_hook(pytester, suite_args):
    pytester.makeconftest(
        "from pytest_kvprofile.checks.catalog import CHECKS\n"
        "def pytest_kvprofile_register(registry):\n"
        "    registry.add_checks(CHECKS[0])\n")
    result = pytester.runpytest(*suite_args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*pytest_kvprofile_register: two checks are registered as '{CHECKS[0].name}'*"])
    assert "Traceback" not in result.stderr.str()


def test_the_run_hands_its_checks_to_the_retried_reservation(pytester, suite_args):
    """The options every check reads carry the run's checks, the project's own among them: what
    ``reservation_exception_safe`` runs on a retried reservation (tests/checks/test_retry_runs_registered_checks.py)."""
    pytester.makeconftest(
        "from pytest_kvprofile.checks.base import Check\n"
        "def _sees_itself(result, options):\n"
        "    names = [c.name for c in options.checks]\n"
        "    return [] if 'acme_sees_itself' in names and 'reservation_exception_safe' in names else [repr(names)]\n"
        "def pytest_kvprofile_register(registry):\n"
        "    registry.add_checks(Check('acme_sees_itself', 'r', 'profiling', 'teardown', (1,), _sees_itself))\n")
    result = pytester.runpytest(*suite_args, "--kvprofile-backend", "stub-flashinfer", "-k", "acme_sees_itself")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) > 0 and "failed" not in outcomes, result.stdout.str()[-2000:]
