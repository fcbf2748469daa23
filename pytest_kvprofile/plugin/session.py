"""The plugin's state for one pytest session: matrices, backends, results, records.

One instance lives in ``config.stash``. Every xdist worker builds its own from the same options
(loading is deterministic), so nothing needs to cross to workers; only the controller records
reports and writes the JSON, the verdict and the summary.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from pytest_kvprofile.contract.backends import Backend, BackendError, coerce_backend, entry_point_backends, load_factory, validate_builders
from pytest_kvprofile.checks.catalog import CHECKS, Check
from pytest_kvprofile.lifecycle.driver import LifecycleResult, run_lifecycle
from pytest_kvprofile.matrix.schema import Case, Matrix, MatrixError, load_matrices, packaged_matrix
from pytest_kvprofile.contract.resources import RESOURCE_KINDS, model_parts
from pytest_kvprofile.contract.support import DeclarationError, ProfilingSupport, builder_name, declared_support, resolve_support

RESULT_CACHE_SIZE = 32


@dataclass(frozen=True)
class Settings:
    gpu: bool = False
    matrices: tuple[str, ...] = ()
    json_path: str | None = None
    verdict_path: str | None = None
    backend_specs: tuple[str, ...] = ()
    timeout: float = 0.0
    waste_slack_mib: float = 2.0


def builtin_backends() -> dict[str, Backend]:
    from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
    from pytest_kvprofile.builtin.stubs import STUB_BACKENDS

    return {b.name: b for b in (*STUB_BACKENDS, *MUTANT_BACKENDS)}


def resolve_backends(specs: Iterable[str], hooked: Iterable[Any] = (), entry_points: bool = True) -> list[Backend]:
    """Backends from the command line/ini and the hook; entry points only when none are named; stubs if none.

    Naming backends explicitly narrows the run to them, so an installed entry-point backend does not
    join every session.
    """
    specs = list(specs)
    from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
    from pytest_kvprofile.builtin.stubs import STUB_BACKENDS

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
            raise BackendError(
                f"--kvprofile-backend {spec!r}: not 'package.module:factory' and not a built-in backend "
                f"(stubs, mutants, or one of: {', '.join(catalog)})"
            )
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


def check_protocol(backend: Backend, case: Case) -> None:
    """Instantiate the builders once and make sure a REQUIRED builder has what the suite calls."""
    try:
        builders = list(backend.make_builders(case))
    except Exception:  # noqa: BLE001 - a factory that raises per case is reported by every check
        return
    validate_builders(backend, builders)
    for b in builders:
        try:
            support = declared_support(b)
        except Exception:  # noqa: BLE001 - the support_declaration check reports it
            continue
        if support is ProfilingSupport.REQUIRED:
            missing = [m for m in ("reserve_persistent_workspace", "declared_workspace") if not callable(getattr(b, m, None))]
            if missing:
                raise BackendError(
                    f"backend {backend.name!r}: builder {builder_name(b)!r} declares REQUIRED but lacks "
                    f"{', '.join(missing)}()"
                )


class KvprofileSession:
    """Matrices and backends for this run, the lifecycle-result cache and the controller's records."""

    def __init__(self, settings: Settings, backends: list[Backend], matrices: list[Matrix], tier: str):
        self.settings = settings
        self.backends = backends
        self.matrices = matrices
        self.tier = tier
        self.cases: list[Case] = [c for m in matrices for c in m.cases]
        self._paths: dict[tuple[str, str], tuple[str, list[Any]]] = {}
        self._results: OrderedDict[tuple[str, str], LifecycleResult] = OrderedDict()
        self.records: list[dict] = []
        self.hardware: dict | None = None
        self.device_factory: Any = None  # the GPU tier's CudaDeviceFactory (set by pytest_kvprofile.plugin.gpu)
        self.case_index = {c.id: i for i, c in enumerate(self.cases)}
        self.backend_index = {b.name: i for i, b in enumerate(backends)}

    @property
    def runnable_cases(self) -> list[Case]:
        return [c for c in self.cases if c.skip_reason is None]

    @property
    def skipped_cases(self) -> list[Case]:
        return [c for c in self.cases if c.skip_reason is not None]

    def matrix_digest(self) -> str:
        h = hashlib.sha256()
        for m in self.matrices:
            h.update(Path(m.path).read_bytes())
        return h.hexdigest()

    def _classify(self, backend: Backend, case: Case) -> tuple[str, list[Any]]:
        """The lifecycle path a (backend, case) takes, and its parts, decided at collection."""
        key = (backend.name, case.id)
        known = self._paths.get(key)
        if known is None:
            parts: list[Any] = []
            try:
                parts = model_parts(backend, case)
                path = "profiling" if resolve_support(parts).enabled else "legacy"
            except DeclarationError:
                path = "legacy"
            except Exception:  # noqa: BLE001 - run every check; each reports the error
                path = "error"
            known = self._paths[key] = (path, parts)
        return known

    def path_for(self, backend: Backend, case: Case) -> str:
        return self._classify(backend, case)[0]

    def pairs_for(self, check: Check) -> list[tuple[Backend, Case]]:
        out = []
        for case in self.runnable_cases:
            for backend in self.backends:
                path, parts = self._classify(backend, case)
                if path == "error" or (check.applies(path) and check.relevant(case, parts)):
                    out.append((backend, case))
        return out

    def result_for(self, backend: Backend, case: Case) -> LifecycleResult:
        key = (backend.name, case.id)
        result = self._results.get(key)
        if result is None:
            if self.device_factory is None:
                result = run_lifecycle(backend, case)
            else:
                result = run_lifecycle(backend, case, device_factory=self.device_factory)
                self.device_factory.release(result)  # a real GPU cannot hold every cached case's memory
            result.extra["waste_slack_bytes"] = int(self.settings.waste_slack_mib * (1 << 20))
            self._results[key] = result
            if len(self._results) > RESULT_CACHE_SIZE:
                self._results.popitem(last=False)
        else:
            self._results.move_to_end(key)
        return result

    def count_items(self) -> int:
        return sum(len(self.pairs_for(c)) for c in CHECKS) + len(self.skipped_cases)


