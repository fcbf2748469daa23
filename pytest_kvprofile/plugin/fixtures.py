"""Public fixtures for a backend's own tests: the case, its device, the arena, builders and a lifecycle runner.

A backend repository writes ``def test_x(kvprofile_case, kvprofile_run): ...`` and gets one item per
case of the selected matrices, with the suite's case ids, on the CPU tier's simulated device or, with
``--kvprofile-gpu``, on the CUDA device. Names carry the ``kvprofile_`` prefix so they never clash
with a backend's own fixtures. The fixture table of docs/protocol.md documents each one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME, CheckOptions, checks_for
from pytest_kvprofile.contract.backends import Backend, EnginePolicy
from pytest_kvprofile.lifecycle.driver import make_device, run_lifecycle
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.plugin.session import SESSION_KEY, KvprofileSession
from pytest_kvprofile.registry import with_workspace_manager

if TYPE_CHECKING:
    from pytest_kvprofile.contract.device import Device
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.contract.workspace import ArenaManager, WorkspaceManager

CASE_ARG = "kvprofile_case"


def _state(config: pytest.Config) -> KvprofileSession:
    state = config.stash.get(SESSION_KEY, None)
    if state is None:
        pytest.fail("pytest-kvprofile is not configured (is the plugin disabled with -p no:kvprofile?)",
                    pytrace=False)
    return state


def case_params(state: KvprofileSession) -> list[object]:
    """One param per case of the selected matrices, in matrix order; impossible layouts and layouts the suite cannot
    size (``Case.unsized_reason``) skipped with their reason."""
    return [pytest.param(case, id=case.id, marks=_case_marks(case)) for case in state.cases]


def _case_marks(case: Case) -> list[pytest.MarkDecorator]:
    if case.skip_reason:
        return [pytest.mark.skip(reason=f"impossible layout: {case.skip_reason}")]
    if case.unsized_reason:
        return [pytest.mark.skip(reason=case.unsized_reason)]
    return []


@dataclass
class KvprofileRun:
    """One backend driven through the reference lifecycle on one case, with the suite's verdicts."""

    backend: Backend
    result: LifecycleResult
    options: CheckOptions

    def violations(self, *checks: str) -> dict[str, list[str]]:
        """{check: violations} for the named checks (default: every check of the run's path); empty lists pass."""
        wanted = [CHECKS_BY_NAME[name] for name in checks] if checks else [
            c for c in checks_for(self.result.path) if c.relevant(self.result.case, self.result.builders)]
        return {check.name: check.run(self.result, self.options) for check in wanted}

    def failures(self, *checks: str) -> dict[str, list[str]]:
        return {name: v for name, v in self.violations(*checks).items() if v}

    def assert_passes(self, *checks: str) -> None:
        """Fail the test with the suite's own message (rule, backend, case, every violation)."""
        failed = self.failures(*checks)
        if failed:
            parts = []
            for name, violations in failed.items():
                text = "\n".join(f"- {v}" for v in violations)
                parts.append(f"[{name}] {CHECKS_BY_NAME[name].rule}\n"
                             f"backend {self.backend.name}, case {self.result.case.id}:\n{text}")
            pytest.fail("\n".join(parts), pytrace=False)


def _as_backend(target: Backend | Callable[[Case], Iterable[Builder]] | Sequence[Builder], case: Case,
                torch_mode: bool, policy: EnginePolicy | None) -> Backend:
    """A Backend from a Backend, a ``make_builders(case)`` callable or a list of unused builder instances.

    Instances are deep-copied before the run, so the warmup-retry probe gets fresh, unused ones too.
    """
    if isinstance(target, Backend):
        return target
    if callable(target):
        return Backend(name=getattr(target, "__name__", "builders"), make_builders=target,
                       policy=policy or EnginePolicy(), torch_mode=torch_mode, origin="fixture")
    if isinstance(target, Sequence) and not isinstance(target, (str, bytes)):
        pristine = copy.deepcopy(list(target))
        torch_mode = torch_mode or any(getattr(b, "torch_mode", False) for b in pristine)
        names = "+".join(str(getattr(b, "name", type(b).__name__)) for b in pristine) or "no-builders"
        return Backend(name=names, make_builders=lambda c: copy.deepcopy(pristine), policy=policy or EnginePolicy(),
                       torch_mode=torch_mode, origin="fixture")
    raise TypeError(f"kvprofile_run takes a Backend, a make_builders(case) callable or a list of builders, "
                    f"not {type(target).__name__}")


@pytest.fixture
def kvprofile_device(request: pytest.FixtureRequest, kvprofile_case: Case) -> Iterator[Device]:
    """A fresh device for the case: the simulated GPU on the CPU tier, the CUDA device with ``--kvprofile-gpu``."""
    state = _state(request.config)
    factory = state.device_factory or make_device
    device = factory(kvprofile_case)
    yield device
    close = getattr(device, "close", None)
    if callable(close):
        close()


