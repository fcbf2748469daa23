"""``pytest --kvprofile`` from anywhere, and the public fixtures a backend's own tests use."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "kvprofile-example-backend"
CI_SOURCE = ROOT / "matrices" / "ci.yaml"
CI = "ci.yaml"  # copied into each test's directory, so that rootdir stays there


@pytest.fixture(autouse=True)
def _ci_matrix(pytester):
    shutil.copy(CI_SOURCE, pytester.path / CI)

LAZY_TEST = """
from pytest_kvprofile import ProfilingSupport, WorkspaceDeclaration
from pytest_kvprofile.sizing import for_case


class Lazy:
    name = "lazy"

    def __init__(self, case):
        self.case, self.ws = case, {}

    def get_persistent_workspace_memory_profiling_support(self):
        return ProfilingSupport.REQUIRED

    def declared_workspace(self, case):
        return WorkspaceDeclaration(for_case(case).float_bytes, 8 << 20)

    def reserve_persistent_workspace(self, ctx):
        return ctx.lease(())

    def build(self, ctx, batch):
        ctx.get_workspace(for_case(self.case).float_bytes, batch.ubatch)
        if batch.ubatch not in self.ws:
            self.ws[batch.ubatch] = ctx.allocate(8 << 20, f"int workspace [ubatch {batch.ubatch}]")


def test_my_builder(kvprofile_case, kvprofile_workspace_manager, kvprofile_run):
    assert kvprofile_workspace_manager.num_ubatches == kvprofile_case.envelope.num_ubatches
    kvprofile_run([Lazy(kvprofile_case)]).assert_passes()
"""


def test_kvprofile_runs_the_suite_from_an_empty_directory(pytester):
    result = pytester.runpytest("--kvprofile", "-q", "-p", "no:cacheprovider", "--kvprofile-matrix", CI,
                                "-k", "qwen3 and l40s and gmu0.90")  # 6 of the 48 cases: every layout, one GPU
    assert result.ret == 0
    outcomes = result.parseoutcomes()
    assert outcomes["passed"] > 200 and outcomes["deselected"] > 1800 and "failed" not in outcomes
    result.stdout.fnmatch_lines(["*kvprofile summary*", "stub-flashinfer *"])
    assert "glm-4" not in result.stdout.str()


@pytest.mark.slow  # collects (and classifies) every default case: a minute
def test_kvprofile_alone_collects_the_default_matrix(pytester):
    result = pytester.runpytest("--kvprofile", "--collect-only", "-q", "-p", "no:cacheprovider")
    assert result.ret == 0
    # deselected: teardown_clean (no stub closes); the B200's NVFP4 layouts are refused (test_engine_accepts_layout)
    result.stdout.fnmatch_lines(["*117576/117577 tests collected (1 deselected)*"])


def test_paths_on_the_command_line_are_collected_too_and_the_suite_is_not_doubled(pytester):
    pytester.makepyfile(test_own="def test_own():\n    pass\n")
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "--kvprofile-matrix", CI]
    with_suite = pytester.runpytest("--kvprofile", "test_own.py", *args)
    assert "test_own.py::test_own" in with_suite.stdout.lines
    # deselected: teardown_clean (no stub closes) and test_layout_is_possible (every ci layout is possible); the
    # B200's NVFP4 layouts are refused (test_engine_accepts_layout)
    with_suite.stdout.fnmatch_lines(["4069/4071 tests collected (2 deselected)*"])
    named = pytester.runpytest("--kvprofile", "--pyargs", "pytest_kvprofile.suite", *args)
    named.stdout.fnmatch_lines(["4068/4070 tests collected (2 deselected)*"])
    without = pytester.runpytest("test_own.py", *args)
    without.stdout.fnmatch_lines(["*1 test collected*"])


def test_kvprofile_gpu_without_a_gpu_is_still_a_usage_error(pytester):
    result = pytester.runpytest("--kvprofile-gpu", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvprofile-gpu: no CUDA device was found*"])


def _runs(case) -> bool:
    """The case is run (neither impossible nor a layout the suite cannot size)."""
    return case.skip_reason is None and case.unsized_reason is None


def _example(pytester) -> None:
    shutil.copy(EXAMPLE / "tests" / "test_paged_attention.py", pytester.path / "test_paged_attention.py")
    pytester.syspathinsert(EXAMPLE)


@pytest.mark.slow  # the example's tests over every default case (the xdist run below covers it in the plain run)
def test_the_example_backends_own_tests_pass_on_every_case(pytester):
    _example(pytester)
    result = pytester.runpytest("-p", "no:cacheprovider", "--kvprofile-matrix", CI)
    from pytest_kvprofile.matrix.schema import load_matrix

    runs = [c for c in load_matrix(CI_SOURCE).cases if _runs(c)]
    listed = len(load_matrix(CI_SOURCE).cases) - len(runs)  # impossible or unsized: skipped with their reason
    result.assert_outcomes(passed=5 * len(runs), skipped=5 * listed)


def test_the_example_backends_own_tests_under_xdist(pytester, monkeypatch):
    _example(pytester)
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--kvprofile-matrix", CI, "-n", "2",
                                           "-k", "tp1-")
    outcomes = result.parseoutcomes()
    from pytest_kvprofile.matrix.schema import load_matrix

    cases = [c for c in load_matrix(CI_SOURCE).cases if "tp1-" in c.id and _runs(c)]
    assert result.ret == 0 and outcomes["passed"] == 5 * len(cases), outcomes


def test_a_lazy_builder_fails_with_the_suites_message(pytester):
    pytester.makepyfile(test_lazy=LAZY_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider", "--kvprofile-matrix", CI, "-k", "qwen3-8b-tp1-")
    result.assert_outcomes(failed=8)
    result.stdout.fnmatch_lines([
        "*[[]persistent_memory_visible_at_closing[]] every builder byte alive after KV sizing was held at the "
        "closing measurement*",
        "*backend lazy, case qwen3-8b-tp1-dcp1-mtp0-*",
        "*builder 'lazy': * invisible to KV sizing*'int workspace [[]ubatch 0[]]'*",
    ])


def test_case_ids_match_the_suite_and_impossible_layouts_are_skipped_with_reason(pytester):
    pytester.makepyfile(test_ids="def test_case(kvprofile_case):\n    assert kvprofile_case.skip_reason is None\n")
    matrix = pytester.makefile(".yaml", m="""
