"""Where code runs, as ``path:line in func``: a backend author's frame, the builder line that called the harness,
a builder method's first line; and the caching allocator's free blocks. The engine attributes what it records
with these.
"""

from __future__ import annotations

import functools
import os
import sys
from types import FrameType

from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.contract.protocol import BuilderContext


def _cached_blocks(device: Device) -> tuple[tuple[int, int], ...]:
    """The reserved-but-free blocks of the device's caching allocator, as ``(ptr, size)``; none off the simulator."""
    allocator = getattr(device, "allocator", None)
    if allocator is None:
        return ()
    return tuple((b["address"], b["size"]) for seg in allocator.snapshot() for b in seg["blocks"]
                 if b["state"] == "inactive")



_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep



_BACKENDS_DIR = os.path.join(_PACKAGE_DIR, "builtin") + os.sep  # the built-in backends: authors' code



def _author_site() -> str:
    """``path:line in func`` of the innermost frame that is a backend's code (outside the harness; the built-in
    backends are backends), "" when none is on the stack."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_PACKAGE_DIR) or path.startswith(_BACKENDS_DIR):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""



def _raised_at(exc: BaseException) -> str:
    """``path:line in func`` of the innermost backend frame ``exc`` was raised through (the author's line that
    raised it, or that called what raised it), "" when none is in its traceback."""
    tb, site = exc.__traceback__, ""
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not path.startswith(_PACKAGE_DIR) or path.startswith(_BACKENDS_DIR):
            site = f"{path}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return site



def _caller_site() -> str:
    """``path:line in func`` of the builder code that called ``ctx.plan_into`` (the first frame outside the harness's
    protocol and driver)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _HARNESS_FILES:
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"



# the engine (``engine.py`` and the modules its run is built from; ``run_uses.py``'s ``note_plan`` asks) and the
# protocol (``ctx.plan_into``): never the builder's line
_HARNESS_FILES = frozenset({*(os.path.join(os.path.dirname(__file__), f"{m}.py")
                              for m in ("engine", "run_state", "run_uses", "run_steps")),
                            sys.modules[BuilderContext.__module__].__file__})



@functools.cache
def _method_site(cls: type, method: str) -> str:
    """``path:line in Class.method`` of a builder's method (a ctx-mode allocation records no stack of its own)."""
    code = getattr(getattr(cls, method, None), "__code__", None)
    if code is None:
        return ""
    return f"{code.co_filename}:{code.co_firstlineno} in {cls.__name__}.{method}"

