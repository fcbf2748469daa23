"""What a case leaves behind: device memory still alive after the engine's teardown, with owners.

Why: cases must be isolated. Each lifecycle run gets a fresh SimDevice, so a leak cannot change the
next case's figures, but it must still be blamed in the case that made it. At teardown the engine
frees its weights, KV cache and arenas, drops the leases it holds, and drops the builders, which
frees every tensor they reference (PyTorch frees a tensor when its last reference goes). What is
then still alive is a leftover: memory referenced only from module globals or class attributes
(which outlive the case, like a module-global workspace list), or never freed at all.

Everything here is a pure function of a finished LifecycleResult (and, optionally, the device it ran
on): nothing is freed or mutated.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .device import Allocation

MiB = 1 << 20
MAX_VISITED = 200_000

# (owner, tag prefix) of what the engine itself frees at teardown.
ENGINE_TEARDOWN: tuple[tuple[str, str], ...] = (
    ("model", "weights"),
    ("kv-cache", ""),
    ("workspace-manager", "float-arena"),
)


@dataclass(frozen=True)
class Leftover:
    """One allocation alive after teardown, and why nothing would free it."""

    id: int
    owner: str
    tag: str
    nbytes: int
    kind: str
    phase: str
    origin: str | None  # the builder method that allocated it, when the run recorded one
    reason: str  # "unreferenced", "held by module or class state" or "from an earlier run"

    def describe(self) -> str:
        where = f" by {self.origin}()" if self.origin else ""
        return (
            f"{self.owner}: {self.tag!r} {self.nbytes / MiB:.2f} MiB ({self.nbytes} bytes, {self.kind}) allocated "
            f"in phase {self.phase!r}{where} is still alive after teardown ({self.reason})"
        )


def _engine_frees(alloc: Allocation) -> bool:
    return any(alloc.owner == owner and alloc.tag.startswith(prefix) for owner, prefix in ENGINE_TEARDOWN)


def _harness_types() -> tuple[type, ...]:
    """Objects whose references are the harness's, not the builder's: never followed."""
    from .device import SimDevice
    from .lifecycle import LifecycleResult, LifecycleRun
    from .matrix import Case
    from .protocol import BuilderContext
    from .workspace import WorkspaceManager

    return (BuilderContext, LifecycleRun, LifecycleResult, SimDevice, WorkspaceManager, Case)


_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range)


def reachable_allocations(roots: Iterable[Any], *, follow_classes: bool = False) -> dict[int, Allocation]:
    """Allocations reachable from ``roots`` through attributes, containers and closures.

    Module objects, function globals and harness objects (contexts, the run, the device) are not
    followed, and classes only when ``follow_classes`` is set: a builder's own references are what
    dropping the builder releases.
    """
    harness = _harness_types()
    found: dict[int, Allocation] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack and len(seen) < MAX_VISITED:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, Allocation):
            found[id(obj)] = obj
            continue
        if isinstance(obj, (types.ModuleType, *harness)):
            continue
        if isinstance(obj, type):
            if follow_classes:
                stack.extend(v for k, v in vars(obj).items() if not k.startswith("__"))
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
            continue
        if isinstance(obj, types.MethodType):
            stack.extend((obj.__self__, obj.__func__))
            continue
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _cell_full(c))
            stack.extend(obj.__defaults__ or ())
            continue
        if isinstance(obj, (types.BuiltinFunctionType, types.CodeType, types.FrameType)):
            continue
        try:
            stack.extend(vars(obj).values())
        except TypeError:
            pass
        for slot in _slots(type(obj)):
            if hasattr(obj, slot):
                stack.append(getattr(obj, slot))
    return found


def _cell_full(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _slots(cls: type) -> list[str]:
    out: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        out.extend([slots] if isinstance(slots, str) else slots)
    return [s for s in out if s not in ("__dict__", "__weakref__")]


def _persistent_roots(builders: Iterable[Any]) -> list[Any]:
    """State that outlives a case: the builders' classes and the globals of the modules defining them."""
    import sys

    roots: list[Any] = []
    for b in builders:
        for klass in type(b).__mro__[:-1]:
            roots.append(klass)
            module = sys.modules.get(klass.__module__)
            if module is not None and not klass.__module__.startswith("pytest_kvprofile"):
                roots.append(dict(vars(module)))
    return roots


def leftover_allocations(result: Any, device: Any = None) -> list[Leftover]:
    """Allocations alive after teardown that the engine and the dropped builders would not free.

    ``device``: the device the run used; with it, live allocations the run did not make (left by an
    earlier run on a shared device) are reported too. Without it, the run's own ledger is used.
    """
    own = {a.id: a for a in result.allocations}
    alive = device.live_allocations() if device is not None else [a for a in result.allocations if a.alive]
    held = reachable_allocations([*result.builders, *(rec.lease for rec in result.leases)])
    persistent = reachable_allocations(_persistent_roots(result.builders), follow_classes=True)
    out = []
    for a in alive:
        if own.get(a.id) is not a:
            reason = "from an earlier run"
        elif _engine_frees(a):
            continue
        elif id(a) in persistent:
            reason = "held by module or class state"
        elif id(a) in held:
            continue
        else:
            reason = "unreferenced"
        out.append(Leftover(a.id, a.owner, a.tag, a.nbytes, a.kind, a.phase, result.alloc_origin.get(a.id), reason))
    return out


def leftover_violations(result: Any, device: Any = None, *, include_engine: bool = False) -> list[str]:
    """Check-style messages, one per leftover, largest first; empty when the case cleans up.

    Engine-owned leftovers (an aborted forward's activations) are the harness's, not the backend's,
    and are left out unless ``include_engine``.
    """
    from .lifecycle import ENGINE_OWNERS

    found = [
        leftover for leftover in leftover_allocations(result, device)
        if include_engine or leftover.owner not in ENGINE_OWNERS
    ]
    found.sort(key=lambda leftover: -leftover.nbytes)
    return [leftover.describe() for leftover in found]
