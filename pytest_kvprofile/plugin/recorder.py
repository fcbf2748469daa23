"""The controller's recorder: each check's outcome, from the reports xdist forwards to the controller.

The suite's tests put their ``CheckOutcome`` in ``user_properties`` as JSON (the channel xdist carries from
workers); the recorder adds the node id, the outcome and the failure message, and the session writes the JSON,
the verdict and the summary from these records.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from pytest_kvprofile.checks.base import CheckOutcome
from pytest_kvprofile.plugin.session import KvprofileSession

RECORD_KEY = "kvprofile"


class Recorder:
    """Collects each check's outcome on the controller (xdist forwards user_properties there)."""

    def __init__(self, state: KvprofileSession):
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = dict(report.user_properties).get(RECORD_KEY)
        if not isinstance(data, dict):  # None: not a kvprofile check; the suite writes CheckOutcome.to_json()
            return
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            outcome: str = report.outcome
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.outcome == "skipped" else "xpassed"
            record = dataclasses.replace(CheckOutcome.from_json(data), nodeid=report.nodeid, outcome=outcome)
            if report.outcome == "failed":
                record = dataclasses.replace(record, message=_short_message(report))
            self.state.records.append(record)


_XDIST_HEADER = re.compile(r"^\[gw\d+\] \S+ -- Python ")


MESSAGE_CHARS = 4000  # what a record keeps of a failure's text
LINE_CHARS = 1500  # what it keeps of one line of it


def _short_message(report: pytest.TestReport) -> str:
    """The failure's assertion lines, cut from the end so that every kept line keeps its head: the rule, the case
    and the amount lead each check's message, and they are what a reviewer reads first."""
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    lines = [ln for ln in text.splitlines() if ln.strip() and not _XDIST_HEADER.match(ln)]
    kept = [ln[2:] if ln.startswith("E ") else ln for ln in lines if ln.startswith("E ") or not ln.startswith(" ")]
    return cut_keeping_heads(kept or lines, MESSAGE_CHARS, LINE_CHARS)


def cut_keeping_heads(lines: list[str], total: int, per_line: int) -> str:
    """``lines`` joined, each cut to ``per_line`` characters and the whole to ``total``, always at the end, saying
    how much was cut."""
    out: list[str] = []
    size = 0
    for i, line in enumerate(lines):
        if len(line) > per_line:
            line = f"{line[:per_line]} [... {len(line) - per_line:,} characters cut]"
        if out and size + len(line) + 1 > total:
            out.append(f"[... {len(lines) - i} more line(s) cut]")
            break
        out.append(line[:total])
        size += len(line) + 1
    return "\n".join(out)
