"""Device memory held by process-wide state: found on the first case, hidden from every later one.

A builder may keep a buffer in process-wide state (vLLM's trtllm-gen workspace: one per process, made by the
first engine inside its profiling window and reused by every later engine). The harness judges each case the way
the first engine of a fresh process is judged, whatever ran before it in this process:

- **Found**: after a run it looks where such state lives (the globals of the modules the backend's classes come
  from and of the modules whose code allocated the memory; their classes, classes made with ``type()``,
  functions' closures and defaults, ``functools`` caches bounded or not, ``threading.local`` objects, a few
  containers deep) and records what holds memory (``held_in_modules``).
- **Fresh view**: before a run's builders are made, what an earlier run left in those modules is put back to
  what a fresh process starts from (``fresh_view``): a key or list item removed, a cache cleared, an attribute
  or closure cell set to None (a thread-local's attribute deleted). So every case makes its buffer itself, in
  any order, under ``-n`` and ``-k``.
- **Second engine**: the driver then starts a second engine of the same backend in the same process, without a
  fresh view (``SecondEngine``): what it makes that state keeps was made again, not reused.

- **After close()**: once the parts' ``close()`` ran, the frames and ``Thread`` objects of every live thread but
  the harness's own, and every ``atexit`` handler registered during the run (``atexit_recorded``), are walked the
  same way (``held_after_close``). Memory still reachable there outlives every engine of the process, and no
  fresh view can take it back (a running frame's locals, a registered handler's arguments).

The ``no_state_outlives_case`` check judges the record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from pytest_kvprofile.lifecycle.record import ModuleHeld
from pytest_kvprofile.memory.device import Allocation, EventSource

_LRU_WRAPPER = type(functools.lru_cache(maxsize=None)(len))
MAX_DEPTH = 4
MAX_ITEMS = 256  # items looked at per container: module state holding device memory is a handful of buffers
_SKIP = (types.ModuleType, types.BuiltinFunctionType, str, bytes, int, float, type(None), range)
_SKIP_TYPES = frozenset((*_SKIP, bool, type(len), types.GetSetDescriptorType, types.MemberDescriptorType,
                         types.WrapperDescriptorType, types.MethodDescriptorType, staticmethod, property))
_IMMUTABLE = frozenset((tuple, frozenset))  # an item of these is cleared through the slot that holds the container
_MUTABLE = frozenset((dict, list, set))
_CONTAINERS = frozenset((dict, list, set, tuple, frozenset, types.FunctionType, types.MethodType, _LRU_WRAPPER))

# a value process-wide state holds: any object, walked by its exact type (``type(value) is dict``...), by which mypy
# does not narrow; and a slot's container and key, changed the way its kind says
StateValue: TypeAlias = Any
# an atexit registration as the harness saw it: the callable, its positional and keyword arguments
Registered = tuple[Callable[..., object], tuple[object, ...], dict[str, object]]
MemoryOf = Callable[[object], "Allocation | None"]
# where a value is held, as (kind, container, key): "attr" an attribute, "item" a dict key, "member" a list or set
# member (key: the value), "cell" a closure cell, "cache" a functools cache; None where nothing can be cleared
Slot = tuple[str, StateValue, StateValue]
_Held = tuple[Slot | None, Slot | None]  # a slot holding an allocation, and the slot holding that container


def modules_of(parts: Iterable[object], files: Iterable[str]) -> list[types.ModuleType]:
    """The modules the parts' classes are defined in (their whole MRO) and the modules of ``files``."""
    names: dict[str, None] = {}
    for part in parts:
        obj = getattr(part, "resource", part)
        for cls in type(obj).__mro__:
            if cls.__module__ not in ("builtins", "abc", "typing"):
                names[cls.__module__] = None
    by_file = _modules_by_file()
    for f in files:
        mod = by_file.get(f)
        if mod is not None:
            names[mod.__name__] = None
    return [sys.modules[n] for n in names if n in sys.modules]


_by_file: tuple[int, dict[str, types.ModuleType]] = (-1, {})


def _modules_by_file() -> dict[str, types.ModuleType]:
    """Loaded modules by source file, looked up again only when the set of loaded modules changes."""
    global _by_file
    if _by_file[0] != len(sys.modules):
        _by_file = (len(sys.modules), {file: m for m in list(sys.modules.values())
                                       if isinstance(file := getattr(m, "__file__", None), str)})
    return _by_file[1]


