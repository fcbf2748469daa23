"""A verdict opts in only over the whole matrix; narrowed runs are ``partial``; runners' verdicts merge (issue 21.8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_kvprofile.cli import main as cli_main
from pytest_kvprofile.report.documents import MergeError, merge_verdicts

STUB = ("--kvprofile-backend", "stub-flashinfer")
ONE_CASE = "qwen3-8b-tp2-dcp1-mtp0-l40s-gmu0.98"


def _run(pytester: pytest.Pytester, suite_args: list[str], name: str, *extra: str, subprocess: bool = False,
         backends: tuple[str, ...] = STUB) -> tuple[pytest.RunResult, dict]:
    out = pytester.path / f"{name}.json"
    args = [*suite_args, *backends, "-q", "--kvprofile-verdict", str(out), *extra]
    result = pytester.runpytest_subprocess(*args) if subprocess else pytester.runpytest(*args)
    return result, json.loads(out.read_text())


def _backend(doc: dict, name: str = "stub-flashinfer") -> dict:
    return {b["name"]: b for b in doc["backends"]}[name]


def test_the_whole_matrix_opts_in_and_says_it_is_complete(pytester, suite_args):
    result, doc = _run(pytester, suite_args, "full")
    assert result.ret == 0
    b = _backend(doc)
    assert doc["partial"] is False and b["partial"] is False and b["may_opt_in"] is True
    assert b["coverage"]["cases_run"] == b["coverage"]["cases_in_matrix"] == 3
    assert b["coverage"]["results_run"] == b["coverage"]["results_in_matrix"] == b["counts"]["passed"]
    assert "partial run" not in result.stdout.str()


@pytest.mark.parametrize("narrowing", [("-k", ONE_CASE), ("--deselect",), ("-k", "test_support_declaration")],
                         ids=["k-one-case", "deselect-one-item", "k-one-check"])
def test_a_narrowed_run_is_partial_and_never_opts_in(pytester, suite_args, narrowing):
    if narrowing == ("--deselect",):
        listed = pytester.runpytest(*suite_args, *STUB, "--collect-only", "-q").stdout.lines
        narrowing = ("--deselect",
                     next(line for line in listed if f"test_support_declaration[stub-flashinfer-{ONE_CASE}]" in line))
    result, doc = _run(pytester, suite_args, "narrowed", *narrowing)
    assert result.ret == 0, result.stdout.str()[-2000:]
    b = _backend(doc)
    assert doc["partial"] is True and b["partial"] is True and b["may_opt_in"] is False
    assert b["coverage"]["results_run"] < b["coverage"]["results_in_matrix"] and b["coverage"]["missing"]
    assert b["reasons"][0].startswith("partial run: "), b["reasons"]
    result.stdout.fnmatch_lines(["*kvprofile partial run*", "stub-flashinfer: partial run, * of 3 cases*",
                                 "stub-flashinfer: may NOT opt in*", "*- partial run: *"])


def test_k_on_one_case_counts_one_case_run(pytester, suite_args):
    _, doc = _run(pytester, suite_args, "one", "-k", ONE_CASE)
    cover = _backend(doc)["coverage"]
    assert (cover["cases_run"], cover["cases_in_matrix"]) == (1, 3)
    assert _backend(doc)["reasons"][0].startswith("partial run: 1 of 3 cases")


def test_a_run_stopped_by_x_or_an_interrupt_is_partial(pytester, suite_args):
    result, doc = _run(pytester, suite_args, "stopped", "-x",
                       backends=("--kvprofile-backend", "mutant-01-lazy-workspace"))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    b = _backend(doc, "mutant-01-lazy-workspace")
    assert b["partial"] is True and b["may_opt_in"] is False and b["coverage"]["cases_run"] < 3

    pytester.makeconftest("""
class Interrupter:
    '''A plugin, not a conftest hook: conftest item hooks do not reach the packaged suite's items.'''
    seen = 0

    def pytest_runtest_setup(self, item):
        self.seen += 1
        if self.seen == 4:
            raise KeyboardInterrupt

def pytest_configure(config):
    config.pluginmanager.register(Interrupter(), "interrupter")
""")
    result, doc = _run(pytester, suite_args, "interrupted", subprocess=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    b = _backend(doc)
    assert b["partial"] is True and b["may_opt_in"] is False
    assert 0 < b["coverage"]["results_run"] < b["coverage"]["results_in_matrix"]


def test_reverse_order_gives_the_same_verdict(pytester, suite_args):
    _, forward = _run(pytester, suite_args, "forward")
    pytester.makeconftest("""
