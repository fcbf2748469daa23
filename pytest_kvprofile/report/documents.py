"""The controller's documents: the JSON report (``--kvprofile-json``) and the opt-in verdict (``--kvprofile-verdict``).

Both are written by the controller only, after the ``pytest_kvprofile_update_json`` hook has had its say.
"""

from __future__ import annotations

import platform
from collections import Counter, defaultdict
from importlib import metadata
from typing import TYPE_CHECKING, Any, TypeAlias

from pytest_kvprofile.checks.base import CheckOutcome, JsonObject
from pytest_kvprofile.report.provenance import (
    REFERENCE_ENGINE,
    backend_provenance,
    kv_sizing_of_records,
    merge_kv_sizing,
    merge_sizing,
    sizing_line,
    sizing_of_cases,
)
from pytest_kvprofile.report.summary import legacy_costs, summarize, waste_costs, waste_reason

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pytest_kvprofile.checks.base import WasteBudget
    from pytest_kvprofile.contract.backends import Backend

# the plugin's KvprofileSession (plugin/session.py), read by attribute: report sits below plugin and cannot name it
Session: TypeAlias = Any

SCHEMA_VERSION = 1
UNMADE = "the builders could not be made"  # a verdict's reason when the backend's factory raised


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions(backends: Iterable[Backend] = ()) -> dict[str, str | None]:
    """The packages the run judged with, and each engine a backend ran on (``{"vllm": "0.34.0"}``), as its
    provenance names it."""
    found: dict[str, str | None] = {
        "pytest-kvprofile": _version("pytest-kvprofile"),
        "pytest": _version("pytest"),
        "torch": _version("torch"),
        "flashinfer-python": _version("flashinfer-python"),
        "python": platform.python_version(),
    }
    for backend in backends:
        facts = backend_provenance(backend)
        engine, version = facts.get("engine"), facts.get("engine_version")
        if isinstance(engine, str) and engine and isinstance(version, str) and version:
            found[engine] = version
    return found


def provenance_facts(session: Session) -> dict[str, JsonObject]:
    """Per backend: the engine it ran on (``provenance``), the KV sizing mode of each case its records carry
    (``kv_sizing``) and how the workspace need of the cases it ran was sized (``sizing``)."""
    kv = kv_sizing_of_records(session.records)
    cases = {c.id: c for c in getattr(session, "cases", ())}  # a session made by hand may carry none
    ran: dict[str, set[str]] = defaultdict(set)
    for rec in session.records:
        if rec.backend:
            ran[rec.backend].add(rec.case)
    return {b.name: {"provenance": backend_provenance(b), "kv_sizing": kv.get(b.name),
                     "sizing": sizing_of_cases(cases[c] for c in sorted(ran.get(b.name, ())) if c in cases)}
            for b in session.backends}


def json_document(session: Session) -> JsonObject:
    facts = provenance_facts(session)
    return {
        "schema": SCHEMA_VERSION,
        "tier": session.tier,
        "versions": versions(session.backends),
        "hardware": session.hardware,
        "matrices": [{"path": m.path, "name": m.name, "cases": len(m.cases)} for m in session.matrices],
        "matrix_digest": session.matrix_digest(),
        "backends": [dict({"name": b.name, "origin": b.origin, "version": b.version, "description": b.description},
                          **facts[b.name]) for b in session.backends],
        "skipped_cases": [{"case": c.id, "reason": c.skip_reason} for c in session.skipped_cases],
        "summary": summarize(session.records, getattr(session, "check_order", ())),
        "results": [r.to_json() for r in sorted(session.records, key=lambda r: r.nodeid or "")],
        "sizing_report": _sizing_report(session),
    }


def _sizing_report(session: Session) -> JsonObject:
    """Every layout's exact requirement next to the fixed sizes engines use, with the headline."""
    from pytest_kvprofile.sizing.comparison import case_row, distinct_layout_cases, report_headline, unsized_layouts

    # the session's own cases: the matrix files are read once, at configure
    rows = [case_row(case) for m in session.matrices for case in distinct_layout_cases(m.cases)]
    unsized = [row for m in session.matrices for row in unsized_layouts(m.cases)]
    return {"headline": report_headline(rows), "rows": rows, "unsized": unsized}


