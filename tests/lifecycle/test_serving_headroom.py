"""What ``build()`` frees before it returns is transient after KV sizing too (issue 37, point 8): a runner builds
a step's metadata before its forward, so those bytes never coexist with the step's activations and fit in the
headroom the closing measurement kept for the profiled activation peak. What a build keeps is another matter."""

from __future__ import annotations

from typing import Any

from pytest_kvprofile import Backend, run_lifecycle
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME, failing_checks
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.units import MiB

SCRATCH = 2 * MiB


class BuildScratch(FlashInferLikeBuilder):
    """Correct: every build makes 2 MiB of plan scratch and frees it before it returns."""

    name = "build-scratch"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        scratch = ctx.allocate(SCRATCH, "plan scratch")
        super().build(ctx, batch)
        ctx.free(scratch)


class BuildKeepsScratch(BuildScratch):
    """Bug: serving builds keep their scratch (a new one per step), after KV sizing."""

    name = "build-keeps-scratch"

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        FlashInferLikeBuilder.build(self, ctx, batch)
        if ctx.phase == "serving":
            self.kept = [*getattr(self, "kept", []), ctx.allocate(SCRATCH, "plan scratch")]


def _run(cls: type) -> Any:
    case = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98")
    return run_lifecycle(Backend(name=cls.name, make_builders=lambda c: [cls(c)]), case)


def test_build_scratch_freed_before_the_build_returns_is_within_the_activation_headroom():
    result = _run(BuildScratch)
    assert result.budget is not None and result.budget.peak_activation > SCRATCH
    assert CHECKS_BY_NAME["no_post_kv_overrun"].run(result) == [] and not failing_checks(result)


def test_build_scratch_kept_after_kv_sizing_is_refused():
    assert "persistent_memory_visible_at_closing" in failing_checks(_run(BuildKeepsScratch))
