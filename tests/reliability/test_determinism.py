"""Determinism: the same inputs give the same verdict and JSON report, however the run is scheduled.

Serial runs, a run without xdist, and xdist runs with one and two workers must write identical
documents apart from timestamps and durations; the verdict is what a backend's opt-in rests on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

MATRIX = """\
name: det
envelope: {num_ubatches: 2}
models:
  qwen3-8b: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36, weights_gib: 15.3, hidden_size: 4096}
gpus: [L40S]
tp: [1, 4]
dcp: [1, 2]
gmu: [0.9]
exclude:
  - {tp: 1, dcp: 2}
"""
BACKENDS = ("stubs", "mutant-01-lazy-workspace", "mutant-10-graph-gross-minus-retained")
MODES = {"serial": [], "serial-again": [], "no-xdist": ["-p", "no:xdist"], "xdist-1": ["-n", "1"], "xdist-2": ["-n", "2"]}
VOLATILE = ("time", "duration", "_at", "seconds")


def _normalize(doc: Any) -> Any:
    """Drop timestamps and durations, the only fields allowed to differ between runs."""
    if isinstance(doc, dict):
        return {k: _normalize(v) for k, v in doc.items() if not any(word in k for word in VOLATILE)}
    if isinstance(doc, list):
        return [_normalize(v) for v in doc]
    return doc


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory, shared_oracle_cache: Path) -> dict[str, tuple[dict, dict]]:
    root = tmp_path_factory.mktemp("determinism")
    (root / "det.yaml").write_text(MATRIX)
    env = dict(os.environ, KVPROFILE_CACHE_DIR=str(shared_oracle_cache))
    out = {}
    for mode, extra in MODES.items():
        argv = [sys.executable, "-m", "pytest", "--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", "det.yaml",
                "-p", "no:cacheprovider", "-q", "--kvprofile-json", f"{mode}.json", "--kvprofile-verdict",
                f"{mode}-verdict.json", *[a for b in BACKENDS for a in ("--kvprofile-backend", b)], *extra]
        proc = subprocess.run(argv, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the mutants fail, nothing crashes
        out[mode] = (json.loads((root / f"{mode}.json").read_text()),
                     json.loads((root / f"{mode}-verdict.json").read_text()))
    return out


def test_documents_are_not_trivially_equal(documents: dict[str, tuple[dict, dict]]) -> None:
    report, verdict = documents["serial"]
    assert {r["backend"] for r in report["results"]} >= {"stub-flashinfer", "mutant-01-lazy-workspace"}
    assert any(r["outcome"] == "failed" for r in report["results"])
    assert {b["name"]: b["may_opt_in"] for b in verdict["backends"]}["mutant-01-lazy-workspace"] is False


@pytest.mark.parametrize("mode", ["serial-again", "no-xdist"])
def test_serial_runs_are_identical(documents: dict[str, tuple[dict, dict]], mode: str) -> None:
    report, verdict = documents["serial"]
    other_report, other_verdict = documents[mode]
    assert _normalize(other_verdict) == _normalize(verdict)
    assert _normalize(other_report) == _normalize(report)


@pytest.mark.parametrize("mode", ["xdist-1", "xdist-2"])
def test_xdist_runs_match_serial(documents: dict[str, tuple[dict, dict]], mode: str) -> None:
    report, verdict = documents["serial"]
    other_report, other_verdict = documents[mode]
    assert _normalize(other_verdict) == _normalize(verdict)
    assert _normalize(other_report) == _normalize(report)


def test_xdist_verdicts_agree_on_every_outcome(documents: dict[str, tuple[dict, dict]]) -> None:
    """What the opt-in rests on (outcomes per check and case, and the decision) is already identical."""

    def decisions(verdict: dict) -> list[tuple]:
        return [(b["name"], b["may_opt_in"], b["reasons"], b["counts"],
                 [(r["check"], r["case"], r["outcome"]) for r in b["results"]]) for b in verdict["backends"]]

    serial = decisions(documents["serial"][1])
    for mode in ("xdist-1", "xdist-2"):
        assert decisions(documents[mode][1]) == serial, mode
