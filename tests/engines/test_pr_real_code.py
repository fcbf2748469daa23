"""The pull request's real code, end to end: its own ``flashinfer.py`` (and ``workspace.py``, ``backend.py`` where
given) loaded in place of the installed vLLM's, driven by the built-in ``vllm-flashinfer`` backend on every case
of matrices/ci.yaml, with no hand mapping.

The code is not in this repository: ``KVPROFILE_PR_DIR`` (or ``KVPROFILE_PR_DIRS``, one directory per revision)
names private copies laid out as vLLM's tree (``tests/engines/pr_overlay.py``). Without one the test skips, saying
so; a skip is never a pass.

What it asserts, per revision:
- nothing crashes, configure included (vLLM's ``WorkspaceManager`` is the pull request's own where given);
- the built-in backend drives the pull request's builder class, and its design opts in on every gated case;
- on the profiling path the only failing check is its real finding, ``persistent_memory_visible_at_closing``:
  FlashInfer's plan-time buffers (a few KB) made at the first plan, after KV sizing;
- the MTP cases (the runner's gate) and the DCP > 1 cases (the revision's own UNSUPPORTED) run the legacy path,
  and ``legacy_path_unchanged`` does not refuse them;
- the plugin's own run with ``-p pr_overlay`` (configure included) gives no INTERNALERROR and the same verdict on
  a profiling case and a gated one, and its ``contract_api`` names the revision driven.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from pr_overlay import private_dirs, pull_request_modules, revision_of  # noqa: E402

from pytest_kvprofile import run_lifecycle  # noqa: E402
from pytest_kvprofile.checks.catalog import failing_checks  # noqa: E402
from pytest_kvprofile.lifecycle.driver import close_parts  # noqa: E402
from pytest_kvprofile.lifecycle.record import LEGACY  # noqa: E402
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix  # noqa: E402

FINDING = "persistent_memory_visible_at_closing"
PLAN_TIME_LIMIT = 16 * 1024  # FlashInfer's plan-time buffers: a few KB; anything larger is not that finding
_INVISIBLE = re.compile(r"([\d,]+) bytes invisible to KV sizing")

DIRS = private_dirs()
CASES = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}


def measure(root: Path) -> dict[str, tuple[str, dict[str, list[str]]]]:
    """{case id: (path or "refused: ..." or "crash: ...", failing checks)} for the revision under ``root``."""
    from pytest_kvprofile.engines.vllm.flashinfer import VLLM_BACKENDS, engine_refusal
    from pytest_kvprofile.engines.vllm.standins import import_vllm_flashinfer

    backend = VLLM_BACKENDS[0]
    out: dict[str, tuple[str, dict[str, list[str]]]] = {}
    with pull_request_modules(root) as loaded:
        assert import_vllm_flashinfer() is loaded["vllm.v1.attention.backends.flashinfer"]
        for case in load_matrix(packaged_matrix("ci")).cases:
            refusal = engine_refusal(case)
            if refusal is not None:
                out[case.id] = ("refused: " + refusal, {})
                continue
            try:
                result = run_lifecycle(backend, case)
            except Exception as exc:  # noqa: BLE001 - a crash is a result here: the assertions name it
                out[case.id] = (f"crash: {type(exc).__name__}: {exc}", {})
                continue
            try:
                driven = type(result.builders[0].inner_builder()) if hasattr(result.builders[0], "inner_builder") \
                    else None
                assert driven is None or driven.__module__ == "vllm.v1.attention.backends.flashinfer"
                out[case.id] = (result.path, failing_checks(result))
            finally:
                close_parts(result)
    return out


def invisible_bytes(message: str) -> int:
    found = _INVISIBLE.search(message)
    assert found, message[:400]
    return int(found.group(1).replace(",", ""))


@pytest.mark.skipif(not DIRS, reason="KVPROFILE_PR_DIR / KVPROFILE_PR_DIRS name no private copy of the pull "
                                     "request's vllm/v1/attention/backends/flashinfer.py (its code is not in "
                                     "this repository; see docs/vllm.md)")
@pytest.mark.parametrize("root", DIRS, ids=[revision_of(d)[:7] for d in DIRS])
def test_the_pull_requests_own_code_is_refused_only_for_its_plan_time_bytes(root: Path) -> None:
    results = measure(root)
    crashes = {c: p for c, (p, _) in results.items() if p.startswith("crash")}
    assert not crashes, crashes
    driven = {c: (p, f) for c, (p, f) in results.items() if not p.startswith("refused")}
    assert driven, "every ci case refused by layout"
    for case_id, (path, failing) in driven.items():
        if path == LEGACY:
            assert "legacy_path_unchanged" not in failing, (case_id, failing)
            assert failing == {}, (case_id, failing)
            case = CASES[case_id]  # the gate: speculative decoding; the revision's own UNSUPPORTED under DCP > 1
            assert case.mtp > 0 or case.dcp > 1, f"{case_id}: the design did not opt in on a gated case"
        else:
            assert set(failing) <= {FINDING}, (case_id, failing)
            for message in failing.get(FINDING, []):
                assert 0 < invisible_bytes(message) <= PLAN_TIME_LIMIT, message[:400]
    assert any(p != LEGACY for p, _ in driven.values()), "the design opted in nowhere"


PLUGIN_CASES = ("qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90", "qwen3-8b-tp1-dcp1-mtp1-l40s-gmu0.90")  # profiling, gated


def _overlay_env(monkeypatch: pytest.MonkeyPatch, root: Path | None) -> None:
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH")))))
    monkeypatch.delenv("KVPROFILE_PR_DIRS", raising=False)
    if root is None:
        monkeypatch.delenv("KVPROFILE_PR_DIR", raising=False)
    else:
        monkeypatch.setenv("KVPROFILE_PR_DIR", str(root))


def test_the_overlay_plugin_without_a_private_copy_is_a_usage_error(pytester: pytest.Pytester,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _overlay_env(monkeypatch, None)
    result = pytester.runpytest_subprocess("-p", "pr_overlay", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stderr.str()[-2000:]
    result.stderr.fnmatch_lines(["*-p pr_overlay: KVPROFILE_PR_DIR / KVPROFILE_PR_DIRS name no private copy*"])


@pytest.mark.skipif(not DIRS, reason="KVPROFILE_PR_DIR / KVPROFILE_PR_DIRS name no private copy of the pull "
                                     "request's code (see docs/vllm.md)")
@pytest.mark.parametrize("root", DIRS, ids=[revision_of(d)[:7] for d in DIRS])
def test_the_suite_judges_the_pull_requests_own_code_through_the_overlay_plugin(
        root: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's own run, configure included (vLLM's WorkspaceManager is the revision's own where given): no
    INTERNALERROR; the profiling case fails only on its plan-time bytes; the gated MTP case passes."""
    _overlay_env(monkeypatch, root)
    verdict, report = pytester.path / "verdict.json", pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "-p", "pr_overlay", "--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(packaged_matrix("ci")),
        "-p", "no:cacheprovider", "--kvprofile-backend", "vllm-flashinfer", "-k", " or ".join(PLUGIN_CASES),
        "--kvprofile-verdict", str(verdict), "--kvprofile-json", str(report))
    text = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in text, text[-3000:]
    result.stdout.fnmatch_lines([f"pull request overlay: {revision_of(root)}: *vllm.v1.attention.backends.flashinfer*"])
    results = json.loads(report.read_text())["results"]
    assert {r["case"] for r in results} == set(PLUGIN_CASES)
    failed = [r for r in results if r["outcome"] == "failed"]
    assert [(r["case"], r["check"]) for r in failed] == [(PLUGIN_CASES[0], FINDING)], failed
    assert 0 < invisible_bytes(failed[0]["message"]) <= PLAN_TIME_LIMIT
    (backend,) = json.loads(verdict.read_text())["backends"]
    assert backend["contract_api"]["vllm-flashinfer"].startswith("vLLM pull request, "), backend["contract_api"]
    gated = {g["case"] for g in backend["engine_gated"]}  # every gated case of the matrix, run or not
    assert PLUGIN_CASES[1] in gated and PLUGIN_CASES[0] not in gated


def _table(root: Path) -> list[tuple[str, str, str]]:  # pragma: no cover - a measuring aid, run by hand
    rows = []
    for case_id, (path, failing) in measure(root).items():
        rows.append((case_id, path[:40], ", ".join(
            f"{k} ({invisible_bytes(v[0]):,} B)" if k == FINDING else k for k, v in sorted(failing.items()))))
    return rows


if __name__ == "__main__":  # pragma: no cover
    for directory in DIRS:
        print(f"## {revision_of(directory)}")
        rows: Any = _table(directory)
        for row in rows:
            print(" | ".join(row))
