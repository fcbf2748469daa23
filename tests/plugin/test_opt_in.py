"""A backend from another package, registered by entry point or by option, gets a trustworthy verdict."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvprofile-example-backend"
CI_MATRIX = Path(__file__).resolve().parents[2] / "matrices" / "ci.yaml"


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """Install the example package (no deps, offline) into a private directory, entry points and all."""
    target = tmp_path_factory.mktemp("example-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(EXAMPLE)],
        check=True, capture_output=True, text=True,
    )
    return target


def _verdict(workdir: Path, site: Path, *extra: str) -> tuple[int, str, dict]:
    """Run the suite over the whole of the CI matrix narrowed to its L40S no-MTP cases (a ``-k`` run would be a
    partial verdict, which never opts in) with ``site`` importable; (rc, stdout, verdicts)."""
    out = workdir / "verdict.json"
    matrix = workdir / "ci-l40s-mtp0.yaml"
    text = CI_MATRIX.read_text().replace("gpus: [L40S, B200]", "gpus: [L40S]").replace("mtp: [0, 1]", "mtp: [0]")
    matrix.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(matrix),
         "-q", "-p", "no:cacheprovider", "--kvprofile-verdict", str(out), *extra],
        cwd=workdir,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))),
        capture_output=True, text=True, timeout=300,
        check=False,
    )
    return proc.returncode, proc.stdout, {b["name"]: b for b in json.loads(out.read_text())["backends"]}


@pytest.fixture(scope="module")
def by_entry_point(tmp_path_factory, installed_example):
    """The entry-point run, made once: its verdict is checked and compared with the option run's."""
    return _verdict(tmp_path_factory.mktemp("entry-point"), installed_example)


def test_entry_point_backend_gets_a_verdict(by_entry_point):
    rc, stdout, verdict = by_entry_point
    assert rc == 1
    good, lazy = verdict["example-paged-attention"], verdict["example-paged-attention-lazy"]
    assert good["may_opt_in"] is True and good["reasons"] == [] and good["version"] == "1.0.0"
    assert good["declared_support"] == {"paged-attention": "required"}
    assert lazy["may_opt_in"] is False
    failed = {r["check"] for r in lazy["results"] if r["outcome"] == "failed"}
    assert "persistent_memory_visible_at_closing" in failed
    assert any("int workspace [ubatch 0]" in (r["message"] or "") for r in lazy["results"])
    pytest.LineMatcher(stdout.splitlines()).fnmatch_lines(
        ["*example-paged-attention: may opt in*", "*example-paged-attention-lazy: may NOT opt in*"])


def test_option_registration_gives_the_same_verdict(tmp_path, installed_example, by_entry_point):
    _, _, by_option = _verdict(tmp_path, installed_example, "--kvprofile-backend", "kvprofile_example_backend:backends")
    strip = lambda b: {k: v for k, v in b.items() if k != "origin"}  # noqa: E731
    assert {n: strip(b) for n, b in by_entry_point[2].items()} == {n: strip(b) for n, b in by_option.items()}
    assert {b["origin"] for b in by_option.values()} != {b["origin"] for b in by_entry_point[2].values()}


def test_a_neutral_builder_is_checked_alone_and_carried(pytester):
    pytester.makepyfile(hybridbk="""
from pytest_kvprofile import Backend
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder, GDNLikeBuilder

def factory():
    return Backend(name="my-hybrid", make_builders=lambda case: [FlashInferLikeBuilder(case), GDNLikeBuilder(case)])
""")
    pytester.syspathinsert()
    result = pytester.runpytest("--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(CI_MATRIX),
                                "--kvprofile-backend", "hybridbk:factory", "-k", "l40s and tp1 and mtp0 and gmu0.90",
                                "-v", "-p", "no:cacheprovider")
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "*test_workspace_covers_planner[[]my-hybrid-qwen3-8b-*PASSED*",
        "*test_legacy_path_unchanged[[]my-hybrid-neutral-alone-qwen3-8b-*PASSED*",
    ])
