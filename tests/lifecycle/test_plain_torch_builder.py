"""The realism hold-out: a builder written only against plain PyTorch runs through the lifecycle.

Nothing in these builders knows the harness: they call ``torch.empty(..., device="cuda")`` on a
CPU-only torch build, and the simulated device serves, attributes and frees those tensors.
"""

import pytest
import torch

from pytest_kvprofile import Backend, Lease, ProfilingSupport, WorkspaceDeclaration, run_lifecycle
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.units import MiB


class TorchWrapper:
    """Like a FlashInfer wrapper: an 8 MiB int workspace on the device and a pinned host mirror."""

    def __init__(self):
        self.int_workspace = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        self.pinned = torch.empty(8 * MiB, dtype=torch.uint8, pin_memory=True)


class PlainTorchBuilder:
    name = "plain-torch"

    def __init__(self, case):
        self.wrapper = None

    def get_persistent_workspace_memory_profiling_support(self):
        return ProfilingSupport.REQUIRED

    def declared_workspace(self, case):
        return WorkspaceDeclaration(float_bytes=0, int_bytes=8 * MiB)

    def reserve_persistent_workspace(self, ctx):
        self.wrapper = TorchWrapper()

        def drop():
            self.wrapper = None

        return Lease(self.name, [self.wrapper], on_release=drop)

    def rebind(self, ctx):
        if self.wrapper is None:
            self.wrapper = TorchWrapper()

    def build(self, ctx, batch):
        if self.wrapper is None:
            self.wrapper = TorchWrapper()
        scratch = torch.zeros(1024, device="cuda")
        del scratch


class LazyPlainTorchBuilder(PlainTorchBuilder):
    def reserve_persistent_workspace(self, ctx):
        return Lease(self.name, [])


@pytest.fixture(scope="module")
def case():
    return next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98")


def backend(cls):
    return Backend(name=cls.__name__, make_builders=lambda case: [cls(case)], torch_mode=True)


@pytest.fixture(scope="module")
def plain_result(case):
    """One lifecycle of the plain builder, read by both tests."""
    return run_lifecycle(backend(PlainTorchBuilder), case)


def test_plain_torch_allocations_appear_in_the_ledger_with_sizes_owners_and_phases(plain_result):
    result = plain_result
    assert not result.errors, result.errors
    mine = [a for a in result.allocations if a.owner == "plain-torch"]
    reserved = [a for a in mine if a.phase == "reservation"]
    assert sorted((a.kind, a.nbytes) for a in reserved) == [("device", 8 * MiB), ("pinned_host", 8 * MiB)]
    assert all(a.freed_phase == "lease_release" for a in reserved), "dropping the last reference frees them"
    rebound = [a for a in mine if a.phase == "rebind"]
    assert [a.nbytes for a in rebound if a.kind == "device"] == [8 * MiB]
    assert any(a.nbytes == 4096 and a.phase == "serving" and a.freed_phase == "serving" for a in mine)
    assert torch.cuda.is_available() is False, "the mode restored torch.cuda after the run"


def test_plain_torch_builder_passes_and_its_lazy_twin_is_caught(plain_result, case):
    assert "persistent_memory_visible_at_closing" not in failing_checks(plain_result)
    failed = failing_checks(run_lifecycle(backend(LazyPlainTorchBuilder), case))
    message = failed["persistent_memory_visible_at_closing"][0]
    assert "plain-torch" in message and "8.00 MiB" in message and "rebind" in message
