"""The capture probe: the engine's CUDA-graph capture fails at each distinct site a builder allocates at in it,
the engine resets the failed graphs and captures again.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from typing import TYPE_CHECKING, Sequence

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.lifecycle.engine import make_device
from pytest_kvprofile.lifecycle.probe_reservation import MAX_FAULT_POINTS
from pytest_kvprofile.lifecycle.probe_runs import (
    Held,
    _allocations_of,
    _fmt_held,
    _graph_pools,
    _held,
    _prefix,
    _ProbeRun,
    _replaced_error,
    _Site,
    _total,
)
from pytest_kvprofile.lifecycle.record import ProbeTarget
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.units import bytes_text, size_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.contract.device import Device, DeviceEvent


CapturePlan = tuple[str, ...]  # the builders that allocated device memory while the main run captured



def capture_retry_violations(target: ProbeTarget, plan: CapturePlan) -> list[str]:
    """Fail the engine's capture at each fault point of ``plan``'s builders and capture again (``capture_retryable``).
    Memoized per case without its gmu on the simulated device, like the warmup probe."""
    if not plan:
        return []
    if target.device_factory is make_device:
        try:
            return list(_capture_simulated(target.backend, dataclasses.replace(target.case, id="", gmu=0.0), plan))
        except TypeError:  # an unhashable backend: probe without the memo
            pass
    return _probe_capture(target, plan)



@functools.lru_cache(maxsize=256)
def _capture_simulated(backend: Backend, case: Case, plan: CapturePlan) -> tuple[str, ...]:
    return tuple(_probe_capture(ProbeTarget(backend, case, make_device), plan))



def _engine_capture(run: _ProbeRun) -> None:
    """The engine's capture phase as the lifecycle runs it: every captured decode step, into graph profiling's pool."""
    run._capture(run.graph_pool)



def _pool_reserved(device: Device) -> int:
    """Bytes the CUDA-graph private pools in use keep reserved (``SimDevice`` only; another device answers 0)."""
    return sum(_graph_pools(device).values())



@dataclasses.dataclass(frozen=True)
class _CleanCapture:
    """What a capture that never fails makes (every allocation, in order) and leaves: per builder of the plan, the
    device memory it holds; the bytes the graph pools in use keep reserved."""

    sites: tuple[_Site, ...]
    held: tuple[tuple[str, Held], ...]
    pool_bytes: int



def _clean_capture(plan: CapturePlan, run: _ProbeRun) -> _CleanCapture:
    dev = run.device
    before = {a.id for a in dev.live_allocations()}
    allocs = _allocations_of(dev, functools.partial(_engine_capture, run))
    sites = tuple(_Site(a.owner, a.kind, a.role, a.stack, a.nbytes, a.tag, a.where) for a in allocs)
    return _CleanCapture(sites, tuple((name, _held(dev, name, before)) for name in plan), _pool_reserved(dev))



def _capture_fault_points(sites: Sequence[_Site], plan: CapturePlan) -> list[int]:
    """The first allocation of each distinct site a builder of ``plan`` has in the capture, and its last, as indices
    among all of the capture's allocations (the engine's own count for ``fail_after``); at most
    ``MAX_FAULT_POINTS``. The engine captures every step again on a retry, so a site's later allocations (the same
    line for the next captured size) add nothing a first one does not show, and each point costs a lifecycle."""
    seen: set[tuple[object, ...]] = set()
    points = []
    for i, a in enumerate(sites):
        if a.owner not in plan or a.kind != "device":
            continue
        key = (a.owner, a.role, a.stack or a.nbytes)
        if key not in seen:
            seen.add(key)
            points.append(i)
        last = i
    if points and points[-1] != last:
        points.append(last)
    if len(points) > MAX_FAULT_POINTS:
        step = (len(points) - 1) / (MAX_FAULT_POINTS - 1)
        points = [points[round(j * step)] for j in range(MAX_FAULT_POINTS)]
    return points



def _probe_capture(target: ProbeTarget, plan: CapturePlan) -> list[str]:
    with _prefix(target, lc.CAPTURE) as step:
        try:
            clean = step(functools.partial(_clean_capture, plan))
        except Exception as exc:  # noqa: BLE001 - the builders cannot even be captured once
            cause = exc.__cause__ or exc
            return [f"the capture retry probe could not run: the engine's CUDA-graph capture (phase "
                    f"{lc.CAPTURE!r}) failed on fresh builders: {type(cause).__name__}: {cause}"]
        if not isinstance(clean, _CleanCapture):
            return []  # the engine never reaches capture
        out: list[str] = []
        for k in _capture_fault_points(clean.sites, plan):
            found = step(functools.partial(_failed_capture, plan, k, clean))
            assert isinstance(found, list)
            out.extend(found)
            if out:
                return out  # one fault point shows the rule broken: the rest costs a lifecycle each
        return out



def _failed_capture(plan: CapturePlan, k: int, clean: _CleanCapture, run: _ProbeRun) -> list[str]:
    """Fail the capture at its allocation ``k``; the engine resets the failed attempt's graphs and captures again.
    Report what breaks the rule, per builder of ``plan``."""
    dev, site = run.device, clean.sites[k]
    where = f" at {site.where}" if site.where else ""
    by = f", by builder {site.owner!r}" if len(plan) > 1 else ""
    what = (f"a CUDA-graph capture (phase {lc.CAPTURE!r}) that failed at its allocation #{k + 1} ({site.tag!r}, "
            f"{size_text(site.nbytes)}{where}{by})")
    before = {a.id for a in dev.live_allocations()}
    pool = run.graph_pool
    graphs = getattr(pool, "use_count", 0)
    ooms: list[DeviceEvent] = []
    unsubscribe = dev.subscribe(ooms.append, kinds=("oom",))
    errors = len(run.result.errors)
    raised: str | None = None
    dev.fail_after(k)
    try:
        _engine_capture(run)
    except Exception as exc:  # noqa: BLE001 - the injected failure, or what a builder made of it
        raised = _replaced_error(exc)  # no local keeps the error: its traceback's frames hold what the step made
    else:
        if ooms:
            return [f"builder {site.owner!r}: {what} went on capturing: the out-of-memory error was swallowed, so "
                    "the graph holds a half-built step. Let the error reach the engine"]
    finally:
        unsubscribe()
        dev.fail_after(None)
        del run.result.errors[errors:]  # the injected failure; the probe judges how it was raised
        run.result.aborted_in = None
    if not ooms:
        return []  # the fault point was never reached (a capture that allocates differently each time)
    out = []
    if raised is not None:
        out.append(f"builder {site.owner!r}: {what} raised {raised} instead of the out-of-memory error: the first "
                   "error wins (an error in the cleanup must not replace it; chain it with `raise ... from`)")
    failed = getattr(pool, "use_count", 0) - graphs
    release = getattr(dev, "release_graph_pool", None)  # SimDevice's; a real device's graphs are torch's own
    if failed > 0 and callable(release):  # the engine drops the failed attempt's graphs (PyTorch's fix resets them)
        release(pool, lazy=True, graphs=failed)
    try:
        _engine_capture(run)
    except Exception as exc:  # noqa: BLE001
        cause = exc.__cause__ or exc
        out.append(f"after {what}, the engine's second capture raised {type(cause).__name__}: {cause}")
        return out
    got = {name: _held(dev, name, before) for name in plan}
    if getattr(run.backend, "torch_mode", False) and any(_total(got[n]) != _total(h) for n, h in clean.held):
        gc.collect()  # tensors a reference cycle still holds (a traceback's frames) are not what a builder keeps
        got = {name: _held(dev, name, before) for name in plan}
    for name, expected in clean.held:
        out.extend(_capture_difference(dev, name, what, before, got[name], expected, clean.pool_bytes))
    return out



def _capture_difference(device: Device, name: str, what: str, before: set[int], got: Held, expected: Held,
                        clean_pool_bytes: int) -> list[str]:
    """A retried capture's builder memory against a clean capture's: more is what the failed attempt kept (its graph
    pool's segments stay reserved), less is a step the retry left half-built."""
    if _total(got) == _total(expected):
        return []
    if _total(got) < _total(expected):
        return [f"builder {name!r}: after {what}, the retried capture holds {bytes_text(_total(got))} against "
                f"{bytes_text(_total(expected))} of a clean capture (missing {_fmt_held(expected - got)}): the retry "
                "skipped what the failed attempt had begun, so a graph was captured over a half-built step. Build "
                "each step whole again when its capture is retried"]
    extra = got - expected
    pools = sorted({a.pool for a in device.live_allocations() if a.owner == name and a.id not in before
                    and a.kind == "device" and a.pool != "default" and (a.tag, a.nbytes, a.where or "") in extra})
    in_pools = ""
    if pools:
        reserved = _pool_reserved(device)
        grown = (f"; the graph pools in use reserve {bytes_text(reserved)} against {bytes_text(clean_pool_bytes)} "
                 "after a clean capture" if reserved > clean_pool_bytes else "")
        in_pools = (f", in the engine's CUDA-graph pool {', '.join(pools)}: it keeps its segment reserved after the "
                    f"failed graph is reset{grown}")
    return [f"builder {name!r}: after {what}, the engine captured again and the builder holds "
            f"{bytes_text(_total(got))} against {bytes_text(_total(expected))} of a clean capture (extra "
            f"{_fmt_held(extra)}{in_pools}). Memory a failed capture made and kept outlives the graph the engine "
            "reset, once per retry and after KV sizing: free what build() made when it raises, and keep a step's "
            "tensors on the builder only once the step is built"]

