"""What a verdict names about how each backend was judged: the engine it ran on, the KV sizing mode per case, the
FlashInfer version and the sizing method (issue 50, "Provenance").

Why here: the verdict, the JSON report, the terminal header and ``kvprofile verdict merge`` all read these facts, and
they must read them the same way. Everything is a plain JSON object so that it crosses xdist and merges.

- :func:`backend_provenance`: ``Backend.provenance()`` (None: pytest-kvprofile's reference engine), with the installed
  FlashInfer filled in where the engine names none. A provenance function that raises is said, never raised.
- :func:`kv_sizing_of_records`: per backend, the KV sizing mode each case's record carries (``CheckOutcome.kv_sizing``,
  from the worker's ``LifecycleResult.kv_sizing``): the modes with counts, the most common, and each case whose mode
  differs from it with the engine's reason.
- :func:`sizing_method` and :func:`sizing_of_cases`: oracle or analytic, and why analytic, per case and per backend.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pytest_kvprofile.checks.base import CheckOutcome, JsonObject

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.matrix.cases import Case
    from pytest_kvprofile.sizing.requirement import SizingResult

REFERENCE_ENGINE = "pytest-kvprofile's reference engine"
UNKNOWN = "unknown"


def installed_flashinfer() -> str:
    """The installed flashinfer-python's version (metadata only; FlashInfer is not imported), or ``unknown``."""
    try:
        from pytest_kvprofile.sizing.requirement import installed_flashinfer_version

        return installed_flashinfer_version() or UNKNOWN
    except Exception:  # noqa: BLE001 - not installed, or no headers: the verdict says unknown
        return UNKNOWN


def backend_provenance(backend: Backend) -> JsonObject:
    """The backend's ``Provenance`` as the verdict keeps it, with ``described``, the one line a reviewer reads.

    ``engine`` empty means the suite's own lifecycle with no engine of its own (stubs, mutants, the ``flashinfer``
    backend, a third party that names none): ``pytest-kvprofile's reference engine``. ``flashinfer`` empty means the
    installed one."""
    from pytest_kvprofile.contract.backends import Provenance

    notes: list[str] = []
    prov = Provenance()
    if backend.provenance is not None:
        try:
            got = backend.provenance()
            if isinstance(got, Provenance):
                prov = got
            else:
                notes.append(f"the backend's provenance() returned {type(got).__name__}, not a Provenance")
        except Exception as exc:  # noqa: BLE001 - a verdict is still written, and says why it names no engine
            notes.append(f"the backend's provenance() raised {type(exc).__name__}: {exc}")
    out: JsonObject = {
        "engine": prov.engine,
        "engine_version": prov.engine_version if prov.engine else "",
        "runner": prov.runner,
        "flashinfer": prov.flashinfer or installed_flashinfer(),
        "notes": [*prov.notes, *notes],
    }
    out["described"] = describe_provenance(out)
    return out


def describe_provenance(prov: Mapping[str, object]) -> str:
    """``vllm 0.33.0, runner V1, FlashInfer 0.7.4`` or ``pytest-kvprofile's reference engine, FlashInfer 0.7.4``."""
    if prov.get("engine"):
        engine = f"{prov['engine']} {prov.get('engine_version') or UNKNOWN}"
    else:
        engine = REFERENCE_ENGINE
    runner = f", runner {prov['runner']}" if prov.get("runner") else ""
    return f"{engine}{runner}, FlashInfer {prov.get('flashinfer') or UNKNOWN}"


def kv_sizing_json(name: str, rule: str, reason: str) -> JsonObject:
    """One case's mode as a record carries it (``CheckOutcome.kv_sizing``)."""
    return {"name": name, "rule": rule, "reason": reason}


def kv_sizing_of_records(records: Iterable[CheckOutcome]) -> dict[str, JsonObject]:
    """Per backend, :func:`kv_sizing_summary` of the modes its records carry (the first record of a case that has one
    says it; every record of a case carries the same)."""
    cases: dict[str, dict[str, JsonObject]] = {}
    for rec in records:
        if rec.backend and rec.kv_sizing:
            cases.setdefault(rec.backend, {}).setdefault(rec.case, rec.kv_sizing)
    return {backend: kv_sizing_summary(by_case) for backend, by_case in sorted(cases.items())}


def kv_sizing_summary(by_case: Mapping[str, Mapping[str, object]]) -> JsonObject:
    """The verdict's ``kv_sizing`` of one backend from ``{case: {name, rule, reason}}``.

    ``modes``: each mode's name with its count of cases; ``most_common``: the backend's usual mode (ties broken by
    name); ``differing``: each case whose mode is not the usual one, with its rule and the engine's reason; ``cases``
    and ``reasons`` (``{case: mode}``, ``{case: reason}`` where one was given) keep every case, so verdicts merge
    without losing any."""
    counts = Counter(str(m.get("name") or UNKNOWN) for m in by_case.values())
    usual = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0] if counts else None
    differing = [{"case": case, "mode": str(m.get("name") or UNKNOWN), "rule": str(m.get("rule") or ""),
                  "reason": str(m.get("reason") or "")}
                 for case, m in sorted(by_case.items()) if str(m.get("name") or UNKNOWN) != usual]
    return {
        "modes": dict(sorted(counts.items())),
        "most_common": usual,
        "differing": differing,
        "cases": {case: str(m.get("name") or UNKNOWN) for case, m in sorted(by_case.items())},
        "rules": {str(m.get("name") or UNKNOWN): str(m.get("rule") or "") for m in by_case.values()},
        "reasons": {case: str(m["reason"]) for case, m in sorted(by_case.items()) if m.get("reason")},
    }


