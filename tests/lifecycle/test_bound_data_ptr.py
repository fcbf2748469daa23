"""``bound_workspaces()`` may report a tensor's ``data_ptr()`` (issue 21, point 5).

In torch mode a simulated "cuda" tensor lives in host memory, so ``data_ptr()`` is a host address while the
arena and the ledger speak simulated addresses. The driver maps a pointer inside a simulated storage to its
allocation (view offsets included); on a real GPU ``data_ptr()`` already is the device pointer.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.stubs import TorchFlashInferLikeBuilder
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import BoundWorkspace, BuilderContext
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix
from pytest_kvprofile.memory.device import SimDevice
from pytest_kvprofile.memory.torch_mode import SimulatedCuda
from pytest_kvprofile.units import GiB, MiB

OFFSET = 4096  # the decode wrapper plans into its view from this byte on: a pointer inside the storage


class DataPtrBuilder(TorchFlashInferLikeBuilder):
    """Correct: plans each wrapper into its own micro-batch's arena view and reports it from ``data_ptr()``."""

    name = "flashinfer-data-ptr"

    def __init__(self, case: Any):
        super().__init__(case)
        self.float_tensors: dict[int, Any] = {}

    def _float_view(self, ctx: BuilderContext, ubatch: int) -> Any:
        view = super()._float_view(ctx, ubatch)
        self.float_tensors[ubatch] = view.tensor
        return view

    def bound_workspaces(self) -> list[BoundWorkspace]:
        out = []
        for route, ub in self.wrappers:
            t = self.float_tensors[ub][OFFSET:] if route == "decode" else self.float_tensors[ub]
            out.append(BoundWorkspace(ub, f"{route} float workspace", t.data_ptr(), t.numel()))
        return out


CORRECT = Backend(name="data-ptr", make_builders=lambda c: [DataPtrBuilder(c)], origin="test", torch_mode=True)
ALIAS = next(b for b in MUTANT_BACKENDS if b.name == "mutant-05c-torch-data-ptr-alias")


def _cases() -> list[Any]:
    return [c for c in load_matrix("matrices/ci.yaml").cases if c.skip_reason is None][:2]


def test_a_builder_reporting_data_ptr_passes_and_its_pointers_are_the_ledgers():
    for case in _cases():
        result = run_lifecycle(CORRECT, case)
        close_parts(result)
        assert failing_checks(result) == {}
        serving = result.phase("serving")
        arenas = {v.ubatch: v for v in serving.arena}
        assert serving.bound and all(arenas[b.workspace.ubatch].ptr <= b.workspace.ptr < arenas[b.workspace.ubatch].end
                                     for b in serving.bound)


def test_its_twin_planning_into_another_micro_batchs_tensor_is_refused():
    for case in _cases():
        failed = failing_checks(run_lifecycle(ALIAS, case))
        assert "inside ubatch 0's arena" in failed["ubatch_arenas_disjoint"][0]


def test_simulated_ptr_maps_a_storage_and_a_view_and_nothing_else():
    dev = SimDevice(name="L40S", total_memory=4 * GiB, num_sm=142)
    with SimulatedCuda(dev) as sim:
        t = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        alloc = sim.allocation_of(t)
        assert sim.simulated_ptr(t.data_ptr(), MiB) == alloc.ptr
        assert sim.simulated_ptr(t[OFFSET:].data_ptr(), MiB - OFFSET) == alloc.ptr + OFFSET
        assert sim.simulated_ptr(t.data_ptr(), MiB + 1) is None  # past the storage
        assert sim.simulated_ptr(torch.empty(16).data_ptr(), 64) is None  # a plain host tensor
