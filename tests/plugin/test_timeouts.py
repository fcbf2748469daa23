"""The per-check time limit: a hang becomes a failure that shows where the backend is stuck."""

from __future__ import annotations

import threading
import time

import pytest

from pytest_kvprofile.plugin.timeouts import CheckTimeout, call_with_timeout


def _stuck_in_backend(release: threading.Event) -> str:
    release.wait(timeout=3.0)
    return "finished late"


def test_a_hang_raises_with_the_stack_of_the_hanging_thread() -> None:
    release = threading.Event()
    start = time.monotonic()
    try:
        with pytest.raises(CheckTimeout) as info:
            call_with_timeout(0.3, "hb / warmup_idempotent / case-1", _stuck_in_backend, release)
    finally:
        release.set()
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    assert message.startswith("hb / warmup_idempotent / case-1: exceeded the per-check time limit of 0.3 s")
    assert "in _stuck_in_backend" in message and "release.wait(timeout=3.0)" in message
    assert "_bootstrap" not in message and "in target" not in message
    assert info.value.pytrace is False  # the report is the hanging stack, not the harness's frames


def test_results_and_errors_cross_back_to_the_caller() -> None:
    assert call_with_timeout(5.0, "fast", lambda x: x * 2, 21) == 42
    with pytest.raises(KeyError, match="boom"):
        call_with_timeout(5.0, "raises", lambda: {}["boom"])
    with pytest.raises(pytest.skip.Exception, match="not here"):
        call_with_timeout(5.0, "skips", lambda: pytest.skip("not here"))


def test_zero_means_no_limit_and_runs_in_the_calling_thread() -> None:
    assert call_with_timeout(0, "inline", threading.current_thread) is threading.current_thread()
    assert call_with_timeout(5.0, "threaded", threading.current_thread) is not threading.current_thread()
