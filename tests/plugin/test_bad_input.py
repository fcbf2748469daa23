"""Malformed matrices and backends end the session with a usage error that names the culprit."""

import os

import pytest

from pytest_kvprofile.checks.catalog import checks_for


def literal(text):
    """An fnmatch pattern matching ``text`` literally (brackets are character classes there)."""
    return "".join("[[]" if c == "[" else "[]]" if c == "]" else c for c in text)

BASE = """
name: bad
models:
  m32: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 2, weights_gib: 1}
gpus: [L40S]
tp: [1]
"""


@pytest.mark.parametrize(
    "text, where",
    [
        (BASE.replace("num_layers", "num_layers_typo"), "models.m32.num_layers_typo: unknown key"),
        (BASE.replace("gpus: [L40S]", "gpus: [{name: X, num_sm: 'many', memory_gib: 24}]"),
         "gpus[0].num_sm: expected integer, got 'many'"),
        (BASE.replace("gpus: [L40S]", "gpus: [{name: X, num_sm: 1.5, memory_gib: 24}]"),
         "gpus[0].num_sm: expected integer, got 1.5"),
        (BASE.replace("tp: [1]", "tpp: [1]"), "tpp: unknown key"),
        (BASE + "gmu: [1.5]\n", "gmu[0]: expected a number in (0, 1]"),
        ("models: [", "invalid YAML"),
        ("!!python/object/apply:os.system ['true']", "invalid YAML"),
    ],
)
def test_bad_matrix_is_a_usage_error_naming_file_and_key(pytester, text, where):
    path = pytester.makefile(".yaml", bad=text)
    result = pytester.runpytest("--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(path))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{path}: *{literal(where)}*"])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


def test_impossible_tp_is_skipped_with_its_reason_in_the_id_list(pytester):
    path = pytester.makefile(".yaml", bad=BASE.replace("tp: [1]", "tp: [1, 3]"))
    result = pytester.runpytest("--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(path), "-rs", "-v",
                                "--kvprofile-backend", "stub-flashinfer")
    result.stdout.fnmatch_lines(["*tp=3 does not divide the 32 query heads of m32*"])
    assert "m32-tp3-dcp1-mtp0-l40s-gmu0.90" in result.stdout.str()
    # a one-micro-batch envelope has nothing to alias: that check is not generated at all
    profiling = len([c for c in checks_for("profiling") if c.name not in ("ubatch_arenas_disjoint", "teardown_clean",
                                                                          "resource_capacity_honoured")])
    result.assert_outcomes(skipped=1, passed=profiling)
    assert "test_ubatch_arenas_disjoint" not in result.stdout.str()


@pytest.mark.parametrize(
    "body, message",
    [
        ("def factory():\n    raise RuntimeError('boom')\n", "the factory raised RuntimeError: boom"),
        ("def factory():\n    return None\n", "the factory returned nothing"),
        ("def factory():\n    return object()\n", "the factory returned object"),
        ("def factory():\n    return ['not a backend']\n",
         "item 0 of the list the factory returned is a str ('not a backend')"),
        ("def factory():\n    return {'name': 'x'}\n", "lacks the key 'make_builders'"),
        ("class B:\n    pass\n\ndef factory():\n    return {'name': 'nameless', 'make_builders': lambda c: [B()]}\n",
         "builder #0 (B) lacks the protocol attribute name"),
        ("from pytest_kvprofile import ProfilingSupport\n"
         "class B:\n    name = 'req'\n"
         "    def get_persistent_workspace_memory_profiling_support(self):\n"
         "        return ProfilingSupport.REQUIRED\n\n"
         "def factory():\n    return {'name': 'req-backend', 'make_builders': lambda c: [B()]}\n",
         "builder 'req' declares REQUIRED but lacks reserve_persistent_workspace(), declared_workspace()"),
    ],
)
def test_bad_backend_factory_is_a_one_line_usage_error(pytester, body, message):
    pytester.makepyfile(badbackend=body)
    pytester.syspathinsert()
    result = pytester.runpytest("--pyargs", "pytest_kvprofile.suite", "--kvprofile-backend", "badbackend:factory",
                                "--kvprofile-matrix", str(pytester.makefile(".yaml", m=BASE)))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: backend *{literal(message)}*"])


def test_unknown_backend_name_names_the_nearest_and_the_groups_in_one_short_line(pytester):
    result = pytester.runpytest("--pyargs", "pytest_kvprofile.suite", "--kvprofile-backend", "stub-flashinfr",
                                "--kvprofile-matrix", str(pytester.makefile(".yaml", m=BASE)))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvprofile-backend 'stub-flashinfr'*Did you mean 'stub-flashinfer'*Groups: stubs, "
                                 "mutants*kvprofile list*"])
    line = next(ln for ln in result.stderr.lines if "stub-flashinfr" in ln)
    assert len(line) < 500 and "mutant-01-lazy-workspace" not in line  # not every mutant's name


HOOKED = """
from pytest_kvprofile import Backend
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS

def pytest_kvprofile_backends(config):
    stub = next(b for b in STUB_BACKENDS if b.name == "stub-flashinfer")
    return Backend(name="from-the-hook", make_builders=stub.make_builders)
"""


@pytest.mark.parametrize("named, expected", [((), {"from-the-hook"}), (("stub-gdn",), {"stub-gdn"}),
                                             (("from-the-hook",), {"from-the-hook"}),
                                             (("stub-gdn", "from-the-hook"), {"stub-gdn", "from-the-hook"})])
def test_a_backend_from_the_hook_joins_a_run_that_names_none_and_is_named_like_any_other(pytester, named, expected):
    pytester.makeconftest(HOOKED)
    args = [a for name in named for a in ("--kvprofile-backend", name)]
    result = pytester.runpytest("--pyargs", "pytest_kvprofile.suite", *args, "--co", "-q",
                                "--kvprofile-matrix", str(pytester.makefile(".yaml", m=BASE)))
    assert result.ret == pytest.ExitCode.OK, result.stderr.str()
    ran = {line.split("[", 1)[1].split("-m32")[0] for line in result.stdout.lines if "[" in line and "::" in line}
    assert ran == expected


def test_a_matrix_given_as_a_separate_argument_does_not_choose_the_rootdir(pytester):
    """pytest reads ``--kvprofile-matrix PATH`` before it knows the option; the matrix's checkout is not the rootdir."""
    checkout = pytester.mkdir("checkout")
    (checkout / "pyproject.toml").write_text("[tool.pytest.ini_options]\nmarkers = ['from_the_checkout: no']\n")
    matrix = checkout / "tiny.yaml"
    matrix.write_text(BASE)
    project = pytester.mkdir("project")
    (project / "pytest.ini").write_text("[pytest]\n")
    os.chdir(project)
    for args in (["--kvprofile-matrix", str(matrix)], [f"--kvprofile-matrix={matrix}"]):
        result = pytester.runpytest("--kvprofile", *args, "--co", "-k", "support_declaration")
        assert result.ret == pytest.ExitCode.OK, result.stdout.str()
        result.stdout.fnmatch_lines([f"rootdir: {project}", "configfile: pytest.ini"])
