"""The typed seams: the builder and resource protocols, the context's engine, and the one record of a check's outcome.

Read from the source with ``ast`` where the claim is about the code's shape (what a module imports, what it names).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest_kvprofile
from pytest_kvprofile.checks.base import CheckDetails, CheckOutcome
from pytest_kvprofile.checks.catalog import CHECKS
from pytest_kvprofile.contract.protocol import BuilderContext
from pytest_kvprofile.memory.device import SimDevice

PACKAGE = Path(pytest_kvprofile.__file__).resolve().parent


def test_a_record_round_trips_through_json_and_leaves_absent_fields_out():
    bare = CheckOutcome("no_post_kv_overrun", "b", "c")
    assert bare.to_json() == {"check": "no_post_kv_overrun", "backend": "b", "case": "c"}
    full = CheckOutcome("no_post_kv_overrun", "b", "c", CheckDetails(budget={"kv_tokens": 3, "case": "c"}),
                        message="", nodeid="n", outcome="failed")
    data = json.loads(json.dumps(full.to_json()))  # what xdist and the report carry
    assert data == {"check": "no_post_kv_overrun", "backend": "b", "case": "c", "budget": {"kv_tokens": 3, "case": "c"},
                    "message": "", "nodeid": "n", "outcome": "failed"}
    assert CheckOutcome.from_json(data) == full
    assert CheckOutcome.from_json(bare.to_json()) == bare


def test_the_packaged_suite_names_no_check():
    """What a check adds to its record is the check's own (``Check.details``), not the suite's special case."""
    source = (PACKAGE / "suite" / "test_conformance.py").read_text()
    strings = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    named = {c.name for c in CHECKS if any(c.name in s for s in strings)}
    assert not named, f"the suite special-cases {named}"


def test_the_checks_with_report_details_are_the_ones_the_report_reads():
    with_details = {c.name for c in CHECKS if c.details is not CHECKS[0].details}
    assert with_details == {"no_post_kv_overrun", "workspace_covers_planner", "legacy_path_unchanged",
                            "reservation_exception_safe"}


def test_the_contract_does_not_reach_into_the_lifecycle():
    """The context is typed against ``BuilderHost``; ``contract/`` imports nothing of ``lifecycle/``, not even for
    type checking."""
    for path in (PACKAGE / "contract").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("pytest_kvprofile.lifecycle"), (path.name, node.module)


class _Host:
    """A BuilderHost that is not the driver: the context needs nothing else of the engine."""

    def __init__(self, case):
        self.case = case
        self.device = SimDevice(name="sim", total_memory=1 << 30)
        self.manager = None
        self.in_window = True
        self.in_dummy_forward = False
        self.noted = []

    def arena_view(self, owner, nbytes, ubatch, route):
        return (owner, nbytes, ubatch, route)

    def note_plan(self, owner, target):
        self.noted.append((owner, target))


def test_a_context_works_on_any_builder_host():
    host = _Host(case=None)
    ctx = BuilderContext(host, "b")
    alloc = ctx.allocate(4096, "t")
    assert (alloc.owner, alloc.tag, alloc.phase) == ("b", "t", ctx.phase)
    assert ctx.profiling and not ctx.dummy and not ctx.capturing
    assert ctx.get_workspace(1024, 1, route="decode") == ("b", 1024, 1, "decode")
    ctx.plan_into(alloc)
    assert host.noted == [("b", alloc)]
    ctx.free(alloc)
    assert not alloc.alive


def test_a_device_keeps_what_it_needs_of_an_allocation_off_the_record():
    """The allocator's block lives in the device's side table: the ledger record carries its fields only, and a
    freed record lets the block go."""
    import dataclasses

    dev = SimDevice(name="t", total_memory=1 << 30)
    alloc = dev.allocate(1 << 20, owner="o", tag="t")
    assert set(vars(alloc)) == {f.name for f in dataclasses.fields(alloc)}
    assert dev._blocks[alloc.id].ptr == alloc.ptr
    dev.free(alloc)
    assert alloc.id not in dev._blocks and dev.memory_allocated() == 0


def test_both_arena_managers_answer_everything_the_protocol_names():
    """``ArenaManager`` is what the driver reads of the harness's manager and of vLLM's; neither is probed with
    getattr, so each must answer every member (vLLM's class is made on vLLM's import: read from its source)."""
    from pytest_kvprofile.contract import workspace
    from pytest_kvprofile.lifecycle.driver import RecordingWorkspaceManager

    members = {n for n in vars(workspace.ArenaManager) if not n.startswith("_")} | set(
        workspace.ArenaManager.__annotations__)
    assert {"get_workspace", "stale_since", "release", "locked", "retired"} <= members
    harness = RecordingWorkspaceManager.__new__(RecordingWorkspaceManager)
    harness.__dict__.update(num_ubatches=1, alignment=256, retired={}, locked=False)
    assert all(hasattr(harness, m) for m in members), sorted(m for m in members if not hasattr(harness, m))
    vllm_source = (PACKAGE / "engines" / "vllm" / "workspace.py").read_text()
    defined = {n.name for n in ast.walk(ast.parse(vllm_source)) if isinstance(n, ast.FunctionDef)}
    targets = [t for n in ast.walk(ast.parse(vllm_source)) if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    defined |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    assert members <= defined | {"get_workspace"}, sorted(members - defined)  # get_workspace: the driver's mixin
