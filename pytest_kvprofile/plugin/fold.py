"""Failures folded: one block per (backend, check) on the terminal, its worst case shown, the rest counted.

A bug fails one check on every case of a backend's matrix: 124 near-identical ``FAILED`` blocks bury the verdict.
Under the default verbosity the controller shows, per (backend, check), the failure of the worst case (the most
bytes, then KV tokens, its message names) with a section naming how many more cases fail and which; the short
summary has one ``FAILED`` line per block. ``-v`` shows every failure, as pytest does; the JSON report and the
verdict keep every result either way. Only the terminal's copy of the reports changes, and only while it prints:
the counts of the last line, JUnit XML, ``--lf`` and xdist see every report.

It also keeps printing the failures linear in the run's size: pytest looks, for each failure it prints, through
every report of the run for the failure's teardown (``_handle_teardown_sections``), which took 2,736 failures of a
43-backend run 22 minutes; while it prints, that list holds only the failures' own teardown reports.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Generator

import pytest

from pytest_kvprofile.plugin.recorder import RECORD_KEY
from pytest_kvprofile.plugin.session import KvprofileSession
from pytest_kvprofile.report.summary import figures, worst_failure

SHOWN_CASES = 5  # the other failing cases a folded block names before "and N more"


def _record(report: pytest.TestReport) -> dict[str, object] | None:
    data = dict(report.user_properties).get(RECORD_KEY)
    return data if isinstance(data, dict) else None


def fold_reports(reports: list[pytest.TestReport], per_token: dict[str, int] | None = None,
                 ) -> list[pytest.TestReport]:
    """The reports as the terminal shows them folded: reports of a suite check that failed on several cases of one
    backend become one copy of the worst case's report (its headline, traceback and message) carrying a section
    that names the others; every other report is kept as it is, in order (a block where its group first failed).
    ``per_token``: each case's KV bytes per token (a message naming bytes only is then given its KV tokens)."""
    groups: dict[tuple[str, str], list[tuple[pytest.TestReport, dict[str, object]]]] = defaultdict(list)
    for rep in reports:
        data = _record(rep)
        if data is not None and rep.when == "call":
            groups[(str(data["backend"]), str(data["check"]))].append((rep, data))
    out: list[pytest.TestReport] = []
    done: set[tuple[str, str]] = set()
    for rep in reports:
        data = _record(rep)
        key = None if data is None or rep.when != "call" else (str(data["backend"]), str(data["check"]))
        if key is None or len(groups[key]) == 1:
            out.append(rep)
            continue
        if key in done:
            continue
        done.add(key)
        out.append(_folded(key, groups[key], per_token or {}))
    return out


def _folded(key: tuple[str, str], members: list[tuple[pytest.TestReport, dict[str, object]]],
            per_token: dict[str, int]) -> pytest.TestReport:
    backend, check = key
    by_case = {str(data["case"]): (rep, data) for rep, data in members}
    worst, nbytes, tokens = worst_failure(
        {case: (str(data["message"]) if data.get("message") else None) for case, (_, data) in by_case.items()},
        per_token)
    rep = copy.copy(by_case[worst][0])
    others = sorted(c for c in by_case if c != worst)
    named = ", ".join(others[:SHOWN_CASES]) + (f" and {len(others) - SHOWN_CASES} more" if len(others) > SHOWN_CASES
                                               else "")
    amount = figures(nbytes, tokens)
    title = (f"kvprofile: {check} fails on {len(members)} cases of {backend}; shown: the worst"
             + (f" ({amount})" if amount else ""))
    body = (f"the other {len(others)} failing cases: {named}\n"
            "-v shows each failure; the JSON report (--kvprofile-json) keeps every message\n")
    rep.sections = [*rep.sections, (title, body)]
    return rep


class FailureFolder:
    """The controller's terminal: failures folded while pytest prints them (unless ``-v``); after pytest's short
    summary, how many failures its lines stand for and the run's last section (``session.final_lines``: what was
    written where, then one verdict line per backend), so that the verdict ends the output."""

    def __init__(self, session: KvprofileSession):
        self.session = session

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter,
                                config: pytest.Config) -> Generator[None, None, None]:
        from pytest_kvprofile.report.summary import kv_bytes_per_token

        stats = terminalreporter.stats
        saved: dict[str, list[object]] = {key: stats[key] for key in ("failed", "") if key in stats}
        folded = 0
        if "failed" in stats and config.get_verbosity() < 1:
            stats["failed"] = fold_reports(stats["failed"], kv_bytes_per_token(self.session.records))
            folded = len(saved["failed"]) - len(stats["failed"])
        if "" in stats:  # pytest's teardown lookup per printed failure: only the reports it can find
            failing = {getattr(rep, "nodeid", None)
                       for key in ("failed", "error") for rep in saved.get(key, stats.get(key, []))}
            stats[""] = [rep for rep in stats[""]
                         if getattr(rep, "when", None) == "teardown" and getattr(rep, "nodeid", None) in failing]
        try:
            return (yield)
        finally:
            stats.update(saved)
            if folded and terminalreporter.reportchars and "f" in terminalreporter.reportchars and \
                    not config.option.no_summary:
                terminalreporter.write_line(
                    f"kvprofile: {len(saved['failed']) - folded} FAILED lines stand for {len(saved['failed'])} "
                    "failures, one per backend and check (its worst case); -v lists each")
            final_section(terminalreporter, self.session)


def final_section(terminalreporter: pytest.TerminalReporter, state: KvprofileSession) -> None:
    """The run's last lines: what was written where, why nothing was tested, then one verdict line per backend
    (``state.final_lines``, which the plugin's summary set)."""
    if not (state.final_lines or state.written or state.nothing_tested):
        return
    terminalreporter.section("kvprofile verdict")
    for written in state.written:
        terminalreporter.write_line(written.line())
    if state.nothing_tested:
        terminalreporter.write_line(f"kvprofile: no conformance check ran, nothing was tested (exit code 5): "
                                    f"{state.nothing_tested}", red=True)
    for line in state.final_lines:
        terminalreporter.write_line(line)
