"""``--kvprofile-html PATH``: one self-contained HTML page a reviewer opens from the CI artifacts, offline.

It holds the verdict per backend (its last line), per case the checks that failed, the KV tokens lost (what the
reservation and any waste cost, or what a failure names) and the workspace declared against the need, and an inline
SVG plot of the KV tokens lost across GPUs and layouts, one series per backend. No script, font, style sheet or image
is fetched: everything is in the file.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Sequence

from pytest_kvprofile.checks.base import CheckOutcome, JsonObject
from pytest_kvprofile.units import MiB

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
STYLE = """
body{font-family:sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#eef}.ok{background:#dfd;color:#060;font-weight:bold}.no{background:#fdd;color:#900;font-weight:bold}
.num{text-align:right;font-variant-numeric:tabular-nums}
"""


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def case_rows(records: Sequence[CheckOutcome]) -> dict[str, dict[str, JsonObject]]:
    """{backend: {case: its figures}}: checks run and failed, KV tokens lost (a failure's, its bytes over the case's KV
    bytes per token where it names no tokens), workspace declared (over its micro-batches) and needed."""
    from pytest_kvprofile.report.provenance import message_amounts
    from pytest_kvprofile.report.summary import kv_bytes_per_token

    per_token = kv_bytes_per_token(list(records))
    out: dict[str, dict[str, JsonObject]] = defaultdict(dict)
    for rec in records:
        if not rec.backend:
            continue
        row = out[rec.backend].setdefault(rec.case, {"checks": 0, "failed": [], "reservation_tokens": None,
                                                     "waste_tokens": None, "failure_tokens": None,
                                                     "declared": None, "needed": None})
        row["checks"] += 1
        if rec.outcome == "failed":
            row["failed"].append(rec.check)
            nbytes, tokens = message_amounts(rec.message)
            if tokens is None and nbytes is not None and per_token.get(rec.case):
                tokens = -(-nbytes // per_token[rec.case])
            if tokens is not None:
                row["failure_tokens"] = max(row["failure_tokens"] or 0, tokens)
        budget = rec.details.budget
        if budget and budget.get("reservation_kv_tokens") is not None:
            row["reservation_tokens"] = int(budget["reservation_kv_tokens"])
        waste = rec.details.waste
        if waste:
            row["waste_tokens"] = int(waste.get("kv_tokens") or 0)
            builders = waste.get("builders") or []
            row["declared"] = sum(int(b.get("declared_bytes") or 0) * int(b.get("ubatches") or 1) for b in builders)
            row["needed"] = sum(int(b.get("need_bytes") or 0) for b in builders)
    return out


def tokens_lost(row: JsonObject) -> int:
    """The KV tokens per rank a case loses: what a failure names, else its reservation's cost and its waste."""
    if row["failure_tokens"] is not None:
        return int(row["failure_tokens"])
    return int(row["reservation_tokens"] or 0) + int(row["waste_tokens"] or 0)


def plot_svg(rows: dict[str, dict[str, JsonObject]], width: int = 1100, height: int = 320) -> str:
    """KV tokens lost per case (x: the cases, grouped by GPU then layout), one series of points per backend."""
    cases = sorted({c for per in rows.values() for c in per}, key=lambda c: (c.split("-")[-2:], c))
    if not cases:
        return "<p>No case ran.</p>"
    top = max((tokens_lost(r) for per in rows.values() for r in per.values()), default=0) or 1
    left, bottom, right, head = 70, 40, 20, 20
    w, h = width - left - right, height - bottom - head
    step = w / max(1, len(cases) - 1) if len(cases) > 1 else 0
    x = {c: left + (i * step if len(cases) > 1 else w / 2) for i, c in enumerate(cases)}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="KV tokens lost per case">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fafafa"/>',
             f'<line x1="{left}" y1="{head + h}" x2="{left + w}" y2="{head + h}" stroke="#444"/>',
             f'<line x1="{left}" y1="{head}" x2="{left}" y2="{head + h}" stroke="#444"/>',
             f'<text x="{left - 6}" y="{head + 4}" font-size="11" text-anchor="end">{top:,}</text>',
             f'<text x="{left - 6}" y="{head + h}" font-size="11" text-anchor="end">0</text>',
             f'<text x="{left + w / 2}" y="{height - 8}" font-size="12" text-anchor="middle">cases, by GPU and '
             'layout</text>',
             f'<text x="14" y="{head + h / 2}" font-size="12" transform="rotate(-90 14 {head + h / 2})" '
             'text-anchor="middle">KV tokens lost per rank</text>']
    gpus: dict[str, str] = {}
    for c in cases:
        gpus.setdefault("-".join(c.split("-")[-2:-1]), c)
    for gpu, first in gpus.items():
        parts.append(f'<text x="{x[first]:.1f}" y="{head + h + 14}" font-size="11">{_esc(gpu)}</text>')
    for i, (backend, per) in enumerate(sorted(rows.items())):
        color = COLORS[i % len(COLORS)]
        points = [(x[c], head + h - h * tokens_lost(r) / top, c, r) for c, r in sorted(per.items(), key=lambda kv:
                                                                                         cases.index(kv[0]))]
        if len(points) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py, _, _ in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for px, py, c, r in points:
            mark = "#900" if r["failed"] else color
            parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{mark}"><title>{_esc(backend)} '
                         f'{_esc(c)}: {tokens_lost(r):,} KV tokens</title></circle>')
        if i < 5:  # the legend: the first five backends (every point's tooltip names its own)
            parts.append(f'<rect x="{left + 10 + 190 * i}" y="4" width="10" height="10" fill="{color}"/>'
                         f'<text x="{left + 24 + 190 * i}" y="13" font-size="11">{_esc(backend[:28])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def html_page(verdict: JsonObject, records: Sequence[CheckOutcome], final_lines: Sequence[str]) -> str:
    """The page: the verdict lines, the plot, then per backend a table of its cases."""
    rows = case_rows(records)
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<title>pytest-kvprofile verdict</title>", f"<style>{STYLE}</style></head><body>",
           "<h1>pytest-kvprofile verdict</h1>",
           f"<p>tier {_esc(verdict.get('tier'))}; matrices {_esc(', '.join(map(str, verdict.get('matrices') or [])))}"
           f"{'; <b>partial run</b>' if verdict.get('partial') else ''}</p>",
           "<table><tr><th>backend</th><th>verdict</th><th>why</th></tr>"]
    lines = {line.split(":", 1)[0]: line for line in final_lines}
    for b in verdict["backends"]:
        ok = bool(b.get("may_opt_in"))
        why = lines.get(b["name"], "").split(":", 1)[-1].strip()
        why = why.removeprefix("may NOT opt in").removeprefix("may opt in").lstrip(":; ") or "-"
        out.append(f'<tr><td>{_esc(b["name"])}</td><td class="{"ok" if ok else "no"}">'
                   f'{"may opt in" if ok else "may NOT opt in"}</td><td>{_esc(why)}</td></tr>')
    out.append("</table><h2>KV tokens lost across GPUs and layouts</h2>")
    out.append(plot_svg(rows))
    for name in sorted(rows):
        out.append(f"<h2>{_esc(name)}</h2><table><tr><th>case</th><th>checks</th><th>failed</th>"
                   "<th>KV tokens lost</th><th>workspace declared (all micro-batches)</th>"
                   "<th>workspace needed</th></tr>")
        for case, r in sorted(rows[name].items()):
            failed = ", ".join(sorted(set(r["failed"]))) or "-"
            declared = "-" if r["declared"] is None else f"{r['declared'] / MiB:,.2f} MiB"
            needed = "-" if r["needed"] is None else f"{r['needed'] / MiB:,.2f} MiB"
            out.append(f'<tr><td>{_esc(case)}</td><td class="num">{r["checks"]}</td>'
                       f'<td class="{"no" if r["failed"] else ""}">{_esc(failed)}</td>'
                       f'<td class="num">{tokens_lost(r):,}</td><td class="num">{declared}</td>'
                       f'<td class="num">{needed}</td></tr>')
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
