"""What a backend leaves invisible to KV sizing: the memory its parts allocate after KV sizing and keep.

On the legacy path this is the backend's cost today (information, not a failure): no builder reserves
anything inside the profiling window, so whatever the builders create lazily (float workspaces, wrappers,
their int workspaces and pinned mirrors) appears after KV sizing. An opted-in backend would have to make it
inside the window, and KV sizing would give up the tokens quoted here. A pull request that opts a backend in
quotes these numbers.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.memory.budget import tokens_for
from pytest_kvprofile.memory.device import Allocation
from pytest_kvprofile.units import MiB, size_text


@dataclass(frozen=True)
class CostSource:
    """The bytes one (owner, source line) keeps after KV sizing."""

    owner: str
    source: str
    tags: tuple[str, ...]
    count: int
    nbytes: int
    phases: tuple[str, ...] = ()  # the phases its allocations were made in, in the engine's order

    def as_dict(self) -> dict[str, object]:
        return {"owner": self.owner, "source": self.source, "tags": list(self.tags), "count": self.count,
                "bytes": self.nbytes, "phases": list(self.phases)}


@dataclass(frozen=True)
class PostKvCost:
    """Per case: device bytes the parts allocated after KV sizing and still held when serving ended.

    ``overrun_bytes`` is the post-KV peak above total x gmu (0 when it fits); ``kv_tokens`` is what KV sizing
    would have given up had the same bytes been reserved inside the profiling window.
    """

    case: str
    nbytes: int
    kv_tokens: int
    overrun_bytes: int
    overrun_kv_tokens: int
    sources: tuple[CostSource, ...]

    def as_dict(self) -> dict[str, object]:
        return {"case": self.case, "bytes": self.nbytes, "mib": round(self.nbytes / MiB, 2),
                "kv_tokens": self.kv_tokens, "overrun_bytes": self.overrun_bytes,
                "overrun_kv_tokens": self.overrun_kv_tokens, "sources": [s.as_dict() for s in self.sources]}

    def describe(self, limit: int = 4) -> str:
        head = (f"{size_text(self.nbytes)} appear after the closing measurement on {self.case} ({self.kv_tokens} KV "
                f"tokens an opted-in backend would reserve)")
        if self.overrun_bytes:
            head += f"; the device peaks {size_text(self.overrun_bytes)} over total x gmu"
        parts = [f"{s.owner}: {size_text(s.nbytes)} in {s.count} allocation(s) at {s.source}"
                 + (f" (made in phase {', '.join(repr(p) for p in s.phases)})" if s.phases else "")
                 for s in self.sources[:limit]]
        more = len(self.sources) - limit
        if more > 0:
            parts.append(f"{more} more source(s)")
        return head + (": " + "; ".join(parts) if parts else "")


AFTER_CLOSING: tuple[str, ...] = (lc.LEASE_RELEASE, lc.GRAPH_PROFILING, *lc.POST_KV_PHASES)
"""Where memory KV sizing never saw is made: after the closing measurement (graph profiling too), not only after KV
sizing."""


def post_kv_allocations(result: LifecycleResult) -> list[Allocation]:
    """The parts' device allocations made after the closing measurement (in graph profiling, say, before KV sizing
    itself) and still held when serving ended: the post-KV cost."""
    names = set(result.builder_names())
    return [a for a in result.allocations
            if a.owner in names and a.kind == "device" and a.phase in AFTER_CLOSING
            and (a.freed_phase is None or lc.PHASE_INDEX.get(a.freed_phase, 0) > lc.PHASE_INDEX[lc.SERVING])]


def post_kv_cost(result: LifecycleResult) -> PostKvCost | None:
    """The record's post-KV cost, or None when the run never reached KV sizing."""
    budget = result.budget
    if budget is None:
        return None
    groups: dict[tuple[str, str], list[Allocation]] = {}
    for a in post_kv_allocations(result):
        groups.setdefault((a.owner, _short(a.stack) if a.stack else f"ctx.allocate({a.tag!r})"), []).append(a)
    sources = sorted(
        (CostSource(owner, source, tuple(sorted({a.tag for a in allocs})), len(allocs), sum(a.nbytes for a in allocs),
                    tuple(sorted({a.phase for a in allocs}, key=lambda p: lc.PHASE_INDEX.get(p, 0))))
         for (owner, source), allocs in groups.items()),
        key=lambda s: (-s.nbytes, s.owner, s.source),
    )
    total = sum(s.nbytes for s in sources)
    overrun = max(0, result.post_kv_overrun)
    per_token = budget.kv_bytes_per_token
    return PostKvCost(result.case.id, total, tokens_for(total, per_token), overrun, tokens_for(overrun, per_token),
                      tuple(sources))


_SITE = os.path.join(sysconfig.get_paths()["purelib"], "")


def _short(stack: str) -> str:
    """A source line relative to its installed package (``vllm/v1/...py:1275``), as a pull request quotes it."""
    return stack.replace(_SITE, "")
