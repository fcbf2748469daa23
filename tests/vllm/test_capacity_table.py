"""The capacity table (scripts/capacity_table.py, report/capacity.py) carries the numbers the verdict's and the
summary's legacy cost carry, on one case (issue 24, point 4)."""

from __future__ import annotations

import pytest

from pytest_kvprofile.engines import vllm_standins as vs

try:
    vs.import_vllm_flashinfer()
except vs.VllmUnavailable as exc:
    pytest.skip(f"vLLM is not importable ({exc.__cause__}); install it with {vs.VLLM_INSTALL_HINT}",
                allow_module_level=True)

from pytest_kvprofile.registry import builtin_backends  # noqa: E402 - after the vLLM guard

from pytest_kvprofile.checks.post_kv_cost import post_kv_cost  # noqa: E402 - after the vLLM guard
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle  # noqa: E402 - after the vLLM guard
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix  # noqa: E402 - after the vLLM guard
from pytest_kvprofile.report.capacity import capacity_cell, capacity_table  # noqa: E402 - after the vLLM guard
from pytest_kvprofile.report.documents import backend_verdict  # noqa: E402 - after the vLLM guard
from pytest_kvprofile.report.summary import legacy_cost_lines, legacy_costs  # noqa: E402 - after the vLLM guard
from pytest_kvprofile.units import MiB  # noqa: E402 - after the vLLM guard

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98")


def test_the_table_and_the_verdict_carry_the_same_legacy_numbers():
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
    costs = legacy_costs([record])[backend.name]
    assert costs[0]["kv_tokens"] == cell.post_kv_tokens and costs[0]["bytes"] == cell.post_kv_bytes
    summary = "\n".join(legacy_cost_lines([record]))
    assert f"{cell.post_kv_bytes / MiB:.2f} MiB" in summary and f"at most {cell.post_kv_tokens} KV tokens" in summary
    verdict = backend_verdict({"results": [dict(record, outcome="passed")], "planned": {CASE.id: [record["check"]]},
                               "refused_layouts": [], "declared_support": {backend.name: "unsupported"},
                               "legacy_cost": costs})
    reason = next(r for r in verdict["reasons"] if r.startswith("legacy path"))
    assert f"{cell.post_kv_bytes / MiB:.2f} MiB ({cell.post_kv_tokens} KV tokens)" in reason
    row = capacity_table({(backend.name, CASE.id): cell}, [CASE.id], backend.name, "v2", "r", "e")[2]
    assert row.split(" | ")[1:4] == [str(cell.kv_tokens), f"{cell.post_kv_bytes / MiB:.1f}",
                                     f"{cell.fits_tokens} (OOM in {result.errors[0].phase})"]
