"""plugin/gc_freeze.py: a pair's lifecycle starts with the run's long-lived objects out of the collector's reach."""

from __future__ import annotations

import gc
import sys
import types

import pytest_kvprofile.plugin.gc_freeze as gc_freeze


def test_freezes_once_per_set_of_modules_and_collects_garbage_first() -> None:
    try:
        gc_freeze._frozen_at = -1
        cycle: list[object] = []
        cycle.append(cycle)
        ref = types.SimpleNamespace(seen=False)

        class Marker:
            def __del__(self) -> None:
                ref.seen = True

        cycle.append(Marker())
        del cycle
        assert gc_freeze.freeze_between_pairs()
        assert ref.seen, "garbage in a cycle was frozen instead of freed"
        assert gc.get_freeze_count() > 0
        assert not gc_freeze.freeze_between_pairs(), "no module was imported: no second collection"
        sys.modules["kvprofile_gc_freeze_probe"] = types.ModuleType("kvprofile_gc_freeze_probe")
        assert gc_freeze.freeze_between_pairs(), "a module imported since: the new objects are frozen too"
    finally:
        sys.modules.pop("kvprofile_gc_freeze_probe", None)
        gc.unfreeze()


def test_leaves_a_disabled_collector_alone() -> None:
    gc_freeze._frozen_at = -1
    gc.disable()
    try:
        assert not gc_freeze.freeze_between_pairs()
    finally:
        gc.enable()
