"""Fault-injection probes that need fresh builders (not the main lifecycle run).

The retry probe fails a builder's warmup at each of its allocations in turn, on a fresh device
each time, and checks that nothing of the failed attempt stays alive and that a retry ends with the
same persistent memory as a warmup that never failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import Counter
from typing import Any, Iterator

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.contract.protocol import call_optional
from pytest_kvprofile.contract.support import (
    ProfilingSupport,
    builder_name,
    declared_support,
)
from pytest_kvprofile.lifecycle.driver import LifecycleRun, make_device
from pytest_kvprofile.lifecycle.record import ProbeTarget
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.units import MiB

MAX_FAIL_POINTS = 16


class _ProbeRun(LifecycleRun):
    """A run that stops after the reservation: the state a warmup starts from inside the window."""

    def prepare(self) -> None:
        self._enter(lc.RESERVATION)
        self.in_window = True
        arena = max((d.float_bytes for d in self._declared().values()), default=0)
        if arena:
            self.manager.reserve("engine", arena)
        for b in self.builders:
            if declared_support(b) is ProfilingSupport.REQUIRED:
                call_optional(b, "reserve_persistent_workspace", self.ctx(b))
        self._enter(lc.PROFILE_WARMUP)

    def _declared(self) -> dict[str, Any]:
        out = {}
        for b in self.builders:
            fn = getattr(b, "declared_workspace", None)
            if fn is not None:
                out[builder_name(b)] = fn(self.case)
        return out


@contextlib.contextmanager
def _fresh(target: ProbeTarget) -> Iterator[tuple[_ProbeRun, Any]]:
    """A new device and builders, prepared up to warmup, with the backend's device mode active."""
    device = target.device_factory(target.case)
    run = _ProbeRun(target, device)
    with run.device_mode():
        run.make_builders()
        run.prepare()
        yield run, device


def _persistent(device: Any, owner: str) -> Counter:
    return Counter((a.tag, a.nbytes) for a in device.live_allocations() if a.owner == owner and a.kind == "device")


def warmup_retry_violations(target: ProbeTarget, names: tuple[str, ...]) -> list[str]:
    """For each of the builders ``names``, fail its warmup at every allocation and retry.

    The probe never reads gpu_memory_utilization, so cases that differ only in it share one answer
    on the simulated device.
    """
    if target.device_factory is make_device:
        try:
            return list(_probe_simulated(target.backend, dataclasses.replace(target.case, id="", gmu=0.0), names))
        except TypeError:  # an unhashable backend: probe without the memo
            pass
    return _probe(target, names)


@functools.lru_cache(maxsize=256)
def _probe_simulated(backend: Any, case: Case, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_probe(ProbeTarget(backend, case, make_device), names))


def _probe(target: ProbeTarget, names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for index, name in enumerate(names):
        stage = lc.RESERVATION
        try:
            with _fresh(target) as (clean_run, clean_dev):
                stage = lc.PROFILE_WARMUP
                builder = clean_run.builders[index]
                count = _count_allocations(
                    clean_dev, lambda b=builder, r=clean_run: call_optional(b, "warmup", r.ctx(b))
                )
                expected = _persistent(clean_dev, name)
        except Exception as exc:  # noqa: BLE001 - the builder cannot even be warmed up once
            return [f"the warmup retry probe could not run: {name} raised {type(exc).__name__} in phase "
                    f"{stage!r}: {exc}"]
        for k in range(min(count, MAX_FAIL_POINTS)):
            with _fresh(target) as (run, dev):
                out.extend(_fail_and_retry(run, dev, index, name, k, expected))
        if out:
            break
    return out


def _fail_and_retry(run: Any, dev: Any, index: int, name: str, k: int, expected: Counter) -> list[str]:
    """Fail warmup at its allocation ``k``, then retry; report leaks and a half-built result."""
    b = run.builders[index]
    ctx = run.ctx(b)
    live_before = {a.id for a in dev.live_allocations()}
    dev.fail_after(k)
    try:
        call_optional(b, "warmup", ctx)
    except Exception:  # noqa: BLE001 - the injected failure (or what the builder made of it)
        pass
    else:
        return [f"builder {name!r}: warmup swallowed an out-of-memory error at its allocation #{k + 1}"]
    out = []
    leaked = [
        a for a in dev.live_allocations()
        if a.id not in live_before and a.owner == name and a.kind == "device" and (a.tag, a.nbytes) not in expected
    ]
    if leaked:
        out.append(
            f"builder {name!r}: a warmup that failed at its allocation #{k + 1} leaked "
            + "; ".join(f"{a.tag!r} {a.nbytes / MiB:.2f} MiB" for a in leaked[:4])
        )
    try:
        call_optional(b, "warmup", ctx)
    except Exception as exc:  # noqa: BLE001
        out.append(f"builder {name!r}: the retry after a failure at allocation #{k + 1} raised "
                   f"{type(exc).__name__}: {exc}")
        return out
    got = _persistent(dev, name)
    if got != expected:
        parts = []
        if expected - got:
            parts.append("missing " + ", ".join(f"{t!r} ({n} bytes)" for (t, n) in expected - got))
        if got - expected:
            parts.append("extra " + ", ".join(f"{t!r} ({n} bytes)" for (t, n) in got - expected))
        out.append(
            f"builder {name!r}: after a warmup failed at allocation #{k + 1} and was retried, its persistent "
            f"memory differs from a clean warmup's ({'; '.join(parts)}): the warmup was left half-built"
        )
    return out


def _count_allocations(device: Any, fn: Any) -> int:
    seen = []
    unsubscribe = device.subscribe(lambda e: seen.append(e) if e.kind == "alloc" else None)
    try:
        fn()
    finally:
        unsubscribe()
    return len(seen)
