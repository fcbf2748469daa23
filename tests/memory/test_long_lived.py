"""``memory/long_lived.py``: a run starts with the process's long-lived objects out of the collector's reach."""

from __future__ import annotations

import gc
import sys
import types

import pytest

from pytest_kvprofile.memory import long_lived


@pytest.fixture
def unfrozen(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(long_lived, "_frozen_at", -1)
    yield
    gc.unfreeze()


def _garbage_cycle() -> types.SimpleNamespace:
    """A reference cycle no name holds; ``freed`` turns True when the collector frees it."""
    seen = types.SimpleNamespace(freed=False)

    class Marker:
        def __del__(self) -> None:
            seen.freed = True

    cycle: list[object] = [Marker()]
    cycle.append(cycle)
    return seen


def test_collects_garbage_first_then_freezes_once_per_set_of_modules(unfrozen: None) -> None:
    seen = _garbage_cycle()
    assert long_lived.freeze_long_lived()
    assert seen.freed, "garbage in a reference cycle was frozen instead of freed"
    assert gc.get_freeze_count() > 0
    assert not long_lived.freeze_long_lived(), "no module imported since: no second collection"
    sys.modules["kvprofile_long_lived_probe"] = types.ModuleType("kvprofile_long_lived_probe")
    try:
        assert long_lived.freeze_long_lived(), "a module imported since: its objects are frozen too"
    finally:
        del sys.modules["kvprofile_long_lived_probe"]


def test_a_cycle_made_after_the_freeze_is_still_collected(unfrozen: None) -> None:
    """What a run makes (after the freeze) is collected as before: the probes' and vLLM's collections still see it."""
    long_lived.freeze_long_lived()
    seen = _garbage_cycle()
    gc.collect()
    assert seen.freed


def test_leaves_a_disabled_collector_alone(unfrozen: None) -> None:
    gc.disable()
    try:
        assert not long_lived.freeze_long_lived()
        assert long_lived._frozen_at == -1
    finally:
        gc.enable()


def test_a_process_that_started_cuda_is_left_alone(unfrozen: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU tier: a frozen cycle could hold an earlier run's real device memory from later measurements."""
    cuda = types.SimpleNamespace(is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert not long_lived.freeze_long_lived()
    cuda.is_initialized = lambda: False
    assert long_lived.freeze_long_lived()
