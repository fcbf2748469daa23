"""Process-wide state: where it hides device memory, the fresh view each run starts from, and the verdicts.

A backend keeping one workspace per process (made in the first engine's window, reused by later engines) passes
on every case, in any order and alone; its twins made after KV sizing or made anew by every engine fail on every
case, the first one a process runs included, in every place process-wide state lives.
"""

import dataclasses
import functools
import sys
import threading
import types

import pytest

from pytest_kvprofile.builtin import process_state
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.lifecycle import module_state
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.module_state import (
    fresh_view,
    held_in_modules,
    modules_of,
)
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.memory.device import Allocation, SimDevice


def _memory(v):
    return v if isinstance(v, Allocation) else None


_MADE: dict[str, Allocation] = {}


def _module_with_state(device: SimDevice) -> types.ModuleType:
    mod = types.ModuleType("kvprofile_state_example")
    a, b, c, d, e, f, g, h, i = (device.allocate(1 << 20, owner="b", tag=t) for t in "abcdefghi")

    class Builder:
        shared = {"wrappers": [c]}  # noqa: RUF012 - the pattern looked for

    Builder.__module__ = mod.__name__

    _MADE.update(d=d, e=e)  # what the caches return, out of the walked module's reach

    @functools.cache
    def unbounded(n):
        return _MADE["d"]

    @functools.lru_cache(maxsize=2)
    def bounded(n):
        return _MADE["e"]

    def closure_over(value):
        def get():
            return value
        return get

    def with_default(cache={"ws": g}):  # noqa: B006 - the pattern looked for
        return cache

    local = threading.local()
    local.ws = h
    unbounded(1)
    bounded(1)
    mod.GLOBAL = a
    mod.ALIAS = [a]  # one allocation, two places: a fresh view clears both
    mod.CACHE = {"decode": {"ws": b}}
    mod.Builder = Builder
    mod.unbounded = unbounded
    mod.bounded = bounded
    mod.get = closure_over(f)
    mod.with_default = with_default
    mod.LOCAL = local
    mod.HOLDERS = {"trtllm": type("Holder", (), {"ws": i, "__module__": "elsewhere"})}
    mod.UNRELATED = (1, "x", None)
    return mod


def test_every_hiding_place_is_found_with_the_path_that_reaches_it():
    device = SimDevice(name="x", total_memory=1 << 34, num_sm=100)
    mod = _module_with_state(device)
    where = {h.alloc.tag: h.where for h in held_in_modules([mod], _memory)}
    assert where["a"] == "kvprofile_state_example.GLOBAL"
    assert where["b"] == "kvprofile_state_example.CACHE['decode']['ws']"
    assert where["c"] == "kvprofile_state_example.Builder.shared['wrappers'][0]"
    assert where["d"].startswith("kvprofile_state_example.unbounded.<cache entry")
    assert where["e"].startswith("kvprofile_state_example.bounded.<cache entry")  # a bounded lru_cache too
    assert where["f"] == "kvprofile_state_example.get.<closure value>"
    assert where["g"] == "kvprofile_state_example.with_default.<default 0>['ws']"
    assert where["h"] == "kvprofile_state_example.LOCAL.ws"
    assert where["i"] == "kvprofile_state_example.HOLDERS['trtllm'].ws"  # a class made with type()


def test_a_fresh_view_puts_every_place_back_to_what_a_fresh_process_holds(monkeypatch):
    device = SimDevice(name="x", total_memory=1 << 34, num_sm=100)
    mod = _module_with_state(device)
    monkeypatch.setitem(__import__("sys").modules, mod.__name__, mod)
    monkeypatch.setattr(module_state, "_stateful", {mod.__name__: {"b"}})
    mod.LIBRARY = device.allocate(1 << 20, owner="flashinfer/utils.py:12", tag="library cache")
    assert fresh_view(_memory) == 9
    assert mod.LIBRARY is not None  # no part of the backend made it: a library's own state stays
    assert [h.alloc.tag for h in held_in_modules([mod], _memory)] == ["library cache"]
    assert (mod.GLOBAL is None and mod.ALIAS == [] and mod.CACHE == {"decode": {}}
            and mod.Builder.shared == {"wrappers": []})
    assert mod.unbounded.cache_info().currsize == 0 and mod.bounded.cache_info().currsize == 0
    assert mod.get() is None and mod.with_default() == {} and not hasattr(mod.LOCAL, "ws")
    assert mod.HOLDERS["trtllm"].ws is None and mod.UNRELATED == (1, "x", None)


