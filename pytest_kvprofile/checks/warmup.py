"""Checks of kernel warmup: replayed profile, idempotence, retry after a failure."""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.checks.evidence import (
    alive_at_end,
    builder_names,
    grouped,
)
from pytest_kvprofile.lifecycle.record import PROFILING, WARMUP_PROBE, LifecycleResult
from pytest_kvprofile.units import bytes_text


def check_profile_replayed_after_warmup(result: LifecycleResult, options: CheckOptions) -> list[str]:
    warmed = [
        a for a in result.allocations
        if a.phase == lc.PROFILE_WARMUP and a.kind == "device" and a.freed_phase not in lc.WINDOW_PHASES
    ]
    if warmed and result.phase(lc.PROFILE_REPLAY) is None:
        total = sum(a.nbytes for a in warmed)
        return [
            (f"warmup inside the window made {bytes_text(total)} persistent but the profile was not "
            "replayed, so the closing measurement never saw the persistent baseline and the activation peak together: "
            f"{grouped(result, warmed)}. Replay the profile run after an in-window warmup")
        ]
    return []


def check_warmup_idempotent(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """A second warmup allocates nothing at all: transient re-tuning scratch counts, not only what it keeps."""
    names = builder_names(result)
    repeat = [a for a in result.allocations if a.phase == lc.WARMUP_REPEAT and a.owner in names]
    if not repeat:
        return []
    kept = [a for a in repeat if alive_at_end(a)]
    what = "new persistent memory" if kept else "transient memory (it re-tunes or re-creates scratch on every call)"
    return [
        f"warmup_idempotent: a repeated warmup (phase {lc.WARMUP_REPEAT!r}) allocated {what}; warmup runs once "
        "and a second call allocates nothing: " + grouped(result, repeat, first=lambda a: alive_at_end(a))
        + ". Return early once warmed (keep what it tuned, not its scratch)"
    ]


def check_warmup_retryable(result: LifecycleResult, options: CheckOptions) -> list[str]:
    """What the lifecycle's ``warmup`` probe found: each warmup the run saw allocate, failed at each allocation and
    retried on fresh builders (``lifecycle/probe_warmup.py``)."""
    return list(result.probed(WARMUP_PROBE).violations)


CHECKS: tuple[Check, ...] = (
    Check("profile_replayed_after_warmup", "persistent memory made by in-window warmup is measured together "
          "with the activation peak (profile replay)", PROFILING, lc.CLOSING, (8,),
          check_profile_replayed_after_warmup),
    Check("warmup_idempotent", "a second warmup allocates nothing", PROFILING, lc.WARMUP_REPEAT, (7,),
          check_warmup_idempotent),
    Check("warmup_retryable", "a warmup that fails part-way leaks nothing and the retry completes it",
          PROFILING, lc.WARMUP, (7,), check_warmup_retryable, probes=(WARMUP_PROBE,)),
)