_stateful: dict[str, set[str]] = {}  # module -> the parts found keeping memory in it, modules in order


def remember(held: Iterable[ModuleHeld]) -> None:
    """The modules and owners of ``held``: what ``fresh_view`` takes back before every later run."""
    for h in held:
        _stateful.setdefault(h.module, set()).add(h.alloc.owner)


def fresh_view(memory_of: MemoryOf) -> int:
    """Put what earlier runs left in process-wide state back to what a fresh process starts from; the count.

    Only modules where a run's parts were found keeping memory are looked at, so a process that never met
    such state pays nothing, and only memory of parts of those names is taken back (a library's own state,
    attributed to no part, stays). Memory no place the harness may change holds (frozen objects) stays: such
    memory is marked (``ModuleHeld.resettable``) and refused on the case that makes it.
    """
    if not _stateful:
        return 0
    modules = [sys.modules[n] for n in _stateful if n in sys.modules]
    owners = set().union(*_stateful.values())
    cleared = 0
    for held, slots in _found(modules, memory_of).values():
        if held.alloc.owner not in owners:
            continue
        done = False
        for slot, outer in slots:  # every place that holds it (or, frozen, the place that holds that)
            done = (_clear(slot) or _clear(outer)) or done
        cleared += done
    return cleared


def held_in_modules(modules: Iterable[types.ModuleType], memory_of: MemoryOf) -> list[ModuleHeld]:
    """Every allocation ``memory_of`` recognises in the modules' process-wide state, with the path to it."""
    held = (dataclasses.replace(h, resettable=all(_resettable(s) or _resettable(o) for s, o in slots))
            for h, slots in _found(modules, memory_of).values())
    return sorted(held, key=lambda h: (h.where, h.alloc.tag, h.alloc.nbytes))


def _found(modules: Iterable[types.ModuleType], memory_of: MemoryOf) -> dict[int, tuple[ModuleHeld, list[_Held]]]:
    """Each allocation found: the first path to it, and every slot that holds it with the slot outside that."""
    found: dict[int, tuple[ModuleHeld, list[_Held]]] = {}
    seen: set[int] = set()
    memory: dict[int, int] = {}
    for mod in modules:
        walk = _Walk(mod.__name__, memory_of, found, seen, memory)
        for name, value in list(vars(mod).items()):
            if not name.startswith("__") and not _inert(value):
                walk.visit(value, (mod.__name__, "attr", name), 0, ("attr", mod, name))
    return found


@contextlib.contextmanager
def atexit_recorded(into: list[Registered]) -> Iterator[None]:
    """``atexit.register`` and ``atexit.unregister`` recorded into ``into`` while the block runs.

    ``atexit`` keeps no public list of its handlers (``atexit._run_exitfuncs`` only runs them, and ``_ncallbacks``
    only counts them), so the harness wraps the two module functions: the real ones still do the work, and a handler
    registered in the block stays in ``into`` until it is unregistered (in the block, or in a later one recording
    into the same list, such as the parts' ``close()``). A backend that bound ``from atexit import register`` before
    the block bypasses the wrapper; every call through the module is seen."""
    import atexit

    register, unregister = atexit.register, atexit.unregister

    def recording_register(func: Callable[..., object], *args: object, **kwargs: object) -> Callable[..., object]:
        into.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    def recording_unregister(func: Callable[..., object]) -> None:
        into[:] = [entry for entry in into if entry[0] != func]  # atexit compares with ==, as here
        unregister(func)

    atexit.register, atexit.unregister = recording_register, recording_unregister  # type: ignore[assignment]
    try:
        yield
    finally:
        atexit.register, atexit.unregister = register, unregister


