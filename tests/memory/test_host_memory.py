"""Host memory that finished runs freed goes back to the operating system (``memory/host_memory.py``)."""

from __future__ import annotations

import sys

import pytest

from pytest_kvprofile.memory import host_memory
from pytest_kvprofile.units import MiB

glibc = pytest.mark.skipif(host_memory.free_heap_bytes() is None or host_memory.resident_bytes() is None,
                           reason="needs glibc's malloc_trim and /proc/self/statm (Linux)")


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """glibc's trim recorded, not made; the mark starts unset."""
    calls: list[int] = []
    monkeypatch.setattr(host_memory, "_LIBC", type("Libc", (), {"malloc_trim": staticmethod(calls.append)})())
    monkeypatch.setattr(host_memory, "_mark", None)
    return calls


def _resident(monkeypatch: pytest.MonkeyPatch, *sizes: int) -> None:
    values = iter(sizes)
    monkeypatch.setattr(host_memory, "resident_bytes", lambda: next(values))


def test_growth_over_the_threshold_since_the_mark_is_trimmed_and_under_it_left_alone(monkeypatch, trims):
    # first look sets the mark (500); +40 is under 64; +100 trims, and the size after the trim (520) is the new mark
    _resident(monkeypatch, 500 * MiB, 540 * MiB, 600 * MiB, 520 * MiB, 580 * MiB, 590 * MiB, 560 * MiB)
    assert not host_memory.return_freed_host_memory(threshold=64 * MiB)
    assert not host_memory.return_freed_host_memory(threshold=64 * MiB) and trims == []
    assert host_memory.return_freed_host_memory(threshold=64 * MiB) and trims == [0]
    assert host_memory._mark == 520 * MiB
    assert not host_memory.return_freed_host_memory(threshold=64 * MiB)  # 580: +60 over 520
    assert host_memory.return_freed_host_memory(threshold=64 * MiB) and trims == [0, 0]  # 590: +70
    assert host_memory._mark == 560 * MiB


def test_a_process_that_shrank_lowers_its_mark(monkeypatch, trims):
    _resident(monkeypatch, 500 * MiB, 300 * MiB, 380 * MiB, 310 * MiB)
    host_memory.return_freed_host_memory(threshold=64 * MiB)
    host_memory.return_freed_host_memory(threshold=64 * MiB)
    assert host_memory._mark == 300 * MiB
    assert host_memory.return_freed_host_memory(threshold=64 * MiB) and trims == [0]  # +80 over the lowered mark


def test_the_trigger_never_asks_glibc_for_its_free_chunks(monkeypatch, trims):
    """``mallinfo2`` walks every free chunk (10 ms and more on a fragmented heap): the trigger reads the resident
    size only."""
    monkeypatch.setattr(host_memory, "free_heap_bytes", lambda: pytest.fail("mallinfo2 asked"))
    _resident(monkeypatch, 100 * MiB, 300 * MiB, 120 * MiB)
    host_memory.return_freed_host_memory()
    assert host_memory.return_freed_host_memory() and trims == [0]


@glibc
def test_freed_pages_under_a_live_chunk_go_back_to_the_os(monkeypatch):
    """Real glibc: 128 MiB freed below a chunk still alive stays resident until the trim gives it back."""
    monkeypatch.setattr(host_memory, "_mark", None)
    host_memory.return_freed_host_memory()  # the mark
    blocks = [bytearray(b"x" * 8192) for _ in range(128 * MiB // 8192)]  # heap chunks, under mmap's threshold
    alive = bytearray(b"y" * 8192)  # above them on the heap: glibc cannot shrink the heap's top past it
    del blocks
    before = host_memory.resident_bytes()
    assert before is not None
    assert host_memory.return_freed_host_memory(threshold=64 * MiB)
    after = host_memory.resident_bytes()
    assert after is not None and before - after > 64 * MiB, (before, after)
    assert alive[0] == ord("y")


def test_without_glibc_nothing_is_done(monkeypatch):
    monkeypatch.setattr(host_memory, "_LIBC", None)
    assert host_memory.free_heap_bytes() is None and not host_memory.return_freed_host_memory(threshold=0)
    assert sys.platform.startswith("linux") or host_memory._libc() is None
