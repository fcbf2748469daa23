"""A per-check time limit that turns a hang into a failure carrying the hanging thread's stack."""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import pytest

if TYPE_CHECKING:
    from types import FrameType

# what the timed call returns, carried back from its thread in a box it shares with the call's exception
TimedResult: TypeAlias = Any


class CheckTimeout(pytest.fail.Exception):  # type: ignore[name-defined,misc]
    """A check exceeded its time limit; the message holds where the backend was stuck.

    A pytest failure without a Python traceback: the stack that matters is the hanging thread's,
    which the message carries, not the harness frames that waited for it.
    """

    def __init__(self, msg: str) -> None:
        super().__init__(msg, pytrace=False)


def call_with_timeout(seconds: float, label: str, fn: Callable[..., TimedResult], *args: object) -> TimedResult:
    """Run ``fn(*args)``; past ``seconds`` (0: no limit) raise CheckTimeout with the worker's stack.

    The call runs in a daemon thread, so a backend that never returns is abandoned rather than
    killed: the session goes on, and the stuck thread dies with the process.
    """
    if not seconds:
        return fn(*args)
    box: dict[str, TimedResult] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=target, name=f"kvprofile {label}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        frame = sys._current_frames().get(worker.ident or -1)
        stack = _backend_stack(frame) if frame is not None else "(stack unavailable)\n"
        raise CheckTimeout(
            f"{label}: exceeded the per-check time limit of {seconds:g} s (kvprofile_timeout); "
            f"the backend was stuck at:\n{stack}"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def _backend_stack(frame: FrameType) -> str:
    """The stuck thread's stack, innermost last, one unindented line per frame (reports keep them).

    The thread bootstrap and this module's wrapper frame are left out.
    """
    frames = [
        f for f in traceback.extract_stack(frame)
        if f.filename != threading.__file__ and not (f.filename == __file__ and f.name == "target")
    ]
    return "".join(f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}\n" for f in frames)