def held_after_close(memory_of: MemoryOf, registered: Iterable[Registered]) -> list[ModuleHeld]:
    """Every allocation ``memory_of`` recognises in a live thread (its ``Thread`` object, its target and arguments,
    the locals of each of its frames) other than the calling one, or in a recorded ``atexit`` handler (its callable,
    closure and arguments). None of these places can be put back to a fresh process's state (``resettable`` False).
    The calling thread is the harness's own: its frames hold the run and its record."""
    found: dict[int, tuple[ModuleHeld, list[_Held]]] = {}
    walk = _Walk("", memory_of, found, set(), {})
    me = threading.get_ident()
    frames = sys._current_frames()
    for thread in threading.enumerate():
        if thread.ident is None or thread.ident == me:
            continue
        label = f"thread {thread.name!r}{' (daemon)' if thread.daemon else ''}"
        walk.visit(thread, label, 0, None)
        frame = frames.get(thread.ident)
        while frame is not None:
            code = frame.f_code
            where = f"{label} frame {code.co_name} ({code.co_filename}:{frame.f_lineno})"
            for name, value in list(frame.f_locals.items())[:MAX_ITEMS]:
                walk.visit(value, (where, "local", name), 1, None)
            frame = frame.f_back
    for func, args, kwargs in registered:
        label = f"atexit handler {getattr(func, '__qualname__', None) or type(func).__name__}"
        walk.visit(func, label, 0, None)
        walk.visit(args, (label, "args", ""), 0, None)
        walk.visit(kwargs, (label, "kwargs", ""), 0, None)
    held = (dataclasses.replace(h, resettable=False) for h, _slots in found.values())
    return sorted(held, key=lambda h: (h.where, h.alloc.tag, h.alloc.nbytes))


def _dynamic(cls: type) -> bool:
    """A class its module does not hold under its name: made with ``type()`` or inside a function."""
    obj: object = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is not cls


if TYPE_CHECKING:
    from typing import TypeAlias

    # (parent path, label kind, key): rendered only for what is found
    _Path: TypeAlias = tuple["_Path | str", str, object]
else:
    _Path = tuple  # (parent path, label kind, key): rendered only for what is found


def _render(path: _Path | str) -> str:
    labels = []
    while isinstance(path, tuple):
        path, kind, key = path
        labels.append(f"[{key!r}]" if kind == "item" else f"[{key}]" if kind == "index" else
                      f".{key}" if kind == "attr" else f" local {key!r}" if kind == "local" else
                      f" {kind}" if key == "" else f".<{kind} {key}>")
    return path + "".join(reversed(labels))


@dataclass
class _Walk:
    """One module's walk; ``found``, ``seen`` and ``memory`` are shared by the modules of one look."""

    module: str
    memory_of: MemoryOf
    found: dict[int, tuple[ModuleHeld, list[_Held]]]
    seen: set[int]
    memory: dict[int, int]  # id of a value holding memory -> id of its allocation

    def visit(self, value: object, path: _Path | str, depth: int, slot: Slot | None, outer: Slot | None = None) -> None:
        if _inert(value):
            return
        if id(value) in self.seen:
            key = self.memory.get(id(value))
            if key is not None:  # memory held in one more place: a fresh view clears each
                self.found[key][1].append((slot, outer))
            return
        tp = type(value)
        self.seen.add(id(value))
        if tp not in _CONTAINERS:
            if isinstance(value, _SKIP) or _harness(value):
                return
            if isinstance(value, type) and not (value.__module__ == self.module or _dynamic(value)):
                return  # a class of another module: looked at there, when the backend's memory comes from there
            alloc = self.memory_of(value)
            if alloc is not None:
                if alloc.alive:
                    entry = self.found.setdefault(id(alloc), (ModuleHeld(_render(path), alloc, self.module), []))
                    entry[1].append((slot, outer))
                    self.memory[id(value)] = id(alloc)
                return
        if depth >= MAX_DEPTH:
            return
        immutable = tp in _IMMUTABLE
        for kind, key, item, item_slot in _children(value, tp):
            self.visit(item, (path, kind, key), depth + 1, slot if immutable else item_slot, slot)


def _inert(value: StateValue) -> bool:
    """What the walk never looks into: a skipped type, or a function holding nothing that can change (most
    functions). Tested before a value's path and slot are built: most of a module's state is this."""
    tp = type(value)
    if tp is types.FunctionType:
        return not (value.__closure__ or value.__defaults__ or value.__dict__)
    return tp in _SKIP_TYPES


_HARNESS_MODULES = frozenset({
    "pytest_kvprofile.memory.torch_mode",  # the simulation
    "pytest_kvprofile.lifecycle.record",  # a run's record: LifecycleResult and its phase records
    "pytest_kvprofile.lifecycle.driver",  # a run in progress
    "pytest_kvprofile.plugin.session",  # the session's cache of records
})


