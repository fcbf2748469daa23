"""What a verdict names about how each backend was judged (issue 50, "Provenance"), and the verdict where people look
(issue 52: a verdict line per backend, "written to" lines, files never lost, a run that tested nothing, --version)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pytest_kvprofile.cli import main as cli_main
from pytest_kvprofile.report.provenance import REFERENCE_ENGINE, installed_flashinfer

STUB = ("--kvprofile-backend", "stub-flashinfer")

# a backend on an engine of its own: the stub's builders, a provenance read from the environment (so two runs can
# differ only in the engine version), and an engine that sizes KV elsewhere on the tp2-dcp2 case, with its reason
ENGINE_CONFTEST = """
import dataclasses, os
from pytest_kvprofile import KvSizingMode, Provenance
from pytest_kvprofile.registry import builtin_registry

def _mode(case):
    if case.dcp == 2:
        return KvSizingMode("profile window (forced)", "profile", "the engine turns its cache off under DCP")
    return KvSizingMode("profile window", "profile")

def _provenance():
    return Provenance(engine="fakeengine", engine_version=os.environ.get("FAKE_ENGINE_VERSION", "0.33.0"),
                      runner="V2")

def pytest_kvprofile_backends(config):
    stub = builtin_registry().backends["stub-flashinfer"]
    return dataclasses.replace(stub, name="engine-stub", origin="", provenance=_provenance,
                               policy=dataclasses.replace(stub.policy, kv_sizing_for=_mode))
"""

# sizing without FlashInfer's planner: the host oracle cannot be built (as without nvcc)
NO_ORACLE_CONFTEST = """
import pytest_kvprofile.attention.oracle as oracle
import pytest_kvprofile.sizing.requirement as requirement
from pytest_kvprofile.attention.oracle_build import OracleUnavailable

def _unavailable(*args, **kwargs):
    raise OracleUnavailable("no CUDA compiler found (the test hides it)")

oracle.get_oracle = requirement.get_oracle = _unavailable
oracle.oracle_available = lambda: (False, "no CUDA compiler found (the test hides it)")
"""

IMPOSSIBLE_MATRIX = """
name: impossible
models:
  qwen3-8b: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36, weights_gib: 15.3, hidden_size: 4096}
gpus: [L40S]
tp: [1]
dcp: [2]
mtp: [0]
gmu: [0.98]
"""


def _backend(doc: dict, name: str) -> dict:
    return {b["name"]: b for b in doc["backends"]}[name]


def _kvprofile_lines(result: pytest.RunResult) -> list[str]:
    """The lines of the run's last section, ``kvprofile verdict``."""
    lines = result.stdout.lines
    start = max(i for i, line in enumerate(lines) if "kvprofile verdict" in line and line.startswith("="))
    return [ln for ln in lines[start + 1:] if not ln.startswith(("=", "FAILED"))]


def test_the_verdict_json_and_header_name_the_reference_engine_flashinfer_and_sizing(pytester, suite_args):
    verdict, report = pytester.path / "v.json", pytester.path / "r.json"
    result = pytester.runpytest(*suite_args, *STUB, "-q", "--kvprofile-verdict", str(verdict),
                                "--kvprofile-json", str(report))
    assert result.ret == 0
    b = _backend(json.loads(verdict.read_text()), "stub-flashinfer")
    prov = b["provenance"]
    assert prov["engine"] == "" and prov["flashinfer"] == installed_flashinfer() != "unknown"
    assert prov["described"] == f"{REFERENCE_ENGINE}, FlashInfer {installed_flashinfer()}"
    assert b["kv_sizing"]["modes"] == {"profile window": 3} and b["kv_sizing"]["differing"] == []
    assert b["sizing"]["method"] in ("oracle", "analytic") and sum(b["sizing"]["counts"].values()) == 3
    assert b["sizing"]["flashinfer"] == installed_flashinfer()
    in_report = _backend(json.loads(report.read_text()), "stub-flashinfer")
    assert {k: in_report[k] for k in ("provenance", "kv_sizing", "sizing")} == {
        k: b[k] for k in ("provenance", "kv_sizing", "sizing")}
    assert all(r.get("kv_sizing", {}).get("name") == "profile window"
               for r in json.loads(report.read_text())["results"])
    header = pytester.runpytest(*suite_args, *STUB, "--collect-only")
    header.stdout.fnmatch_lines([f"kvprofile: stub-flashinfer: {REFERENCE_ENGINE}, FlashInfer *; KV sizing profile "
                                 "window (3 cases)", "kvprofile: sizing: *"])


