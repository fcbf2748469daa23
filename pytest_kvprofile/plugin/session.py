"""The plugin's state for one pytest session: matrices, backends, per-pair plans, results, records.

One instance lives in ``config.stash``. Every xdist worker builds its own from the same options
(loading is deterministic), so nothing needs to cross to workers; only the controller records
reports and writes the JSON, the verdict and the summary.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import pytest

from pytest_kvprofile.checks.base import CheckOutcome
from pytest_kvprofile.checks.catalog import Check, CheckOptions, WasteBudget
from pytest_kvprofile.contract.backends import (
    Backend,
    check_requirements,
    engine_gate,
    layout_refusal,
)
from pytest_kvprofile.contract.support import DeclarationError, resolve_support
from pytest_kvprofile.lifecycle.driver import (
    case_parts,
    close_parts,
    make_device,
    run_lifecycle,
)
from pytest_kvprofile.lifecycle.record import LEGACY, PROFILING, LifecycleResult
from pytest_kvprofile.matrix.cases import Case, Matrix
from pytest_kvprofile.matrix.schema import MatrixError, load_matrices, packaged_matrix
from pytest_kvprofile.registry import (
    BackendProfile,
    PartsOnDevice,
    Registry,
    builtin_registry,
    inspect_backend,
    plain_parts,
    resolve_backends,
    with_workspace_manager,
)
from pytest_kvprofile.report.files import Written

if TYPE_CHECKING:
    from pytest_kvprofile.gpu.cuda_device import CudaDeviceFactory

RESULT_CACHE_SIZE = 32
FACTORY_ERROR = "error"  # the path of a pair whose factory or declaration raised: one check per case reports it


@dataclass(frozen=True)
class Settings:
    gpu: bool = False
    matrices: tuple[str, ...] = ()
    json_path: str | None = None
    verdict_path: str | None = None
    html_path: str | None = None  # --kvprofile-html: the verdict as one self-contained page
    backend_specs: tuple[str, ...] = ()
    timeout: float = 0.0
    max_waste: WasteBudget | None = None  # --kvprofile-max-waste; None: waste reported, not refused
    # --kvprofile-workspace-manager: "harness" or "vllm" for every backend; None: each backend's own (EnginePolicy)
    workspace_manager: str | None = None

    @property
    def check_options(self) -> CheckOptions:
        return CheckOptions(max_waste=self.max_waste)


@dataclass(frozen=True)
class PairPlan:
    """What collection decided for one (backend, case): its lifecycle path and the checks that apply."""

    path: str
    checks: frozenset[str]
    engine_gate: str | None = None  # why the engine keeps this opted-in pair on the legacy path, if it does


class KvprofileSession:
    """Matrices and backends for this run, the per-pair plans, the lifecycle-result cache and the records."""

    def __init__(self, settings: Settings, profiles: list[BackendProfile], matrices: list[Matrix], tier: str,
                 registry: Registry | None = None):
        self.settings = settings
        self.registry = builtin_registry() if registry is None else registry
        self.checks: tuple[Check, ...] = tuple(self.registry.checks)
        self.profiles = {p.backend.name: p for p in profiles}
        self.backends = [p.backend for p in profiles]
        self.matrices = matrices
        self.tier = tier
        self.cases: list[Case] = [c for m in matrices for c in m.cases]
        self._plans: dict[tuple[str, str], PairPlan] = {}
        self._refusals: dict[tuple[str, str], str | None] = {}
        self._results: OrderedDict[tuple[str, str], LifecycleResult] = OrderedDict()
        self.records: list[CheckOutcome] = []
        self.hardware: dict[str, object] | None = None  # JSON for the report (gpu.controller_hardware)
        self.device_factory: CudaDeviceFactory | None = None  # the GPU tier's (set by pytest_kvprofile.plugin.gpu)
        self.case_index = {c.id: i for i, c in enumerate(self.cases)}
        self.backend_index = {b.name: i for i, b in enumerate(self.backends)}
        self.runnable_cases: list[Case] = [c for c in self.cases if c.skip_reason is None]
        self.skipped_cases: list[Case] = [c for c in self.cases if c.skip_reason is not None]
        self._pairs: dict[str, list[tuple[Backend, Case]]] | None = None
        self._refused: list[tuple[Backend, Case, str]] | None = None
        self.suite_collected = False  # the packaged suite's items were collected (a run that can test nothing)
        self.nothing_tested: str | None = None  # why a run that collected the suite ran no check (exit code 5)
        self.written: list[Written] = []  # what the controller wrote (or kept) at the end, for "written to" lines
        # --kvprofile-gpu --collect-only without a CUDA device: why, and every case is listed (no GPU to select for)
        self.gpu_preview: str | None = None
        self.final_lines: list[str] = []  # the run's verdict lines, one per backend, printed last

    @property
    def check_options(self) -> CheckOptions:
        """The settings' options with the run's checks, registered ones included (a retried run is judged by all)."""
        return replace(self.settings.check_options, checks=self.checks)

    @property
    def check_order(self) -> list[str]:
        """The checks in the order the suite runs them on a case (the lifecycle's): a verdict's root cause is the
        first failing one."""
        return [c.name for c in self.checks]

    def why_nothing_ran(self) -> str:
        """Why a run that collected the suite ran no check: no case to run, or every check deselected or skipped."""
        refused = len(self.refused_pairs())
        if not any(self.pairs_for(c) for c in self.checks):
            return (f"no (backend, case) pair to check: {len(self.skipped_cases)} of {len(self.cases)} cases are "
                    f"impossible layouts and {refused} (backend, case) layouts are refused by their engine or "
                    "unsized; fix the matrix (docs/matrices.md) or the backend's refusals")
        return "every conformance check was deselected or skipped (-k, -m, --deselect, skip marks)"

    def matrix_digest(self) -> str:
        h = hashlib.sha256()
        for m in self.matrices:
            h.update(Path(m.path).read_bytes())
        return h.hexdigest()

    def classify(self, backend: Backend, case: Case) -> PairPlan:
        """The lifecycle path a (backend, case) takes and the checks that apply, decided at collection.

        Constructs the pair's builders once, on the case's device as the lifecycle does, to ask their
        declarations, then drops them: the lifecycle makes its own.
        """
        key = (backend.name, case.id)
        plan = self._plans.get(key)
        if plan is None:
            with parts_on_device(self.tier)(backend, case) as construct:
                gate = None
                try:
                    parts = construct()
                    resolution = resolve_support(parts, engine_gate(backend.policy, case))
                    path, gate = (PROFILING if resolution.enabled else LEGACY), resolution.engine_gate
                except DeclarationError:
                    path, parts = LEGACY, []
                except Exception:  # noqa: BLE001 - every check runs and reports the error
                    path, parts = FACTORY_ERROR, []
                checks = frozenset(
                    [self._factory_error_check] if path == FACTORY_ERROR
                    else (c.name for c in self.checks if c.applies(path) and c.relevant(case, parts))
                )
            plan = self._plans[key] = PairPlan(path, checks, gate)
        return plan

    @property
    def _factory_error_check(self) -> str:
        """The one check a pair whose builders could not be made fails (its error, the author's frames): the support
        declaration, which such builders never gave; a registry without it, its first check."""
        names = [c.name for c in self.checks]
        return "support_declaration" if "support_declaration" in names else names[0]

    def refusal(self, backend: Backend, case: Case) -> str | None:
        """The engine's reason for refusing the pair's layout (``Backend.refuses_layout``), asked once."""
        key = (backend.name, case.id)
        if key not in self._refusals:
            self._refusals[key] = layout_refusal(backend, case)
        return self._refusals[key]

    def accepted_cases(self, backend: Backend) -> list[Case]:
        """The backend's matrix: the runnable cases its engine does not refuse."""
        return [c for c in self.runnable_cases if self.refusal(backend, c) is None]

    def refused_pairs(self) -> list[tuple[Backend, Case, str]]:
        """Every (backend, case) whose layout the backend's engine refuses, with the engine's reason, in run order."""
        if self._refused is None:
            self._refused = [(b, c, reason) for c in self.runnable_cases for b in self.backends
                             if (reason := self.refusal(b, c)) is not None]
        return self._refused

    def gated(self, backend: Backend) -> list[dict[str, str]]:
        """The cases of the backend's matrix its engine keeps on the legacy path although every builder opts in,
        each with the engine's reason (``EnginePolicy.gate``)."""
        return [{"case": c.id, "reason": gate} for c in self.accepted_cases(backend)
                if (gate := self.classify(backend, c).engine_gate) is not None]

    def planned(self, backend: Backend) -> dict[str, list[str]]:
        """{case id: the checks that apply} over the backend's whole matrix: what a complete run records."""
        return {c.id: sorted(self.classify(backend, c).checks) for c in self.accepted_cases(backend)}

    def pairs_for(self, check: Check) -> list[tuple[Backend, Case]]:
        """The (backend, case) pairs ``check`` applies to, in run order (case, then backend); every check's list is
        made in one pass over the matrix, the first time any is asked."""
        if self._pairs is None:
            pairs: dict[str, list[tuple[Backend, Case]]] = {}
            for case in self.runnable_cases:
                for backend in self.backends:
                    if self.refusal(backend, case) is None:
                        for name in self.classify(backend, case).checks:
                            pairs.setdefault(name, []).append((backend, case))
            self._pairs = pairs
        return self._pairs.get(check.name, [])

    def result_for(self, backend: Backend, case: Case) -> LifecycleResult:
        key = (backend.name, case.id)
        result = self._results.get(key)
        if result is None:
            if self.device_factory is None:
                result = run_lifecycle(backend, case, make_device)
                close_parts(result)  # the cache keeps records, not every case's workspaces
            else:
                result = run_lifecycle(backend, case, self.device_factory)
                self.device_factory.release(result)  # a real GPU cannot hold every cached case's memory
            self._results[key] = result
            if len(self._results) > RESULT_CACHE_SIZE:
                self._results.popitem(last=False)
        else:
            self._results.move_to_end(key)
        return result


SESSION_KEY = pytest.StashKey[KvprofileSession]()


def default_matrices() -> tuple[str, ...]:
    return (str(packaged_matrix("default")),)


def parts_on_device(tier: str) -> PartsOnDevice:
    """Where collection and inspection construct builders: on the CPU tier the case's simulated device (torch
    mode for a torch-mode backend, as its lifecycle runs); on the GPU tier the real GPU plain torch calls reach."""
    return plain_parts if tier == "gpu" else case_parts


def build_session(settings: Settings, hooked: Iterable[object], tier: str,
                  registry: Registry | None = None) -> KvprofileSession:
    """Load and validate everything once; raises MatrixError or BackendError with a precise message."""
    from pytest_kvprofile.lifecycle.resources import RESOURCE_KINDS

    matrices = load_matrices(settings.matrices or default_matrices())
    for matrix in matrices:
        for case in matrix.cases:
            for res in case.resources:
                if res.kind not in RESOURCE_KINDS:
                    raise MatrixError(matrix.path, "resources", f"unknown resource kind {res.kind!r} "
                                      f"(known: {', '.join(RESOURCE_KINDS)})")
    registry = builtin_registry() if registry is None else registry
    backends = [with_workspace_manager(b, settings.workspace_manager or b.policy.workspace_manager, registry)
                for b in resolve_backends(settings.backend_specs, hooked, registry=registry)]
    for backend in backends:
        check_requirements(backend)
    runnable = [c for m in matrices for c in m.cases if c.skip_reason is None]
    on_device = parts_on_device(tier)
    profiles = [_profile(b, runnable, on_device) for b in backends]
    profiles += [_profile(p.neutral_alone, runnable, on_device) for p in profiles if p.neutral_alone is not None]
    return KvprofileSession(settings, profiles, matrices, tier, registry)


_suite_checks: list[tuple[Check, ...]] = []  # the configured sessions' checks in this process, innermost last


def publish_checks(checks: tuple[Check, ...] | None) -> None:
    """The packaged suite makes one test function per check when pytest imports it, at collection, with no config at
    hand: the configured session publishes its registry's checks here (``None``: unconfigure withdraws them)."""
    if checks is None:
        if _suite_checks:
            _suite_checks.pop()
    else:
        _suite_checks.append(checks)


def suite_checks() -> tuple[Check, ...]:
    """The checks of the session configured last in this process, else the built-in ones."""
    return _suite_checks[-1] if _suite_checks else tuple(builtin_registry().checks)


def _profile(backend: Backend, runnable: list[Case], on_device: PartsOnDevice) -> BackendProfile:
    """The backend inspected on the first case its engine accepts (none: nothing to inspect), on that case's
    device."""
    first = next((c for c in runnable if layout_refusal(backend, c) is None), None)
    return BackendProfile(backend, {}, None) if first is None else inspect_backend(backend, first, on_device)


__all__ = ["SESSION_KEY", "KvprofileSession", "PairPlan", "Settings", "build_session", "publish_checks",
           "suite_checks"]
