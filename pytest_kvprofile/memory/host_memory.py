"""Host memory a simulated run gave back, returned to the operating system before the next run.

Why: every simulated device byte a kernel or a copy writes is backed by host memory that torch allocates through
glibc's malloc; when a run ends torch frees it, but glibc keeps freed heap pages mapped for reuse, so a process that
runs case after case (a worker of the slow set, a whole-matrix sweep) grows by a few MiB a case although nothing is
alive (measured: 40 real-FlashInfer cases peak at 526 MiB with a trim before each run, 761 MiB after 20 without).

When: ``malloc_trim`` costs milliseconds, so it runs only once the process's resident size has grown more than
``threshold`` bytes since the last trim (``/proc/self/statm``, about 30 us to read). Asking glibc how much it holds
free (``mallinfo2``) would be exact but is not cheap: glibc walks every free chunk to answer, 10 ms and more on a
fragmented heap. Asked before every run, it was 11 % of the README's main job (benchmarks/PROFILE.md, eighth pass).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from pytest_kvprofile.units import MiB

__all__ = ["TRIM_THRESHOLD", "free_heap_bytes", "resident_bytes", "return_freed_host_memory"]

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
    """Bytes glibc's main heap holds free (``mallinfo2().fordblks``), or None without glibc. A diagnostic: it walks
    every free chunk, so the trim below does not ask it."""
    return None if _LIBC is None else int(_LIBC.mallinfo2().fordblks)


def resident_bytes() -> int | None:
    """The process's resident size (``/proc/self/statm``), or None where the file cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_mark: int | None = None  # the resident size after the last trim, or at the first look


def return_freed_host_memory(threshold: int = TRIM_THRESHOLD) -> bool:
    """Give freed heap pages back to the operating system once the process has grown more than ``threshold``
    bytes since the last trim (or since the first call); whether it trimmed. A process that shrank lowers its mark."""
    global _mark
    if _LIBC is None:
        return False
    resident = resident_bytes()
    if resident is None:
        return False
    if _mark is None or resident <= _mark + threshold:
        _mark = resident if _mark is None else min(_mark, resident)
        return False
    _LIBC.malloc_trim(0)
    _mark = resident_bytes() or resident
    return True