def test_an_engines_provenance_and_per_case_kv_sizing_cross_xdist(pytester, suite_args):
    """The engine, its version and runner come from ``Backend.provenance``; each case's KV sizing mode is carried
    from the workers (``-n 2``) to the controller, and a case whose mode differs is named with the engine's reason."""
    pytester.makeconftest(ENGINE_CONFTEST)
    verdict = pytester.path / "v.json"
    result = pytester.runpytest_subprocess(*suite_args, "-n", "2",
                                           "--kvprofile-verdict", str(verdict))
    assert result.ret == 0, result.stdout.str()[-2000:]
    b = _backend(json.loads(verdict.read_text()), "engine-stub")
    assert b["provenance"]["engine"] == "fakeengine" and b["provenance"]["engine_version"] == "0.33.0"
    assert b["provenance"]["runner"] == "V2"
    kv = b["kv_sizing"]
    assert kv["modes"] == {"profile window": 2, "profile window (forced)": 1}
    assert kv["most_common"] == "profile window"
    assert kv["differing"] == [{"case": "qwen3-8b-tp2-dcp2-mtp0-l40s-gmu0.98", "mode": "profile window (forced)",
                                "rule": "profile", "reason": "the engine turns its cache off under DCP"}]
    result.stdout.fnmatch_lines(["kvprofile: engine-stub: fakeengine 0.33.0, runner V2, FlashInfer *; KV sizing "
                                 "profile window (2 cases), profile window (forced) (1 cases); differs from profile "
                                 "window on qwen3-8b-tp2-dcp2-mtp0-l40s-gmu0.98 (profile window (forced): the engine "
                                 "turns its cache off under DCP)"])


