"""The controller's outputs: the summary table, the JSON report and the verdict document."""

from __future__ import annotations

import platform
from collections import Counter, defaultdict
from importlib import metadata
from typing import Any

from pytest_kvprofile.units import MiB

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


def summarize(records: list[dict]) -> list[dict]:
    """Per backend: cases, checks passed/failed/xfailed, the most failed check and the worst budget."""
    by_backend: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        if rec.get("backend"):
            by_backend[rec["backend"]].append(rec)
    rows = []
    for backend, recs in sorted(by_backend.items()):
        outcomes = Counter(r["outcome"] for r in recs)
        failed = Counter(r["check"] for r in recs if r["outcome"] == "failed")
        worst_check = failed.most_common(1)[0] if failed else None
        budgets = [r["budget"] for r in recs if r.get("budget")]
        worst_budget = min(budgets, key=lambda b: (b["kv_tokens"], b["case"]), default=None)
        rows.append({
            "backend": backend,
            "cases": len({r["case"] for r in recs}),
            "passed": outcomes.get("passed", 0),
            "failed": outcomes.get("failed", 0),
            "xfailed": outcomes.get("xfailed", 0),
            "skipped": outcomes.get("skipped", 0),
            "worst_check": f"{worst_check[0]} ({worst_check[1]})" if worst_check else "-",
            "worst_case": worst_budget["case"] if worst_budget else None,
            "worst_case_kv_tokens": worst_budget["kv_tokens"] if worst_budget else None,
            "worst_case_reservation_tokens": worst_budget["reservation_kv_tokens"] if worst_budget else None,
        })
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    header = ("backend", "cases", "passed", "failed", "xfailed", "worst check", "fewest KV tokens (case)")
    body = []
    for r in rows:
        worst = "-"
        if r["worst_case"]:
            worst = f"{r['worst_case_kv_tokens']} ({r['worst_case']}; reservation costs {r['worst_case_reservation_tokens']})"
        body.append((r["backend"], str(r["cases"]), str(r["passed"]), str(r["failed"]), str(r["xfailed"]),
                     r["worst_check"], worst))
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in body]


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
        declared = _declared_support(session, backend)
        if declared and not any(s in ("required", "neutral") for s in declared.values()):
            reasons.append("no builder declares REQUIRED or NEUTRAL: the backend stays on the legacy path")
        elif declared and "unsupported" in declared.values():
            reasons.append("a builder declares UNSUPPORTED, which keeps the model on the legacy path")
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
        })
    return doc


def _declared_support(session: Any, backend: Any) -> dict[str, str]:
    from pytest_kvprofile.contract.support import builder_name, declared_support

    case = next(iter(session.runnable_cases), None)
    if case is None:
        return {}
    from pytest_kvprofile.contract.resources import model_parts

    try:
        builders = model_parts(backend, case)
    except Exception as exc:  # noqa: BLE001
        return {"<factory>": f"error: {type(exc).__name__}: {exc}"}
    out = {}
    for b in builders:
        try:
            out[builder_name(b)] = declared_support(b).value
        except Exception as exc:  # noqa: BLE001
            out[builder_name(b)] = f"invalid: {type(exc).__name__}: {exc}"
    return out


def verdict_lines(doc: dict) -> list[str]:
    lines = []
    for b in doc["backends"]:
        verdict = "may opt in" if b["may_opt_in"] else "may NOT opt in"
        counts = ", ".join(f"{n} {k}" for k, n in sorted(b["counts"].items()))
        lines.append(f"{b['name']}: {verdict} ({counts or 'nothing ran'})")
        for reason in b["reasons"]:
            lines.append(f"    - {reason}")
    return lines


def budget_record(budget: Any, case_id: str) -> dict:
    d = budget.as_dict()
    d["case"] = case_id
    d["limit"] = budget.limit
    d["available_kv_mib"] = round(budget.available_kv / MiB, 2)
    return d
