"""Item 6: an allocation names the library frame that made it and the builder's own line that caused it."""

from __future__ import annotations

from typing import Any

from pytest_kvprofile.contract.protocol import call_optional
from pytest_kvprofile.memory.device import (
    SimDevice,
    builder_call_site,
    with_builder_call_site,
)

_LIBRARY: dict[str, Any] = {}
_SOURCE = "def _library_allocate(dev):\n    return dev.allocate(4096, owner='b', tag='int workspace')\n"
exec(compile(_SOURCE, "/site-packages/somelib/wrapper.py", "exec"), _LIBRARY)  # noqa: S102 - a library frame, own file


class _Builder:
    def __init__(self, dev: SimDevice) -> None:
        self.dev = dev
        self.stacks: list[str | None] = []

    def build(self) -> None:
        self.stacks.append(_LIBRARY["_library_allocate"](self.dev).stack)  # the builder's call site
        self.stacks.append(self.dev.allocate(1, owner="b", stack="lib.py:7 in alloc").stack)


def test_stack_names_the_allocating_frame_and_the_builder_line() -> None:
    dev = SimDevice(name="sim", total_memory=1 << 30, record_stacks=True)
    builder = _Builder(dev)
    call_optional(builder, "build")
    recorded, given = builder.stacks
    assert recorded is not None and given is not None
    assert recorded.startswith("/site-packages/somelib/wrapper.py:2 in _library_allocate (builder call site ")
    assert (f"{__file__}:" in recorded and recorded.endswith("in build)")
            and given.startswith("lib.py:7 in alloc (builder call site "))


def test_no_builder_frame_outside_a_harness_call() -> None:
    assert builder_call_site() is None
    assert with_builder_call_site("lib.py:1 in f") == "lib.py:1 in f"
    dev = SimDevice(name="sim", total_memory=1 << 30, record_stacks=True)
    stack = dev.allocate(1, owner="t").stack
    assert stack is not None and "builder call site" not in stack
