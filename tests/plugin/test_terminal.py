"""The verdict where people look (issue 52): failures folded one block per (backend, check) with its worst case,
``-v`` for every failure, the summary table in 100 columns with the root cause, the verdict the output's end."""

from __future__ import annotations

import pytest

from pytest_kvprofile.report.summary import TABLE_COLUMNS, table_lines

LAZY = ("--kvprofile-backend", "mutant-01-lazy-workspace")
STUB = ("--kvprofile-backend", "stub-flashinfer")
CHECK = "persistent_memory_visible_at_closing"


def _blocks(result: pytest.RunResult) -> list[str]:
    """The headlines of the FAILURES section's blocks."""
    return [ln for ln in result.stdout.lines if ln.startswith("_ test_")]


def _short_summary(result: pytest.RunResult) -> list[str]:
    return [ln for ln in result.stdout.lines if ln.startswith("FAILED ")]


def _assert_folded(result: pytest.RunResult) -> None:
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    (block,) = _blocks(result)
    assert f"test_{CHECK}[mutant-01-lazy-workspace-qwen3-8b-" in block
    result.stdout.fnmatch_lines([
        f"*kvprofile: {CHECK} fails on 3 cases of mutant-01-lazy-workspace; shown: the worst (*bytes, * KV tokens)*",
        "the other 2 failing cases: qwen3-8b-*, qwen3-8b-*",
        "-v shows each failure*",
    ])
    assert len(_short_summary(result)) == 1
    result.stdout.fnmatch_lines(["kvprofile: 1 FAILED lines stand for 3 failures, one per backend and check*",
                                 "*kvprofile verdict*", "mutant-01-lazy-workspace: may NOT opt in*",
                                 "*3 failed, * passed*"])


def test_failures_fold_one_block_per_backend_and_check_with_the_worst_case(pytester, suite_args):
    _assert_folded(pytester.runpytest(*suite_args, *LAZY))


def test_failures_fold_under_xdist_too(pytester, suite_args):
    _assert_folded(pytester.runpytest_subprocess(*suite_args, *LAZY, "-n", "2"))


def test_minus_v_shows_every_failure_and_every_failed_line(pytester, suite_args):
    result = pytester.runpytest(*suite_args, *LAZY, "-v")
    assert len(_blocks(result)) == 3 and len(_short_summary(result)) == 3
    assert "stand for" not in result.stdout.str() and "shown: the worst" not in result.stdout.str()


def test_the_worst_case_is_the_one_with_the_most_bytes(pytester, suite_args):
    """Two cases fail with different amounts: the block shown is the larger one's, whatever the run order."""
    pytester.makeconftest("""
import pytest
from pytest_kvprofile.plugin.recorder import RECORD_KEY

class Amounts:
    '''A plugin, not a conftest hook: conftest item hooks do not reach the packaged suite's items.'''

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report):
        # the tp2-dcp2 case's message names the most bytes
        for i, (key, value) in enumerate(report.user_properties):
            if key == RECORD_KEY and value.get("message") and "tp2-dcp2" in value["case"]:
                report.user_properties[i] = (key, dict(value, message="x: 999,999,999 bytes lost"))

def pytest_configure(config):
    config.pluginmanager.register(Amounts(), "amounts")
""")
    result = pytester.runpytest(*suite_args, *LAZY)
    (block,) = _blocks(result)
    assert "tp2-dcp2" in block, block
    result.stdout.fnmatch_lines(["*shown: the worst (999,999,999 bytes*"])


def test_the_summary_fits_100_columns_and_names_the_root_cause_not_a_tie(pytester, suite_args):
    """mutant-07d fails warmup_retryable and no_post_kv_overrun on each case: the root cause is the check a case
    runs first (warmup_retryable), not the name that sorts first among equally frequent ones."""
    result = pytester.runpytest(*suite_args, *STUB, "--kvprofile-backend", "mutant-07d-post-kv-warmup-leaks",
                                "--kvprofile-backend", "mutant-11d-torch-short-native-route")
    lines = result.stdout.lines
    start = next(i for i, ln in enumerate(lines) if "kvprofile summary" in ln)
    table = lines[start + 1:start + 8]
    assert all(len(ln) <= TABLE_COLUMNS for ln in table), table
    text = "\n".join(table)
    assert "\n    root cause: warmup_retryable (3); 6 failures in all\n" in text, table
    assert "\n    root cause: persistent_memory_visible_at_closing (3); 33 failures in all\n" in text, table
    assert "no_post_kv_overrun" not in text


def test_a_long_backend_name_is_cut_in_its_middle_to_keep_100_columns():
    row = {"backend": "b" * 60 + "-end", "cases": 1200, "passed": 123456, "failed": 123456, "xfailed": 0,
           "worst_case": "c", "worst_case_kv_tokens": 1234567, "worst_case_reservation_tokens": 12345,
           "root_cause": "persistent_memory_visible_at_closing (1234)"}
    lines = table_lines([row])
    assert all(len(ln) <= TABLE_COLUMNS for ln in lines), [len(ln) for ln in lines]
    assert "..." in lines[2] and lines[2].split()[0].endswith("-end")


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["plain", "xdist"])
def test_junit_classnames_carry_the_backend(pytester, suite_args, xdist):
    import xml.etree.ElementTree as ET

    out = pytester.path / "junit.xml"
    args = (*suite_args, *STUB, *LAZY, f"--junitxml={out}", *xdist)
    result = pytester.runpytest_subprocess(*args) if xdist else pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    cases = ET.parse(out).getroot().iter("testcase")
    classes = {c.get("classname") for c in cases if not c.get("name", "").startswith("test_layout_is_possible")}
    assert classes == {"test_conformance.stub-flashinfer", "test_conformance.mutant-01-lazy-workspace"}, classes


