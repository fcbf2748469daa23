"""``capture_retryable`` (issue 51, item 1): the engine's CUDA-graph capture failed at each distinct allocation site a
builder has in it, reset and captured again. Each way to break the rule is refused, a correct builder passes, and a
backend that allocates nothing in capture is not probed (torch mode's 07g and its twin: tests/lifecycle/
test_field_incidents.py)."""

from __future__ import annotations

import pytest

from pytest_kvprofile.builtin.stubs import STUB_BACKENDS, FlashInferLikeBuilder
from pytest_kvprofile.checks.capture import check_capture_retryable
from pytest_kvprofile.checks.catalog import CheckOptions
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.probes import capture_plan
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.memory.device import DeviceOutOfMemory
from pytest_kvprofile.units import KiB

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None)
STEP = 256 * KiB


class _CapturedSteps(FlashInferLikeBuilder):
    """Keeps two buffers per captured step, made in capture (``steps``); what each variant does with a failure."""

    def __init__(self, case):
        super().__init__(case)
        self.steps: dict[tuple[int, int], list[object]] = {}

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if ctx.capturing and batch.cuda_graph:
            self.step(ctx, (batch.num_reqs, batch.ubatch))

    def step(self, ctx: BuilderContext, key: tuple[int, int]) -> None:
        made = [ctx.allocate(STEP, "step indices")]
        try:
            made.append(ctx.allocate(STEP // 2, "step lengths"))
        except BaseException:
            ctx.free(made[0])
            raise
        self.steps[key] = made


class Correct(_CapturedSteps):
    """Frees what a failed step made; a retried step is built whole (its buffers made again over the old)."""

    def step(self, ctx: BuilderContext, key: tuple[int, int]) -> None:
        for buf in self.steps.pop(key, []):
            ctx.free(buf)
        super().step(ctx, key)


class Swallows(_CapturedSteps):
    def step(self, ctx: BuilderContext, key: tuple[int, int]) -> None:
        try:
            super().step(ctx, key)
        except DeviceOutOfMemory:
            pass  # the bug: the graph is captured without the step's buffers


class Replaces(_CapturedSteps):
    def step(self, ctx: BuilderContext, key: tuple[int, int]) -> None:
        try:
            super().step(ctx, key)
        except DeviceOutOfMemory:
            raise RuntimeError("could not plan the captured step")  # noqa: B904 - the bug: the first error replaced


class HalfBuilt(_CapturedSteps):
    def step(self, ctx: BuilderContext, key: tuple[int, int]) -> None:
        if key in self.steps:
            return  # the bug: a step the failed attempt began counts as built
        self.steps[key] = made = []
        made.append(ctx.allocate(STEP, "step indices"))
        made.append(ctx.allocate(STEP // 2, "step lengths"))


class Leaks(_CapturedSteps):
    def step(self, ctx: BuilderContext, key: tuple[int, int]) -> None:
        self.steps[key] = made = []  # the bug: the retry makes the step again beside the one the failure kept
        made.append(ctx.allocate(STEP, "step indices"))
        made.append(ctx.allocate(STEP // 2, "step lengths"))


def _judge(cls: type) -> tuple[tuple[str, ...], list[str]]:
    backend = Backend(name=f"capture-{cls.__name__.lower()}", make_builders=lambda case: [cls(case)])
    result = run_lifecycle(backend, CASE)
    try:
        return capture_plan(result), check_capture_retryable(result, CheckOptions())
    finally:
        close_parts(result)


def test_a_builder_that_frees_a_failed_step_passes():
    plan, found = _judge(Correct)
    assert plan == ("flashinfer",) and found == []


@pytest.mark.parametrize(("cls", "needles"), [
    (Swallows, ("went on capturing", "swallowed", "phase 'capture'")),
    (Replaces, ("RuntimeError: could not plan the captured step", "the first error wins")),
    (HalfBuilt, ("missing 'step indices' 0.25 MiB (262144 bytes)", "half-built", "against 6.75 MiB (7077888 bytes)")),
    (Leaks, ("extra 'step indices' 0.25 MiB (262144 bytes)", "the engine captured again", "graph_pool_1")),
])
def test_each_way_to_break_the_rule_is_refused(cls, needles):
    plan, found = _judge(cls)
    assert plan == ("flashinfer",) and found, found
    text = " ".join(found)
    assert all(n in text for n in needles), (needles, text)


@pytest.mark.parametrize("backend", STUB_BACKENDS, ids=[b.name for b in STUB_BACKENDS])
def test_a_backend_that_allocates_nothing_in_capture_is_not_probed(backend):
    result = run_lifecycle(backend, CASE)
    close_parts(result)
    assert capture_plan(result) == ()
