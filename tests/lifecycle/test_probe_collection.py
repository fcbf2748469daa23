"""A faulted step's collection looks only at what the step made (``probe_runs.only_new_objects_collected``)."""

from __future__ import annotations

import gc
import weakref

from pytest_kvprofile.lifecycle.probe_runs import only_new_objects_collected


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_a_cycle_made_in_the_block_is_collected_and_an_older_one_waits_for_the_block_to_end():
    old = _Node()
    old_ref = weakref.ref(old)
    with only_new_objects_collected():
        assert gc.get_freeze_count() > 0
        new = _Node()
        new_ref = weakref.ref(new)
        del old, new  # both are garbage now; only the one the block made is looked at
        gc.collect()
        assert new_ref() is None
        assert old_ref() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None


def test_inside_another_freeze_the_outer_one_holds():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with only_new_objects_collected():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_the_freeze_ends_when_the_step_raises():
    try:
        with only_new_objects_collected():
            raise MemoryError("injected")
    except MemoryError:
        pass
    assert gc.get_freeze_count() == 0