def _legacy_reason(declared: dict[str, str]) -> str | None:
    """Why the model stays on the legacy path (docs/contract.md, "Support declaration"), or None.

    Opting in means taking the profiling path: every part REQUIRED or NEUTRAL and at least one REQUIRED.
    A declaration that raised or is not a member counts as not REQUIRED.
    """
    if not declared:
        return None
    errors = [f"{'the factory' if part == '<factory>' else part} raised {answer.split(': ', 1)[1]}"
              for part, answer in declared.items()
              if answer.startswith("error: ")]
    if errors:
        return (f"{UNMADE} ({'; '.join(errors)}): the support they declare is unknown; fix the "
                "factory or the builder's __init__ (the failures show where it raised)")
    answers = list(declared.values())
    if "unsupported" in answers:
        return "a builder declares UNSUPPORTED, which keeps the model on the legacy path"
    if "required" not in answers:
        if all(a == "neutral" for a in answers):
            return "every builder declares NEUTRAL, so the model stays on the legacy path"
        return "no builder declares REQUIRED: the backend stays on the legacy path"
    return None


def waste_budget(budget: WasteBudget | None) -> JsonObject | None:
    """The run's waste budget as the verdict records it (None: waste is reported, never refused)."""
    if budget is None:
        return None
    return {"amount": budget.amount, "unit": budget.unit, "text": budget.describe()}


def verdict_document(session: Session) -> JsonObject:
    """Per backend: declared support, results per check x case, coverage of its matrix, and whether it may opt in.

    A backend's matrix is every runnable case its engine accepts, each with the checks that apply
    (``session.planned``); a run that did not record all of them (``-k``, ``--deselect``, ``-x``, ``--lf``,
    ``--sw``, an interrupt) is ``partial`` and may not opt in.
    """
    doc = {
        "schema": SCHEMA_VERSION,
        "tier": session.tier,
        "versions": versions(session.backends),
        "hardware": session.hardware,
        "matrix_digest": session.matrix_digest(),
        "matrices": [m.path for m in session.matrices],
        "waste_budget": waste_budget(session.settings.max_waste),
        "backends": [],
    }
    by_backend: dict[str, list[CheckOutcome]] = defaultdict(list)
    for rec in session.records:
        if rec.backend:
            by_backend[rec.backend].append(rec)
    costs = legacy_costs(session.records)
    facts = provenance_facts(session)
    refused_pairs = session.refused_pairs()
    wastes = waste_costs(session.records)
    for backend in session.backends:
        results = [
            {"check": r.check, "case": r.case, "outcome": r.outcome, "message": r.message}
            for r in by_backend.get(backend.name, [])
        ]
        refused = [{"case": case.id, "reason": reason}
                   for b, case, reason in refused_pairs if b.name == backend.name]
        doc["backends"].append(backend_verdict({
            "name": backend.name,
            "version": backend.version,
            "origin": backend.origin,
            "declared_support": session.profiles[backend.name].declared_support,
            "contract_api": session.profiles[backend.name].contract_api,
            "engine_gated": session.gated(backend),
            "expected_failures": backend.xfails,
            "results": results,
            "planned": session.planned(backend),
            "refused_layouts": refused,
            "legacy_cost": costs.get(backend.name, []),
            "waste": wastes.get(backend.name, []),
            **facts[backend.name],
        }))
    doc["partial"] = any(b["partial"] for b in doc["backends"])
    return doc


def coverage(planned: dict[str, list[str]], results: list[JsonObject]) -> JsonObject:
    """How much of the backend's matrix the results cover: a case is run when every check planned for it has a
    result."""
    ran = {(r["check"], r["case"]) for r in results}
    want = [(check, case) for case, checks in sorted(planned.items()) for check in checks]
    missing = [key for key in want if key not in ran]
    return {
        "cases_in_matrix": len(planned),
        "cases_run": sum(1 for case, checks in planned.items() if all((c, case) in ran for c in checks)),
        "results_in_matrix": len(want),
        "results_run": len(want) - len(missing),
        "missing": [f"{check}[{case}]" for check, case in missing[:10]],
    }


