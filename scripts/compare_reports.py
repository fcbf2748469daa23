#!/usr/bin/env python3
"""Compare two ``--kvprofile-json`` reports result by result.

Usage::

    scripts/compare_reports.py BEFORE.json AFTER.json [--messages]

A result is keyed by (backend, case, check). It differs when it is in one report only, or when its
outcome, waste or budget differs. ``--subset`` compares only the backends and cases AFTER ran. With
``--messages`` a failure's message counts too, with source files, lines and object ids blanked, and a
cut line compared up to the shorter cut (a refactor moves lines, not verdicts). Exit 0 when nothing
differs, 1 when something does, 2 on a file that is not a report.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

_LOCATION = re.compile(r"(?:/[\w.-]+)+(?::\d+)?|[\w.-]+\.py(?::\d+)?")  # a path (cut or whole), with its line
_CUT = re.compile(r" \[\.\.\. [\d,]+ characters cut\]$")  # where the recorder cut a long line
_LINES_CUT = re.compile(r"^\[\.\.\. \d+ more line\(s\) cut\]$")  # where the recorder cut the whole message
_OBJECT_ID = re.compile(r"\b\d{13,}\b")  # id() of an object: new every run (bytes stay below 13 digits)
_COMPARED = ("outcome", "waste", "budget")


def _load(path: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    try:
        document = json.loads(path.read_text())
        results = document["results"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"compare_reports: {path} is not a --kvprofile-json report ({exc})", file=sys.stderr)
        raise SystemExit(2) from None
    return {(r["backend"], r["case"], r["check"]): r for r in results}


def _view(result: dict[str, Any], messages: bool) -> dict[str, Any]:
    view = {key: result.get(key) for key in _COMPARED}
    if messages:
        view["message"] = str(result.get("message", ""))
    return view


def _message_lines(message: str) -> list[tuple[str, bool]]:
    """Each line with its locations and object ids blanked, and whether the recorder cut it."""
    out = []
    for line in message.splitlines():
        cut = _CUT.search(line)
        line = _CUT.sub("", line)
        out.append((_OBJECT_ID.sub("ID", _LOCATION.sub("FILE", line)), cut is not None))
    return out


def same_message(old: str, new: str) -> bool:
    """The same text once locations and ids are blanked; a cut line agrees up to the shorter cut (a longer checkout
    path moves where the recorder cuts)."""
    a, b = _message_lines(old), _message_lines(new)
    a_cut = bool(a) and _LINES_CUT.match(a[-1][0]) is not None
    b_cut = bool(b) and _LINES_CUT.match(b[-1][0]) is not None
    if a_cut or b_cut:  # cut at a total length: the lines both kept, the last of them perhaps cut too
        a, b = a[:-1] if a_cut else a, b[:-1] if b_cut else b
        n = min(len(a), len(b))
        a, b = a[:n], b[:n]
    if len(a) != len(b):
        return False
    for (x, x_cut), (y, y_cut) in zip(a, b):
        if x_cut or y_cut:
            n = min(len(x), len(y))
            x, y = x[:n], y[:n]
        if x != y:
            return False
    return True


def differences(before: dict[tuple[str, str, str], dict[str, Any]],
                after: dict[tuple[str, str, str], dict[str, Any]], messages: bool) -> list[str]:
    lines: list[str] = []
    for key in sorted(before.keys() | after.keys()):
        label = " / ".join(key)
        if key not in after:
            lines.append(f"only before: {label}")
        elif key not in before:
            lines.append(f"only after: {label}")
        else:
            old, new = _view(before[key], messages), _view(after[key], messages)
            for field in old:
                if field == "message" and same_message(old[field], new[field]):
                    continue
                if old[field] != new[field]:
                    lines.append(f"{label}: {field} {old[field]!r} -> {new[field]!r}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--messages", action="store_true", help="also compare failure messages")
    parser.add_argument("--subset", action="store_true",
                        help="compare only the backends and cases AFTER ran (a quick run against a full baseline)")
    args = parser.parse_args(argv)
    before, after = _load(args.before), _load(args.after)
    if args.subset:
        backends, cases = {key[0] for key in after}, {key[1] for key in after}
        before = {key: result for key, result in before.items() if key[0] in backends and key[1] in cases}
    lines = differences(before, after, args.messages)
    for line in lines[:200]:
        print(line)
    if len(lines) > 200:
        print(f"... and {len(lines) - 200} more")
    print(f"{len(before | after)} results compared, {len(lines)} differ")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