def merge_kv_sizing(found: Iterable[Mapping[str, object] | None]) -> JsonObject | None:
    """One ``kv_sizing`` from several runners' (each case's mode and reason kept; None when none has one)."""
    by_case: dict[str, dict[str, object]] = {}
    seen = False
    for kv in found:
        if not kv:
            continue
        seen = True
        cases = kv.get("cases") or {}
        rules = kv.get("rules") or {}
        reasons = kv.get("reasons") or {}
        assert isinstance(cases, dict) and isinstance(rules, dict) and isinstance(reasons, dict)
        for case, name in cases.items():
            by_case.setdefault(case, {"name": name, "rule": rules.get(name, ""), "reason": reasons.get(case, "")})
    return kv_sizing_summary(by_case) if seen else None


def kv_sizing_line(kv: Mapping[str, object] | None) -> str:
    """``KV sizing profile window (2 cases), post-capture (1 cases); differs from profile window on <case>
    (post-capture: <reason>)`` for the terminal."""
    if not kv or not kv.get("modes"):
        return "KV sizing not recorded (no check ran)"
    modes = kv["modes"]
    assert isinstance(modes, dict)
    text = "KV sizing " + ", ".join(f"{name} ({n} cases)" for name, n in modes.items())
    differing = kv.get("differing") or []
    assert isinstance(differing, list)
    if differing and len(modes) > 1:
        first = differing[0]
        why = f": {first['reason']}" if first.get("reason") else ""
        more = f" (+{len(differing) - 1} more in the verdict)" if len(differing) > 1 else ""
        text += f"; differs from {kv.get('most_common')} on {first['case']} ({first['mode']}{why}){more}"
    return text


def sizing_method(result: SizingResult) -> tuple[str, str]:
    """``(method, reason)`` of one sizing: ``oracle`` (FlashInfer's own planner, compiled for the host, confirmed
    the worst batch) or ``analytic`` (the closed-form model) with why.

    Reads ``result.method_reason`` where the sizing gives it (a later ``SizingResult``), else finds the reason in its
    notes, so it works before and after that field exists."""
    method = str(getattr(result, "method", "") or UNKNOWN)
    reason = str(getattr(result, "method_reason", "") or "")
    if method == "analytic" and not reason:
        notes = [str(n) for n in getattr(result, "notes", ()) or ()]
        reason = next((n for n in notes if "oracle" in n.lower()), "")
        if not reason:
            reason = ("the host oracle did not confirm the worst route's batch" if notes
                      else "the host oracle was not used")
    return method, reason


def sizing_of_cases(cases: Iterable[Case]) -> JsonObject:
    """How the workspace need of ``cases`` was found (``sizing.for_case``, what ``workspace_covers_planner`` judges
    by): the FlashInfer version sized, the method (``oracle``, ``analytic``, ``mixed``, or ``none`` when no case is
    sizable), the count per method, each distinct reason for an analytic sizing and the first such cases."""
    from pytest_kvprofile.sizing.case import for_case, sizable_refusal

    counts: Counter[str] = Counter()
    reasons: dict[str, list[str]] = {}
    versions: set[str] = set()
    for case in cases:
        if sizable_refusal(case) is not None:
            continue
        try:
            result = for_case(case)
        except Exception as exc:  # noqa: BLE001 - the check reports the error; the verdict says it was not sized
            counts["error"] += 1
            reasons.setdefault(f"sizing raised {type(exc).__name__}: {exc}", []).append(case.id)
            continue
        method, reason = sizing_method(result)
        counts[method] += 1
        versions.add(str(getattr(result, "flashinfer_version", "") or UNKNOWN))
        if method != "oracle":
            reasons.setdefault(reason, []).append(case.id)
    return sizing_summary(counts, reasons, versions)


def sizing_summary(counts: Mapping[str, int], reasons: Mapping[str, list[str]], versions: Iterable[str]) -> JsonObject:
    """The verdict's ``sizing`` from per-method counts, ``{reason: [cases]}`` and the FlashInfer versions sized."""
    kinds = sorted(k for k, n in counts.items() if n)
    method = "none" if not kinds else kinds[0] if len(kinds) == 1 else "mixed"
    found = sorted(set(versions)) or [installed_flashinfer()]
    return {
        "flashinfer": ", ".join(found),
        "method": method,
        "counts": dict(sorted((k, n) for k, n in counts.items() if n)),
        "analytic_reasons": [{"reason": reason, "cases": len(cases), "first_cases": sorted(cases)[:5]}
                             for reason, cases in sorted(reasons.items())],
    }


