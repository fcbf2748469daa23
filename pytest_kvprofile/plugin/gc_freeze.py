"""Long-lived objects moved out of the garbage collector's reach between (backend, case) pairs.

A full collection walks every tracked object. With torch imported it costs about 0.1 s; with vLLM, 0.4 s
(800,000 objects). A run pays many: Python's own (12 over ``stub-flashinfer`` on ci.yaml, with 93,000 collected
items on the default matrix) and vLLM's ``memory_profiling`` (two per window, two windows per lifecycle).
Almost all of what they walk lives as long as the process: modules, collected items, the matrix.

``freeze_between_pairs`` runs where no case is in flight (before a pair's lifecycle; the cache keeps records, not
workspaces). It collects first, so no garbage is frozen, then ``gc.freeze()``. It does so only when modules were
imported since the last time (the first pair, and the first of each engine), so a process freezes a few times.
An object frozen there and dropped later in a reference cycle is never freed: a leak of the records of a few pairs,
not of any later case's memory (a case's tensors are made after the freeze).
"""

from __future__ import annotations

import gc
import sys

_frozen_at = -1


def freeze_between_pairs() -> bool:
    """Collect and freeze when modules were imported since the last freeze; say whether it did."""
    global _frozen_at
    count = len(sys.modules)
    if count == _frozen_at or not gc.isenabled():
        return False
    gc.collect()
    gc.freeze()
    _frozen_at = count
    return True