def backend_verdict(entry: JsonObject) -> JsonObject:
    """One backend's verdict from its facts (results, planned matrix, refused layouts, declarations, legacy cost).

    The one computation of ``may_opt_in`` and its reasons, for a run's verdict and for a merged one alike.
    """
    recs = sorted(entry["results"], key=lambda r: (r["check"], r["case"], r["outcome"]))
    failed = [r for r in recs if r["outcome"] == "failed"]
    xfailed = [r for r in recs if r["outcome"] == "xfailed"]
    cover = coverage(entry["planned"], recs)
    partial = cover["results_run"] < cover["results_in_matrix"]
    reasons = []
    if not recs:
        reasons.append("no check ran for this backend")
    elif partial:
        reasons.append(
            f"partial run: {cover['cases_run']} of {cover['cases_in_matrix']} cases ({cover['results_run']} of "
            f"{cover['results_in_matrix']} check results) ran; only a run over the whole matrix may opt in (the run "
            "was narrowed by -k, --deselect, -x, --lf or --sw, or interrupted; merge the runners' verdicts with "
            "`kvprofile verdict merge`)")
    if failed:
        checks = sorted({r["check"] for r in failed})
        reasons.append(f"{len(failed)} check results failed: {', '.join(checks)}")
    if xfailed:
        reasons.append(f"{len(xfailed)} expected failures declared: {', '.join(sorted({r['check'] for r in xfailed}))}")
    legacy = _legacy_reason(entry["declared_support"])
    cost = entry["legacy_cost"]
    if legacy:
        worst = f"; up to {cost[0]['mib']:.2f} MiB ({cost[0]['kv_tokens']} KV tokens) appear after KV sizing " \
                f"on {cost[0]['case']}" if cost and cost[0]["bytes"] else ""
        reasons.append(legacy if legacy.startswith(UNMADE) else f"legacy path: nothing to opt in ({legacy}{worst})")
    waste = waste_reason(entry.get("waste") or [], entry.get("waste_cases"), entry.get("waste_wasting"))
    return dict(
        entry,
        cost_reasons=[waste] if waste else [],
        notices=notices(entry),
        results=recs,
        refused_layouts=sorted(entry["refused_layouts"], key=lambda r: r["case"]),
        counts=dict(Counter(r["outcome"] for r in recs)),
        coverage=cover,
        partial=partial,
        may_opt_in=not reasons,
        reasons=reasons,
    )


def notices(entry: JsonObject) -> list[str]:
    """What the reviewer must know to read the verdict, which blocks nothing: a sizing by the analytic model
    (FlashInfer's planner did not judge the workspace) and the engine the backend ran on."""
    out = []
    sizing = entry.get("sizing")
    if sizing and sizing.get("method") in ("analytic", "mixed", "error"):
        out.append(sizing_line(sizing))
    prov = entry.get("provenance")
    if prov and prov.get("notes"):
        out += [f"provenance: {n}" for n in prov["notes"]]
    return out


class MergeError(ValueError):
    """Verdicts that cannot be merged; the message names the files and the values that differ."""