def default_matrices() -> tuple[str, ...]:
    return (str(packaged_matrix("default")),)


def build_session(settings: Settings, hooked: Iterable[Any], tier: str) -> KvprofileSession:
    """Load and validate everything once; raises MatrixError or BackendError with a precise message."""
    matrices = load_matrices(settings.matrices or default_matrices())
    for matrix in matrices:
        for case in matrix.cases:
            for res in case.resources:
                if res.kind not in RESOURCE_KINDS:
                    raise MatrixError(matrix.path, "resources", f"unknown resource kind {res.kind!r} "
                                      f"(known: {', '.join(RESOURCE_KINDS)})")
    backends = resolve_backends(settings.backend_specs, hooked)
    first = next((c for m in matrices for c in m.cases if c.skip_reason is None), None)
    if first is not None:
        for backend in backends:
            check_protocol(backend, first)
        backends = backends + [d for b in backends if (d := neutral_alone(b, first)) is not None]
    return KvprofileSession(settings, backends, matrices, tier)


def neutral_alone(backend: Backend, case: Case) -> Backend | None:
    """A third-party set mixing REQUIRED and NEUTRAL builders also runs with its NEUTRAL ones alone.

    NEUTRAL must be safe both carried under a REQUIRED builder's lease and on its own (where the
    model stays on the legacy path), so both are checked.
    """
    if backend.origin in ("builtin", "mutant"):
        return None
    try:
        supports = {builder_name(b): declared_support(b) for b in backend.make_builders(case)}
    except Exception:  # noqa: BLE001 - the checks of the backend itself report this
        return None
    neutral = {n for n, s in supports.items() if s is ProfilingSupport.NEUTRAL}
    if not neutral or ProfilingSupport.REQUIRED not in supports.values():
        return None
    make = backend.make_builders

    def make_neutral(c: Case) -> list[Any]:
        return [b for b in make(c) if builder_name(b) in neutral]

    return Backend(
        name=f"{backend.name}-neutral-alone", make_builders=make_neutral, policy=backend.policy,
        version=backend.version, description=f"the NEUTRAL builders of {backend.name} without the rest",
        origin=backend.origin, torch_mode=backend.torch_mode,
    )


__all__ = ["KvprofileSession", "Settings", "build_session", "resolve_backends"]
