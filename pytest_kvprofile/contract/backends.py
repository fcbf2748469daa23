"""Backends: a named factory of builders for one model, plus how the engine integrates them.

The built-in backends are the CPU stubs and the mutant catalog; third-party backends register
through the ``pytest_kvprofile.contract.backends`` entry-point group, ``--kvprofile-backend module:factory``
or the ``pytest_kvprofile_backends`` hook.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from pytest_kvprofile.lifecycle.driver import EnginePolicy

ENTRY_POINT_GROUP = "pytest_kvprofile.contract.backends"
REQUIRED_BUILDER_ATTRS = ("name",)


class BackendError(ValueError):
    """A backend cannot be used; the message names it and what is missing."""


@dataclass(frozen=True)
class Backend:
    """A named builder set and the engine policy it is integrated with.

    ``make_builders(case)`` returns fresh builder instances for one case. ``expected_failures``
    maps check names to reasons; those checks become strict xfails and block the opt-in.
    """

    name: str
    make_builders: Callable[[Any], Iterable[Any]]
    policy: EnginePolicy = field(default_factory=EnginePolicy)
    version: str = ""
    description: str = ""
    expected_failures: tuple[tuple[str, str], ...] = ()
    origin: str = ""  # where it was registered from; filled in by the registry
    bug_class: int | None = None
    torch_mode: bool = False  # builders allocate with plain torch "cuda" calls, served by the simulated device
    make_resources: Callable[[Any], Iterable[Any]] | None = None  # None: the resources the case carries

    @property
    def xfails(self) -> dict[str, str]:
        return dict(self.expected_failures)


def coerce_backend(obj: Any, origin: str) -> Backend:
    """Turn what a factory or hook returned into a Backend, or say precisely what is wrong."""
    if isinstance(obj, Backend):
        return obj if obj.origin else dataclasses.replace(obj, origin=origin)
    if isinstance(obj, dict):
        try:
            name = obj["name"]
            make = obj["make_builders"]
        except KeyError as exc:
            raise BackendError(f"backend from {origin}: mapping lacks the key {exc.args[0]!r}") from None
        if not callable(make):
            raise BackendError(f"backend {name!r} from {origin}: make_builders is not callable")
        policy = obj.get("policy") or EnginePolicy()
        xfail = obj.get("expected_failures") or {}
        return Backend(
            name=str(name), make_builders=make, policy=policy, version=str(obj.get("version", "")),
            description=str(obj.get("description", "")), expected_failures=tuple(sorted(dict(xfail).items())),
            origin=origin, torch_mode=bool(obj.get("torch_mode", False)),
        )
    if obj is None:
        raise BackendError(f"backend from {origin}: the factory returned nothing (expected a Backend)")
    raise BackendError(
        f"backend from {origin}: the factory returned {type(obj).__name__}, expected a "
        "pytest_kvprofile.Backend or a mapping with 'name' and 'make_builders'"
    )


def validate_builders(backend: Backend, builders: list[Any]) -> None:
    """A builder set must be non-empty and every builder must name itself."""
    if not builders:
        raise BackendError(f"backend {backend.name!r}: make_builders() returned no builders")
    names = []
    for i, b in enumerate(builders):
        missing = [attr for attr in REQUIRED_BUILDER_ATTRS if not getattr(b, attr, None)]
        if missing:
            raise BackendError(
                f"backend {backend.name!r}: builder #{i} ({type(b).__name__}) lacks the protocol attribute "
                f"{', '.join(missing)}"
            )
        names.append(b.name)
    if len(set(names)) != len(names):
        raise BackendError(f"backend {backend.name!r}: builder names are not unique: {names}")


def load_factory(spec: str) -> list[Backend]:
    """Import ``package.module:factory`` and call it; it returns one backend or several."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BackendError(f"--kvprofile-backend {spec!r}: expected 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the backend's, reported as such
        raise BackendError(f"backend {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    factory = module
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
