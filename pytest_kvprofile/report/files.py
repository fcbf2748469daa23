"""Writing the controller's documents so that none is ever lost (issue 52, items 4 and 6).

- Atomically: the document goes to a temporary file beside the target, flushed to disk, then ``os.replace``d over
  it, so a reader (or a Ctrl-C, or a full disk) sees the old file or the new one, never half of one.
- A run that executed no check (interrupted during collection, everything deselected or skipped) never replaces a
  document already at the path: it would replace a verdict that says something with one that says nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pytest_kvprofile.checks.base import JsonObject


@dataclass(frozen=True)
class Written:
    """What happened to one document: ``what`` (``verdict``, ``JSON report``), its absolute ``path``, and whether it
    was ``written`` or kept as it was (``why``)."""

    what: str
    path: str
    written: bool
    why: str = ""

    def line(self) -> str:
        if self.written:
            return f"{self.what} written to {self.path}"
        return f"{self.what} NOT written: {self.why}; {self.path} kept as it was"


def write_json_atomic(path: str | os.PathLike[str], doc: JsonObject) -> Path:
    """``doc`` as indented JSON at ``path`` (parents made), atomically; returns the absolute path."""
    return write_text_atomic(path, json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """``text`` at ``path`` (parents made), atomically; returns the absolute path."""
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def write_document(what: str, path: str | os.PathLike[str], doc: JsonObject | str, *, checks_ran: bool) -> Written:
    """Write ``doc`` (JSON, or a page's text) unless no check ran and a file is already there (that file is kept,
    and the result says so); a file that cannot be written is said, not raised."""
    target = Path(path).absolute()
    if not checks_ran and target.exists():
        return Written(what, str(target), False, "no check ran in this run")
    try:
        written = write_text_atomic(target, doc) if isinstance(doc, str) else write_json_atomic(target, doc)
        return Written(what, str(written), True)
    except OSError as exc:
        return Written(what, str(target), False, f"cannot write it ({type(exc).__name__}: {exc})")
