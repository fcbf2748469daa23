"""pytest-kvprofile: prove that an attention backend's persistent memory is visible to KV-cache sizing.

The public API is importable without pytest: the contract (support declaration, lease, workspace
manager, builder protocol), the lifecycle driver and its checks, the matrix loader, and the backend
registry. Heavy modules (torch, flashinfer, the sizing oracle) load lazily.
"""

from __future__ import annotations

from pytest_kvprofile.contract.backends import Backend, BackendError
from pytest_kvprofile.contract.lease import Lease, LeaseReleasedError
from pytest_kvprofile.lifecycle.driver import EnginePolicy, LifecycleResult, run_lifecycle
from pytest_kvprofile.matrix.schema import Case, Envelope, MatrixError, load_matrix
from pytest_kvprofile.matrix.models import ModelSpec
from pytest_kvprofile.contract.protocol import Batch, BoundWorkspace, BuilderContext, WorkspaceDeclaration
from pytest_kvprofile.contract.support import DeclarationError, ProfilingSupport, SupportResolution, declared_support, resolve_support
from pytest_kvprofile.contract.workspace import ArenaView, WorkspaceLockedError, WorkspaceManager

__version__ = "0.1.0"

__all__ = [
    "ArenaView",
    "Backend",
    "BackendError",
    "Batch",
    "BoundWorkspace",
    "BuilderContext",
    "Case",
    "DeclarationError",
    "EnginePolicy",
    "Envelope",
    "Lease",
    "LeaseReleasedError",
    "LifecycleResult",
    "MatrixError",
    "ModelSpec",
    "ProfilingSupport",
    "SupportResolution",
    "WorkspaceDeclaration",
    "WorkspaceLockedError",
    "WorkspaceManager",
    "__version__",
    "declared_support",
    "load_matrix",
    "resolve_support",
    "run_lifecycle",
]
