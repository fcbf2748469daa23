"""pytest hook implementations for pytest-kvprofile (the ``pytest11`` entry point).

Hooks only: the session state is :mod:`.session`, the controller's recorder :mod:`.recorder`, the
GPU tier's hooks :mod:`.gpu`, the plugin's own hook specifications :mod:`.hookspecs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import pytest

from pytest_kvprofile.checks.base import WasteBudget, parse_waste_budget
from pytest_kvprofile.contract.backends import BackendError
from pytest_kvprofile.matrix.schema import MatrixError
from pytest_kvprofile.plugin.fixtures import CASE_ARG, case_params
from pytest_kvprofile.plugin.fold import FailureFolder
from pytest_kvprofile.plugin.junit import JunitClassnames
from pytest_kvprofile.plugin.recorder import Recorder
from pytest_kvprofile.plugin.session import (
    SESSION_KEY,
    KvprofileSession,
    Settings,
    build_session,
    publish_checks,
)
from pytest_kvprofile.registry import Registry

if TYPE_CHECKING:
    from pytest_kvprofile.checks.base import JsonObject

# a parameter pytest_generate_tests gave (a skipped Case, a refused (Backend, Case) pair), read back from
# request.param, which pytest leaves untyped
FixtureParam: TypeAlias = Any


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    import pytest_kvprofile.plugin.hookspecs as hookspecs
    from pytest_kvprofile.registry import builtin_plugins

    pluginmanager.add_hookspecs(hookspecs)
    for plugin in reversed(builtin_plugins()):  # the hook calls the last registered first: they register in order
        if not pluginmanager.is_registered(plugin):
            pluginmanager.register(plugin, f"kvprofile-{plugin.__name__.rsplit('.', 1)[-1]}")


SUITES = ("pytest_kvprofile.suite", "pytest_kvprofile.gpu_suite")
# FlashInfer's own modules use deprecated CuTe-DSL names when imported (16 warnings a run, none a user can act on):
# ignored only when raised from FlashInfer's own code. A deprecated FlashInfer API called from a builder is
# attributed to the builder's line and still shown; ``-W`` on the command line still overrides this.
FLASHINFER_IMPORT_WARNINGS = r"ignore::DeprecationWarning:flashinfer(\.|$)"


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """``--kvprofile`` (and ``--kvprofile-gpu``) add the packaged suite to what is collected, from any directory.

    Paths on the command line are collected too; with none, only the suite runs. The suite is named
    as a module (``--pyargs``, which leaves path arguments paths), and not twice if already named.
    """
    ns = early_config.known_args_namespace
    _rootdir_without_option_values(early_config)
    gpu, wanted = getattr(ns, "kvprofile_gpu", None), getattr(ns, "kvprofile", None)
    gpu = gpu if gpu is not None else early_config.getini("kvprofile_gpu")
    wanted = wanted if wanted is not None else early_config.getini("kvprofile")
    if not (wanted or gpu):
        return
    named = {a.split("::")[0] for a in args if not a.startswith("-")}
    added = [m for m in (SUITES if gpu else SUITES[:1]) if not any(n == m or n.startswith(m + ".") for n in named)]
    if added:
        args.extend(["--pyargs", *added])
        ns.pyargs = True



def _rootdir_without_option_values(config: pytest.Config) -> None:
    """``--kvprofile-matrix PATH`` as two arguments behaves like ``--kvprofile-matrix=PATH``.

    pytest picks the rootdir and ini file before it loads this plugin, when it does not yet know our options: it
    takes PATH for a test path and may pick the matrix's checkout and its config. Now that the options are known,
    pick them again from the real test paths; nothing changes when they agree (pytest's private fields, guarded).
    """
    from _pytest.config.findpaths import determine_setup

    ns = config.known_args_namespace
    if not all(hasattr(config, f) for f in ("_rootpath", "_inipath", "_inicfg", "_inicache")):
        return
    try:
        rootpath, inipath, inicfg, _ignored = determine_setup(
            inifile=ns.inifilename, override_ini=ns.override_ini, args=ns.file_or_dir,
            rootdir_cmd_arg=ns.rootdir or None, invocation_dir=config.invocation_params.dir)
    except Exception:  # noqa: BLE001 - pytest's own choice stands when it cannot be made again
        return
    if (rootpath, inipath) == (config._rootpath, config._inipath):
        return
    old_cut = str(config._inipath.parent if config._inipath is not None else config._rootpath)
    config._rootpath, config._inipath, config._inicfg = rootpath, inipath, inicfg
    config._inicache.clear()
    if ns.confcutdir == old_cut:
        ns.confcutdir = str(inipath.parent if inipath is not None else rootpath)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvprofile", "KV-cache profiling conformance (pytest-kvprofile)")
    group.addoption("--kvprofile", action="store_true", default=None,
                    help="add the packaged suite to the collection, from any directory")
    group.addoption("--kvprofile-gpu", action="store_true", default=None,
                    help="run the GPU tier; a usage error without a CUDA device, except with --collect-only")
    group.addoption("--kvprofile-matrix", action="append", default=None, metavar="PATH",
                    help="matrix files (repeatable); default: the packaged default.yaml")
    group.addoption("--kvprofile-backend", action="append", default=None, metavar="SPEC",
                    help="backends (repeatable): 'package.module:factory', 'stubs', 'mutants' or a built-in name; "
                         "default: entry points and the hook, else the correct stubs")
    group.addoption("--kvprofile-json", default=None, metavar="PATH", help="JSON report: every case and result")
    group.addoption("--kvprofile-verdict", default=None, metavar="PATH", help="the opt-in verdict (attach it)")
    group.addoption("--kvprofile-html", default=None, metavar="PATH",
                    help="one offline HTML page of the verdicts and failures")
    group.addoption("--kvprofile-timeout", default=None, type=float, metavar="S",
                    help="per-check time limit in seconds; a hang fails with its thread's stack")
    group.addoption("--kvprofile-max-waste", default=None, metavar="BUDGET",
                    help="waste that fails workspace_covers_planner: MiB ('64'), KV tokens ('2000 tok') or pool "
                         "share ('1.5%%'); default none (reported, not refused)")
    group.addoption("--kvprofile-workspace-manager", default=None, metavar="NAME",
                    help="the shared arena manager: 'harness', 'vllm' (default for vLLM's builders) or a registered "
                         "one")
    parser.addini("kvprofile", "add the packaged conformance suite to the collection (like --kvprofile)",
                  type="bool", default=False)
    parser.addini("kvprofile_gpu", "run the GPU tier (like --kvprofile-gpu)", type="bool", default=False)
    parser.addini("kvprofile_matrix", "matrix YAML files (like --kvprofile-matrix)", type="paths", default=[])
    parser.addini("kvprofile_json", "JSON report path (like --kvprofile-json)", default="")
    parser.addini("kvprofile_backend", "backends (like --kvprofile-backend)", type="linelist", default=[])
    parser.addini("kvprofile_backends", "the former spelling of kvprofile_backend, read when it is unset",
                  type="linelist", default=[])
    parser.addini("kvprofile_verdict", "verdict document path (like --kvprofile-verdict)", default="")
    parser.addini("kvprofile_html", "HTML page path (like --kvprofile-html)", default="")
    parser.addini("kvprofile_timeout", "per-check time limit in seconds (0: none)", default="0")
    parser.addini("kvprofile_max_waste", "workspace waste budget per case (like --kvprofile-max-waste)", default="")
    parser.addini("kvprofile_workspace_slack_mib", "deprecated: a waste budget in MiB", default="")
    parser.addini("kvprofile_workspace_manager", "the lifecycle's shared arena manager, harness or vllm (like "
                  "--kvprofile-workspace-manager); empty: each backend's own", default="")


def _settings(config: pytest.Config, registry: Registry) -> Settings:
    opt = config.option
    gpu = opt.kvprofile_gpu if opt.kvprofile_gpu is not None else config.getini("kvprofile_gpu")
    matrices = opt.kvprofile_matrix or [str(p) for p in config.getini("kvprofile_matrix")]
    backends = opt.kvprofile_backend or config.getini("kvprofile_backend") or config.getini("kvprofile_backends")
    timeout = opt.kvprofile_timeout
    if timeout is None:
        timeout = _ini_float(config, "kvprofile_timeout")
    return Settings(
        gpu=bool(gpu),
        matrices=tuple(matrices),
        json_path=_path(config, opt.kvprofile_json, "kvprofile_json"),
        verdict_path=_path(config, opt.kvprofile_verdict, "kvprofile_verdict"),
        html_path=_path(config, opt.kvprofile_html, "kvprofile_html"),
        backend_specs=tuple(backends),
        timeout=max(0.0, timeout),
        max_waste=_max_waste(config),
        workspace_manager=_workspace_manager(config, bool(gpu), registry),
    )


def _path(config: pytest.Config, option: str | None, ini: str) -> str | None:
    """A file the run writes, as an absolute path resolved one way for every option: the command line's against the
    directory pytest was invoked from, the ini file's against the ini file's directory (as ``kvprofile_matrix``, a
    ``paths`` ini key, is)."""
    if option:
        return str(config.invocation_params.dir / option)
    raw = str(config.getini(ini) or "")
    if not raw:
        return None
    base = config.inipath.parent if config.inipath is not None else config.rootpath
    return str(base / raw)


def _workspace_manager(config: pytest.Config, gpu: bool, registry: Registry) -> str | None:
    """``--kvprofile-workspace-manager``, else its ini twin, else None (each backend's own: vLLM's manager for vLLM's
    builders, the harness's for the rest; the GPU tier always the harness's). A usage error when no registered
    manager has the name, when it cannot run here (vLLM not installed: naming the install script) or on the GPU tier
    when it runs on the simulated device only."""
    kind = (config.option.kvprofile_workspace_manager or str(config.getini("kvprofile_workspace_manager"))).strip()
    if not kind:
        return "harness" if gpu else None
    entry = registry.managers.get(kind)
    if entry is None:
        raise pytest.UsageError(f"--kvprofile-workspace-manager: unknown manager {kind!r} "
                                f"(known: {', '.join(registry.managers)})")
    problem = entry.unavailable()
    if problem is None and gpu and entry.gpu_refusal is not None:
        problem = f"--kvprofile-workspace-manager {kind} {entry.gpu_refusal}"
    if problem is not None:
        raise pytest.UsageError(problem)
    return kind


def _max_waste(config: pytest.Config) -> WasteBudget | None:
    """The waste budget: the option, else its ini twin, else the deprecated ``kvprofile_workspace_slack_mib``
    (MiB; it used to fail any waste above it, and keeps doing so where a project set it); else none."""
    for source, raw in (("--kvprofile-max-waste", config.option.kvprofile_max_waste),
                        ("ini option kvprofile_max_waste", config.getini("kvprofile_max_waste")),
                        ("ini option kvprofile_workspace_slack_mib", config.getini("kvprofile_workspace_slack_mib"))):
        if raw not in (None, ""):
            try:
                return parse_waste_budget(str(raw), source)
            except ValueError as exc:
                raise pytest.UsageError(str(exc)) from None
    return None


def _ini_float(config: pytest.Config, name: str) -> float:
    raw = config.getini(name)
    try:
        return float(raw or 0)
    except ValueError:
        raise pytest.UsageError(f"ini option {name}: expected a number, got {raw!r}") from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvprofile_check(name): a pytest-kvprofile conformance check")
    config.addinivalue_line("markers", "kvprofile_gpu: needs a CUDA device; skipped unless --kvprofile-gpu")
    config.addinivalue_line("filterwarnings", FLASHINFER_IMPORT_WARNINGS)
    registry = Registry()
    try:
        config.pluginmanager.hook.pytest_kvprofile_register(registry=registry)
    except (BackendError, ValueError) as exc:  # a name registered twice, by the package and a plugin or two plugins
        raise pytest.UsageError(f"pytest_kvprofile_register: {exc}") from None
    settings = _settings(config, registry)
    tier = "gpu" if settings.gpu else "cpu"
    if settings.gpu:
        from pytest_kvprofile.gpu.nvml import cuda_device_count

        count, why = cuda_device_count()
        if count == 0 and not config.option.collectonly:
            raise pytest.UsageError(f"--kvprofile-gpu: no CUDA device was found ({why}); "
                                    "run without it for the CPU tier (--collect-only lists a GPU runner's cases)")
        preview = f"no CUDA device here ({why})" if count == 0 else None
    hooked = config.pluginmanager.hook.pytest_kvprofile_backends(config=config)
    try:
        session = build_session(settings, hooked, tier, registry)
    except (MatrixError, BackendError) as exc:
        raise pytest.UsageError(str(exc)) from None
    if settings.gpu:
        session.gpu_preview = preview
    config.stash[SESSION_KEY] = session
    publish_checks(session.checks)
    import pytest_kvprofile.plugin.fixtures as fixtures

    if not config.pluginmanager.is_registered(fixtures):
        config.pluginmanager.register(fixtures, "kvprofile-fixtures")
    import pytest_kvprofile.plugin.gpu as gpu_hooks

    if not config.pluginmanager.is_registered(gpu_hooks):
        config.pluginmanager.register(gpu_hooks, "kvprofile-gpu")
    if _is_controller(config):
        config.pluginmanager.register(Recorder(session), "kvprofile-recorder")
        config.pluginmanager.register(FailureFolder(session), "kvprofile-fold")
        config.pluginmanager.register(JunitClassnames(config), "kvprofile-junit")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _session(config) is not None:
        publish_checks(None)


def _session(config: pytest.Config) -> KvprofileSession | None:
    return config.stash.get(SESSION_KEY, None)


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    session = _session(config)
    if session is None:
        return None
    from pytest_kvprofile.report.provenance import header_lines

    names = ", ".join(Path(m.path).name for m in session.matrices)
    return [
        f"kvprofile: tier {session.tier}, matrices {names} ({len(session.runnable_cases)} cases, "
        f"{len(session.skipped_cases)} impossible), {len(session.backends)} backends",
        _backends_line(session),
        *header_lines(session),
    ]


HEADER_NAMES = 6  # the backends the header names before "and N more"


def _backends_line(session: KvprofileSession) -> str:
    """Which backends run and why these: named, the hook's and installed ones (which replace the stubs), or the
    stubs because none is named, hooked or installed."""
    names = [b.name for b in session.backends]
    shown = ", ".join(names[:HEADER_NAMES]) + (f" and {len(names) - HEADER_NAMES} more"
                                                if len(names) > HEADER_NAMES else "")
    if session.settings.backend_specs:
        why = "named by --kvprofile-backend or kvprofile_backend"
    elif all(b.origin in ("builtin", "mutant") for b in session.backends):
        why = "the built-in stubs: no backend named, installed or returned by the hook"
    else:
        origins = sorted({b.origin.split(" (")[0] for b in session.backends})
        why = (f"from {', '.join(origins)}, in place of the built-in stubs; name backends to choose "
               "(kvprofile list)")
    return f"kvprofile: backends ({why}): {shown}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    session = _session(metafunc.config)
    if session is None:
        return
    if "kvprofile_pair" in metafunc.fixturenames:
        check = session.registry.check(metafunc.function.kvprofile_check)
        params = []
        for backend, case in session.pairs_for(check):
            marks = []
            reason = backend.xfails.get(check.name)
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=f"{backend.name} expects to fail: {reason}"))
            params.append(pytest.param((backend, case), id=f"{backend.name}-{case.id}", marks=marks))
        metafunc.parametrize("kvprofile_pair", params)
    elif CASE_ARG in metafunc.fixturenames:
        metafunc.parametrize(CASE_ARG, case_params(session))
    elif "kvprofile_impossible_case" in metafunc.fixturenames:
        params = [
            pytest.param(case, id=case.id, marks=pytest.mark.skip(reason=f"impossible layout: {case.skip_reason}"))
            for case in session.skipped_cases
        ]
        metafunc.parametrize("kvprofile_impossible_case", params)
    elif "kvprofile_refused_pair" in metafunc.fixturenames:
        params = [
            pytest.param((backend, case), id=f"{backend.name}-{case.id}",
                         marks=pytest.mark.skip(reason=f"the layout is refused: {reason}"))
            for backend, case, reason in session.refused_pairs()
        ]
        metafunc.parametrize("kvprofile_refused_pair", params)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the suite's items by (case, backend) so a lifecycle result is computed once and reused."""
    state = _session(config)
    gpu = state is not None and state.tier == "gpu"
    skip_gpu = pytest.mark.skip(reason="GPU tier: pass --kvprofile-gpu on a machine with a CUDA device")
    for item in items:
        if not gpu and item.get_closest_marker("kvprofile_gpu") is not None:
            item.add_marker(skip_gpu)
    if state is None or not any(_is_suite_item(it) for it in items):
        return
    state.suite_collected = True
    has_impossible = bool(state.skipped_cases)
    has_refused = bool(state.refused_pairs())
    nonempty = {c.name for c in state.checks if state.pairs_for(c)}

    def unparametrized(item: pytest.Item) -> bool:
        """A suite test whose matrix slice is empty (pytest would report a meaningless skip)."""
        fixtures = getattr(item, "fixturenames", ())
        if "kvprofile_impossible_case" in fixtures:
            return not has_impossible
        if "kvprofile_refused_pair" in fixtures:
            return not has_refused
        if "kvprofile_pair" in fixtures:  # a suite test function: cast only names its type for mypy
            return cast(pytest.Function, item).function.kvprofile_check not in nonempty
        return False

    empty = [it for it in items if unparametrized(it)]
    if empty:
        config.hook.pytest_deselected(items=empty)
        dropped = set(map(id, empty))
        items[:] = [it for it in items if id(it) not in dropped]

    order = {c.name: i for i, c in enumerate(state.checks)}

    def key(pair: tuple[int, pytest.Item]) -> tuple[int, ...]:
        index, item = pair
        callspec = getattr(item, "callspec", None)
        checked = None if callspec is None else callspec.params.get("kvprofile_pair")
        if checked is None:
            return (0, index, 0, 0, 0)
        backend, case = checked
        return (1, state.case_index[case.id], state.backend_index[backend.name],
                order.get(cast(pytest.Function, item).function.kvprofile_check, 0), index)  # a suite test function

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def _is_suite_item(item: pytest.Item) -> bool:
    fixtures = getattr(item, "fixturenames", ())
    return any(f in fixtures for f in ("kvprofile_pair", "kvprofile_impossible_case", "kvprofile_refused_pair"))


@pytest.fixture
def kvprofile_impossible_case(request: pytest.FixtureRequest) -> FixtureParam:
    return request.param


@pytest.fixture
def kvprofile_refused_pair(request: pytest.FixtureRequest) -> FixtureParam:
    return request.param


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the sizing oracle first, saying so on the terminal, when its first use would compile it: on the
    controller of a run of the packaged suite (its workers then find it built), and with a per-check time limit (so
    no check's clock includes it). Without a CUDA compiler nothing is built: the header says what sizes instead."""
    config = session.config
    state = _session(config)
    if state is None or config.option.collectonly:
        return
    suite = bool(config.option.kvprofile or config.getini("kvprofile") or state.tier == "gpu")
    if not (state.settings.timeout or (suite and _is_controller(config))):
        return
    import time

    from pytest_kvprofile.attention.oracle import OracleError, ensure_built
    from pytest_kvprofile.attention.oracle_build import cache_root, is_built

    try:
        if is_built():
            return
    except OracleError:
        return  # no FlashInfer headers: the header says the analytic model sizes, and why
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"kvprofile: compiling FlashInfer's planner for the host (once; about 20 s; cached in "
                            f"{cache_root()})")
    start = time.monotonic()
    try:
        ensure_built()
        said = f"kvprofile: FlashInfer's planner compiled in {time.monotonic() - start:.0f} s"
    except OracleError as exc:  # the sizing falls back to its analytic model and says so in its notes
        said = f"kvprofile: FlashInfer's planner did not compile ({str(exc).splitlines()[0][:200]}): the analytic " \
               "model sizes instead (the last lines say so)"
    if reporter is not None:
        reporter.write_line(said)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The controller writes the JSON report and the verdict (atomically; a run that ran no check keeps the files
    already there), and a run that collected the suite but ran no check exits 5, pytest's "no tests ran"."""
    config = session.config
    state = _session(config)
    if state is None or not _is_controller(config):
        return
    from pytest_kvprofile.report.documents import json_document, slim_verdict, verdict_document
    from pytest_kvprofile.report.files import write_document

    ran = bool(state.records)
    if (state.suite_collected and not ran and exitstatus == pytest.ExitCode.OK and not config.option.collectonly
            and not _any_test_ran(config)):
        state.nothing_tested = state.why_nothing_ran()
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
    if state.settings.json_path:
        doc = json_document(state)
        config.pluginmanager.hook.pytest_kvprofile_update_json(config=config, report=doc)
        state.written.append(write_document("JSON report", state.settings.json_path, doc, checks_ran=ran))
    if state.settings.html_path:
        from pytest_kvprofile.report.html import html_page
        from pytest_kvprofile.report.summary import final_lines

        verdict = verdict_document(state)
        page = html_page(verdict, state.records, final_lines(verdict, state.records, state.check_order))
        state.written.append(write_document("HTML page", state.settings.html_path, page, checks_ran=ran))
    if state.settings.verdict_path:
        doc = slim_verdict(verdict_document(state))
        config.pluginmanager.hook.pytest_kvprofile_update_json(config=config, report=doc)
        state.written.append(write_document("verdict", state.settings.verdict_path, doc, checks_ran=ran))


def _any_test_ran(config: pytest.Config) -> bool:
    """Whether any test at all (the project's own beside the suite) passed or failed in this run."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(reporter, "stats", {}) or {}
    return any(stats.get(key) for key in ("passed", "failed", "xfailed", "xpassed", "error"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    state = _session(config)
    if state is None or not _is_controller(config):
        return
    if not state.records:
        if state.written or state.nothing_tested:
            _final_lines(terminalreporter, state, [])
        return
    from pytest_kvprofile.report.documents import verdict_document
    from pytest_kvprofile.report.summary import (
        final_lines,
        legacy_cost_lines,
        partial_lines,
        summarize,
        table_lines,
        verdict_lines,
        waste_lines,
    )

    rows = summarize(state.records, state.check_order)
    terminalreporter.section("kvprofile summary")
    for line in table_lines(rows):
        terminalreporter.write_line(line)
    if state.skipped_cases:
        terminalreporter.write_line(f"{len(state.skipped_cases)} impossible layouts skipped (reasons in the id list)")
    refused = state.refused_pairs()
    if refused:
        terminalreporter.write_line(f"{len(refused)} (backend, case) layouts refused by their engine or unsized by the "
                                    "suite skipped, not counted against the opt-in (reasons in the id list and the "
                                    "verdict)")
    legacy = legacy_cost_lines(state.records)
    if legacy:
        terminalreporter.section("kvprofile legacy-path cost (what KV sizing does not see; information)")
        for line in legacy:
            terminalreporter.write_line(line)
    waste = waste_lines(state.records)
    if waste:
        terminalreporter.section("kvprofile workspace waste (KV capacity lost; a cost, refused only over a budget)")
        for line in waste:
            terminalreporter.write_line(line)
    verdict = verdict_document(state)
    partial = partial_lines(verdict)
    if partial:
        terminalreporter.section("kvprofile partial run (no verdict may opt in)")
        for line in partial:
            terminalreporter.write_line(line)
    if state.settings.verdict_path:
        terminalreporter.section("kvprofile verdict reasons")
        for line in verdict_lines(verdict):
            terminalreporter.write_line(line)
    _final_lines(terminalreporter, state, final_lines(verdict, state.records, state.check_order)
                 + _sizing_lines(verdict))


def _sizing_lines(verdict: JsonObject) -> list[str]:
    """``sizing: analytic model (why)`` once for the run when any backend's workspace was sized without FlashInfer's
    planner (each backend's verdict says it too)."""
    from pytest_kvprofile.report.provenance import sizing_line

    seen = [sizing_line(b["sizing"]) for b in verdict["backends"]
            if (b.get("sizing") or {}).get("method") in ("analytic", "mixed", "error")]
    return list(dict.fromkeys(seen))


def _final_lines(terminalreporter: pytest.TerminalReporter, state: KvprofileSession, lines: list[str]) -> None:
    """The run's last lines, printed after pytest's short summary (``plugin/fold.py``'s ``final_section``)."""
    state.final_lines = lines
