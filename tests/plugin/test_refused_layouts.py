"""Layouts a backend's engine refuses are skipped with its reason (issue 21.7); a missing engine is one usage error
naming its install, before collection (issue 21.9); FlashInfer's import-time deprecations do not flood the summary."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pytest_kvprofile.contract.backends import (
    Backend,
    BackendError,
    check_requirements,
    layout_refusal,
)
from pytest_kvprofile.report.documents import expand_verdict

BACKENDS = """
from pytest_kvprofile import Backend
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder

def refuse_dcp(case):
    return "my engine rejects DCP" if case.dcp > 1 else None

def raise_on_dcp(case):
    if case.dcp > 1:
        raise ValueError("my engine rejects DCP")
    return [FlashInferLikeBuilder(case)]

def refusal_that_raises(case):
    raise RuntimeError("the refusal itself is broken")

def pytest_kvprofile_backends(config):
    return [
        Backend(name="refuser", make_builders=lambda case: [FlashInferLikeBuilder(case)], refuses_layout=refuse_dcp),
        Backend(name="raiser", make_builders=raise_on_dcp),
        Backend(name="broken-refusal", make_builders=raise_on_dcp, refuses_layout=refusal_that_raises),
    ]
"""
DCP_CASE = "qwen3-8b-tp2-dcp2-mtp0-l40s-gmu0.98"


def test_a_refused_layout_is_skipped_with_the_engine_reason_and_not_counted(pytester, suite_args):
    pytester.makeconftest(BACKENDS)
    out = pytester.path / "verdict.json"
    result = pytester.runpytest(*suite_args, "-v", "-rs", "--kvprofile-verdict", str(out))
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        f"*test_engine_accepts_layout[[]refuser-{DCP_CASE}[]] SKIPPED*",
        "*1 (backend, case) layouts refused by their engine or unsized by the suite skipped, not counted against the "
        "opt-in*",
        "SKIPPED [[]1[]] *: the layout is refused: my engine rejects DCP",
    ])
    assert f"[refuser-{DCP_CASE}]" not in result.stdout.str().replace("test_engine_accepts_layout[", "")
    verdict = {b["name"]: b for b in json.loads(out.read_text())["backends"]}
    refuser = verdict["refuser"]
    assert refuser["may_opt_in"] is True and refuser["reasons"] == []
    assert refuser["refused_layouts"] == [{"case": DCP_CASE, "reason": "my engine rejects DCP"}]
    assert refuser["coverage"]["cases_in_matrix"] == refuser["coverage"]["cases_run"] == 2
    # a backend that raises stays a failure, and so does one whose refusal raises (it refuses nothing)
    for name in ("raiser", "broken-refusal"):
        b = verdict[name]
        assert b["may_opt_in"] is False and b["refused_layouts"] == []
        assert {r["case"] for r in b["results"] if r["outcome"] == "failed"} == {DCP_CASE}


def test_layout_refusal_asks_only_runnable_cases_and_keeps_the_reason():
    backend = Backend(name="b", make_builders=lambda case: [], refuses_layout=lambda case: "no")
    assert layout_refusal(backend, SimpleNamespace(skip_reason=None)) == "no"
    assert layout_refusal(backend, SimpleNamespace(skip_reason="impossible")) is None
    assert layout_refusal(Backend(name="c", make_builders=lambda case: []), SimpleNamespace(skip_reason=None)) is None


def test_a_missing_engine_module_is_named_with_its_install():
    check_requirements(Backend(name="ok", make_builders=lambda case: [], requires=("json",)))
    with pytest.raises(BackendError, match=r"backend 'eng' needs no_such_engine_kv, which is not installed; "
                                           r"install it with pip install no-such-engine"):
        check_requirements(Backend(name="eng", make_builders=lambda case: [], requires=("no_such_engine_kv",),
                                   install_hint="pip install no-such-engine"))


def test_vllm_backend_without_vllm_is_one_usage_error_before_collection(pytester, suite_args):
    pytester.makeconftest("import sys\n"
                          "sys.modules['vllm'] = None  # vLLM's import fails, as where it is not installed\n")
    result = pytester.runpytest_subprocess(*suite_args, "--kvprofile-backend", "vllm-flashinfer")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert err.count("scripts/install_vllm_cpu.sh") == 1 and "vllm-flashinfer" in err
    assert "Traceback" not in err + result.stdout.str()
    assert "collected" not in result.stdout.str() and "failed" not in result.stdout.str()


def test_a_registered_backend_whose_engine_is_missing_is_a_usage_error(pytester, suite_args):
    pytester.makeconftest("""