@dataclasses.dataclass(frozen=True)
class _Frozen:
    ws: Allocation


def test_memory_a_fresh_view_cannot_take_back_is_marked_so(monkeypatch):
    device = SimDevice(name="x", total_memory=1 << 34, num_sm=100)
    mod = types.ModuleType("kvprofile_state_frozen")
    a, b = (device.allocate(1 << 20, owner="b", tag=t) for t in "ab")
    mod.FROZEN = {"k": _Frozen(a)}  # the frozen object cannot change, the dict item holding it can go
    mod.ALSO = _Frozen(b)  # the module attribute can be set to None
    assert {h.alloc.tag: h.resettable for h in held_in_modules([mod], _memory)} == {"a": True, "b": True}
    mod.PINNED = [_Frozen(_Frozen(b))]  # two frozen levels: no place the harness may change holds it
    assert {h.alloc.tag: h.resettable for h in held_in_modules([mod], _memory)} == {"a": True, "b": False}
    monkeypatch.setitem(__import__("sys").modules, mod.__name__, mod)
    monkeypatch.setattr(module_state, "_stateful", {mod.__name__: {"b"}})
    fresh_view(_memory)
    assert mod.FROZEN == {} and mod.ALSO is None and len(mod.PINNED) == 1


def test_a_process_that_never_met_such_state_looks_nowhere(monkeypatch):
    monkeypatch.setattr(module_state, "_stateful", {})
    assert fresh_view(lambda v: pytest.fail("looked")) == 0


def test_nothing_is_found_where_nothing_is_held():
    mod = types.ModuleType("kvprofile_state_empty")
    mod.VALUES = [1, 2, {"k": "v"}]
    assert held_in_modules([mod], lambda v: None) == []


def test_modules_of_a_part_include_its_classes_and_the_files_that_allocated():
    class Part:
        pass

    assert {m.__name__ for m in modules_of([Part()], [functools.__file__])} == {__name__, "functools"}


# -- verdicts ------------------------------------------------------------------------------------------------

CI = [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None
      and c.unsized_reason is None]
FIRST, LAST = CI[0], CI[-1]
PLACES = {b.name: b for b in process_state.place_backends()}


def _failing(backend, case):
    result = run_lifecycle(backend, case)
    close_parts(result)
    return failing_checks(result)


@pytest.fixture
def fresh_process(monkeypatch):
    """The module state of a process that has run nothing yet: the places empty, nothing remembered."""
    import torch

    from pytest_kvprofile.memory.torch_mode import SimulatedCuda

    sim = SimulatedCuda(SimDevice(name="x", total_memory=1 << 34, num_sm=100))  # knows every simulation's tensors
    owners = {"flashinfer", "flashinfer-torch"}

    def empty_places() -> None:
        monkeypatch.setattr(module_state, "_stateful", {process_state.__name__: owners})
        fresh_view(lambda v: v if isinstance(v, Allocation) else sim.memory_of(v) if isinstance(v, torch.Tensor)
                   else None)

    empty_places()
    monkeypatch.setattr(module_state, "_stateful", {})
    yield
    empty_places()  # what the test left must not meet a later test of the process: its remembering is undone


