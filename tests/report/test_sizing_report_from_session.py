"""The report's sizing section is made from the session's cases: no matrix file is read again (issue 53)."""

from __future__ import annotations

from types import SimpleNamespace

from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.report.documents import _sizing_report
from pytest_kvprofile.sizing.comparison import report_for_matrix, unsized_for_matrix


def test_the_sizing_report_reads_the_sessions_cases_not_the_file(tmp_path):
    path = packaged_matrix("ci")
    matrix = load_matrix(path)
    gone = SimpleNamespace(path=str(tmp_path / "deleted.yaml"), cases=matrix.cases)  # the file is no longer there
    report = _sizing_report(SimpleNamespace(matrices=[gone]))
    assert report["rows"] == report_for_matrix(path) and report["rows"]
    assert report["unsized"] == unsized_for_matrix(path)
