"""``report/journal.py``: a resumable table run's journal reads back what was appended, without the timing and the
derived fields, past a last line a killed run cut short."""

from __future__ import annotations

import time

from pytest_kvprofile.report.journal import append_row, journal_rows, open_for_append


def test_rows_read_back_without_seconds_or_derived_fields_and_a_cut_line_is_skipped(tmp_path):
    journal = tmp_path / "rows.jsonl"
    append_row(journal, {"case": "a", "nbytes": 1, "fits_tokens": 7}, time.monotonic())
    with open(journal, "a") as out:
        out.write('{"case": "b", "nby')  # the run was killed here
    assert list(journal_rows(journal, derived=("fits_tokens",))) == [{"case": "a", "nbytes": 1}]
    open_for_append(journal)  # the resumed run's next row starts on a line of its own
    append_row(journal, {"case": "c"}, time.monotonic())
    assert [r["case"] for r in journal_rows(journal)] == ["a", "c"]
    assert "seconds" in journal.read_text().splitlines()[-1]


def test_opening_a_missing_or_whole_journal_changes_nothing(tmp_path):
    journal = tmp_path / "rows.jsonl"
    open_for_append(journal)
    assert not journal.exists()
    append_row(journal, {"case": "a"}, time.monotonic())
    before = journal.read_text()
    open_for_append(journal)
    assert journal.read_text() == before
