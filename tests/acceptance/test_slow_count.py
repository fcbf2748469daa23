"""The project's ``slow`` marker: a plain run leaves the slow sweeps out and says how many, under ``-n 2`` too."""

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]



def test_a_plain_run_says_how_many_slow_tests_it_left_out(pytester: pytest.Pytester,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    pytester.makeini("[pytest]\nmarkers =\n    slow: a full sweep\n")
    pytester.makepyfile(test_x="""
        import pytest

        def test_fast():
            pass

        @pytest.mark.slow
        @pytest.mark.parametrize("i", range(3))
        def test_sweep(i):
            pass
    """)
    base = ("-p", "slow_sweeps", "-p", "no:cacheprovider", "-p", "no:kvprofile")
    plain = pytester.runpytest_subprocess(*base, "-n", "2")  # the controller collects nothing: workers tell it
    plain.assert_outcomes(passed=1)
    plain.stdout.fnmatch_lines(["3 slow tests deselected (the full sweeps): run them with `pytest -m slow`"])
    only_slow = pytester.runpytest_subprocess(*base, "-m", "slow")
    only_slow.assert_outcomes(passed=3)
    assert "slow tests deselected" not in only_slow.stdout.str()
    named = pytester.runpytest_subprocess(*base, "test_x.py::test_sweep[1]")
    named.assert_outcomes(passed=1)