import pytest
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    items.reverse()
""")
    _, backward = _run(pytester, suite_args, "backward")
    assert backward == forward and forward["partial"] is False


def test_shards_under_xdist_merge_into_a_complete_verdict(pytester, suite_args, capsys):
    """Two runners, one of them with two xdist workers, each partial; their merge covers the matrix and opts in."""
    pytester.makeconftest("")
    shard_a, doc_a = _run(pytester, suite_args, "a", "-k", "tp1", "-n", "2", subprocess=True)
    shard_b, doc_b = _run(pytester, suite_args, "b", "-k", "not tp1", subprocess=True)
    assert shard_a.ret == shard_b.ret == 0
    assert shard_a.stdout.str().count("kvprofile partial run") == 1  # the controller alone reports
    assert doc_a["partial"] and doc_b["partial"]
    out = pytester.path / "merged.json"
    assert cli_main(["verdict", "merge", str(pytester.path / "a.json"), str(pytester.path / "b.json"),
                     "-o", str(out)]) == 0
    merged = json.loads(out.read_text())
    b = _backend(merged)
    assert merged["partial"] is False and b["may_opt_in"] is True and b["reasons"] == []
    assert b["coverage"]["cases_run"] == 3 and [s["path"] for s in merged["merge"]["sources"]] == [
        str(pytester.path / "a.json"), str(pytester.path / "b.json")]
    assert "stub-flashinfer: may opt in" in capsys.readouterr().out

    # one shard alone does not cover the matrix
    assert cli_main(["verdict", "merge", str(pytester.path / "a.json"), "-o", str(out)]) == 0
    assert _backend(json.loads(out.read_text()))["may_opt_in"] is False


def _doc(digest: str = "d1", version: str = "1.0", outcome: str = "passed", case: str = "c1") -> dict:
    return {
        "schema": 1, "tier": "cpu", "matrix_digest": digest, "matrices": ["m.yaml"], "versions": {}, "hardware": None,
        "partial": True,
        "backends": [{
            "name": "b", "version": version, "origin": "test", "declared_support": {"b": "required"},
            "expected_failures": {}, "refused_layouts": [], "legacy_cost": [],
            "planned": {"c1": ["support_declaration"], "c2": ["support_declaration"]},
            "results": [{"check": "support_declaration", "case": case, "outcome": outcome, "message": None}],
        }],
    }


def test_merge_needs_every_case_and_no_failure():
    assert _backend(merge_verdicts({"A": _doc(), "B": _doc(case="c2")}), "b")["may_opt_in"] is True
    failed = _backend(merge_verdicts({"A": _doc(), "B": _doc(case="c2", outcome="failed")}), "b")
    assert failed["may_opt_in"] is False and failed["reasons"] == ["1 check results failed: support_declaration"]
    gap = _backend(merge_verdicts({"A": _doc(), "B": _doc()}), "b")
    assert gap["may_opt_in"] is False and gap["coverage"]["missing"] == ["support_declaration[c2]"]


@pytest.mark.parametrize("field, a, b, named", [
    ("matrix_digest", _doc(digest="aaa"), _doc(digest="bbb"), ("aaa", "bbb")),
    ("version", _doc(version="1.0"), _doc(version="2.0"), ("'1.0'", "'2.0'")),
])
def test_merging_different_digests_or_versions_is_an_error_naming_them(tmp_path: Path, capsys, field, a, b, named):
    with pytest.raises(MergeError):
        merge_verdicts({"A": a, "B": b})
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    rc = cli_main(["verdict", "merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                   "-o", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and not (tmp_path / "o.json").exists()
    assert all(n in err for n in named) and str(tmp_path / "a.json") in err and str(tmp_path / "b.json") in err


def test_merging_what_is_not_a_verdict_is_an_error(tmp_path: Path, capsys):
    (tmp_path / "x.json").write_text("[1, 2]")
    assert cli_main(["verdict", "merge", str(tmp_path / "x.json"), str(tmp_path / "missing.json"),
                     "-o", str(tmp_path / "o.json")]) == 2
    assert "not a kvprofile verdict" in capsys.readouterr().err


def test_a_verdict_without_its_planned_matrix_cannot_be_merged():
    old = _doc()
    del old["backends"][0]["planned"]
    with pytest.raises(MergeError, match=r"backend 'b' in OLD does not say which cases its matrix has"):
        merge_verdicts({"NEW": _doc(), "OLD": old})


def test_the_verdict_records_its_waste_budget_and_merge_refuses_different_ones():
    """Issue 37, point 10: waste is refused only above a budget, so verdicts judged under two budgets disagree."""
    a, b, none = _doc(), _doc(case="c2"), _doc(case="c2")
    a["waste_budget"] = {"amount": 64.0, "unit": "MiB", "text": "64 MiB (--kvprofile-max-waste)"}
    b["waste_budget"] = {"amount": 1000.0, "unit": "tok", "text": "1000 KV tokens per rank (--kvprofile-max-waste)"}
    with pytest.raises(MergeError, match=r"different waste budgets.*A: 64 MiB.*B: 1000 KV tokens"):
        merge_verdicts({"A": a, "B": b})
    with pytest.raises(MergeError, match=r"A: 64 MiB.*C: no budget"):
        merge_verdicts({"A": a, "C": none})
    same = dict(b, waste_budget=a["waste_budget"])
    assert merge_verdicts({"A": a, "B": same})["waste_budget"] == a["waste_budget"]


def test_merging_a_json_report_says_what_it_is():
    report = {"schema": 1, "tier": "cpu", "backends": [{"name": "b"}], "summary": {}, "results": [],
              "matrix_digest": "x"}
    with pytest.raises(MergeError, match=r"R is a --kvprofile-json report, not a verdict"):
        merge_verdicts({"R": report, "V": _doc()})
