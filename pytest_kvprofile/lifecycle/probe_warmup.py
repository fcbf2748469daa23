"""The warmup probe: a warmup that fails part-way leaks nothing and the retry completes it.

The probe drives fresh builders on a fresh device up to each phase the engine calls warmup in
(inside the profiling window when it warms up there, and after KV sizing), fails the warmup at each of its
allocations in turn, and checks that nothing of the failed attempt stays alive and that a retry ends with
the same persistent memory as a warmup that never failed. Every allocation is a fault point; the probe's
answer is memoized per case without its gmu, which the simulated device's probe never reads.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import TYPE_CHECKING

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.contract.protocol import (
    Builder,
    call_optional,
)
from pytest_kvprofile.contract.support import builder_name
from pytest_kvprofile.lifecycle.engine import make_device
from pytest_kvprofile.lifecycle.probe_runs import (
    _UNREACHED,
    _allocations_of,
    _graph_pools,
    _new_pool_bytes,
    _persistent,
    _prefix,
    _ProbeRun,
)
from pytest_kvprofile.lifecycle.record import ProbeTarget
from pytest_kvprofile.lifecycle.sites import _method_site, _raised_at
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.units import bytes_text, size_text

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.contract.device import Allocation


def _warmup(run: _ProbeRun, builder: Builder) -> None:
    """Call warmup as the engine does: attributed to the builder (in torch mode too), never recorded."""
    with run._as_part(builder_name(builder), "warmup"):
        call_optional(builder, "warmup", run.ctx(builder))



def warmup_retry_violations(target: ProbeTarget, plan: tuple[tuple[lc.Phase, int, str], ...]) -> list[str]:
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
def _probe_simulated(backend: Backend, case: Case, plan: tuple[tuple[lc.Phase, int, str], ...]) -> tuple[str, ...]:
    return tuple(_probe(ProbeTarget(backend, case, make_device), plan))



def _clean_warmup(index: int, name: str, run: _ProbeRun) -> tuple[int, Counter[tuple[str, int]], int]:
    """How many allocations a warmup that never fails makes, the persistent memory it leaves, and the bytes the
    private graph pools it captured into keep reserved."""
    pools = _graph_pools(run.device)
    count = len(_allocations_of(run.device, functools.partial(_warmup, run, run.builders[index])))
    return count, _persistent(run.device, name), _new_pool_bytes(run.device, pools)



def _probe(target: ProbeTarget, plan: tuple[tuple[lc.Phase, int, str], ...]) -> list[str]:
    out: list[str] = []
    for state, index, name in plan:
        with _prefix(target, state) as step:
            try:
                clean = step(functools.partial(_clean_warmup, index, name))
            except Exception as exc:  # noqa: BLE001 - the builder cannot even be warmed up once
                cause = exc.__cause__ or exc  # a builder error the run recorded and aborted on
                return [f"the warmup retry probe could not run: {name} failed before or during its warmup in phase "
                        f"{state!r}: {type(cause).__name__}: {cause}"]
            if clean is _UNREACHED:
                continue
            count, expected, pool_bytes = clean  # type: ignore[misc]
            for k in range(count):
                found = step(functools.partial(_warmup_fault, index, name, k, expected, state, pool_bytes))
                assert found is not _UNREACHED
                out.extend(found)  # type: ignore[arg-type]
        if out:
            return out
    return out



def _warmup_fault(index: int, name: str, k: int, expected: Counter[tuple[str, int]], state: lc.Phase,
                  pool_bytes: int, run: _ProbeRun) -> list[str]:
    """:func:`_fail_and_retry` as a probe step."""
    return _fail_and_retry(run, index, name, k, expected, state, pool_bytes)



def _fail_and_retry(run: _ProbeRun, index: int, name: str, k: int, expected: Counter[tuple[str, int]],
                    state: lc.Phase, pool_bytes: int = 0) -> list[str]:
    """Fail warmup at its allocation ``k`` in ``state``, then retry; report leaks, a half-built result, and private
    graph pools a failed CUDA-graph capture kept (``pool_bytes``: what a clean warmup's pools keep reserved).
    Long because the fault, the retry and the three things judged after it share one device's state, read in order."""
    b, dev = run.builders[index], run.device
    where = "inside the profiling window" if state == lc.PROFILE_WARMUP else "after KV sizing"
    live_before = {a.id for a in dev.live_allocations()}
    pools_before = _graph_pools(dev)
    failed: list[Allocation] = []
    unsubscribe = dev.subscribe(lambda e: failed.append(e.alloc) if e.alloc is not None else None, kinds=("alloc",))
    dev.fail_after(k)
    try:
        _warmup(run, b)
    except Exception:  # noqa: BLE001 - the injected failure (or what the builder made of it)
        pass
    else:
        site = _method_site(type(b), "warmup")
        return [f"builder {name!r}: warmup {where} swallowed an out-of-memory error at its allocation #{k + 1}"
                + (f" (warmup at {site})" if site else "") + ". Let the error propagate (free what the attempt made "
                "first), so the engine sees the failure and retries"]
    finally:
        unsubscribe()
        dev.fail_after(None)
    kept_pools = {pid: n for pid, n in _graph_pools(dev).items() if pid not in pools_before}
    out = []
    leaked = [
        a for a in dev.live_allocations()
        if a.id not in live_before and a.owner == name and a.kind == "device" and (a.tag, a.nbytes) not in expected
    ]
    if leaked:
        out.append(
            f"builder {name!r}: a warmup {where} that failed at its allocation #{k + 1} leaked "
            + "; ".join(f"{a.tag!r} {size_text(a.nbytes)}" + (f" at {a.where}" if a.where else "") for a in leaked[:4])
            + ". Free what a failed warmup made before it raises (try/finally), or reuse it on the retry"
        )
    try:
        _warmup(run, b)
    except Exception as exc:  # noqa: BLE001
        site = _raised_at(exc)
        out.append(f"builder {name!r}: the retry {where} after a failure at allocation #{k + 1} raised "
                   f"{type(exc).__name__}: {exc}" + (f" (raised at {site})" if site else "")
                   + ". A warmup the engine retries runs again from the start: undo a failed attempt's partial work")
        return out
    retried = _new_pool_bytes(dev, pools_before)
    if retried > pool_bytes and kept_pools:
        out.append(_kept_pool_message(name, where, state, k, kept_pools, failed, retried, pool_bytes))
    got = _persistent(dev, name)
    if got != expected:
        parts = []
        if expected - got:
            parts.append("missing " + ", ".join(f"{t!r} ({n} bytes)" for (t, n) in expected - got))
        if got - expected:
            parts.append("extra " + ", ".join(f"{t!r} ({n} bytes)" for (t, n) in got - expected))
        site = _method_site(type(b), "warmup")
        out.append(
            f"builder {name!r}: after a warmup {where} failed at allocation #{k + 1} and was retried, its persistent "
            f"memory differs from a clean warmup's ({'; '.join(parts)}): the warmup was left half-built. Mark it "
            "warmed only once it completed, and undo (or finish) a failed attempt's partial work on the retry"
            + (f" (warmup at {site})" if site else "")
        )
    return out



def _kept_pool_message(name: str, where: str, state: lc.Phase, k: int, kept: dict[str, int],
                       failed: list[Allocation], retried: int, clean: int) -> str:
    """A failed CUDA-graph capture's private pool, still held after the retry: bytes, phase and source line."""
    pools = []
    for pid, nbytes in sorted(kept.items()):
        lines = sorted({a.stack for a in failed if a.pool == pid and a.stack})
        made = f", captured at {lines[0]}" if lines else ""
        pools.append(f"{pid} {bytes_text(nbytes)}{made}")
    return (f"builder {name!r}: a warmup {where} (phase {state!r}) that failed at its allocation #{k + 1} inside a "
            f"CUDA-graph capture and was retried keeps {bytes_text(retried)} reserved in private graph pools against "
            f"{bytes_text(clean)} of a clean warmup: the failed capture's pool stays ({'; '.join(pools)}). A failed "
            "capture's graph still holds its pool: reset or drop the graph when capture raises (keep a graph only "
            "once its capture succeeded)")