def merge_verdicts(docs: dict[str, JsonObject]) -> JsonObject:
    """One verdict from the verdicts of several runners of one matrix (xdist shards, the CPU tier, each GPU runner).

    ``docs`` maps a source name (its path) to its verdict. Every document must have the same matrix digest,
    and a backend the same version in each. A backend's matrix is the union of what the runners planned;
    it may opt in only when the union of their results covers all of it and nothing failed.
    """
    if not docs:
        raise MergeError("no verdicts to merge")
    docs = {name: expand_verdict(doc) for name, doc in docs.items()}
    for name, doc in docs.items():
        if "results" in doc and "summary" in doc and "partial" not in doc:  # what json_document writes
            raise MergeError(f"{name} is a --kvprofile-json report, not a verdict: merge the files that "
                             "--kvprofile-verdict writes")
    budgets = {name: _budget_key(doc) for name, doc in docs.items()}
    if len(set(budgets.values())) > 1:
        raise MergeError("the verdicts were judged under different waste budgets (--kvprofile-max-waste): "
                         + ", ".join(f"{n}: {_budget_text(d)}" for n, d in docs.items())
                         + "; run them again with one budget")
    for key in ("schema", "matrix_digest"):
        values = {name: doc.get(key) for name, doc in docs.items()}
        if len(set(map(str, values.values()))) > 1:
            raise MergeError(f"the verdicts differ in {key}: " + ", ".join(f"{n}: {v}" for n, v in values.items()))
    _same_flashinfer(docs)
    entries: dict[str, list[tuple[str, JsonObject]]] = defaultdict(list)
    for name, doc in docs.items():
        for b in doc.get("backends", []):
            entries[b["name"]].append((name, b))
    _same_engine(entries)
    for backend, found in entries.items():
        unplanned = [name for name, b in found if not isinstance(b.get("planned"), dict)]
        if unplanned:
            raise MergeError(f"backend {backend!r} in {', '.join(unplanned)} does not say which cases its matrix has "
                             "(no 'planned'; written by an older pytest-kvprofile): run it again to merge it")
        versions_seen = {name: b.get("version") for name, b in found}
        if len(set(versions_seen.values())) > 1:
            raise MergeError(f"backend {backend!r} has different versions: "
                             + ", ".join(f"{n}: {v!r}" for n, v in versions_seen.items()))
    first = next(iter(docs.values()))
    backends = [_merge_backend(found) for _, found in sorted(entries.items())]
    return {
        "schema": first.get("schema"),
        "tier": "+".join(sorted({str(d.get("tier")) for d in docs.values()})),
        "versions": first.get("versions"),
        "hardware": [d.get("hardware") for d in docs.values() if d.get("hardware")] or None,
        "matrix_digest": first.get("matrix_digest"),
        "matrices": first.get("matrices"),
        "waste_budget": first.get("waste_budget"),
        "merge": {"sources": [{"path": name, "tier": d.get("tier"), "partial": d.get("partial"),
                               "versions": d.get("versions"), "hardware": d.get("hardware")}
                              for name, d in docs.items()]},
        "backends": backends,
        "partial": any(b["partial"] for b in backends),
    }


NO_PROVENANCE = "not recorded (written before pytest-kvprofile named engines)"


def _same_flashinfer(docs: dict[str, JsonObject]) -> None:
    """Verdicts judged against different FlashInfer releases do not merge: their planners carve different workspaces
    (the document's installed ``flashinfer-python``, and each backend's own FlashInfer where its engine names one)."""
    seen = {name: str((doc.get("versions") or {}).get("flashinfer-python")) for name, doc in docs.items()}
    for name, doc in docs.items():
        for b in doc.get("backends") or []:
            prov = b.get("provenance") or {}
            if prov.get("flashinfer") and prov["flashinfer"] != seen[name]:
                seen[name] = f"{seen[name]} ({b['name']} ran {prov['flashinfer']})"
    if len(set(seen.values())) > 1:
        raise MergeError("the verdicts were judged against different FlashInfer versions: "
                         + ", ".join(f"{n}: {v}" for n, v in seen.items())
                         + "; merge only verdicts of one FlashInfer (run each runner with the same one)")


def _same_engine(entries: dict[str, list[tuple[str, JsonObject]]]) -> None:
    """A backend judged on different engines or engine versions (vLLM 0.33 and 0.34) does not merge: the engines
    size KV differently. Verdicts that all predate provenance merge as before; a mix is refused (it cannot be told)."""
    for backend, found in sorted(entries.items()):
        engines = {name: _engine_text(b) for name, b in found}
        if len(set(engines.values())) > 1:
            raise MergeError(f"backend {backend!r} was judged on different engine versions: "
                             + ", ".join(f"{n}: {v}" for n, v in engines.items())
                             + "; merge only verdicts of one engine version")


