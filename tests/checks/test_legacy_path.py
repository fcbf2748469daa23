"""``legacy_path_unchanged`` reads the whole serving run: a legacy-path backend that raises after the profiling
window (the released vLLM builder planning a query its kernels refuse, in capture) fails it, instead of every check
that ran before the error passing and its post-KV cost read from a run that never served. Running out of device
memory after KV sizing is different: it is the legacy path's own cost (what KV sizing never saw), reported in bytes
and KV tokens and never refused (DESIGN section 8), as vLLM's released builder does at gmu 0.98 on the L40S."""

from __future__ import annotations

import pytest

from pytest_kvprofile.builtin.stubs import UntaughtBuilder
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.lifecycle.driver import run_lifecycle
from pytest_kvprofile.lifecycle.phases import CAPTURE, SERVING
from pytest_kvprofile.lifecycle.record import LEGACY
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None)


def _raising_in(phase: str) -> Backend:
    class RaisesLate(UntaughtBuilder):
        def build(self, ctx, batch):  # type: ignore[no-untyped-def]
            if ctx.phase == phase:
                raise NotImplementedError(f"this kernel refuses the batch planned in {phase}")
            return super().build(ctx, batch)

    return Backend(name=f"raises-in-{phase}", make_builders=lambda case: [RaisesLate(case)], origin="test")


def test_the_correct_legacy_stub_passes():
    result = run_lifecycle(Backend(name="u", make_builders=lambda case: [UntaughtBuilder(case)]), CASE)
    assert result.path == LEGACY and failing_checks(result) == {}


@pytest.mark.parametrize("phase", [CAPTURE, SERVING])
def test_a_legacy_run_that_raises_after_the_window_fails_legacy_path_unchanged(phase):
    result = run_lifecycle(_raising_in(phase), CASE)
    assert result.path == LEGACY and result.aborted_in == phase
    failed = failing_checks(result)
    assert list(failed) == ["legacy_path_unchanged"], failed
    message = failed["legacy_path_unchanged"][0]
    assert f"the legacy run stopped in phase {phase!r} and never served" in message
    assert f"refuses the batch planned in {phase}" in message


def _out_of_memory_in(phase: str) -> Backend:
    class KeepsTooMuch(UntaughtBuilder):
        def build(self, ctx, batch):  # type: ignore[no-untyped-def]
            if ctx.phase == phase and not getattr(self, "kept", None):
                self.kept = ctx.allocate(CASE.gpu.memory_bytes, "post-kv-hoard")
            return super().build(ctx, batch)

    return Backend(name=f"oom-in-{phase}", make_builders=lambda case: [KeepsTooMuch(case)], origin="test")


@pytest.mark.parametrize("phase", [CAPTURE, SERVING])
def test_running_out_of_memory_after_kv_sizing_on_the_legacy_path_is_its_reported_cost_not_a_refusal(phase):
    result = run_lifecycle(_out_of_memory_in(phase), CASE)
    assert result.path == LEGACY and result.aborted_in == phase
    assert result.errors[0].exc_type == "DeviceOutOfMemory"
    assert failing_checks(result) == {}


def _wrapped_out_of_memory_in(phase: str) -> Backend:
    """An engine adapter's build error raised from the engine's own out-of-memory error, as the vLLM adapter names the
    case and batch around vLLM's ``build()`` (``VllmBuildError`` from the simulated ``torch.OutOfMemoryError``)."""
    class AdapterError(RuntimeError):
        pass

    class WrapsTheEnginesOom(UntaughtBuilder):
        def build(self, ctx, batch):  # type: ignore[no-untyped-def]
            try:
                if ctx.phase == phase and not getattr(self, "kept", None):
                    self.kept = ctx.allocate(CASE.gpu.memory_bytes, "post-kv-hoard")
                return super().build(ctx, batch)
            except Exception as exc:
                raise AdapterError(f"case {CASE.id}: build() of {batch.label} failed: {exc}") from exc

    return Backend(name=f"wrapped-oom-in-{phase}", make_builders=lambda case: [WrapsTheEnginesOom(case)],
                   origin="test")


@pytest.mark.parametrize("phase", [CAPTURE, SERVING])
def test_an_out_of_memory_error_an_adapter_wraps_is_still_the_legacy_paths_cost(phase):
    """vLLM's released builder at gmu 0.98 on qwen3-8b TP8 L40S (default matrix) was refused for this."""
    result = run_lifecycle(_wrapped_out_of_memory_in(phase), CASE)
    assert result.path == LEGACY and result.aborted_in == phase
    assert result.errors[0].exc_type == "AdapterError" and result.errors[0].out_of_memory
    assert failing_checks(result) == {}
