"""Where module state hides device memory: globals, containers, class attributes, functools caches."""

import functools
import types

from pytest_kvprofile.lifecycle.module_state import held_in_modules, made_by, modules_of, note_backend
from pytest_kvprofile.memory.device import SimDevice


def _module_with_state(device: SimDevice) -> types.ModuleType:
    mod = types.ModuleType("kvprofile_state_example")
    a, b, c, d = (device.allocate(1 << 20, owner="b", tag=t) for t in "abcd")

    class Builder:
        shared = {"wrappers": [c]}

    Builder.__module__ = mod.__name__

    @functools.lru_cache(maxsize=None)
    def unbounded(n):
        return d

    unbounded(1)
    mod.GLOBAL = a
    mod.CACHE = {"decode": {"ws": b}}
    mod.Builder = Builder
    mod.unbounded = unbounded
    mod.UNRELATED = (1, "x", None)
    return mod


def test_every_hiding_place_is_found_with_the_path_that_reaches_it():
    device = SimDevice(name="x", total_memory=1 << 34, num_sm=100)
    mod = _module_with_state(device)
    found = held_in_modules([mod], lambda v: v if hasattr(v, "tag") and hasattr(v, "nbytes") else None)
    where = {h.alloc.tag: h.where for h in found}
    assert where["a"] == "kvprofile_state_example.GLOBAL"
    assert where["b"] == "kvprofile_state_example.CACHE['decode']['ws']"
    assert where["c"] == "kvprofile_state_example.Builder.shared['wrappers'][0]"
    assert where["d"].startswith("kvprofile_state_example.unbounded.<cache entry")


def test_nothing_is_found_where_nothing_is_held():
    mod = types.ModuleType("kvprofile_state_empty")
    mod.VALUES = [1, 2, {"k": "v"}]
    assert held_in_modules([mod], lambda v: None) == []


def test_modules_of_a_part_include_its_classes_and_the_files_that_allocated():
    class Part:
        pass

    assert {m.__name__ for m in modules_of([Part()], [functools.__file__])} == {__name__, "functools"}


def test_the_backend_that_made_an_allocation_is_remembered_while_it_lives():
    device = SimDevice(name="x", total_memory=1 << 34, num_sm=100)
    alloc = device.allocate(1 << 20, owner="b", tag="t")
    assert made_by(alloc) is None
    note_backend([alloc], "mine")
    assert made_by(alloc) == "mine"