def merge_sizing(found: Iterable[Mapping[str, object] | None]) -> JsonObject | None:
    """One ``sizing`` from several runners' (counts summed, reasons kept)."""
    counts: Counter[str] = Counter()
    reasons: dict[str, list[str]] = {}
    versions: set[str] = set()
    seen = False
    for s in found:
        if not s:
            continue
        seen = True
        got = s.get("counts") or {}
        assert isinstance(got, dict)
        counts.update({str(k): int(v) for k, v in got.items()})
        versions.update(v.strip() for v in str(s.get("flashinfer") or "").split(",") if v.strip())
        for r in s.get("analytic_reasons") or []:  # type: ignore[attr-defined]
            reasons.setdefault(str(r["reason"]), []).extend(r.get("first_cases") or [])
    if not seen:
        return None
    out = sizing_summary(counts, reasons, versions)
    return out


def sizing_line(sizing: Mapping[str, object] | None) -> str:
    """``sizing: FlashInfer 0.7.4 host oracle`` or ``sizing: analytic model (why)`` for the terminal."""
    if not sizing:
        return "sizing: not recorded"
    method = sizing.get("method")
    version = sizing.get("flashinfer")
    reasons = sizing.get("analytic_reasons") or []
    assert isinstance(reasons, list)
    why = "; ".join(str(r["reason"]) for r in reasons[:2]) or "no reason given"
    if method == "oracle" and not sizing.get("counts"):  # expected, before any case is sized (the header)
        return (f"sizing: FlashInfer {version} host oracle (its own planner; should its build fail, the analytic model "
                "sizes and the last lines say so)")
    if method == "oracle":
        return f"sizing: FlashInfer {version} host oracle (its own planner)"
    if method == "analytic":
        return f"sizing: analytic model ({why}); FlashInfer {version} not confirmed by its planner"
    if method == "mixed":
        counts = sizing.get("counts") or {}
        return f"sizing: mixed, {_counts(counts)}; analytic model where: {why}"
    if method == "none":
        return "sizing: no case sized (none of its routes plans natively)"
    return f"sizing: {method} ({why})"


def _counts(counts: object) -> str:
    assert isinstance(counts, dict)
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def expected_sizing() -> JsonObject:
    """What sizing will use here, known before any case is sized (the terminal header): the host oracle when it can
    be built, else the analytic model and why (no CUDA compiler, no FlashInfer headers). Builds nothing."""
    try:
        from pytest_kvprofile.attention.oracle import oracle_available

        ok, why = oracle_available()
    except Exception as exc:  # noqa: BLE001 - the header says it, the run goes on
        ok, why = False, f"{type(exc).__name__}: {exc}"
    version = installed_flashinfer()
    if ok:
        return {"flashinfer": version, "method": "oracle", "counts": {}, "analytic_reasons": []}
    return {"flashinfer": version, "method": "analytic", "counts": {},
            "analytic_reasons": [{"reason": f"oracle unavailable: {why}", "cases": 0, "first_cases": []}]}


_BYTES = re.compile(r"([0-9][0-9,]*) bytes")
_TOKENS = re.compile(r"([0-9][0-9,]*) KV tokens")


def message_amounts(message: str | None) -> tuple[int | None, int | None]:
    """The first byte count and KV token count a failure message names (checks lead with them), if any."""
    text = message or ""
    b, t = _BYTES.search(text), _TOKENS.search(text)
    return (int(b.group(1).replace(",", "")) if b else None, int(t.group(1).replace(",", "")) if t else None)


def header_lines(session: object) -> list[str]:
    """The terminal header's provenance: per group of backends that ran on the same engine with the same KV sizing
    modes, one line naming the engine, its version, the runner, the FlashInfer version and the modes over the
    backends' matrices (the verdict has them per case); then what sizing will use (``sizing: analytic model (why)``
    when FlashInfer's planner cannot be built here). ``session`` is the plugin's ``KvprofileSession``."""
    from pytest_kvprofile.contract.backends import kv_sizing_mode

    groups: dict[tuple[str, str], list[str]] = {}
    for backend in getattr(session, "backends", []):
        by_case: dict[str, JsonObject] = {}
        for case in session.accepted_cases(backend):  # type: ignore[attr-defined]
            try:
                mode = kv_sizing_mode(backend.policy, case)
                by_case[case.id] = kv_sizing_json(str(mode.name), str(mode.rule), str(mode.reason))
            except Exception:  # noqa: BLE001 - the engine's own answer raised: the verdict says it per case
                by_case[case.id] = kv_sizing_json(UNKNOWN, "", "")
        kv = kv_sizing_line(kv_sizing_summary(by_case)) if by_case else "KV sizing: no case in its matrix"
        groups.setdefault((backend_provenance(backend)["described"], kv), []).append(backend.name)
    lines = []
    for (described, kv), names in groups.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(f"kvprofile: {shown}: {described}; {kv}")
    lines.append(f"kvprofile: {sizing_line(expected_sizing())}")
    return lines