def _harness(value: object) -> bool:
    """The harness's own ledger: a device (its live allocations), the torch-mode simulation, or a run's record,
    reachable from a library's module while the run's simulation has patched it (FlashInfer's module loaders close
    over the simulated device) or from the module a test keeps its results in. What it holds is every allocation
    of a run, not process-wide state of the backend; putting it back to a fresh process's would erase the record."""
    return isinstance(value, EventSource) or type(value).__module__ in _HARNESS_MODULES


def _children(value: StateValue, tp: type) -> Iterator[tuple[str, StateValue, object, Slot | None]]:
    """A container's items, a class's or object's attributes, a function's closure and mutable defaults, a
    cache's results: each as (label kind, key, item, the slot that holds it)."""
    if tp is dict:
        for k, v in list(value.items())[:MAX_ITEMS]:
            if not _inert(v):
                yield "item", k, v, ("item", value, k)
    elif tp is list or tp is set:
        for i, v in enumerate(list(value)[:MAX_ITEMS]):
            if not _inert(v):
                yield "index", i, v, ("member", value, v)
    elif tp in _IMMUTABLE:
        for i, v in enumerate(list(value)[:MAX_ITEMS]):
            if not _inert(v):
                yield "index", i, v, None
    elif tp is types.FunctionType:
        closure = value.__closure__
        if closure:
            for name, cell in zip(value.__code__.co_freevars, closure):
                try:
                    yield "closure", name, cell.cell_contents, ("cell", cell, None)
                except ValueError:  # an empty cell
                    continue
        for i, v in enumerate(value.__defaults__ or ()):
            if type(v) in _MUTABLE:  # a mutable default (``def f(cache={})``) is process-wide state
                yield "default", i, v, None
        if value.__dict__:
            yield from _attributes(value, value.__dict__)
    elif tp is _LRU_WRAPPER:
        # a functools cache keeps its results out of reach of attributes: the collector's referents reach them
        # (an unbounded cache's dict of results, a bounded one's links' keys and results)
        j = 0
        for ref in gc.get_referents(value):
            for item in (list(ref.values()) if type(ref) is dict else [ref])[:MAX_ITEMS]:
                yield "cache entry", j, item, ("cache", value, None)
                j += 1
    elif tp is functools.partial:  # an exit handler or thread target bound to its arguments
        yield "attr", "func", value.func, None
        yield "attr", "args", value.args, None
        yield "attr", "keywords", value.keywords, None
    elif tp is types.MethodType:
        yield "attr", "__self__", value.__self__, None
        yield "attr", "__func__", value.__func__, None
    elif isinstance(value, dict):
        yield from _children(value, dict)
    elif isinstance(value, (list, set)):
        yield from _children(value, list)
    elif isinstance(value, type):
        yield from _attributes(value, vars(value))
    else:
        attrs = getattr(value, "__dict__", None)
        if type(attrs) is dict and attrs:
            yield from _attributes(value, attrs)


def _attributes(value: object, attrs: Mapping[str, object]) -> Iterator[tuple[str, StateValue, object, Slot | None]]:
    for k, v in list(attrs.items())[:MAX_ITEMS]:
        if not (type(k) is str and k.startswith("__")) and not _inert(v):
            yield "attr", k, v, ("attr", value, k)


def _resettable(slot: Slot | None) -> bool:
    """Whether ``_clear`` can change the slot: not an immutable default, not a frozen object's attribute."""
    if slot is None:
        return False
    kind, container, key = slot
    if kind != "attr" or isinstance(container, (types.ModuleType, type, threading.local)):
        return True
    try:
        setattr(container, key, getattr(container, key))  # the same value back: only a frozen object refuses
    except (AttributeError, TypeError):
        return False
    return True


def _clear(slot: Slot | None) -> bool:
    """Put one slot back to what a fresh process holds there; False where it cannot be changed."""
    if slot is None:
        return False
    kind, container, key = slot
    try:
        if kind == "item":
            container.pop(key, None)
        elif kind == "member":
            if isinstance(container, list):
                container[:] = [v for v in container if v is not key]
            else:
                container.discard(key)
        elif kind == "cell":
            container.cell_contents = None
        elif kind == "cache":
            container.cache_clear()
        elif isinstance(container, threading.local):
            delattr(container, key)
        else:
            setattr(container, key, None)
    except (AttributeError, TypeError):  # a frozen object, a read-only attribute
        return False
    return True
