"""The report's provenance functions and file writing, as plain functions (the pytester runs are
tests/plugin/test_provenance.py)."""

from __future__ import annotations

import json
import os
from collections import Counter
from types import SimpleNamespace

import pytest

from pytest_kvprofile.checks.catalog import CHECKS
from pytest_kvprofile.report.files import write_document, write_json_atomic
from pytest_kvprofile.report.provenance import merge_kv_sizing, merge_sizing, sizing_method
from pytest_kvprofile.report.summary import root_cause

ORDER = [c.name for c in CHECKS]


def test_the_root_cause_is_the_first_failing_check_in_run_order_not_the_most_frequent():
    failed = Counter({"no_post_kv_overrun": 62, "persistent_memory_visible_at_closing": 3})
    assert root_cause(failed, ORDER) == "persistent_memory_visible_at_closing"
    assert root_cause(failed) == "no_post_kv_overrun"  # without an order: the most frequent
    assert root_cause(Counter(), ORDER) is None


def test_sizing_method_reads_method_reason_when_the_sizing_gives_one_else_its_notes():
    assert sizing_method(SimpleNamespace(method="oracle", notes=())) == ("oracle", "")
    assert sizing_method(SimpleNamespace(method="analytic", method_reason="nvcc missing", notes=("x",))) == (
        "analytic", "nvcc missing")
    assert sizing_method(SimpleNamespace(method="analytic", notes=("oracle unavailable, analytic only: boom",))) == (
        "analytic", "oracle unavailable, analytic only: boom")


def test_merged_kv_sizing_keeps_every_case_and_its_reason():
    a = {"cases": {"c1": "profile window", "c2": "extensible"}, "rules": {"profile window": "profile",
         "extensible": "post_warmup"}, "reasons": {"c1": "kv_cache_memory_bytes is set"}}
    b = {"cases": {"c3": "extensible", "c4": "extensible"}, "rules": {"extensible": "post_warmup"}, "reasons": {}}
    merged = merge_kv_sizing([a, None, b])
    assert merged is not None
    assert merged["modes"] == {"extensible": 3, "profile window": 1} and merged["most_common"] == "extensible"
    assert merged["differing"] == [{"case": "c1", "mode": "profile window", "rule": "profile",
                                    "reason": "kv_cache_memory_bytes is set"}]
    assert merge_kv_sizing([None]) is None
    sizing = merge_sizing([{"flashinfer": "0.7.4", "counts": {"oracle": 2}, "analytic_reasons": []},
                           {"flashinfer": "0.7.4", "counts": {"analytic": 1},
                            "analytic_reasons": [{"reason": "no nvcc", "cases": 1, "first_cases": ["c9"]}]}])
    assert sizing is not None and sizing["method"] == "mixed" and sizing["counts"] == {"analytic": 1, "oracle": 2}


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "verdict.json"
    write_json_atomic(target, {"old": True})

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        write_json_atomic(target, {"new": True})
    said = write_document("verdict", target, {"new": True}, checks_ran=True)
    assert not said.written and "disk full" in said.line()
    assert json.loads(target.read_text()) == {"old": True} and [p.name for p in tmp_path.iterdir()] == ["verdict.json"]
    monkeypatch.undo()
    kept = write_document("verdict", target, {"empty": True}, checks_ran=False)
    assert not kept.written and json.loads(target.read_text()) == {"old": True}
    assert write_document("verdict", tmp_path / "new.json", {"empty": True}, checks_ran=False).written


def test_the_verdict_line_of_a_legacy_backend_names_its_worst_cost_and_of_an_opted_in_one_its_waste():
    from pytest_kvprofile.report.summary import verdict_line

    legacy = {"name": "b", "may_opt_in": False, "results": [{"check": "c", "case": "x", "outcome": "passed"}],
              "reasons": ["legacy path: nothing to opt in (a builder declares UNSUPPORTED)"],
              "legacy_cost": [{"case": "x", "bytes": 3128, "kv_tokens": 1}]}
    assert verdict_line(legacy) == "b: may NOT opt in: legacy path; worst x: 3,128 bytes (1 KV tokens) appear after " \
                                   "KV sizing"
    opted = {"name": "b", "may_opt_in": True, "waste": [{"case": "y", "bytes": 2 ** 20, "kv_tokens": 7}]}
    assert verdict_line(opted) == "b: may opt in; worst y: 1,048,576 bytes wasted (7 KV tokens)"
    failed = {"name": "b", "may_opt_in": False, "reasons": ["2 check results failed"], "results": [
        {"check": "no_post_kv_overrun", "case": "x", "outcome": "failed", "message": "over by 10 bytes"},
        {"check": "persistent_memory_visible_at_closing", "case": "y", "outcome": "failed",
         "message": "3,128 bytes invisible to KV sizing (2 KV tokens)"}]}
    assert verdict_line(failed, ORDER) == ("b: may NOT opt in: persistent_memory_visible_at_closing fails on 1 cases; "
                                           "worst y: 3,128 bytes, 2 KV tokens")


def test_the_documents_versions_name_each_engine_a_backend_ran_on():
    """Issue 50: ``versions`` had no vLLM entry. An engine backend's provenance adds its engine and version; the
    reference engine (no provenance) adds nothing."""
    from pytest_kvprofile.contract.backends import Backend, Provenance
    from pytest_kvprofile.report.documents import versions

    engine = Backend(name="e", make_builders=list, provenance=lambda: Provenance(engine="vllm",
                                                                                   engine_version="0.34.0"))
    reference = Backend(name="r", make_builders=list)
    assert versions([engine, reference])["vllm"] == "0.34.0"
    assert set(versions([reference])) == set(versions())
    assert "vllm" not in versions([reference])
