"""scripts/compare_reports.py: the before/after comparison that refactors and speed work are held to."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_reports.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compare_reports", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(path: Path, *results: dict[str, object]) -> Path:
    path.write_text(json.dumps({"results": list(results)}))
    return path


def _result(outcome: str = "passed", message: str = "", case: str = "c1") -> dict[str, object]:
    return {"backend": "b", "case": case, "check": "k", "outcome": outcome, "message": message,
            "waste": None, "budget": None}


def test_same_results_compare_equal_and_exit_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _report(tmp_path / "a.json", _result("failed", "at /work/a/x.py:10 short by 3 bytes"))
    after = _report(tmp_path / "b.json", _result("failed", "at /work/b/x.py:99 short by 3 bytes"))
    assert _module().main([str(before), str(after), "--messages"]) == 0
    assert "1 results compared, 0 differ" in capsys.readouterr().out


def test_an_outcome_a_message_or_a_missing_result_differs(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    before = _report(tmp_path / "a.json", _result("failed", "short by 3 bytes"), _result(case="c2"))
    after = _report(tmp_path / "b.json", _result("passed", "short by 4 bytes"), _result(case="c3"))
    assert _module().main([str(before), str(after), "--messages"]) == 1
    out = capsys.readouterr().out
    assert "b / c1 / k: outcome 'failed' -> 'passed'" in out
    assert "short by 4 bytes" in out
    assert "only before: b / c2 / k" in out and "only after: b / c3 / k" in out


def test_a_file_that_is_not_a_report_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(SystemExit) as exit_info:
        _module().main([str(bad), str(bad)])
    assert exit_info.value.code == 2
    assert "bad.json is not a --kvprofile-json report" in capsys.readouterr().err


def test_subset_compares_only_the_backends_the_second_report_ran(tmp_path: Path) -> None:
    other = {**_result(), "backend": "other"}
    before = _report(tmp_path / "a.json", _result(), other)
    after = _report(tmp_path / "b.json", _result())
    assert _module().main([str(before), str(after)]) == 1
    assert _module().main([str(before), str(after), "--subset"]) == 0


def test_a_cut_moved_by_a_longer_path_and_an_object_id_do_not_differ() -> None:
    module = _module()
    old = "at /work/baseline/src/x.py:3 held by _PARKED[140234567890123] then more text [... 161 characters cut]"
    new = "at /work/wt/x.py:9 held by _PARKED[139876543210987] then more te [... 136 characters cut]"
    assert module.same_message(old, new)
    assert not module.same_message(old, new.replace("then", "than"))
    assert not module.same_message("a\nb", "a")


def test_a_message_cut_after_fewer_lines_by_a_longer_path_does_not_differ() -> None:
    module = _module()
    old = "head\n- at /work/baseline/src/a.py:1 x\n[... 2 more line(s) cut]"
    new = "head\n- at /work/a.py:1 x\n- at /work/a.py:1 y\n[... 1 more line(s) cut]"
    assert module.same_message(old, new)
    assert not module.same_message(old, new.replace("head", "other"))