def _engine_text(b: JsonObject) -> str:
    prov = b.get("provenance")
    if not isinstance(prov, dict):
        return NO_PROVENANCE
    if not prov.get("engine"):
        return REFERENCE_ENGINE
    return f"{prov['engine']} {prov.get('engine_version') or 'unknown'}"


def _budget_key(doc: JsonObject) -> str:
    budget = doc.get("waste_budget")
    return "none" if not budget else f"{budget.get('amount')} {budget.get('unit')}"


def _budget_text(doc: JsonObject) -> str:
    budget = doc.get("waste_budget")
    return "no budget" if not budget else str(budget.get("text") or _budget_key(doc))


def _merge_backend(found: list[tuple[str, JsonObject]]) -> JsonObject:
    """A backend's facts from several runners, judged again by :func:`backend_verdict`."""
    name, first = found[0]
    planned: dict[str, set[str]] = defaultdict(set)
    refused: dict[str, str] = {}
    declared = dict(first.get("declared_support") or {})
    results: list[JsonObject] = []
    costs: list[JsonObject] = []
    wastes: list[JsonObject] = []
    disagreements: list[str] = []
    counted, waste_cases, waste_wasting = True, 0, 0  # written verdicts keep the largest wastes and their counts
    for source, b in found:
        for case, checks in (b.get("planned") or {}).items():
            planned[case].update(checks)
        for r in b.get("refused_layouts") or []:
            refused.setdefault(r["case"], r["reason"])
        results += [dict(r, source=source) for r in b.get("results") or []]
        costs += b.get("legacy_cost") or []
        wastes += b.get("waste") or []
        counted = counted and "waste_cases" in b
        waste_cases += int(b.get("waste_cases") or 0)
        waste_wasting += int(b.get("waste_wasting") or 0)
        if (b.get("declared_support") or {}) != declared:
            disagreements.append(source)
    entry = backend_verdict({
        "name": first["name"],
        "version": first.get("version"),
        "origin": first.get("origin"),
        "declared_support": declared,
        "contract_api": first.get("contract_api") or {},
        "engine_gated": sorted({g["case"]: g for _, b in found for g in b.get("engine_gated") or []}.values(),
                               key=lambda g: g["case"]),
        "expected_failures": first.get("expected_failures") or {},
        "results": results,
        "planned": {case: sorted(checks) for case, checks in sorted(planned.items()) if case not in refused},
        "refused_layouts": [{"case": c, "reason": r} for c, r in refused.items()],
        "legacy_cost": sorted(costs, key=lambda c: (-c["bytes"], c["case"])),
        "waste": sorted({w["case"]: w for w in wastes}.values(), key=lambda c: (-c["bytes"], c["case"])),
        **({"waste_cases": waste_cases, "waste_wasting": waste_wasting} if counted else {}),
        "provenance": first.get("provenance"),
        "kv_sizing": merge_kv_sizing(b.get("kv_sizing") for _, b in found),
        "sizing": merge_sizing(b.get("sizing") for _, b in found),
    })
    if disagreements:
        entry["reasons"].append(f"the runners disagree on declared support ({name} vs {', '.join(disagreements)})")
        entry["may_opt_in"] = False
    return entry


VERDICT_BOUND = 1_000_000  # bytes: the verdict of the default matrix (the correct stubs) stays below this
VERDICT_MESSAGE_CHARS = 600  # what the verdict keeps of a failure's message; the JSON report keeps it all
VERDICT_MESSAGE_TAIL = 160  # of those, the message's end: a refusal ends with what to do


def cut_message(msg: str) -> str:
    """A failure's message as the verdict keeps it: whole up to ``VERDICT_MESSAGE_CHARS``, else its head (the rule
    and the bytes) and its tail (the remedy), the middle marked as cut."""
    if len(msg) <= VERDICT_MESSAGE_CHARS:
        return msg
    head = VERDICT_MESSAGE_CHARS - VERDICT_MESSAGE_TAIL
    return f"{msg[:head]} [... cut; the JSON report has it all ...] {msg[-VERDICT_MESSAGE_TAIL:]}"
