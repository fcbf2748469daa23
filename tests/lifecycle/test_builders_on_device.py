"""Builders are constructed on the case's simulated device: a torch-mode builder that allocates in
``__init__`` (as engines' metadata builders do) works on a CPU-only torch, and what it allocates is
attributed to it, in phase ``setup``, and judged like any other persistent memory."""

from __future__ import annotations

import torch

from pytest_kvprofile import (
    Backend,
    ProfilingSupport,
    WorkspaceDeclaration,
    run_lifecycle,
)
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing import for_case

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90")


class AllocatesInInit:
    name = "eager-init"

    def __init__(self, case):
        self.case = case
        self.table = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda")  # kept for life

    def get_persistent_workspace_memory_profiling_support(self):
        return ProfilingSupport.REQUIRED

    def declared_workspace(self, case):
        return WorkspaceDeclaration(for_case(case).float_bytes, 8 << 20)

    def reserve_persistent_workspace(self, ctx):
        return ctx.lease(())


class GrowsAfterKvSizing(AllocatesInInit):
    """Constructed on the device too, but then grows its table lazily on the first real plan."""

    name = "lazy-table"

    def build(self, ctx, batch):
        if self.table.numel() < 6 << 20 and not ctx.dummy:
            self.table = torch.zeros(6 << 20, dtype=torch.uint8, device="cuda")


def _run(cls):
    return run_lifecycle(Backend(name=cls.name, make_builders=lambda c: [cls(c)], torch_mode=True), CASE)


def test_allocations_in_init_belong_to_the_builder_in_setup():
    result = _run(AllocatesInInit)
    assert not result.errors, result.errors
    mine = [a for a in result.allocations if a.owner == "eager-init"]
    assert [(a.phase, a.tag, a.nbytes) for a in mine] == [("setup", "__init__", 3 << 20)]
    assert failing_checks(result) == {}


def test_what_an_init_table_becomes_after_kv_sizing_is_judged():
    failures = failing_checks(_run(GrowsAfterKvSizing))
    assert "persistent_memory_visible_at_closing" in failures
    assert "lazy-table" in failures["persistent_memory_visible_at_closing"][0]
