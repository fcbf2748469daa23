"""The persistent resources a matrix names, which the reference engine carries beside a backend's builders.

Matrices name resources by kind (``resources:`` with a ``when:`` filter); :data:`RESOURCE_KINDS` builds them and
:func:`case_resources` gives a case its own. The one kind is a DMA output workspace (correct); its buggy variants
are built-in mutants (``builtin/resources.py``, bug class 13). Why in the engine: a backend that brings no
resources of its own (``make_resources``) runs beside the case's, so the engine builds them without importing
any backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.contract.support import ProfilingSupport

if TYPE_CHECKING:
    from pytest_kvprofile.contract.device import Allocation
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.resources import PersistentResource
    from pytest_kvprofile.matrix.cases import Case, YamlValue


class DMAOutputWorkspace:
    """A PCIe ring-DMA default-output workspace of exact capacity, visible to profiling (correct).

    Sized from its tensor shapes: one output row of ``hidden_size`` per token, for ``max_tokens``.
    It keeps the buffer for life; its lease only vouches that it existed at the closing measurement.
    """

    name = "dma-output-workspace"

    def __init__(self, case: Case, params: dict[str, YamlValue]):
        self.case = case
        self.capacity_bytes = int(params.get("max_tokens", 8192)) * int(params.get("hidden_size", 4096)) * int(
            params.get("dtype_bytes", 2)
        )
        self.buffer: Allocation | None = None

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def _allocate(self, ctx: BuilderContext) -> None:
        if self.buffer is None:
            self.buffer = ctx.allocate(self.capacity_bytes, "dma output workspace")

    def materialize(self, ctx: BuilderContext) -> Lease:
        self._allocate(ctx)
        return ctx.lease([self.buffer])

    def use(self, ctx: BuilderContext, batch: Batch) -> None:
        self._allocate(ctx)


RESOURCE_KINDS: dict[str, Callable[[Case, dict[str, YamlValue]], PersistentResource]] = {
    "dma-output-workspace": DMAOutputWorkspace}
DEFAULT_PARAMS = {"max_tokens": 8192, "hidden_size": 4096, "dtype_bytes": 2}


def case_resources(case: Case) -> list[PersistentResource]:
    """The resources a case carries (from its matrix), built from :data:`RESOURCE_KINDS`."""
    out = []
    for res in case.resources:
        factory = RESOURCE_KINDS.get(res.kind)
        if factory is None:
            raise KeyError(f"unknown resource kind {res.kind!r} (known: {', '.join(RESOURCE_KINDS)})")
        out.append(factory(case, dict(res.params)))
    return out