from pytest_kvprofile import Backend

def pytest_kvprofile_backends(config):
    return Backend(name="needs-engine", make_builders=lambda case: [], requires=("no_such_engine_kv",),
                   install_hint="pip install no-such-engine")
""")
    result = pytester.runpytest_subprocess(*suite_args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    expected = ("*backend 'needs-engine' needs no_such_engine_kv, which is not installed; install it "
                "with pip install no-such-engine*")
    result.stderr.fnmatch_lines([expected])


def test_flashinfers_import_deprecations_do_not_reach_the_warnings_summary(pytester):
    """FlashInfer's own modules' DeprecationWarnings (raised when it is imported) are filtered; others still show."""
    pytester.makepyfile(test_imports="""
import warnings

def test_import_flashinfer():
    import flashinfer.decode  # noqa: F401

def test_a_deprecation_of_ours_still_shows():
    warnings.warn("ours is deprecated", DeprecationWarning)
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == 0
    text = result.stdout.str()
    assert "ours is deprecated" in text and "1 warning" in text
    assert "flashinfer/" not in text.split("warnings summary")[-1]


def test_a_mapping_backend_declares_its_refusals_and_requirements():
    from pytest_kvprofile.contract.backends import coerce_backend

    backend = coerce_backend({"name": "m", "make_builders": lambda case: [], "requires": "vllm",
                              "install_hint": "scripts/install_vllm_cpu.sh", "refuses_layout": lambda case: "no"},
                             "test")
    assert backend.requires == ("vllm",) and backend.install_hint == "scripts/install_vllm_cpu.sh"
    assert layout_refusal(backend, SimpleNamespace(skip_reason=None)) == "no"


NVFP4_MATRIX = """
name: nv
envelope: {max_num_seqs: 64, max_num_batched_tokens: 2048, max_model_len: 8192, page_size: 16,
           cuda_graph_sizes: [1, 8, 64], num_ubatches: 2}
models:
  qwen3-8b: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36, weights_gib: 15.3, hidden_size: 4096,
             kv_dtype: [bf16, nvfp4]}
gpus: [L40S, B200]
tp: [1]
gmu: [0.98]
"""


def test_a_layout_the_suite_cannot_size_is_refused_by_name_on_every_backend_and_not_counted(pytester):
    """NVFP4 on the B200 (SM100) runs on trtllm-gen only: no backend is run (and so failed) with a sizing it cannot
    trust, the layout is listed with the reason, and an engine's own refusal keeps its words (issue 35.2)."""
    pytester.makeconftest(BACKENDS)
    matrix = pytester.makefile(".yaml", nv=NVFP4_MATRIX)
    out = pytester.path / "verdict.json"
    result = pytester.runpytest("--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(matrix),
                                "-p", "no:cacheprovider", "-rs", "--kvprofile-verdict", str(out))
    nvfp4 = "qwen3-8b-tp1-dcp1-mtp0-b200-gmu0.98-kvnvfp4"
    result.stdout.fnmatch_lines([
        "*3 (backend, case) layouts refused by their engine or unsized by the suite skipped*",
        "SKIPPED [[]3[]] *: the layout is refused: unsized by the suite: KV dtype nvfp4 runs on FlashInfer's "
        "trtllm-gen kernels only on sm_100*",
    ])
    assert result.ret == pytest.ExitCode.OK
    verdict = {b["name"]: b for b in expand_verdict(json.loads(out.read_text()))["backends"]}  # passed ones listed
    for b in verdict.values():
        assert b["may_opt_in"] is True, b["reasons"]
        assert [r["case"] for r in b["refused_layouts"]] == [nvfp4]
        assert "trtllm-gen kernels only on sm_100" in b["refused_layouts"][0]["reason"]
        ran = {r["case"] for r in b["results"]}
        assert nvfp4 not in ran and "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98-kvnvfp4" in ran  # FA2 on the L40S


def test_an_engine_refusal_is_named_before_the_suite_own():
    unsized = SimpleNamespace(skip_reason=None, unsized_reason="unsized by the suite: no FA2 kernel")
    engine = Backend(name="b", make_builders=lambda case: [], refuses_layout=lambda case: "my engine says no")
    assert layout_refusal(engine, unsized) == "my engine says no"
    assert layout_refusal(Backend(name="c", make_builders=lambda case: []), unsized) == (
        "unsized by the suite: no FA2 kernel")
