"""The registry: what a run can name (backends, checks, shared arena managers), and what the harness learns of a
backend at configure.

Everything nameable is added to a :class:`Registry` through the ``pytest_kvprofile_register`` hook: the built-ins
(``builtin/``, ``engines/``, ``checks/catalog.py``, listed by :func:`builtin_plugins`) implement it as a third
party's plugin or ``conftest.py`` would, so this module keeps no list of them. Backends are then named on the
command line or in the ini (``--kvprofile-backend``: a registered name or group, ``package.module:factory``, an
installed entry point), returned by the ``pytest_kvprofile_backends`` hook, or installed under the
``pytest_kvprofile.backends`` entry-point group. Why here, above the contract: the contract the built-ins implement
knows none of them.

When builders are constructed, and why:

- :func:`inspect_backend`, once per backend at configure, on the first runnable case: the protocol
  check, the declared support the verdict reports, and the NEUTRAL-alone derivation; on the case's device
  (``on_device``: the session passes the lifecycle's, so a torch-mode backend's ``__init__`` meets the same
  simulated GPU it runs on);
- :meth:`KvprofileSession.classify <pytest_kvprofile.plugin.session.KvprofileSession.classify>`,
  once per (backend, case) at collection: which lifecycle path the pair takes, hence which checks
  apply (the builders are dropped right after);
- the lifecycle, once per (backend, case): the builders it drives; the warmup-retry probe builds
  fresh ones for every fault it injects, on a fresh device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable

from pytest_kvprofile.contract.backends import (
    Backend,
    BackendError,
    coerce_backend,
    validate_builders,
)
from pytest_kvprofile.contract.resources import ResourceAdapter
from pytest_kvprofile.contract.support import (
    ProfilingSupport,
    builder_name,
    declared_support,
)
from pytest_kvprofile.contract.workspace import ManagerKind
from pytest_kvprofile.lifecycle.parts import model_parts
from pytest_kvprofile.matrix.engine_facts import EngineFacts, register_engine_facts

if TYPE_CHECKING:
    from pytest_kvprofile.checks.base import Check
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.matrix.cases import Case

ENTRY_POINT_GROUP = "pytest_kvprofile.backends"
REQUIRED_METHODS = ("reserve_persistent_workspace", "declared_workspace")


@dataclass
class Registry:
    """Everything a run can name, in the order it was registered: backends by name and named groups of them (the
    default group runs when nothing is named), checks (the suite makes one test per check), shared arena managers,
    the engines' facts."""

    backends: dict[str, Backend] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    default_group: str | None = None
    checks: list[Check] = field(default_factory=list)
    managers: dict[str, ManagerKind] = field(default_factory=dict)
    engines: dict[str, EngineFacts] = field(default_factory=dict)

    def add_backends(self, *backends: Backend, group: str | None = None, default: bool = False) -> None:
        """Make ``backends`` nameable; ``group`` names them together (``--kvprofile-backend stubs``), ``default``
        makes that group the one a run without named backends uses."""
        for backend in backends:
            known = self.backends.get(backend.name)
            if known is not None and known is not backend:
                raise BackendError(f"two backends are registered as {backend.name!r} ({known.origin} and "
                                   f"{backend.origin})")
            if backend.name in self.groups:
                raise BackendError(f"backend {backend.name!r} has the name of a registered group")
            self.backends[backend.name] = backend
        if group is not None:
            if group in self.backends:
                raise BackendError(f"group {group!r} has the name of a registered backend")
            self.groups.setdefault(group, []).extend(b.name for b in backends)
            if default:
                self.default_group = group

    def group(self, name: str) -> list[Backend]:
        return [self.backends[b] for b in self.groups[name]]

    def add_checks(self, *checks: Check) -> None:
        """Checks the suite runs after those registered before them; a name is registered once."""
        names = {c.name for c in self.checks}
        for check in checks:
            if check.name in names:
                raise ValueError(f"two checks are registered as {check.name!r}")
            names.add(check.name)
            self.checks.append(check)

    def check(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"no check is registered as {name!r} (known: {', '.join(c.name for c in self.checks)})")

    def add_workspace_manager(self, kind: ManagerKind) -> None:
        if kind.name in self.managers:
            raise ValueError(f"two workspace managers are registered as {kind.name!r}")
        self.managers[kind.name] = kind

    def add_engine_facts(self, facts: EngineFacts) -> None:
        """An engine's facts (``matrix.engine_facts``): kept here, and published to the matrix and the sizing, which
        read them by role, never by engine (a ValueError where they contradict facts already stated)."""
        if facts.name in self.engines and self.engines[facts.name] != facts:
            raise ValueError(f"two engines state facts as {facts.name!r}, and they differ")
        register_engine_facts(facts)
        self.engines[facts.name] = facts


