"""The backend registry: where backends come from, and what the harness learns of them at configure.

Backends are named on the command line or in the ini (``--kvprofile-backend``), returned by the
``pytest_kvprofile_backends`` hook, installed under the ``pytest_kvprofile.backends`` entry-point
group, or built in (the correct stubs, the mutant catalog, the real-FlashInfer and vLLM backends).
Why here, above the contract: built-ins (``builtin/``) and engine adapters (``engines/``) register like any
third-party backend, through this catalog; the contract they implement knows none of them.

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
from dataclasses import dataclass
from typing import Any, Iterable

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
from pytest_kvprofile.lifecycle.parts import model_parts

ENTRY_POINT_GROUP = "pytest_kvprofile.backends"
REQUIRED_METHODS = ("reserve_persistent_workspace", "declared_workspace")


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


def call_factory(factory: Any, origin: str) -> list[Backend]:
    if not callable(factory):
        raise BackendError(f"backend {origin!r}: {factory!r} is not callable")
    try:
        produced = factory()
    except Exception as exc:  # noqa: BLE001
        raise BackendError(f"backend {origin!r}: the factory raised {type(exc).__name__}: {exc}") from None
    items = produced if isinstance(produced, (list, tuple)) else [produced]
    if not items:
        raise BackendError(f"backend {origin!r}: the factory returned an empty list")
    return [coerce_backend(item, origin) for item in items]


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


def _installed(name: str, catalog: dict[str, Backend]) -> list[Backend]:
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
    raise BackendError(
        f"--kvprofile-backend {name!r}: not 'package.module:factory', not a built-in backend (stubs, mutants, or one "
        f"of: {', '.join(catalog)}) and not an installed backend ({', '.join(installed) or 'none installed'}: a "
        f"package registers them under the {ENTRY_POINT_GROUP!r} entry point group)"
    )


def builtin_backends() -> dict[str, Backend]:
    """Every built-in backend by name: the correct stubs, the mutant catalog, and the backend made of real
    FlashInfer wrappers (``flashinfer``) with its lazy twin, which run FlashInfer on the simulated GPU."""
    from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS, REAL_FLASHINFER_MUTANTS
    from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
    from pytest_kvprofile.builtin.stubs import ROUTE_STUB_BACKENDS, STUB_BACKENDS, TORCH_STUB_BACKENDS
    from pytest_kvprofile.engines.vllm_flashinfer import VLLM_BACKENDS  # imports no vLLM: make_builders does

    return {b.name: b for b in (*STUB_BACKENDS, *TORCH_STUB_BACKENDS, *ROUTE_STUB_BACKENDS, *MUTANT_BACKENDS,
                                *REAL_FLASHINFER_BACKENDS, *REAL_FLASHINFER_MUTANTS, *VLLM_BACKENDS)}


def resolve_backends(specs: Iterable[str], hooked: Iterable[Any] = (), entry_points: bool = True) -> list[Backend]:
    """Backends from the command line/ini and the hook; entry points only when none are named; stubs if none.

    Naming backends explicitly narrows the run to them, so an installed entry-point backend does not
    join every session.
    """
    from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
    from pytest_kvprofile.builtin.stubs import STUB_BACKENDS

    specs = list(specs)
    catalog = builtin_backends()
    out: list[Backend] = []
    for spec in specs:
        spec = spec.strip()
        if spec == "stubs":
            out.extend(STUB_BACKENDS)
        elif spec == "mutants":
            out.extend(MUTANT_BACKENDS)
        elif spec in catalog:
            out.append(catalog[spec])
        elif ":" in spec:
            out.extend(load_factory(spec))
        else:
            out.extend(_installed(spec, catalog))
    for item in hooked:
        if item is None:
            continue
        items = item if isinstance(item, (list, tuple)) else [item]
        out.extend(coerce_backend(i, "the pytest_kvprofile_backends hook") for i in items)
    if entry_points and not specs:
        out.extend(entry_point_backends())
    if not out:
        out = list(STUB_BACKENDS)
    seen: dict[str, Backend] = {}
    for b in out:
        if b.name in seen and seen[b.name] is not b:
            raise BackendError(f"two backends are named {b.name!r} ({seen[b.name].origin} and {b.origin})")
        seen[b.name] = b
    return list(seen.values())


PartsOnDevice = Callable[[Backend, Any], AbstractContextManager[Callable[[], list[Any]]]]
"""Constructs a backend's parts for a case on the case's device: a context manager yielding the constructor.
What the constructor raises is the backend factory's; what entering the context raises is the harness's."""


@contextlib.contextmanager
def plain_parts(backend: Backend, case: Any) -> Iterator[Callable[[], list[Any]]]:
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


def inspect_backend(backend: Backend, case: Any, on_device: PartsOnDevice = plain_parts) -> BackendProfile:
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

    def make_neutral(case: Any) -> list[Any]:
        return [b for b in make(case) if builder_name(b) in neutral]

    return Backend(
        name=f"{backend.name}-neutral-alone", make_builders=make_neutral, policy=backend.policy,
        version=backend.version, description=f"the NEUTRAL builders of {backend.name} without the rest",
        origin=backend.origin, torch_mode=backend.torch_mode, make_resources=backend.make_resources,
        refuses_layout=backend.refuses_layout, requires=backend.requires, install_hint=backend.install_hint,
    )


def _vllm_workspace_manager(run: Any, device: Any, num_ubatches: int) -> Any:
    from pytest_kvprofile.engines.vllm_workspace import RecordingVllmWorkspaceManager

    return RecordingVllmWorkspaceManager(run, device, num_ubatches)


WORKSPACE_MANAGERS: dict[str, Callable[..., Any] | None] = {"harness": None, "vllm": _vllm_workspace_manager}
"""The shared arena managers a run may use, by ``--kvprofile-workspace-manager`` name: None is the engine's own."""


def with_workspace_manager(backend: Backend, kind: str) -> Backend:
    """The backend integrated with ``kind``'s shared arena manager (``EnginePolicy.workspace_manager`` and its
    ``manager_factory``)."""
    if backend.policy.workspace_manager == kind and (backend.policy.manager_factory is not None or kind == "harness"):
        return backend
    if kind not in WORKSPACE_MANAGERS:
        raise BackendError(f"unknown workspace manager {kind!r} ({' or '.join(WORKSPACE_MANAGERS)})")
    policy = dataclasses.replace(backend.policy, workspace_manager=kind, manager_factory=WORKSPACE_MANAGERS[kind])
    return dataclasses.replace(backend, policy=policy)
