"""Host memory that finished runs freed goes back to the operating system (``memory/host_memory.py``)."""

from __future__ import annotations

import sys

import pytest

from pytest_kvprofile.memory import host_memory

glibc = pytest.mark.skipif(host_memory.free_heap_bytes() is None, reason="needs glibc's mallinfo2 (Linux)")


@glibc
def test_freed_heap_over_the_threshold_is_trimmed_and_under_it_left_alone(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(host_memory, "free_heap_bytes", lambda: 200 << 20)
    real = host_memory._LIBC
    assert real is not None
    monkeypatch.setattr(host_memory, "_LIBC", type("Libc", (), {"malloc_trim": staticmethod(calls.append)})())
    assert host_memory.return_freed_host_memory(threshold=64 << 20) and calls == [0]
    monkeypatch.setattr(host_memory, "free_heap_bytes", lambda: 10 << 20)
    assert not host_memory.return_freed_host_memory(threshold=64 << 20) and calls == [0]


def test_without_glibc_nothing_is_done(monkeypatch):
    monkeypatch.setattr(host_memory, "_LIBC", None)
    assert host_memory.free_heap_bytes() is None and not host_memory.return_freed_host_memory(threshold=0)
    assert sys.platform.startswith("linux") or host_memory._libc() is None
