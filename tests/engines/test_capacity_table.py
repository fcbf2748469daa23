"""The capacity table (scripts/capacity_table.py, report/capacity.py) carries the numbers the verdict's and the
summary's legacy cost carry, on one case (issue 24, point 4)."""

from __future__ import annotations

import pytest

from pytest_kvprofile.checks.base import CheckOutcome
from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.registry import builtin_backends
from pytest_kvprofile.report.capacity import CapacityCell, capacity_cell, capacity_table
from pytest_kvprofile.report.documents import backend_verdict
from pytest_kvprofile.report.summary import legacy_cost_lines, legacy_costs
from pytest_kvprofile.units import MiB

pytestmark = pytest.mark.usefixtures("vllm_flashinfer")

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98")


def test_the_table_and_the_verdict_carry_the_same_legacy_numbers(v1_runner):
    backend = builtin_backends()["vllm-flashinfer"]
    result = run_lifecycle(backend, CASE)
    try:
        cell = capacity_cell(backend.name, result)
        # the record the suite keeps for the verdict and the summary (suite/test_conformance.py)
        cost = post_kv_cost(result)
        assert cost is not None
        record = {"check": "legacy_path_unchanged", "backend": backend.name, "case": CASE.id,
                  "legacy_cost": cost.as_dict()}
    finally:
        close_parts(result)
    assert cell.oom, cell.outcome  # V1 at gmu 0.98 on an L40S: the overcommit ends in a simulated OOM
    assert cell.kv_tokens == result.budget.kv_tokens and cell.fits_tokens == cell.kv_tokens - cell.post_kv_tokens
    outcome = CheckOutcome.from_json(record)  # what the summary reads (the verdict reads the JSON report's form)
    costs = legacy_costs([outcome])[backend.name]
    assert costs[0]["kv_tokens"] == cell.post_kv_tokens and costs[0]["bytes"] == cell.post_kv_bytes
    summary = "\n".join(legacy_cost_lines([outcome]))
    assert f"{cell.post_kv_bytes / MiB:.2f} MiB" in summary and f"at most {cell.post_kv_tokens} KV tokens" in summary
    verdict = backend_verdict({"results": [dict(record, outcome="passed")], "planned": {CASE.id: [record["check"]]},
                               "refused_layouts": [], "declared_support": {backend.name: "unsupported"},
                               "legacy_cost": costs})
    reason = next(r for r in verdict["reasons"] if r.startswith("legacy path"))
    assert f"{cell.post_kv_bytes / MiB:.2f} MiB ({cell.post_kv_tokens} KV tokens)" in reason
    row = capacity_table({(backend.name, CASE.id): cell}, [CASE.id], backend.name, "v2", "r", "e")[2]
    assert row.split(" | ")[1:4] == [str(cell.kv_tokens), f"{cell.post_kv_bytes / MiB:.1f}",
                                     f"{cell.fits_tokens} (OOM in {result.errors[0].phase})"]


def _script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "capacity_table.py"
    spec = importlib.util.spec_from_file_location("capacity_table_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_resumes_from_its_json_file(tmp_path, monkeypatch):
    """Cells already in the --json file are not run again and the table carries them; a line cut short by a killed
    run is ignored, and the next cell starts on a line of its own."""
    import json

    import pytest_kvprofile.lifecycle.driver as driver

    script = _script()
    case = script.cases(packaged_matrix("ci"), [1])[0]
    names = (script.V1, script.V2, script.RESERVING, script.EXACT)
    lines = [json.dumps({"backend": name, "case": case.id, "path": "legacy", "kv_tokens": 1000 + i,
                         "post_kv_bytes": 0, "post_kv_tokens": 10 * i, "overrun_bytes": 0, "outcome": "ran",
                         "fits_tokens": 1000 - 9 * i, "seconds": 1.5}) for i, name in enumerate(names)]
    store = tmp_path / "cells.jsonl"
    store.write_text("\n".join(lines) + '\n{"backend": "cut sh')
    monkeypatch.setattr(script, "cases", lambda matrix, ubatches: [case])

    def no_run(*args, **kwargs):
        raise AssertionError("a cell already in the --json file ran again")

    monkeypatch.setattr(driver, "run_lifecycle", no_run)
    out = tmp_path / "table.md"
    assert script.main(["--json", str(store), "--out", str(out)]) == 0
    row = out.read_text().splitlines()[2]
    assert row == f"| {case.id} | 1000 | 0.0 | 1000 | 1001 | 0.0 | 991 | 1002 | 1003 |"
    assert store.read_text().endswith("\n")
    assert set(script.read_cells(store, CapacityCell)) == {(name, case.id) for name in names}