DETAILED_COSTS = 3  # the costs (waste, legacy) per backend the verdict keeps, the largest


def slim_verdict(doc: JsonObject) -> JsonObject:
    """The verdict as it is written, the file a reviewer attaches: small (under ``VERDICT_BOUND`` on the default
    matrix). The JSON report (``--kvprofile-json``) keeps everything.

    - ``cases``: every case id of the backends' matrices, once; ranges of their indices (``"0-5,9"``) stand for them;
    - ``planned``: ``[{"checks": [...], "cases": RANGES}]``, the cases grouped by the checks that apply;
    - ``results``: the results that did not pass, each message cut to ``VERDICT_MESSAGE_CHARS``
      (its head and its remedy: ``cut_message``);
      ``passed``: RANGES, the cases whose every other planned check passed; ``passed_some``: {case: checks} for the
      cases where only some did;
    - ``waste``, ``legacy_cost``: the ``DETAILED_COSTS`` largest, ``waste_cases``/``legacy_cases`` their counts.

    :func:`expand_verdict` is the inverse merging reads (cut messages and left-out costs stay out)."""
    ids = sorted({case for b in doc["backends"] for case in b.get("planned") or {}})
    index = {case: i for i, case in enumerate(ids)}
    out = dict(doc, cases=ids, backends=[])
    for b in doc["backends"]:
        planned: dict[str, list[str]] = b.get("planned") or {}
        passed: dict[str, set[str]] = defaultdict(set)
        other: dict[str, set[str]] = defaultdict(set)
        kept = []
        for r in b["results"]:
            if r["outcome"] == "passed":
                passed[r["case"]].add(r["check"])
                continue
            other[r["case"]].add(r["check"])
            msg = r.get("message")
            if msg:
                msg = cut_message(msg)
            kept.append(dict(r, message=msg))
        rest = [c for c, checks in passed.items() if c in index and checks == set(planned.get(c, ())) - other[c]]
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for case, checks in planned.items():
            groups[tuple(sorted(checks))].append(index[case])
        wastes, legacy = b.get("waste") or [], b.get("legacy_cost") or []
        out["backends"].append(dict(
            b, results=kept,
            planned=[{"checks": list(checks), "cases": ranges(cases)} for checks, cases in sorted(groups.items())],
            passed=ranges([index[c] for c in rest]),
            passed_some={c: sorted(checks) for c, checks in sorted(passed.items()) if c not in set(rest)},
            waste=wastes[:DETAILED_COSTS], waste_cases=len(wastes),
            waste_wasting=sum(1 for w in wastes if w["bytes"]),
            legacy_cost=legacy[:DETAILED_COSTS], legacy_cases=len(legacy),
        ))
    return out


def ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``."""
    out: list[str] = []
    for i in sorted(set(indices)):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def from_ranges(text: str) -> list[int]:
    """:func:`ranges`' inverse."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def expand_verdict(doc: JsonObject) -> JsonObject:
    """A written verdict as :func:`verdict_document` made it (``planned`` per case, passed results listed), which
    merging reads; a verdict written before :func:`slim_verdict` passes unchanged."""
    if not isinstance(doc.get("cases"), list):
        return doc
    ids = doc["cases"]
    backends = []
    for b in doc.get("backends") or []:
        planned = {ids[i]: list(group["checks"])
                   for group in b.get("planned") or [] for i in from_ranges(group["cases"])}
        results = list(b.get("results") or [])
        other: dict[str, set[str]] = defaultdict(set)
        for r in results:
            other[r["case"]].add(r["check"])
        passed = {ids[i]: [c for c in planned.get(ids[i], []) if c not in other[ids[i]]]
                  for i in from_ranges(b.get("passed") or "")}
        passed.update(b.get("passed_some") or {})
        results += [{"check": check, "case": case, "outcome": "passed", "message": None}
                    for case, checks in passed.items() for check in checks]
        backends.append(dict({k: v for k, v in b.items() if k not in ("passed", "passed_some")},
                             planned=planned, results=results))
    return dict({k: v for k, v in doc.items() if k != "cases"}, backends=backends)