def test_verdicts_of_two_engine_versions_or_two_flashinfers_do_not_merge(pytester, suite_args, monkeypatch, capsys):
    """A vLLM 0.33 verdict and a 0.34 one (here: one engine's two versions) are refused by merge, exit 2, naming the
    files and the versions; so are verdicts judged against different FlashInfer versions."""
    pytester.makeconftest(ENGINE_CONFTEST)
    paths = {}
    for version in ("0.33.0", "0.34.0"):
        monkeypatch.setenv("FAKE_ENGINE_VERSION", version)
        paths[version] = pytester.path / f"v{version}.json"
        result = pytester.runpytest(*suite_args, "-q", "-k", "tp1",
                                    "--kvprofile-verdict", str(paths[version]))
        assert result.ret == 0
    out = pytester.path / "merged.json"
    assert cli_main(["verdict", "merge", str(paths["0.33.0"]), str(paths["0.34.0"]), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "different engine versions" in err and "fakeengine 0.33.0" in err and "fakeengine 0.34.0" in err
    assert str(paths["0.33.0"]) in err and str(paths["0.34.0"]) in err and not out.exists()

    other = json.loads(paths["0.33.0"].read_text())
    other["versions"]["flashinfer-python"] = "0.7.3"
    for b in other["backends"]:
        b["provenance"]["flashinfer"] = "0.7.3"
    moved = pytester.path / "flashinfer-0.7.3.json"
    moved.write_text(json.dumps(other))
    assert cli_main(["verdict", "merge", str(paths["0.33.0"]), str(moved), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "different FlashInfer versions" in err and "0.7.3" in err and installed_flashinfer() in err

    same = pytester.path / "same.json"  # the same engine version still merges, and keeps every case's mode
    same.write_text(paths["0.33.0"].read_text())
    assert cli_main(["verdict", "merge", str(paths["0.33.0"]), str(same), "-o", str(out)]) == 0
    merged = _backend(json.loads(out.read_text()), "engine-stub")
    assert merged["provenance"]["engine_version"] == "0.33.0" and merged["kv_sizing"]["modes"] == {"profile window": 1}


def test_an_analytic_fallback_is_said_in_the_terminal_and_the_verdict(pytester, suite_args):
    pytester.makeconftest(NO_ORACLE_CONFTEST)
    verdict = pytester.path / "v.json"
    result = pytester.runpytest_subprocess(*suite_args, *STUB, "--kvprofile-verdict", str(verdict))
    assert result.ret == 0, result.stdout.str()[-2000:]
    b = _backend(json.loads(verdict.read_text()), "stub-flashinfer")
    assert b["sizing"]["method"] == "analytic" and b["sizing"]["counts"] == {"analytic": 3}
    (why,) = b["sizing"]["analytic_reasons"]
    assert "no CUDA compiler found (the test hides it)" in why["reason"] and why["cases"] == 3
    assert any(n.startswith("sizing: analytic model (") for n in b["notices"])
    result.stdout.fnmatch_lines(["kvprofile: sizing: analytic model (oracle unavailable: no CUDA compiler found*",
                                 "*kvprofile verdict*", "stub-flashinfer: may opt in*",
                                 "sizing: analytic model (*no CUDA compiler found (the test hides it)*"])


def test_the_run_ends_with_a_verdict_line_per_backend_without_a_verdict_file(pytester, suite_args):
    """The main job prints who may opt in, and a failing backend's root cause is the first failing check in the
    order the suite runs them, with the worst case, its bytes and its KV tokens."""
    result = pytester.runpytest(*suite_args, *STUB, "--kvprofile-backend", "mutant-01-lazy-workspace", "-q")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    last = _kvprofile_lines(result)
    assert last[0].startswith("stub-flashinfer: may opt in; worst qwen3-8b-"), last
    assert last[1].startswith("mutant-01-lazy-workspace: may NOT opt in: persistent_memory_visible_at_closing fails "
                              "on 3 cases; worst qwen3-8b-"), last
    assert last[1].endswith(" KV tokens") and " bytes, " in last[1]
    assert not any("written to" in line for line in last)


def test_written_to_lines_name_every_file_the_run_writes(pytester, suite_args):
    verdict, report = pytester.path / "out" / "v.json", pytester.path / "r.json"
    result = pytester.runpytest(*suite_args, *STUB, "-q", "--kvprofile-verdict", str(verdict),
                                "--kvprofile-json", str(report))
    result.stdout.fnmatch_lines([f"JSON report written to {report}", f"verdict written to {verdict}",
                                 "stub-flashinfer: may opt in*"])
    assert json.loads(verdict.read_text())["backends"] and not list(pytester.path.rglob("*.tmp"))


def test_a_run_that_ran_no_check_keeps_an_earlier_verdict(pytester, suite_args):
    """Ctrl-C during collection, or a selection that runs no check, leaves a complete verdict as it was."""
    verdict = pytester.path / "v.json"
    assert pytester.runpytest(*suite_args, *STUB, "-q", "--kvprofile-verdict", str(verdict)).ret == 0
    before = verdict.read_bytes()
    pytester.makeconftest("""
class Interrupter:
    def pytest_collection_finish(self, session):
        raise KeyboardInterrupt

def pytest_configure(config):
    config.pluginmanager.register(Interrupter(), "interrupter")
""")
    interrupted = pytester.runpytest_subprocess(*suite_args, *STUB, "-q", "--kvprofile-verdict", str(verdict))
    assert interrupted.ret == pytest.ExitCode.INTERRUPTED
    interrupted.stdout.fnmatch_lines([f"verdict NOT written: no check ran in this run; {verdict} kept as it was"])
    assert verdict.read_bytes() == before
    pytester.makeconftest("")
    nothing = pytester.runpytest(*suite_args, *STUB, "-q", "--kvprofile-verdict", str(verdict),
                                 "-k", "test_layout_is_possible")
    assert verdict.read_bytes() == before and nothing.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    assert not list(pytester.path.glob(".v.json*"))


def test_a_matrix_with_no_runnable_case_exits_5_saying_why(pytester):
    matrix = pytester.makefile(".yaml", impossible=IMPOSSIBLE_MATRIX)
    args = ["--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(matrix), "-p", "no:cacheprovider", *STUB]
    result = pytester.runpytest(*args, "-q")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED == 5
    result.stdout.fnmatch_lines(["*kvprofile verdict*", "kvprofile: no conformance check ran, nothing was tested "
                                 "(exit code 5): no (backend, case) pair to check: 1 of 1 cases are impossible*"])
    assert pytester.runpytest(*args, "--collect-only", "-q").ret == 0  # previewing is not testing


def test_kvprofile_version(pytester):
    result = pytester.run(sys.executable, "-m", "pytest_kvprofile.cli", "--version")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["kvprofile (pytest-kvprofile) *"])
    assert "unknown" not in result.stdout.str() or not Path(sys.prefix, "bin", "kvprofile").exists()


def test_a_run_whose_own_tests_ran_is_not_said_to_have_tested_nothing(pytester):
    """The project's own tests beside a suite that has nothing to check: they were tested, the exit code is theirs."""
    matrix = pytester.makefile(".yaml", impossible=IMPOSSIBLE_MATRIX)
    pytester.makepyfile(test_own="def test_own():\n    pass\n")
    result = pytester.runpytest("test_own.py", "--kvprofile", "--kvprofile-matrix", str(matrix),
                                "-p", "no:cacheprovider", *STUB, "-q")
    assert result.ret == 0 and "nothing was tested" not in result.stdout.str()
