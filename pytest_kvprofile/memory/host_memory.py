"""Host memory a simulated run gave back, returned to the operating system before the next run.

Why: every simulated device byte a kernel or a copy writes is backed by host memory that torch allocates through
glibc's malloc; when a run ends torch frees it, but glibc keeps freed heap pages mapped for reuse, so a process that
runs case after case (a worker of the slow set, a whole-matrix sweep) grows by a few MiB a case although nothing is
alive (measured: 40 real-FlashInfer cases peak at 526 MiB with a trim before each run, 761 MiB after 20 without).
``malloc_trim`` costs milliseconds, so it runs only when glibc holds more than ``threshold`` bytes free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from pytest_kvprofile.units import MiB

__all__ = ["TRIM_THRESHOLD", "free_heap_bytes", "return_freed_host_memory"]

TRIM_THRESHOLD = 64 * MiB


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> ctypes.CDLL | None:
    """glibc with ``mallinfo2`` (2.33 and later), or None (another libc, or another platform: nothing to do)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def free_heap_bytes() -> int | None:
    """Bytes glibc's main heap holds free (``mallinfo2().fordblks``), or None without glibc."""
    return None if _LIBC is None else int(_LIBC.mallinfo2().fordblks)


def return_freed_host_memory(threshold: int = TRIM_THRESHOLD) -> bool:
    """Give freed heap pages back to the operating system when more than ``threshold`` bytes sit free; whether it
    trimmed."""
    free = free_heap_bytes()
    if free is None or free <= threshold:
        return False
    assert _LIBC is not None
    _LIBC.malloc_trim(0)
    return True