def _places() -> list:
    """Every place process-wide state lives: the module dict in the plain run, the others in ``pytest -m slow``
    (``test_every_hiding_place_is_found_with_the_path_that_reaches_it`` finds each of them in the plain run)."""
    return [pytest.param(p, marks=[] if p == "module-dict" else [pytest.mark.slow], id=p) for p in process_state.PLACES]


@pytest.mark.parametrize("place", _places())
def test_one_workspace_per_process_passes_first_alone_and_after_another_case(fresh_process, place):
    backend = PLACES[f"process-workspace-{place}-{process_state.ONCE}"]
    assert _failing(backend, LAST) == {}  # the first case of the process (``-k`` on one case)
    assert _failing(backend, FIRST) == {}  # a later case, whose builders would find the state the first left
    assert _failing(backend, LAST) == {}


@pytest.mark.parametrize("when", [process_state.AFTER_KV, process_state.PER_ENGINE])
@pytest.mark.parametrize("place", _places())
def test_a_workspace_made_after_kv_sizing_or_by_every_engine_fails_on_the_first_case_and_later(
        fresh_process, place, when):
    backend = PLACES[f"process-workspace-{place}-{when}"]
    first = _failing(backend, LAST)
    assert "no_state_outlives_case" in first, first
    words = "after the closing measurement" if when == process_state.AFTER_KV else "a second engine"
    assert words in first["no_state_outlives_case"][0]
    later = _failing(backend, FIRST)
    assert "no_state_outlives_case" in later, later


@pytest.mark.slow  # every sixth (torch) or second (ctx) ci case, twice, per backend
@pytest.mark.parametrize("backend", process_state.backends(), ids=lambda b: b.name)
def test_the_correct_process_workspace_backends_pass_every_ci_case_in_both_orders(fresh_process, backend):
    cases = CI[::6] if backend.torch_mode else CI[::2]
    forward = {c.id: _failing(backend, c) for c in cases}
    backward = {c.id: _failing(backend, c) for c in reversed(cases)}
    assert forward == backward == {c.id: {} for c in cases}


_COUNTER_LIB = """
import torch

_COUNTER = None


def counter(nbytes):
    global _COUNTER
    if _COUNTER is None or _COUNTER.numel() < nbytes:
        _COUNTER = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    return _COUNTER
"""


@pytest.mark.parametrize("backend_name", ["stub-flashinfer-torch-process-counter", "library-counter"])
def test_a_buffer_a_constructor_makes_once_per_process_passes_after_collection_constructed_it(
        fresh_process, tmp_path, monkeypatch, backend_name):
    """vLLM's multi-CTA KV counter: made by the first builder's ``__init__`` in a global of a library module the
    part's classes do not come from, and reused by later builders. Collection constructs the builders first
    (``case_parts``); the case's run must make it itself, not meet collection's."""
    from pytest_kvprofile.builtin.stubs import TorchFlashInferLikeBuilder
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.lifecycle.driver import case_parts

    (tmp_path / "kvprofile_counter_lib.py").write_text(_COUNTER_LIB)
    monkeypatch.syspath_prepend(str(tmp_path))
    import kvprofile_counter_lib as lib

    class CounterBuilder(TorchFlashInferLikeBuilder):
        def __init__(self, case):
            super().__init__(case)
            self.counter = lib.counter(1 << 20)

    backends = {b.name: b for b in process_state.backends()}
    backends["library-counter"] = Backend(name="library-counter", make_builders=lambda case: [CounterBuilder(case)],
                                          origin="test", torch_mode=True)
    backend = backends[backend_name]
    try:
        for case in (LAST, FIRST):
            with case_parts(backend, case) as construct:
                construct()
            assert _failing(backend, case) == {}
    finally:
        lib._COUNTER = None
        monkeypatch.delitem(sys.modules, "kvprofile_counter_lib")


