"""pytest-kvprofile: prove that an attention backend's persistent memory is visible to KV-cache sizing.

The public API is importable without pytest and without initializing CUDA: the contract (support
declaration, lease, workspace manager, builder protocol, backends), the matrix, the lifecycle and its
checks, the simulated device and the sizing entry point. the "Public API" table of `docs/reference.md` lists it;
heavy modules (torch, flashinfer, the sizing oracle's compiled library) load lazily.
"""

from __future__ import annotations

from pytest_kvprofile.checks.catalog import CHECKS, Check, CheckOptions, failing_checks
from pytest_kvprofile.contract.backends import Backend, BackendError, EnginePolicy, KvSizingMode, Provenance
from pytest_kvprofile.contract.budget import BudgetArithmetic, BudgetTerm, EngineTerms
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.contract.lease import Lease, LeaseReleasedError
from pytest_kvprofile.contract.protocol import (
    Batch,
    BoundWorkspace,
    Builder,
    BuilderContext,
    ProfilingBuilder,
    WorkspaceDeclaration,
)
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import (
    DeclarationError,
    ProfilingSupport,
    SupportResolution,
    declared_support,
    resolve_support,
)
from pytest_kvprofile.contract.workspace import (
    ArenaView,
    ManagerKind,
    WorkspaceLockedError,
    WorkspaceManager,
)
from pytest_kvprofile.lifecycle.driver import make_device, run_lifecycle
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.matrix import engine_facts as _engine_facts
from pytest_kvprofile.matrix.cases import Case, DecodeCapture, Envelope
from pytest_kvprofile.matrix.gpus import GpuSpec, lookup_gpu
from pytest_kvprofile.matrix.models import ModelSpec
from pytest_kvprofile.matrix.schema import MatrixError, load_matrix, packaged_matrix
from pytest_kvprofile.memory.device import DeviceOutOfMemory, SimDevice
from pytest_kvprofile.memory.simulated_gpu import simulated_gpu

__version__ = "0.1.0"


def _register_builtin_engines() -> None:
    """The package's own engines' facts, registered through their hooks, for a program that runs without pytest."""
    from pytest_kvprofile.registry import builtin_registry

    builtin_registry()


_engine_facts.set_fallback_registration(_register_builtin_engines)

__all__ = [
    "CHECKS",
    "ArenaView",
    "Backend",
    "BackendError",
    "Batch",
    "BoundWorkspace",
    "BudgetArithmetic",
    "BudgetTerm",
    "Builder",
    "BuilderContext",
    "Case",
    "Check",
    "CheckOptions",
    "DecodeCapture",
    "DeclarationError",
    "Device",
    "DeviceOutOfMemory",
    "EnginePolicy",
    "EngineTerms",
    "Envelope",
    "GpuSpec",
    "KvSizingMode",
    "Lease",
    "LeaseReleasedError",
    "LifecycleResult",
    "MatrixError",
    "ModelSpec",
    "ProfilingBuilder",
    "ProfilingSupport",
    "Provenance",
    "Role",
    "SimDevice",
    "SupportResolution",
    "WorkspaceDeclaration",
    "WorkspaceLockedError",
    "ManagerKind",
    "WorkspaceManager",
    "__version__",
    "declared_support",
    "failing_checks",
    "load_matrix",
    "lookup_gpu",
    "make_device",
    "packaged_matrix",
    "resolve_support",
    "run_lifecycle",
    "simulated_gpu",
]
