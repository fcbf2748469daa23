"""Lease semantics and the reference workspace manager on the simulated device."""

import pytest

from pytest_kvprofile import ArenaView, Lease, LeaseReleasedError, WorkspaceLockedError, WorkspaceManager
from pytest_kvprofile.memory.device import SimDevice
from pytest_kvprofile.units import MiB


def test_release_is_idempotent_and_runs_the_callback_once():
    calls = []
    lease = Lease("fi", ["ws"], on_release=lambda: calls.append(1))
    lease.release()
    lease.release()
    assert calls == [1]
    assert lease.released and lease.release_count == 2


def test_use_after_release_is_an_error():
    lease = Lease("fi", ["ws"])
    lease.release()
    with pytest.raises(LeaseReleasedError, match="'fi'"):
        lease.hold("more")


@pytest.fixture
def device():
    return SimDevice(name="test", total_memory=8 << 30, num_sm=132)


def test_arena_grows_until_locked_then_growth_names_requester_and_sizes(device):
    mgr = WorkspaceManager(device, num_ubatches=1)
    first = mgr.get_workspace("fi", 10 * MiB)
    grown = mgr.get_workspace("gdn", 20 * MiB)
    assert grown.arena_size == 20 * MiB and grown.ptr != first.ptr
    assert mgr.get_workspace("fi", 5 * MiB).ptr == grown.ptr
    mgr.lock()
    with pytest.raises(WorkspaceLockedError) as info:
        mgr.get_workspace("late-builder", 30 * MiB)
    msg = str(info.value)
    assert "'late-builder'" in msg and str(30 * MiB) in msg and str(20 * MiB) in msg and "Workspace is locked" in msg
    assert mgr.snapshot() == (ArenaView(0, grown.ptr, 20 * MiB, 20 * MiB),)


def test_ubatch_arenas_are_disjoint_and_separately_sized(device):
    mgr = WorkspaceManager(device, num_ubatches=2)
    views = mgr.reserve("engine", 16 * MiB)
    a0, a1 = mgr.snapshot()
    assert (a0.ubatch, a1.ubatch) == (0, 1) and a0.nbytes == a1.nbytes == 16 * MiB
    assert a0.end <= a1.ptr or a1.end <= a0.ptr
    assert [v.ubatch for v in views] == [0, 1]


def test_bad_requests_are_rejected(device):
    mgr = WorkspaceManager(device, num_ubatches=2)
    with pytest.raises(IndexError, match="ubatch 2 out of range"):
        mgr.get_workspace("x", 1, ubatch=2)
    with pytest.raises(ValueError, match="negative"):
        mgr.get_workspace("x", -1)


def test_close_frees_every_arena(device):
    mgr = WorkspaceManager(device, num_ubatches=2)
    mgr.reserve("engine", 4 * MiB)
    assert device.memory_allocated() == 8 * MiB
    mgr.close()
    assert device.memory_allocated() == 0


def test_the_manager_called_the_ctx_way_says_how_to_call_it(device):
    manager = WorkspaceManager(device, num_ubatches=2)
    with pytest.raises(TypeError, match=r"requester's name first.*ctx.get_workspace\(nbytes, ubatch\)"):
        manager.get_workspace(4 * MiB, 1)
    assert manager.size(0) == 0 and manager.size(1) == 0


def test_a_zero_byte_view_before_any_arena_is_empty(device):
    manager = WorkspaceManager(device, num_ubatches=2)
    view = manager.get_workspace("builder", 0, 1)
    assert (view.ubatch, view.ptr, view.nbytes, view.arena_size) == (1, 0, 0, 0)
    assert device.memory_allocated() == 0
