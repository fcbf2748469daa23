"""The check of a non-builder resource's declared capacity."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.checks.evidence import (
    grouped,
    live_device_bytes,
)
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult
from pytest_kvprofile.units import bytes_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.matrix.cases import Case


def _has_capacity_resource(case: Case, parts: list[Builder]) -> bool:
    from pytest_kvprofile.contract.resources import is_resource

    return any(is_resource(p) and getattr(p, "capacity_bytes", None) is not None for p in parts)


def check_resource_capacity_honoured(result: LifecycleResult, options: CheckOptions) -> list[str]:
    from pytest_kvprofile.contract.resources import is_resource

    out = []
    for part in result.builders:
        capacity = getattr(part, "capacity_bytes", None) if is_resource(part) else None
        if capacity is None:
            continue
        for rec in result.phases:
            live = live_device_bytes(result, part.name, rec.name)
            if live > capacity:
                mine = [a for a in result.allocations if a.owner == part.name and a.kind == "device"]
                out.append(
                    f"resource {part.name!r} declared an exact capacity of {bytes_text(capacity)} "
                    f"but holds {bytes_text(live)} in phase {rec.name!r}: {grouped(result, mine)}. "
                    "Declare the capacity it really holds, or allocate within it"
                )
                break
    return out


CHECKS: tuple[Check, ...] = (
    Check("resource_capacity_honoured", "a resource never holds more device memory than the exact capacity "
          "it declared", PROFILING, lc.WARMUP_REPEAT, (13,), check_resource_capacity_honoured, _has_capacity_resource),
)