def test_the_header_names_the_backends_and_why_these(pytester, suite_args):
    plain = pytester.runpytest(*suite_args, "--collect-only")
    assert any(ln.startswith("kvprofile: backends (the built-in stubs: no backend named, installed or returned by "
                             "the hook): stub-flashinfer, stub-") for ln in plain.stdout.lines)
    named = pytester.runpytest(*suite_args, *STUB, "--collect-only")
    named.stdout.fnmatch_lines(["kvprofile: backends (named by --kvprofile-backend or kvprofile_backend): "
                                "stub-flashinfer"])
    pytester.makeconftest("""
import dataclasses
from pytest_kvprofile.registry import builtin_registry

def pytest_kvprofile_backends(config):
    return dataclasses.replace(builtin_registry().backends["stub-flashinfer"], name="mine", origin="")
""")
    hooked = pytester.runpytest(*suite_args, "--collect-only")
    hooked.stdout.fnmatch_lines(["kvprofile: backends (from the pytest_kvprofile_backends hook, in place of the "
                                 "built-in stubs; name backends to choose (kvprofile list)): mine"])


def test_ini_paths_resolve_against_the_ini_file_and_options_against_the_invocation_dir(pytester, tiny_matrix):
    """kvprofile_matrix and kvprofile_verdict in an ini file both resolve against its directory, wherever pytest
    runs from; on the command line both resolve against the directory pytest was invoked from."""
    pytester.makeini(f"[pytest]\nkvprofile_matrix = {tiny_matrix.name}\nkvprofile_verdict = out/v.json\n"
                     "kvprofile_backends = stub-flashinfer\n")
    sub = pytester.mkdir("sub")
    args = ["--pyargs", "pytest_kvprofile.suite", "-p", "no:cacheprovider", "-q", "-c", str(pytester.path / "tox.ini"),
            "--rootdir", str(pytester.path)]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(sub)
        result = pytester.runpytest(*args)
        assert result.ret == 0, result.stdout.str()[-1500:]
        assert (pytester.path / "out" / "v.json").is_file() and not (sub / "out").exists()
        result = pytester.runpytest(*args, "--kvprofile-verdict", "here.json")
        assert result.ret == 0 and (sub / "here.json").is_file()
    result.stdout.fnmatch_lines([f"verdict written to {sub / 'here.json'}"])


def test_gpu_collect_only_without_a_gpu_lists_the_gpu_runners_cases(pytester, tiny_matrix, monkeypatch):
    """A runner's maintainer previews what a GPU runner would run; without --collect-only it stays a usage error."""
    import pytest_kvprofile.gpu.nvml as nvml

    monkeypatch.setattr(nvml, "cuda_device_count", lambda: (0, "no GPU (the test hides them)"))
    args = ["--kvprofile-gpu", "--kvprofile-matrix", str(tiny_matrix), "-p", "no:cacheprovider", *STUB]
    listed = pytester.runpytest(*args, "--collect-only")
    assert listed.ret == 0, listed.stdout.str()[-1500:]
    listed.stdout.fnmatch_lines(["kvprofile-gpu: no CUDA device here (no GPU (the test hides them)): every case of "
                                 "the matrix is listed*", "*test_gpu_tier*", "*test_support_declaration*"])
    refused = pytester.runpytest(*args)
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*--kvprofile-gpu: no CUDA device was found*--collect-only lists a GPU runner's*"])


def test_the_oracle_compile_and_its_fallback_are_said_on_the_terminal(pytester, tiny_matrix, monkeypatch):
    import pytest_kvprofile.attention.oracle as oracle
    import pytest_kvprofile.attention.oracle_build as build

    built: list[bool] = []
    monkeypatch.setattr(build, "is_built", lambda install=None: False)
    monkeypatch.setattr(oracle, "ensure_built", lambda *a, **k: built.append(True))
    args = ["--kvprofile", "--kvprofile-matrix", str(tiny_matrix), "-p", "no:cacheprovider", *STUB,
            "-k", "support_declaration"]
    result = pytester.runpytest(*args)
    result.stdout.fnmatch_lines(["kvprofile: compiling FlashInfer's planner for the host (once; about 20 s; cached in*",
                                 "kvprofile: FlashInfer's planner compiled in * s"])
    assert built  # compiled before any check asked (the stand-in builds nothing, so later checks ask again)

    def fails(*a: object, **k: object) -> None:
        raise oracle.OracleError("nvcc: error: the test breaks it")

    monkeypatch.setattr(oracle, "ensure_built", fails)
    result = pytester.runpytest(*args)
    result.stdout.fnmatch_lines(["kvprofile: FlashInfer's planner did not compile (nvcc: error: the test breaks it): "
                                 "the analytic model sizes instead*"])


@pytest.mark.parametrize("key", ["kvprofile_backend", "kvprofile_backends"])
def test_the_backend_ini_key_is_spelled_as_the_option_and_the_former_spelling_still_narrows(pytester, suite_args,
                                                                                            key):
    """``--kvprofile-backend``'s ini twin is ``kvprofile_backend``; ``kvprofile_backends``, the spelling of earlier
    releases, still narrows the run when the new key is unset."""
    pytester.makeini(f"[pytest]\n{key} = stub-gdn\n")
    result = pytester.runpytest(*suite_args, "--collect-only")
    result.stdout.fnmatch_lines(["kvprofile: backends (named by --kvprofile-backend or kvprofile_backend): stub-gdn"])