name: m
models:
  m32: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 2, weights_gib: 1}
gpus: [L40S]
tp: [1, 3]
""")
    result = pytester.runpytest("-p", "no:cacheprovider", "--kvprofile-matrix", str(matrix), "-rs", "-v")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*test_case[[]m32-tp1-dcp1-mtp0-l40s-gmu0.90[]] PASSED*",
                                 "*SKIPPED*impossible layout: tp=3 does not divide the 32 query heads*"])


def test_flashinfer_builders_run_real_wrappers_on_the_cpu_tier(pytester):
    pytester.makepyfile(test_fi="""
def test_fi(kvprofile_case, kvprofile_flashinfer_builders, kvprofile_run):
    (builder,) = kvprofile_flashinfer_builders
    assert builder.name == "flashinfer"
    run = kvprofile_run(kvprofile_flashinfer_builders)
    run.assert_passes()
    assert any("flashinfer/prefill.py" in (a.stack or "") for a in run.result.allocations)
""")
    result = pytester.runpytest("-p", "no:cacheprovider", "--kvprofile-matrix", CI, "-k", "qwen3-8b-tp1-dcp1-mtp0-l40s")
    result.assert_outcomes(passed=2)


def test_simulated_cuda_serves_plain_torch_from_the_cases_device(pytester):
    pytester.makepyfile(test_t="""
import torch

def test_t(kvprofile_case, kvprofile_simulated_cuda):
    before = kvprofile_simulated_cuda.memory_allocated()
    t = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    assert kvprofile_simulated_cuda.memory_allocated() - before == 3 << 20
    assert kvprofile_simulated_cuda.total_memory == kvprofile_case.gpu.memory_bytes
""")
    result = pytester.runpytest("-p", "no:cacheprovider", "--kvprofile-matrix", CI, "-k",
                                "(qwen3 or glm) and l40s and tp1-dcp1-mtp0")
    result.assert_outcomes(passed=4)
