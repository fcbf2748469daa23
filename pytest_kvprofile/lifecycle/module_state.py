"""Device memory held by module or class state: what outlives the case that created it.

A builder that keeps a buffer in a module global (a trtllm-gen-like workspace made on first use, a cache keyed
by shape) shows its memory to the first case a process runs and hides it from every later one, which reuses it
and allocates nothing. The harness looks where such state lives: the globals of the modules the backend's
classes come from and of the modules whose code allocated the memory, and those classes' attributes, a few
containers deep. What it finds is judged against the run (allocated by it, or used by it) by the
``no_state_outlives_case`` check, so the same cases fail whatever ran before them.
"""

from __future__ import annotations

import functools
import gc
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from pytest_kvprofile.memory.device import Allocation

_LRU_WRAPPER = type(functools.lru_cache(maxsize=None)(len))
MAX_DEPTH = 4
MAX_ITEMS = 256  # items looked at per container: module state holding device memory is a handful of buffers
_SKIP = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type(len), str, bytes,
         int, float, bool, type(None), range)


_made_by: dict[int, tuple["weakref.ref[Allocation]", str]] = {}


def note_backend(allocs: Iterable[Allocation], backend: str) -> None:
    """Remember which backend's run made these allocations (while they live), so an earlier case's buffer found
    in module state is laid at the door of the backend that keeps it, not of another sharing its module."""
    for a in allocs:
        key = id(a)
        if key not in _made_by:
            _made_by[key] = (weakref.ref(a, lambda _, k=key: _made_by.pop(k, None)), backend)


def made_by(alloc: Allocation) -> str | None:
    entry = _made_by.get(id(alloc))
    return entry[1] if entry is not None and entry[0]() is alloc else None


@dataclass(frozen=True)
class ModuleHeld:
    """A device allocation reachable from module or class state, and the first path that reaches it."""

    where: str
    alloc: Allocation


def modules_of(parts: Iterable[Any], files: Iterable[str]) -> list[types.ModuleType]:
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
        _by_file = (len(sys.modules), {m.__file__: m for m in list(sys.modules.values())
                                       if isinstance(getattr(m, "__file__", None), str)})
    return _by_file[1]


def held_in_modules(modules: Iterable[types.ModuleType], memory_of: Callable[[Any], Allocation | None]) -> list[ModuleHeld]:
    """Every allocation ``memory_of`` recognises among the modules' globals and their classes' attributes."""
    found: dict[int, ModuleHeld] = {}
    seen: set[int] = set()
    for mod in modules:
        for name, value in list(vars(mod).items()):
            if name.startswith("__"):
                continue
            if isinstance(value, type) and value.__module__ == mod.__name__:
                for attr, v in list(vars(value).items()):
                    if not attr.startswith("__"):
                        _walk(v, f"{mod.__name__}.{name}.{attr}", 1, memory_of, found, seen)
                continue
            _walk(value, f"{mod.__name__}.{name}", 0, memory_of, found, seen)
    return sorted(found.values(), key=lambda h: (h.where, h.alloc.tag, h.alloc.nbytes))


def _walk(value: Any, where: str, depth: int, memory_of: Callable[[Any], Allocation | None],
          found: dict[int, ModuleHeld], seen: set[int]) -> None:
    if isinstance(value, _SKIP) or isinstance(value, type) or id(value) in seen:
        return
    seen.add(id(value))
    alloc = memory_of(value)
    if alloc is not None:
        found.setdefault(id(alloc), ModuleHeld(where, alloc))
        return
    if depth >= MAX_DEPTH:
        return
    for key, item in _children(value):
        _walk(item, f"{where}{key}", depth + 1, memory_of, found, seen)


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, _LRU_WRAPPER):
        # a functools cache keeps its entries out of reach of attributes: its cache dict is a referent (a bounded
        # lru_cache keeps results in C links the collector cannot walk: those stay unseen)
        for i, ref in enumerate(gc.get_referents(value)):
            if isinstance(ref, dict):
                for j, v in enumerate(list(ref.values())[:MAX_ITEMS]):
                    yield f".<cache entry {j}>", v  # an unbounded cache (functools.cache) keeps results as values
        return
    if isinstance(value, dict):
        for i, (k, v) in enumerate(list(value.items())):
            if i >= MAX_ITEMS:
                return
            yield f"[{k!r}]", v
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(value)):
            if i >= MAX_ITEMS:
                return
            yield f"[{i}]", v
    else:
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict):
            for k, v in list(attrs.items())[:MAX_ITEMS]:
                yield f".{k}", v
