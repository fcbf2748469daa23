"""Errors in the author's code (issue 52, items 9 and 10): a builder raising in ``build()`` shows the author's frames
under pytest's ``--tb``; a builder that cannot be made is one failure per case and the verdict says so."""

from __future__ import annotations

import json

import pytest

AUTHOR = '''
from pytest_kvprofile import Backend
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder


def compute_plan(batch):
    raise ValueError("boom")


class RaisesInBuild(FlashInferLikeBuilder):
    def build(self, ctx, batch):
        compute_plan(batch)


class RaisesInInit(FlashInferLikeBuilder):
    def __init__(self, case):
        raise RuntimeError("cannot make it")


def in_build():
    return Backend(name="raises-in-build", make_builders=lambda case: [RaisesInBuild(case)])


def in_init():
    return Backend(name="raises-in-init", make_builders=lambda case: [RaisesInInit(case)])
'''
CHECK = "persistent_memory_visible_at_closing"


@pytest.fixture
def author(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(my_backend=AUTHOR)
    pytester.syspathinsert()


@pytest.mark.parametrize("tb", ["auto", "long", "short"])
def test_a_builder_raising_in_build_shows_the_authors_frames(pytester, suite_args, author, tb):
    result = pytester.runpytest(*suite_args, "--kvprofile-backend", "my_backend:in_build", "-k", CHECK, f"--tb={tb}")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "*flashinfer raised ValueError in phase * boom; raised at *my_backend.py:6 (in compute_plan): fix the error "
        "there*",
        "traceback into your code (the harness's frames left out*",
        "*my_backend.py*11*in build*", "*compute_plan(batch)", "*my_backend.py*6*in compute_plan*",
        "ValueError: boom"])
    assert "lifecycle/driver.py" not in out  # the harness's frames are left out


def test_tb_line_and_no_show_no_frames(pytester, suite_args, author):
    line = pytester.runpytest(*suite_args, "--kvprofile-backend", "my_backend:in_build", "-k", CHECK, "--tb=line")
    assert "traceback into your code" not in line.stdout.str()
    no = pytester.runpytest(*suite_args, "--kvprofile-backend", "my_backend:in_build", "-k", CHECK, "--tb=no")
    assert "traceback into your code" not in no.stdout.str() and no.ret == pytest.ExitCode.TESTS_FAILED


def test_a_builder_that_cannot_be_made_is_one_failure_per_case_and_the_verdict_says_so(pytester, suite_args, author):
    verdict = pytester.path / "v.json"
    result = pytester.runpytest(*suite_args, "--kvprofile-backend", "my_backend:in_init", "-v",
                                "--kvprofile-verdict", str(verdict))
    result.assert_outcomes(failed=3, skipped=1)
    failed = [ln for ln in result.stdout.lines if ln.startswith("FAILED ")]
    assert len(failed) == 3 and all("test_support_declaration[raises-in-init-" in ln for ln in failed)
    result.stdout.fnmatch_lines(["*factory raised RuntimeError*cannot make it; raised at *my_backend.py:16 (in "
                                 "__init__)*", "raises-in-init: may NOT opt in: the builders could not be made "
                                 "(RuntimeError: cannot make it) on 3 cases"])
    (b,) = json.loads(verdict.read_text())["backends"]
    assert not b["may_opt_in"] and not b["partial"]
    assert any(r.startswith("the builders could not be made (the factory raised RuntimeError: cannot make it)")
               for r in b["reasons"]), b["reasons"]
    assert not any("no builder declares REQUIRED" in r or r.startswith("legacy path") for r in b["reasons"])
