"""A resumable table run's journal: one JSON object a line, appended as each row finishes.

Why: the result tables (``scripts/capacity_table.py``, ``scripts/sglang_table.py``) run for minutes; a run killed
part-way is finished by running the same command, which reads what the journal already holds. A killed run can leave
its last line cut short: reading ignores it, and :func:`open_for_append` ends it so the next row starts afresh.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["append_row", "journal_rows", "open_for_append"]

JournalRow = dict[str, object]  # a table's dataclass fields; each reader rebuilds its own type


def journal_rows(path: Path, derived: tuple[str, ...] = ()) -> Iterator[JournalRow]:
    """The rows of a journal in order, without their ``seconds`` and the ``derived`` fields a writer added for
    readers (not constructor arguments); a line that is not JSON (cut short) is skipped."""
    for line in path.read_text().splitlines():
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        for key in ("seconds", *derived):
            raw.pop(key, None)
        yield raw


def open_for_append(path: Path) -> None:
    """Before a resumed run appends: a last line cut short by a killed run gets its newline."""
    if path.exists() and path.stat().st_size and not path.read_text().endswith("\n"):
        with open(path, "a") as out:
            out.write("\n")


def append_row(path: Path, row: JournalRow, started: float) -> None:
    """``row`` and the wall ``seconds`` since ``started`` (``time.monotonic()``), as one line."""
    with open(path, "a") as out:
        out.write(json.dumps(dict(row, seconds=round(time.monotonic() - started, 2))) + "\n")
