"""The verdict a reviewer attaches stays small (issue 52, item 8): under ``VERDICT_BOUND`` on the default matrix,
every detail in the JSON report, and a written verdict read back whole for merging."""

from __future__ import annotations

import json

import pytest

from pytest_kvprofile.checks.base import CheckOutcome
from pytest_kvprofile.matrix.schema import packaged_matrix
from pytest_kvprofile.plugin.session import Settings, build_session
from pytest_kvprofile.report.documents import (
    VERDICT_BOUND,
    expand_verdict,
    from_ranges,
    ranges,
    slim_verdict,
    verdict_document,
)


def _written_size(doc: dict) -> int:
    return len(json.dumps(doc, indent=2, sort_keys=True, default=str)) + 1  # as report/files.py writes it


def _every_check_ran(matrix: str, fail_every: int = 0) -> tuple[dict, dict]:
    session = build_session(Settings(matrices=(str(packaged_matrix(matrix)),)), [], "cpu")
    n = 0
    for backend in session.backends:
        for case, checks in session.planned(backend).items():
            for check in checks:
                n += 1
                failed = bool(fail_every) and n % fail_every == 0
                session.records.append(CheckOutcome(
                    check=check, backend=backend.name, case=case, outcome="failed" if failed else "passed",
                    message=("x" * 5000 + " 123 bytes") if failed else None, nodeid=f"t::{check}[{case}]"))
    full = verdict_document(session)
    return full, slim_verdict(full)


def test_the_default_matrix_verdict_is_under_the_bound():
    full, slim = _every_check_ran("default")
    assert _written_size(full) > 10 * VERDICT_BOUND  # what it was: 22.8 MB for the six stubs
    assert _written_size(slim) < VERDICT_BOUND / 4, _written_size(slim)  # 0.2 MB


@pytest.mark.parametrize("fail_every", [0, 7])
def test_a_written_verdict_reads_back_whole(fail_every):
    full, slim = _every_check_ran("ci", fail_every)
    back = expand_verdict(json.loads(json.dumps(slim)))
    for a, b in zip(full["backends"], back["backends"]):
        assert a["planned"] == b["planned"] and a["may_opt_in"] == b["may_opt_in"]
        key = lambda r: (r["check"], r["case"], r["outcome"])  # noqa: E731
        assert sorted(map(key, a["results"])) == sorted(map(key, b["results"]))
    if fail_every:
        msgs = [r["message"] for b in slim["backends"] for r in b["results"]]
        assert msgs and all(len(m) < 700 and "[... cut; the JSON report has it all ...]" in m for m in msgs)


def test_ranges_round_trip():
    assert ranges([5, 0, 1, 2, 9, 10]) == "0-2,5,9-10" and from_ranges("0-2,5,9-10") == [0, 1, 2, 5, 9, 10]
    assert ranges([]) == "" and from_ranges("") == []


def test_a_cut_message_keeps_its_head_and_its_remedy():
    """The verdict cuts a long message in the middle: the rule and bytes at its head and what to do at its end stay
    (issue 52 item 11); a short one is kept whole."""
    from pytest_kvprofile.report.documents import VERDICT_MESSAGE_CHARS, cut_message

    msg = "3128 bytes invisible to KV sizing; " + "x" * 2000 + " Reserve it in reserve_persistent_workspace()."
    cut = cut_message(msg)
    assert cut.startswith("3128 bytes invisible") and cut.endswith("Reserve it in reserve_persistent_workspace().")
    assert "[... cut; the JSON report has it all ...]" in cut and len(cut) < VERDICT_MESSAGE_CHARS + 60
    assert cut_message("short") == "short"
