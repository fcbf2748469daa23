"""The controller's terminal output: the per-backend summary table and the verdict lines."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from pytest_kvprofile.checks.base import CheckOutcome, JsonObject
from pytest_kvprofile.units import MiB


def root_cause(failed: Counter[str], order: Sequence[str] = ()) -> str | None:
    """The check a reviewer should read first: the failing check the suite runs first on a case (``order``, the
    catalog's, which follows the lifecycle: declaration, leases, reservation, warmup, arena, ...), not the one that
    fails most often (a lease released too early fails many later checks too). Checks ``order`` does not know come
    after it, most failed first, ties by name."""
    if not failed:
        return None
    index = {name: i for i, name in enumerate(order)}
    return min(failed, key=lambda c: (index.get(c, len(index)), -failed[c], c))


def summarize(records: list[CheckOutcome], order: Sequence[str] = ()) -> list[JsonObject]:
    """Per backend: cases, checks passed/failed/xfailed, the most failed check, the root cause (:func:`root_cause`)
    and the worst budget."""
    by_backend: dict[str, list[CheckOutcome]] = defaultdict(list)
    for rec in records:
        if rec.backend:
            by_backend[rec.backend].append(rec)
    rows = []
    for backend, recs in sorted(by_backend.items()):
        outcomes = Counter(r.outcome for r in recs)
        failed = Counter(r.check for r in recs if r.outcome == "failed")
        # ties broken by name, so every case order gives the same summary
        worst_check = min(failed.items(), key=lambda kv: (-kv[1], kv[0])) if failed else None
        cause = root_cause(failed, order)
        budgets = [r.details.budget for r in recs if r.details.budget]
        worst_budget = min(budgets, key=lambda b: (b["kv_tokens"], b["case"]), default=None)
        rows.append({
            "backend": backend,
            "cases": len({r.case for r in recs}),
            "passed": outcomes.get("passed", 0),
            "failed": outcomes.get("failed", 0),
            "xfailed": outcomes.get("xfailed", 0),
            "skipped": outcomes.get("skipped", 0),
            "worst_check": f"{worst_check[0]} ({worst_check[1]})" if worst_check else "-",
            "root_cause": f"{cause} ({failed[cause]})" if cause else "-",
            "worst_case": worst_budget["case"] if worst_budget else None,
            "worst_case_kv_tokens": worst_budget["kv_tokens"] if worst_budget else None,
            "worst_case_reservation_tokens": worst_budget["reservation_kv_tokens"] if worst_budget else None,
            "worst_case_reservation_bytes": worst_budget.get("persistent_reserved") if worst_budget else None,
        })
    return rows


def legacy_costs(records: list[CheckOutcome]) -> dict[str, list[JsonObject]]:
    """Per legacy-path backend, each case's post-KV cost (``checks/post_kv_cost.py``), largest first."""
    out: dict[str, list[JsonObject]] = defaultdict(list)
    for rec in records:
        cost = rec.details.legacy_cost
        if rec.backend and cost:
            out[rec.backend].append(cost)
    return {b: sorted(costs, key=lambda c: (-c["bytes"], c["case"])) for b, costs in sorted(out.items())}


def legacy_cost_lines(records: list[CheckOutcome]) -> list[str]:
    """Information, not failures: what each legacy-path backend leaves invisible to KV sizing."""
    lines = []
    for backend, costs in legacy_costs(records).items():
        worst = costs[0]
        if not worst["bytes"]:
            continue
        overruns = sum(1 for c in costs if c["overrun_bytes"])
        lines.append(
            f"{backend} (legacy path): on {len(costs)} cases {min(c['mib'] for c in costs):.2f}-{worst['mib']:.2f} MiB "
            f"appear after KV sizing; at most {worst['kv_tokens']} KV tokens on {worst['case']}"
            + (f"; {overruns} cases overrun total x gmu" if overruns else "")
        )
        for src in worst["sources"][:4]:
            lines.append(f"    {src['owner']}: {src['bytes'] / MiB:.2f} MiB x{src['count']} at {src['source']}")
    return lines


def waste_costs(records: list[CheckOutcome]) -> dict[str, list[JsonObject]]:
    """Per opted-in backend, each case's workspace waste (``checks/workspace.py``), largest first."""
    out: dict[str, list[JsonObject]] = defaultdict(list)
    for rec in records:
        waste = rec.details.waste
        if rec.backend and waste:
            out[rec.backend].append(waste)
    return {b: sorted(costs, key=lambda c: (-c["bytes"], c["case"])) for b, costs in sorted(out.items())}


def waste_reason(costs: list[JsonObject], cases: int | None = None, wasting: int | None = None) -> str | None:
    """The verdict's cost line: the worst case's waste in MiB, bytes and KV tokens, or None without waste.
    ``cases``, ``wasting``: the counts where ``costs`` holds the largest only (a written verdict's)."""
    if not costs or not costs[0]["bytes"]:
        return None
    worst = costs[0]
    wasting = sum(1 for c in costs if c["bytes"]) if wasting is None else wasting
    return (f"workspace waste (a cost, not a refusal unless over --kvprofile-max-waste): on {wasting} of "
            f"{len(costs) if cases is None else cases} cases; at most {worst['mib']:.2f} MiB ({worst['bytes']} bytes, "
            f"{worst['kv_tokens']} KV tokens per rank) on {worst['case']}")


def waste_lines(records: list[CheckOutcome]) -> list[str]:
    """Information, not failures (unless a budget is set): what each backend reserves beyond the planned routes."""
    lines = []
    for backend, costs in waste_costs(records).items():
        reason = waste_reason(costs)
        if reason is None:
            continue
        lines.append(f"{backend}: {reason}")
        for b in costs[0]["builders"]:
            if not b["waste_bytes"]:
                continue
            parts = [f"routes sized {', '.join(b['sized_routes']) or 'none (all trtllm-gen)'}"]
            if b["float_waste_bytes"]:
                parts.append(f"float workspace {b['float_waste_bytes'] / MiB:.2f} MiB beyond the need (arena "
                             f"{b['arena_bytes'] / MiB:.2f} MiB, own buffers {b['private_float_bytes'] / MiB:.2f} MiB)")
            if b["unused_trtllm_bytes"]:
                parts.append(f"trtllm-gen workspace no route uses {b['unused_trtllm_bytes'] / MiB:.2f} MiB")
            lines.append(f"    {b['builder']}: " + "; ".join(parts))
    return lines


TABLE_COLUMNS = 100  # the summary table's width at most: an 80-to-100-column CI log shows it unwrapped


def table_lines(rows: list[JsonObject], width: int = TABLE_COLUMNS) -> list[str]:
    """One row per backend (cases, results, the fewest KV tokens per rank over its cases and what its reservation
    costs there), and under a failing backend's row its root cause (:func:`root_cause`) with how many of its
    failures that check is; at most ``width`` columns (a longer backend name is cut in its middle)."""
    header = ("backend", "cases", "passed", "failed", "xfailed", "fewest KV tokens", "reservation")
    body = []
    for r in rows:
        fewest = f"{r['worst_case_kv_tokens']:,}" if r["worst_case"] else "-"
        reserve = f"{r['worst_case_reservation_tokens']:,}" if r["worst_case"] else "-"
        body.append((r["backend"], str(r["cases"]), str(r["passed"]), str(r["failed"]), str(r["xfailed"]),
                     fewest, reserve))
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    widths[0] = max(len(header[0]), min(widths[0], width - sum(widths[1:]) - 2 * (len(header) - 1)))
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    for r, row in zip(rows, body):
        out.append(fmt.format(_cut(row[0], widths[0]), *row[1:]))
        if r.get("root_cause") not in (None, "-"):
            out.append(_cut(f"    root cause: {r['root_cause']}; {r['failed']} failures in all", width))
    return out


def _cut(text: str, width: int) -> str:
    """``text`` in ``width`` columns, its middle replaced by ``...`` when longer."""
    if len(text) <= width:
        return text
    keep = width - 3
    return f"{text[:(keep + 1) // 2]}...{text[len(text) - keep // 2:]}"


def verdict_lines(doc: JsonObject) -> list[str]:
    lines = []
    for b in doc["backends"]:
        verdict = "may opt in" if b["may_opt_in"] else "may NOT opt in"
        counts = ", ".join(f"{n} {k}" for k, n in sorted(b["counts"].items()))
        lines.append(f"{b['name']}: {verdict} ({counts or 'nothing ran'})")
        for reason in b["reasons"]:
            lines.append(f"    - {reason}")
        for cost in b.get("cost_reasons", []):
            lines.append(f"    - cost: {cost}")
    return lines


def partial_lines(doc: JsonObject) -> list[str]:
    """Why a narrowed or interrupted run's verdict cannot opt in: the coverage of each backend's matrix."""
    lines = []
    for b in doc["backends"]:
        if b["partial"]:
            c = b["coverage"]
            lines.append(f"{b['name']}: partial run, {c['cases_run']} of {c['cases_in_matrix']} cases "
                         f"({c['results_run']} of {c['results_in_matrix']} check results): no opt-in from this run")
    if lines:
        lines.append("only a run over the whole matrix may opt in; merge several runners' verdicts with "
                     "`kvprofile verdict merge A.json B.json -o OUT.json`")
    return lines


def final_lines(verdict: JsonObject, records: list[CheckOutcome], order: Sequence[str] = ()) -> list[str]:
    """The run's last lines: one :func:`verdict_line` per backend of ``verdict``."""
    rows = {r["backend"]: r for r in summarize(records, order)}
    return [verdict_line(b, order, rows.get(b["name"]), kv_bytes_per_token(records, b["name"]))
            for b in verdict["backends"]]


def kv_bytes_per_token(records: list[CheckOutcome], backend: str | None = None) -> dict[str, int]:
    """Each case's KV bytes per token, from the budgets the records carry (``backend``: its records only)."""
    out: dict[str, int] = {}
    for rec in records:
        if (backend is None or rec.backend == backend) and rec.details.budget \
                and rec.details.budget.get("kv_bytes_per_token"):
            out[rec.case] = int(rec.details.budget["kv_bytes_per_token"])
    return out


def verdict_line(b: JsonObject, order: Sequence[str] = (), row: JsonObject | None = None,
                 per_token: dict[str, int] | None = None) -> str:
    """One backend's verdict in one line: ``may opt in`` or the root cause, with the worst case, its bytes and its
    KV tokens (what the run's last lines say, with or without ``--kvprofile-verdict``). ``row``: the backend's
    summary row (its fewest-KV-tokens case); ``per_token``: each case's KV bytes per token, which turns the bytes a
    failure names into KV tokens where the message names none."""
    name = b["name"]
    failed = [r for r in b.get("results") or [] if r.get("outcome") == "failed"]
    if b.get("may_opt_in"):
        return f"{name}: may opt in{_opt_in_worst(b, row)}"
    if failed:
        cause = root_cause(Counter(r["check"] for r in failed), order)
        mine = [r for r in failed if r["check"] == cause]
        worst, nbytes, tokens = worst_failure({r["case"]: r.get("message") for r in mine}, per_token)
        text = figures(nbytes, tokens)
        unmade = next((a.split(": ", 1)[1] for a in (b.get("declared_support") or {}).values()
                       if str(a).startswith("error: ")), None)
        if unmade:
            return f"{name}: may NOT opt in: the builders could not be made ({unmade}) on {len(mine)} cases"
        return (f"{name}: may NOT opt in: {cause} fails on {len(mine)} cases; worst {worst}"
                + (f": {text}" if text else ""))
    reasons = b.get("reasons") or ["no reason recorded"]
    cost = b.get("legacy_cost") or []
    first = str(reasons[0])
    if first.startswith("partial run:"):
        c = b["coverage"]
        return (f"{name}: may NOT opt in: partial run, {c['cases_run']} of {c['cases_in_matrix']} cases ran "
                "(merge every runner's verdict)")
    if first.startswith("legacy path") and cost and cost[0]["bytes"]:
        return (f"{name}: may NOT opt in: legacy path; worst {cost[0]['case']}: {cost[0]['bytes']:,} bytes "
                f"({cost[0]['kv_tokens']:,} KV tokens) appear after KV sizing")
    return f"{name}: may NOT opt in: {first.split('; ')[0]}"


def worst_failure(messages: dict[str, str | None], per_token: dict[str, int] | None = None,
                  ) -> tuple[str, int | None, int | None]:
    """The worst of one check's failing cases (``messages``: case id to its failure message): the most bytes, then
    the most KV tokens the message names, ties by case id. Returns the case, its bytes and its KV tokens (from
    ``per_token``, each case's KV bytes per token, where the message names bytes only)."""
    from pytest_kvprofile.report.provenance import message_amounts

    amounts = {case: message_amounts(message) for case, message in messages.items()}
    worst = max(sorted(amounts), key=lambda c: (amounts[c][0] or -1, amounts[c][1] or -1))
    nbytes, tokens = amounts[worst]
    if tokens is None and nbytes is not None and (per_token or {}).get(worst):
        tokens = -(-nbytes // (per_token or {})[worst])
    return worst, nbytes, tokens


def figures(nbytes: int | None, tokens: int | None) -> str:
    """``33,554,432 bytes, 228 KV tokens``, or what of it is known ('' for neither)."""
    return ", ".join(x for x in (f"{nbytes:,} bytes" if nbytes is not None else "",
                                 f"{tokens:,} KV tokens" if tokens is not None else "") if x)


def _opt_in_worst(b: JsonObject, row: JsonObject | None) -> str:
    """The worst case of an opted-in backend: its largest workspace waste, else (``row``, the summary's) what its
    reservation costs where KV tokens are fewest."""
    waste = b.get("waste") or []
    if waste and waste[0]["bytes"]:
        w = waste[0]
        return f"; worst {w['case']}: {w['bytes']:,} bytes wasted ({w['kv_tokens']:,} KV tokens)"
    if row and row.get("worst_case") and row.get("worst_case_reservation_bytes") is not None:
        return (f"; worst {row['worst_case']}: reserves {row['worst_case_reservation_bytes']:,} bytes "
                f"({row['worst_case_reservation_tokens']:,} KV tokens)")
    return ""