def builtin_plugins() -> tuple[ModuleType, ...]:
    """The package's own plugins, each implementing ``pytest_kvprofile_register`` for its part, in the order they
    register (the checks, the built-in backends and the harness's manager, then each engine's package: its adapters
    and its manager)."""
    import pytest_kvprofile.builtin as builtin
    import pytest_kvprofile.checks.catalog as catalog
    from pytest_kvprofile.engines import engine_plugins

    return (catalog, builtin, *engine_plugins())


def builtin_registry() -> Registry:
    """The built-ins alone, registered as the plugin registers them (for the CLI, sweeps and benchmarks, which run
    without pytest's plugin manager)."""
    registry = Registry()
    for plugin in builtin_plugins():
        plugin.pytest_kvprofile_register(registry=registry)
    return registry


def load_factory(spec: str) -> list[Backend]:
    """Import ``package.module:factory`` and call it; it returns one backend or several."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BackendError(f"--kvprofile-backend {spec!r}: expected 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the backend's, reported as such
        raise BackendError(f"backend {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    factory: object = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise BackendError(f"backend {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return call_factory(factory, spec)


def call_factory(factory: object, origin: str) -> list[Backend]:
    if not callable(factory):
        raise BackendError(f"backend {origin!r}: {factory!r} is not callable")
    try:
        produced = factory()
    except Exception as exc:  # noqa: BLE001
        raise BackendError(f"backend {origin!r}: the factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(produced, (list, tuple)):
        return [coerce_backend(produced, origin)]
    if not produced:
        raise BackendError(f"backend {origin!r}: the factory returned an empty list")
    for i, item in enumerate(produced):
        if not isinstance(item, (Backend, dict)):
            raise BackendError(f"backend {origin!r}: item {i} of the {type(produced).__name__} the factory returned is "
                               f"a {type(item).__name__} ({item!r:.60}), expected a pytest_kvprofile.Backend or a "
                               "mapping with 'name' and 'make_builders'")
    return [coerce_backend(item, origin) for item in produced]


def entry_point_backends() -> list[Backend]:
    from importlib.metadata import entry_points

    out: list[Backend] = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            factory = ep.load()
        except Exception as exc:  # noqa: BLE001
            raise BackendError(
                f"backend entry point {ep.name!r} ({ep.value}): cannot load: {type(exc).__name__}: {exc}"
            ) from None
        out.extend(call_factory(factory, f"entry point {ep.name!r}"))
    return out


def _installed(name: str, registry: Registry, hooked: Iterable[str] = ()) -> list[Backend]:
    """An installed backend by name: a backend an entry point makes (that one alone), or an entry point (all it makes,
    e.g. ``vllm-flashinfer-reserving``'s default and exact arenas when no backend has that name)."""
    from importlib.metadata import entry_points

    points = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    made: dict[str, list[Backend]] = {}
    for ep_name in sorted(points):
        try:
            made[ep_name] = call_factory(points[ep_name].load(), f"entry point {ep_name!r}")
        except Exception as exc:  # noqa: BLE001 - any failure of a backend's package is reported as its own
            if ep_name == name:
                raise BackendError(f"--kvprofile-backend {name!r}: entry point {points[ep_name].value!r} cannot be "
                                   f"loaded: {type(exc).__name__}: {exc}") from None
    for backends in made.values():
        for backend in backends:
            if backend.name == name:
                return [backend]
    if name in made:
        return made[name]
    installed = sorted({b.name for backends in made.values() for b in backends} | set(made))
    raise BackendError(unknown_backend(name, registry, installed, hooked))


def unknown_backend(name: str, registry: Registry, installed: Iterable[str] = (), hooked: Iterable[str] = ()) -> str:
    """What ``--kvprofile-backend NAME`` says when nothing has that name: the nearest names, then the groups and
    where the rest are listed (one short line, not every mutant's name)."""
    import difflib

    installed, hooked = sorted(installed), sorted(hooked)
    known = [*registry.groups, *registry.backends, *installed, *hooked]
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"Did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
    extra = "".join(f"; {label}: {', '.join(names)}" for label, names in (("installed", installed), ("from the "
                    "pytest_kvprofile_backends hook", hooked)) if names)
    groups = ", ".join(registry.groups) or "none"
    return (f"--kvprofile-backend {name!r}: no backend or group has that name. {hint}Groups: {groups} "
            f"({len(registry.backends)} registered backends in all: `kvprofile list` names them){extra}. A factory "
            f"is named 'package.module:factory'; a package registers backends under the {ENTRY_POINT_GROUP!r} entry "
            "point group")


def builtin_backends() -> dict[str, Backend]:
    """Every built-in backend by name (the registry's, without a plugin manager)."""
    return builtin_registry().backends


def resolve_backends(specs: Iterable[str], hooked: Iterable[object] = (), entry_points: bool = True,
                     registry: Registry | None = None) -> list[Backend]:
    """Backends from the command line/ini; with none named, the hook's and the entry points'; the registry's
    default group (the correct stubs) if none.

    Naming backends explicitly narrows the run to them, so neither an installed entry-point backend nor one the
    ``pytest_kvprofile_backends`` hook returns joins a session that names others; either is named by its name.
    """
    registry = builtin_registry() if registry is None else registry
    specs = [s.strip() for s in specs]
    by_hook: dict[str, Backend] = {}
    for item in hooked:
        if item is None:
            continue
        items = item if isinstance(item, (list, tuple)) else [item]
        for i, obj in enumerate(items):
            origin = "the pytest_kvprofile_backends hook" + (f" (item {i} of the list it returned)"
                                                             if isinstance(item, (list, tuple)) else "")
            backend = coerce_backend(obj, origin)
            by_hook.setdefault(backend.name, backend)
    out: list[Backend] = []
    for spec in specs:
        if spec in by_hook:
            out.append(by_hook[spec])
        elif spec in registry.groups:
            out.extend(registry.group(spec))
        elif spec in registry.backends:
            out.append(registry.backends[spec])
        elif ":" in spec:
            out.extend(load_factory(spec))
        else:
            out.extend(_installed(spec, registry, by_hook))
    if not specs:
        out.extend(by_hook.values())
        if entry_points:
            out.extend(entry_point_backends())
    if not out and registry.default_group is not None:
        out = registry.group(registry.default_group)
    seen: dict[str, Backend] = {}
    for b in out:
        if b.name in seen and seen[b.name] is not b:
            raise BackendError(f"two backends are named {b.name!r} ({seen[b.name].origin} and {b.origin})")
        seen[b.name] = b
    return list(seen.values())


PartsOnDevice = Callable[[Backend, "Case"], AbstractContextManager[Callable[[], list["Builder"]]]]
"""Constructs a backend's parts for a case on the case's device: a context manager yielding the constructor.
What the constructor raises is the backend factory's; what entering the context raises is the harness's."""


@contextlib.contextmanager
def plain_parts(backend: Backend, case: Case) -> Iterator[Callable[[], list[Builder]]]:
    """Construction with no device set up (a real GPU, where plain torch calls already reach it)."""
    yield lambda: model_parts(backend, case)


@dataclass(frozen=True)
class BackendProfile:
    """What one construction of a backend's builders showed at configure.

    ``contract_api``: for a part that adapts an engine's own builder class, which revision of the engine's
    reservation API it drives (its ``contract_api``), so the verdict says what was judged.

    ``declared_support`` maps each part to its answer (``required``/``neutral``/``unsupported``, or
    ``invalid: ...``/``error: ...`` when the declaration or the factory raised); ``neutral_alone``
    is the derived backend of its NEUTRAL builders alone, when it mixes them with REQUIRED ones.
    """

    backend: Backend
    declared_support: dict[str, str]
    neutral_alone: Backend | None
    contract_api: dict[str, str] = dataclasses.field(default_factory=dict)  # part -> the API revision driven


def inspect_backend(backend: Backend, case: Case, on_device: PartsOnDevice = plain_parts) -> BackendProfile:
    """Construct the builders once on ``case``, on its device (``on_device``), and check what the suite will call
    on them.

    Raises BackendError for a builder set the protocol cannot drive at all (no builders, unnamed or
    duplicate builders, a REQUIRED builder without the methods the reservation path calls). A
    factory that raises is not an error here: every check of the backend reports it per case. A harness
    that cannot set up the case's device raises as itself: it is never recorded as the backend's declaration.
    """
    with on_device(backend, case) as construct:
        try:
            parts = construct()
        except BackendError:  # the factory says its builders cannot be driven at all: a usage error
            raise
        except Exception as exc:  # noqa: BLE001 - reported per case by every check
            return BackendProfile(backend, {"<factory>": f"error: {type(exc).__name__}: {exc}"}, None)
        return _profile(backend, parts)


# Any: Builders, read for an adapter's optional contract_api too, which the protocol does not name
def _profile(backend: Backend, parts: list[Any]) -> BackendProfile:
    """The declarations of constructed parts, the protocol check and the NEUTRAL-alone derivation."""
    validate_builders(backend, [p for p in parts if not isinstance(p, ResourceAdapter)])
    supports: dict[str, str] = {}
    neutral: list[str] = []
    has_required = False
    for part in parts:
        name = builder_name(part)
        try:
            support = declared_support(part)
        except Exception as exc:  # noqa: BLE001 - the support_declaration check reports it
            supports[name] = f"invalid: {type(exc).__name__}: {exc}"
            continue
        supports[name] = support.value
        if support is ProfilingSupport.REQUIRED:
            has_required = True
            missing = [m for m in REQUIRED_METHODS if not callable(getattr(part, m, None))]
            if missing:
                raise BackendError(
                    f"backend {backend.name!r}: builder {name!r} declares REQUIRED but lacks "
                    f"{', '.join(m + '()' for m in missing)}"
                )
        elif support is ProfilingSupport.NEUTRAL and not isinstance(part, ResourceAdapter):
            neutral.append(name)
    derived = None
    if neutral and has_required and backend.origin not in ("builtin", "mutant"):
        derived = _neutral_alone(backend, frozenset(neutral))
    apis = {builder_name(p): str(p.contract_api) for p in parts if getattr(p, "contract_api", None)}
    return BackendProfile(backend, supports, derived, apis)


def _neutral_alone(backend: Backend, neutral: frozenset[str]) -> Backend:
    """A third-party set mixing REQUIRED and NEUTRAL builders also runs with its NEUTRAL ones alone.

    NEUTRAL must be safe both carried under a REQUIRED builder's lease and on its own (where the
    model stays on the legacy path), so both are checked.
    """
    make = backend.make_builders

    def make_neutral(case: Case) -> list[Builder]:
        return [b for b in make(case) if builder_name(b) in neutral]

    return dataclasses.replace(backend, name=f"{backend.name}-neutral-alone", make_builders=make_neutral,
                               description=f"the NEUTRAL builders of {backend.name} without the rest",
                               expected_failures=())


def with_workspace_manager(backend: Backend, kind: str, registry: Registry | None = None) -> Backend:
    """The backend integrated with ``kind``'s shared arena manager (``EnginePolicy.workspace_manager`` and its
    ``manager_factory``), ``kind`` one the registry knows."""
    if backend.policy.workspace_manager == kind and backend.policy.manager_factory is not None:
        return backend  # the backend's engine brings its own (a policy's factory needs no registration)
    managers = (builtin_registry() if registry is None else registry).managers
    if kind not in managers:
        raise BackendError(f"unknown workspace manager {kind!r} ({' or '.join(managers)})")
    factory = managers[kind].for_run
    if backend.policy.workspace_manager == kind and factory is None:
        return backend
    policy = dataclasses.replace(backend.policy, workspace_manager=kind, manager_factory=factory)
    return dataclasses.replace(backend, policy=policy)
