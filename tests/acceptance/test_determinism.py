"""Determinism: the same inputs give the same verdict and JSON report, however the run is scheduled.

A serial run, a run with xdist disabled (``-p no:xdist``), a two-worker xdist run (``-n 2``) and a run
of the items in reverse order must write identical documents apart from timestamps and durations, and
fail the same node ids: the verdict is what a backend's opt-in rests on. Backends keeping memory in
process-wide state are among them: each case is judged as the first engine of a fresh process, so which
case ran before it changes nothing. This is the project's one scheduling test.
"""

from __future__ import annotations

import json
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
PROCESS_STATE = "pytest_kvprofile.builtin.process_state:backends"  # one workspace per process, done right
STATEFUL_BUGS = ("mutant-14b-global-per-engine", "mutant-14d-torch-global-per-engine")
CTX_PROCESS_STATE = """\
from pytest_kvprofile.builtin.process_state import backends


def ctx_backends():
    return [b for b in backends() if not b.torch_mode]
"""
BACKENDS = {  # the plain run's set (context mode: no torch-mode process to start), and the slow run's
    "core": ("stub-flashinfer", "mutant-01-lazy-workspace", "det_backends:ctx_backends", STATEFUL_BUGS[0]),
    "full": ("stubs", "mutant-01-lazy-workspace", "mutant-10-graph-gross-minus-retained", PROCESS_STATE,
             *STATEFUL_BUGS),
}
LAST_CASE = "qwen3-8b-tp4-dcp2-mtp0-l40s-gmu0.90"  # run alone, after the others, or on another worker
REVERSE = """\
import pathlib

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    pathlib.Path("order.txt").write_text("\\n".join(i.nodeid for i in items))
    items.reverse()
    pathlib.Path("reversed-order.txt").write_text("\\n".join(i.nodeid for i in items))
"""
MODES = {"serial": [], "no-xdist": ["-p", "no:xdist"], "xdist-2": ["-n", "2"], "reversed": ["-p", "reverse_items"]}
CORE_MODES = ("serial", "xdist-2", "reversed")  # the plain run's; "no-xdist" differs from "serial" only in a plugin
VOLATILE = ("time", "duration", "_at", "seconds")


def _normalize(doc: Any) -> Any:
    """Drop timestamps and durations, the only fields allowed to differ between runs, and order results by node
    id (a reversed run lists them in its own order)."""
    if isinstance(doc, dict):
        return {k: _normalize(v) for k, v in doc.items() if not any(word in k for word in VOLATILE)}
    if isinstance(doc, list) and doc and all(isinstance(v, dict) and "nodeid" in v for v in doc):
        return [_normalize(v) for v in sorted(doc, key=lambda v: v["nodeid"])]
    if isinstance(doc, list):
        return [_normalize(v) for v in doc]
    return doc


@pytest.mark.parametrize("backends", ["core", pytest.param("full", marks=pytest.mark.slow)])
def test_serial_no_xdist_and_two_workers_give_identical_reports_verdicts_and_failures(
    pytester: pytest.Pytester, backends: str,
) -> None:
    pytester.makefile(".yaml", det=MATRIX)
    pytester.makepyfile(reverse_items=REVERSE, det_backends=CTX_PROCESS_STATE)
    chosen = BACKENDS[backends]
    modes = {m: extra for m, extra in MODES.items() if backends == "full" or m in CORE_MODES}
    runs = {}
    for mode, extra in modes.items():
        result = pytester.runpytest_subprocess(
            "--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", "det.yaml", "-p", "no:cacheprovider", "-q",
            "--kvprofile-json", f"{mode}.json", "--kvprofile-verdict", f"{mode}-verdict.json",
            *[a for b in chosen for a in ("--kvprofile-backend", b)], *extra,
        )
        assert result.ret == pytest.ExitCode.TESTS_FAILED, f"{mode}: " + result.stdout.str()[-3000:]
        assert result.stdout.str().count("kvprofile summary") == 1, f"{mode}: one summary, from the controller"
        runs[mode] = (json.loads((pytester.path / f"{mode}.json").read_text()),
                      json.loads((pytester.path / f"{mode}-verdict.json").read_text()))

    report, verdict = runs["serial"]
    order, ran = ((pytester.path / f).read_text().splitlines() for f in ("order.txt", "reversed-order.txt"))
    assert len(ran) > 50 and ran == order[::-1]  # the reversed run ran every item, last first
    failed = sorted(r["nodeid"] for r in report["results"] if r["outcome"] == "failed")
    # not trivially equal: both outcomes occur, and the lazy mutant is refused
    assert failed and any(r["outcome"] == "passed" for r in report["results"])
    assert {r["backend"] for r in report["results"]} >= {"stub-flashinfer", "mutant-01-lazy-workspace"}
    assert {b["name"]: b["may_opt_in"] for b in verdict["backends"]}["mutant-01-lazy-workspace"] is False

    assert {m: sorted(r["nodeid"] for r in rep["results"] if r["outcome"] == "failed")
            for m, (rep, _) in runs.items()} == {m: failed for m in modes}
    assert {m: _normalize(v) for m, (_, v) in runs.items()} == {m: _normalize(verdict) for m in modes}
    assert {m: _normalize(rep) for m, (rep, _) in runs.items()} == {m: _normalize(report) for m in modes}

    # one workspace per process made in the first engine's window passes every case; made again by every
    # engine, it fails every case, whichever ran first and wherever
    outlived = {(r["backend"], r["case"]) for r in report["results"]
                if r["check"] == "no_state_outlives_case" and r["outcome"] == "failed"}
    assert outlived == {(r["backend"], r["case"]) for r in report["results"] if r["backend"] in STATEFUL_BUGS}
    opt_in = {b["name"]: b["may_opt_in"] for b in verdict["backends"]}
    process_wide = {name: ok for name, ok in opt_in.items() if "-process-" in name}
    assert "stub-flashinfer-process-workspace" in process_wide and all(process_wide.values()), process_wide
    alone = pytester.runpytest_subprocess(
        "--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", "det.yaml", "-p", "no:cacheprovider", "-q",
        "--kvprofile-json", "alone.json", *[a for b in chosen for a in ("--kvprofile-backend", b)],
        "-k", LAST_CASE)
    assert alone.ret == pytest.ExitCode.TESTS_FAILED
    alone_failed = sorted(r["nodeid"] for r in json.loads((pytester.path / "alone.json").read_text())["results"]
                          if r["outcome"] == "failed")
    assert alone_failed == [n for n in failed if LAST_CASE in n]