def test_the_first_engine_made_the_workspace_in_its_window_and_the_second_reused_it(fresh_process):
    backend = process_state.backends()[0]
    result = run_lifecycle(backend, FIRST)
    close_parts(result)
    [held] = [h for h in result.module_held if h.alloc.tag == "trtllm-gen workspace"]
    assert held.where.endswith("_ALLOCATIONS['trtllm-gen']") and held.alloc.phase == "reservation"
    assert str(held.alloc.role) == "trtllm-workspace"
    assert result.second_engine is not None and result.second_engine.remade == [] and not result.second_engine.error


_PINNED: list = []  # process-wide state of the builder below


class _FrozenKeeper(process_state.ProcessWorkspaceBuilder):
    """Keeps its process-wide workspace inside frozen objects: no place a fresh view may change holds it."""

    def reserve_persistent_workspace(self, ctx):
        if not _PINNED:
            _PINNED.append(_Frozen(_Frozen(ctx.allocate(1 << 20, "pinned workspace"))))
        return super().reserve_persistent_workspace(ctx)


def test_memory_kept_where_a_fresh_view_cannot_reach_fails_on_the_first_case(fresh_process):
    from pytest_kvprofile.contract.backends import Backend

    _PINNED.clear()
    backend = Backend(name="frozen-keeper", make_builders=lambda case: [_FrozenKeeper(case)])
    failed = _failing(backend, LAST)
    assert "cannot put it back" in failed["no_state_outlives_case"][0], failed
    assert "_PINNED[0].ws.ws" in failed["no_state_outlives_case"][0]
    _PINNED.clear()


_ONE_PER_PROCESS: dict = {}


class _SecondEngineRaises(process_state.ProcessWorkspaceBuilder):
    """Made in the window, but assumes one engine per process: a second one raises instead of reusing it."""

    def reserve_persistent_workspace(self, ctx):
        if _ONE_PER_PROCESS:
            raise RuntimeError("the trtllm-gen workspace was already made")
        _ONE_PER_PROCESS["ws"] = ctx.allocate(1 << 20, "trtllm-gen workspace")
        return super().reserve_persistent_workspace(ctx)


def test_a_second_engine_that_fails_on_the_state_the_first_left_fails_the_case(fresh_process):
    from pytest_kvprofile.contract.backends import Backend

    _ONE_PER_PROCESS.clear()
    backend = Backend(name="one-engine-only", make_builders=lambda case: [_SecondEngineRaises(case)])
    for case in (LAST, FIRST):  # alone, and after another case: the fresh view gives each its own first engine
        message = _failing(backend, case)["no_state_outlives_case"][0]
        assert "second engine" in message and "already made" in message, message
    _ONE_PER_PROCESS.clear()


AUTHOR_SCRIPT = """
from pytest_kvprofile import Backend, run_lifecycle
from pytest_kvprofile.builtin.stubs import TorchFlashInferLikeBuilder
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix


class AuthorBuilder(TorchFlashInferLikeBuilder):
    name = "author"

    def build(self, ctx, batch):
        import torch

        scratch = torch.empty(1 << 21, dtype=torch.uint8, device="cuda")
        scratch.zero_()
        super().build(ctx, batch)


cases = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
for cid in ("qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90", "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98"):
    result = run_lifecycle(Backend(name="author", make_builders=lambda c: [AuthorBuilder(c)], torch_mode=True),
                           cases[cid])
    made = len(result.allocations)
    print(cid, sorted(failing_checks(result)), made, len(result.allocations))
"""


def test_a_script_that_keeps_run_records_in_its_globals_keeps_them_whole(tmp_path):
    """A backend author's script defines its builder and keeps the result it ran in a global, beside the builder's
    class: the fresh view of process-wide state that a later run (and its probes) makes puts the backend's state
    back, never the records (they list every allocation, and erasing them refused a correct builder)."""
    import subprocess
    import sys

    script = tmp_path / "author.py"
    script.write_text(AUTHOR_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 2, out
    for line in lines:
        cid, rest = line.split(" ", 1)
        assert rest.startswith("[] "), line
        made, kept = rest[3:].split()
        assert made == kept, line
