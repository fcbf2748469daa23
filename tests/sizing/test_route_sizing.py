"""Torch mode: the routes FlashInfer's real wrappers ``plan()`` are the routes sized (issue 21.2).

A real-FlashInfer builder whose prefill goes to trtllm-gen plans only its decode wrappers, into an arena view
sized for decode alone: it passes, with the decode sub-routes reported as sized. Its twin plans prefill natively
into the same view: the planner's prefill need does not fit, and the plan is caught where it happened. A builder
whose wrappers plan into float buffers of its own has them counted in what it reserves (issue 22.4).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile.builtin.flashinfer_real import RealFlashInferBuilder
from pytest_kvprofile.checks.catalog import CheckOptions, WasteBudget, failing_checks
from pytest_kvprofile.checks.workspace import case_waste, check_workspace_covers_planner
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.engines.vllm.facts import VLLM_DEFAULT_FLOAT_BYTES
from pytest_kvprofile.lifecycle.driver import run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing.case import need_for_planned, need_for_routes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # FlashInfer's cutlass-dsl imports
CASE = "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"


class NativeDecodeRealBuilder(RealFlashInferBuilder):
    """Decode on FlashInfer's FA2 wrappers, sized for decode alone; prefill goes to trtllm-gen (not planned here)."""

    name = "flashinfer-native-decode"

    def float_bytes(self) -> int:
        return need_for_routes(self.case, ("decode",))[0]

    def _prime(self, slots: list[Any]) -> None:
        reqs = self._max_reqs()
        for slot in slots:
            self._plan(slot, slot.decode, "decode", *self._lens(Batch("decode", reqs, reqs * (1 + self.case.mtp))))

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        if batch.kind == "decode":
            super().build(ctx, batch)


class PrefillIntoDecodeViewBuilder(NativeDecodeRealBuilder):
    """The buggy twin: its prefill wrapper also plans natively, into the decode-sized view."""

    name = "flashinfer-prefill-into-decode-view"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        RealFlashInferBuilder.build(self, ctx, batch)


def _backend(cls: type) -> Backend:
    return Backend(name=cls.name, make_builders=lambda case: [cls(case)], torch_mode=True)


@pytest.fixture(scope="module")
def case():
    return next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == CASE)


def test_a_real_builder_planning_decode_alone_is_sized_for_decode(case):
    result = run_lifecycle(_backend(NativeDecodeRealBuilder), case)
    assert {p.route for p in result.plans} == {"decode"}
    assert failing_checks(result) == {}
    waste = case_waste(result).builders[0]
    assert waste.sized == ("decode_tc", "decode_tc_cuda_graph") and waste.trtllm == ("prefill",)
    assert waste.float_waste == 0


def test_a_real_prefill_plan_into_a_decode_sized_view_fails(case):
    result = run_lifecycle(_backend(PrefillIntoDecodeViewBuilder), case)
    violations = check_workspace_covers_planner(result, CheckOptions())
    assert any("its prefill wrappers (without CUDA graphs) plan() into" in v and "short by" in v and "float-arena" in v
               for v in violations), violations


class PrivateFloatRealBuilder(RealFlashInferBuilder):
    """Issue 22.4 with FlashInfer's own wrappers: besides the arena view, each micro-batch's wrappers plan into a
    float workspace of the builder's own, vLLM's 394 MiB default, made with plain torch inside the window. No role
    is set: the harness sees the ``plan()`` calls land in it."""

    name = "flashinfer-private-float"

    def _new_slot(self, ctx: BuilderContext, ubatch: int) -> Any:
        import torch

        slot = super()._new_slot(ctx, ubatch)
        own = torch.empty(VLLM_DEFAULT_FLOAT_BYTES, dtype=torch.uint8, device="cuda")
        for _, w in slot.wrappers():
            w.reset_workspace_buffer(own, w._int_workspace_buffer)
        return slot


def test_private_float_buffers_real_wrappers_plan_into_count(case):
    result = run_lifecycle(_backend(PrivateFloatRealBuilder), case)
    waste = case_waste(result).builders[0]
    assert waste.private_bytes == 2 * VLLM_DEFAULT_FLOAT_BYTES
    # FlashInfer's prefill wrapper here plans without CUDA graphs (observed): the need is eager prefill's and decode's
    eager = need_for_planned(case, [("prefill", False), ("decode", None)])[0]
    assert "prefill_cuda_graph" not in waste.sized and waste.need_per_ubatch == eager
    assert waste.float_waste == waste.private_bytes + waste.arena_bytes - 2 * eager
    assert check_workspace_covers_planner(result, CheckOptions()) == []  # a cost: KV sizing saw it
    over = check_workspace_covers_planner(result, CheckOptions(max_waste=WasteBudget(64.0)))
    assert len(over) == 1 and "own buffers 788.00 MiB" in over[0], over