@pytest.fixture
def kvprofile_workspace_manager(request: pytest.FixtureRequest, kvprofile_case: Case,
                                kvprofile_device: Device) -> Iterator[WorkspaceManager | ArenaManager]:
    """A WorkspaceManager on the case's device with one arena per micro-batch of the case.

    Which one: the run's ``--kvprofile-workspace-manager`` (else ``harness``), or per test by indirect
    parametrization, ``@pytest.mark.parametrize("kvprofile_workspace_manager", ["vllm"], indirect=True)``:
    ``"vllm"`` is vLLM's own manager behind the same interface (``engines/vllm/workspace.py``; the test is skipped
    with the install command when vLLM is not installed).
    """
    state = _state(request.config)
    kind = getattr(request, "param", None) or state.settings.workspace_manager or "harness"
    entry = state.registry.managers.get(kind)
    if entry is None:
        raise pytest.UsageError(f"kvprofile_workspace_manager: unknown manager {kind!r} "
                                f"({' or '.join(state.registry.managers)})")
    problem = entry.unavailable()
    if problem is not None:
        pytest.skip(problem)
    manager = entry.plain(kvprofile_device, kvprofile_case.envelope.num_ubatches)
    yield manager
    manager.close()


@pytest.fixture
# Any: the tier's device, a SimDevice wherever SimulatedCuda serves it (the CPU tier)
def kvprofile_simulated_cuda(request: pytest.FixtureRequest, kvprofile_device: Any) -> Iterator[Device]:
    """Plain ``torch`` "cuda" calls served by the case's simulated device (CPU tier); the real device on the GPU tier.

    Yields the device, whose ledger attributes every tensor.
    """
    state = _state(request.config)
    if state.device_factory is not None:
        yield kvprofile_device
        return
    from pytest_kvprofile.memory.torch_mode import SimulatedCuda

    with SimulatedCuda(kvprofile_device):
        yield kvprofile_device


@pytest.fixture
def kvprofile_stub_builders(kvprofile_case: Case) -> list[Builder]:
    """Fresh builders of the built-in correct ``stub-flashinfer`` backend (the lifecycle adds the case's resources)."""
    from pytest_kvprofile.builtin.stubs import STUB_BACKENDS

    stub = next(b for b in STUB_BACKENDS if b.name == "stub-flashinfer")
    return list(stub.make_builders(kvprofile_case))


@pytest.fixture
def kvprofile_flashinfer_builders(request: pytest.FixtureRequest, kvprofile_case: Case) -> list[Builder]:
    """Builders made of real FlashInfer wrappers for the case, unused.

    CPU tier: the built-in ``flashinfer`` backend's builders, which run FlashInfer's own wrappers on the
    simulated GPU (``kvprofile_run`` serves their torch calls); MLA cases are skipped with the reason
    (FlashInfer's MLA planner is not served there). GPU tier: the same builders on the CUDA device, whose warmup
    checks FlashInfer's kernels against the float32 reference; MLA cases are skipped there too.
    """
    if kvprofile_case.model.attention == "mla":
        pytest.skip("kvprofile_flashinfer_builders: MLA runs FlashInfer's MLA wrapper, which these builders do not "
                    "build (and the CPU tier's simulated GPU does not serve)")
    from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS

    return list(REAL_FLASHINFER_BACKENDS[0].make_builders(kvprofile_case))


@pytest.fixture
def kvprofile_run(request: pytest.FixtureRequest, kvprofile_case: Case) -> Callable[..., KvprofileRun]:
    """``kvprofile_run(backend_or_builders, *, torch_mode=False, policy=None, workspace_manager=None)`` drives the
    reference lifecycle (``workspace_manager``: ``"harness"`` or ``"vllm"``; default: the run's option, else the
    backend's own).

    Takes a Backend, a ``make_builders(case)`` callable or a list of unused builders (a builder with
    ``torch_mode = True`` turns torch mode on); runs on a fresh device of the tier (each call its own);
    returns a :class:`KvprofileRun` with ``violations()``, ``failures()`` and ``assert_passes()``.
    """
    state = _state(request.config)
    factory = state.device_factory or make_device

    def run(target: Backend | Callable[[Case], Iterable[Builder]] | Sequence[Builder], *, torch_mode: bool = False,
            policy: EnginePolicy | None = None, workspace_manager: str | None = None) -> KvprofileRun:
        backend = _as_backend(target, kvprofile_case, torch_mode, policy)
        backend = with_workspace_manager(backend, workspace_manager or state.settings.workspace_manager
                                         or backend.policy.workspace_manager)
        result = run_lifecycle(backend, kvprofile_case, factory)
        return KvprofileRun(backend, result, state.check_options)

    return run
