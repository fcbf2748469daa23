"""The controller's documents: the JSON report (``--kvprofile-json``) and the opt-in verdict (``--kvprofile-verdict``).

Both are written by the controller only, after the ``pytest_kvprofile_update_json`` hook has had its say.
"""

from __future__ import annotations

import platform
from collections import Counter, defaultdict
from importlib import metadata
from typing import Any

from pytest_kvprofile.report.summary import legacy_costs, summarize, waste_costs, waste_reason

SCHEMA_VERSION = 1


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {
        "pytest-kvprofile": _version("pytest-kvprofile"),
        "pytest": _version("pytest"),
        "torch": _version("torch"),
        "flashinfer-python": _version("flashinfer-python"),
        "python": platform.python_version(),
    }


def json_document(session: Any) -> dict:
    return {
        "schema": SCHEMA_VERSION,
        "tier": session.tier,
        "versions": versions(),
        "hardware": session.hardware,
        "matrices": [{"path": m.path, "name": m.name, "cases": len(m.cases)} for m in session.matrices],
        "matrix_digest": session.matrix_digest(),
        "backends": [{"name": b.name, "origin": b.origin, "version": b.version, "description": b.description}
                     for b in session.backends],
        "skipped_cases": [{"case": c.id, "reason": c.skip_reason} for c in session.skipped_cases],
        "summary": summarize(session.records),
        "results": sorted(session.records, key=lambda r: r["nodeid"]),
        "sizing_report": _sizing_report(session),
    }


def _sizing_report(session: Any) -> dict:
    """Every layout's exact requirement next to the fixed sizes engines use, with the headline."""
    from pytest_kvprofile.sizing.comparison import report_for_matrix, report_headline

    rows = [row for m in session.matrices for row in report_for_matrix(m.path)]
    return {"headline": report_headline(rows), "rows": rows}


def _legacy_reason(declared: dict[str, str]) -> str | None:
    """Why the model stays on the legacy path (docs/contract.md, "Support declaration"), or None.

    Opting in means taking the profiling path: every part REQUIRED or NEUTRAL and at least one REQUIRED.
    A declaration that raised or is not a member counts as not REQUIRED.
    """
    if not declared:
        return None
    answers = list(declared.values())
    if "unsupported" in answers:
        return "a builder declares UNSUPPORTED, which keeps the model on the legacy path"
    if "required" not in answers:
        if all(a == "neutral" for a in answers):
            return "every builder declares NEUTRAL, so the model stays on the legacy path"
        return "no builder declares REQUIRED: the backend stays on the legacy path"
    return None


def verdict_document(session: Any) -> dict:
    """Per backend: declared support, results per check x case, and whether it may opt in."""
    doc = {
        "schema": SCHEMA_VERSION,
        "tier": session.tier,
        "versions": versions(),
        "hardware": session.hardware,
        "matrix_digest": session.matrix_digest(),
        "matrices": [m.path for m in session.matrices],
        "backends": [],
    }
    by_backend: dict[str, list[dict]] = defaultdict(list)
    for rec in session.records:
        if rec.get("backend"):
            by_backend[rec["backend"]].append(rec)
    costs = legacy_costs(session.records)
    wastes = waste_costs(session.records)
    for backend in session.backends:
        recs = sorted(by_backend.get(backend.name, []), key=lambda r: (r["check"], r["case"]))
        failed = [r for r in recs if r["outcome"] == "failed"]
        xfailed = [r for r in recs if r["outcome"] == "xfailed"]
        reasons = []
        if not recs:
            reasons.append("no check ran for this backend")
        if failed:
            checks = sorted({r["check"] for r in failed})
            reasons.append(f"{len(failed)} check results failed: {', '.join(checks)}")
        if xfailed:
            reasons.append(f"{len(xfailed)} expected failures declared: {', '.join(sorted({r['check'] for r in xfailed}))}")
        declared = session.profiles[backend.name].declared_support
        legacy = _legacy_reason(declared)
        cost = costs.get(backend.name, [])
        if legacy:
            worst = f"; up to {cost[0]['mib']:.2f} MiB ({cost[0]['kv_tokens']} KV tokens) appear after KV sizing " \
                    f"on {cost[0]['case']}" if cost and cost[0]["bytes"] else ""
            reasons.append(f"legacy path: nothing to opt in ({legacy}{worst})")
        doc["backends"].append({
            "name": backend.name,
            "version": backend.version,
            "origin": backend.origin,
            "declared_support": declared,
            "expected_failures": backend.xfails,
            "results": [
                {"check": r["check"], "case": r["case"], "outcome": r["outcome"], "message": r.get("message")}
                for r in recs
            ],
            "counts": dict(Counter(r["outcome"] for r in recs)),
            "may_opt_in": not reasons,
            "reasons": reasons,
            "legacy_cost": cost,
            "waste": wastes.get(backend.name, []),
            "cost_reasons": [r for r in (waste_reason(wastes.get(backend.name, [])),) if r],
        })
    return doc
