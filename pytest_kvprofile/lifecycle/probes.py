"""Fault-injection probes that need fresh builders (not the main lifecycle run).

The retry probe drives fresh builders on a fresh device up to each phase the engine calls warmup in
(inside the profiling window when it warms up there, and after KV sizing), fails the warmup at each of its
allocations in turn, and checks that nothing of the failed attempt stays alive and that a retry ends with
the same persistent memory as a warmup that never failed. Every allocation is a fault point; the probe's
answer is memoized per case without its gmu, which the simulated device's probe never reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import Counter
from typing import Any, Iterator

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.contract.protocol import call_optional
from pytest_kvprofile.contract.support import builder_name
from pytest_kvprofile.lifecycle.driver import LifecycleRun, make_device
from pytest_kvprofile.lifecycle.record import ProbeTarget
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.units import MiB

class _Stop(Exception):
    """Stops a probe run as it enters the phase whose warmup is probed."""


class _ProbeRun(LifecycleRun):
    """The engine's lifecycle up to a phase in which it calls warmup: the state a warmup starts from there."""

    stop_at = lc.PROFILE_WARMUP
    reached = False

    def _enter(self, phase: str) -> None:
        super()._enter(phase)
        if lc.PHASE_INDEX[phase] >= lc.PHASE_INDEX[self.stop_at]:
            self.reached = phase == self.stop_at
            raise _Stop


@contextlib.contextmanager
def _fresh(target: ProbeTarget, state: str) -> Iterator[_ProbeRun | None]:
    """New builders on a new device, driven up to ``state``; None when the engine never reaches it (no
    warmup inside the window). The backend's device mode stays active for the block."""
    run = _ProbeRun(target, target.device_factory(target.case))
    run.stop_at = state
    try:
        with run.device_mode():
            run.make_builders()
            try:
                run._run()
            except _Stop:
                pass
            yield run if run.reached else None
    finally:
        run._teardown()


def _warmup(run: _ProbeRun, builder: Any) -> None:
    """Call warmup as the engine does: attributed to the builder (in torch mode too), never recorded."""
    with run._as_part(builder_name(builder), "warmup"):
        call_optional(builder, "warmup", run.ctx(builder))


def _persistent(device: Any, owner: str) -> Counter:
    return Counter((a.tag, a.nbytes) for a in device.live_allocations() if a.owner == owner and a.kind == "device")


def warmup_retry_violations(target: ProbeTarget, plan: tuple[tuple[str, int, str], ...]) -> list[str]:
    """For each ``(state, builder index, name)`` of ``plan``, fail that builder's warmup in that state at every
    allocation and retry. The plan lists the states in which the main run saw the builder's warmup allocate (a
    warmup that allocates nothing there has no fault point to inject).

    The probe never reads gpu_memory_utilization, so cases that differ only in it share one answer
    on the simulated device.
    """
    if not plan:
        return []
    if target.device_factory is make_device:
        try:
            return list(_probe_simulated(target.backend, dataclasses.replace(target.case, id="", gmu=0.0), plan))
        except TypeError:  # an unhashable backend: probe without the memo
            pass
    return _probe(target, plan)


@functools.lru_cache(maxsize=256)
def _probe_simulated(backend: Any, case: Case, plan: tuple[tuple[str, int, str], ...]) -> tuple[str, ...]:
    return tuple(_probe(ProbeTarget(backend, case, make_device), plan))


def _probe(target: ProbeTarget, plan: tuple[tuple[str, int, str], ...]) -> list[str]:
    out: list[str] = []
    for state, index, name in plan:
        try:
            with _fresh(target, state) as clean:
                if clean is None:
                    continue
                count = _count_allocations(clean.device, lambda r=clean: _warmup(r, r.builders[index]))
                expected = _persistent(clean.device, name)
        except Exception as exc:  # noqa: BLE001 - the builder cannot even be warmed up once
            cause = exc.__cause__ or exc  # a builder error the run recorded and aborted on
            return [f"the warmup retry probe could not run: {name} failed before or during its warmup in phase "
                    f"{state!r}: {type(cause).__name__}: {cause}"]
        for k in range(count):
            with _fresh(target, state) as run:
                assert run is not None
                out.extend(_fail_and_retry(run, index, name, k, expected, state))
        if out:
            return out
    return out


def _fail_and_retry(run: _ProbeRun, index: int, name: str, k: int, expected: Counter, state: str) -> list[str]:
    """Fail warmup at its allocation ``k`` in ``state``, then retry; report leaks and a half-built result."""
    b, dev = run.builders[index], run.device
    where = "inside the profiling window" if state == lc.PROFILE_WARMUP else "after KV sizing"
    live_before = {a.id for a in dev.live_allocations()}
    dev.fail_after(k)
    try:
        _warmup(run, b)
    except Exception:  # noqa: BLE001 - the injected failure (or what the builder made of it)
        pass
    else:
        return [f"builder {name!r}: warmup {where} swallowed an out-of-memory error at its allocation #{k + 1}"]
    out = []
    leaked = [
        a for a in dev.live_allocations()
        if a.id not in live_before and a.owner == name and a.kind == "device" and (a.tag, a.nbytes) not in expected
    ]
    if leaked:
        out.append(
            f"builder {name!r}: a warmup {where} that failed at its allocation #{k + 1} leaked "
            + "; ".join(f"{a.tag!r} {a.nbytes / MiB:.2f} MiB" for a in leaked[:4])
        )
    try:
        _warmup(run, b)
    except Exception as exc:  # noqa: BLE001
        out.append(f"builder {name!r}: the retry {where} after a failure at allocation #{k + 1} raised "
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
            f"builder {name!r}: after a warmup {where} failed at allocation #{k + 1} and was retried, its persistent "
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
