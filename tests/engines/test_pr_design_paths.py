"""The pull request's design on every path (issue 50 point 5): vLLM's own kernel warmup before the lock on the legacy
path, vLLM's WorkspaceManager built from its signature for any revision, layout refusals asked of the backend class
driven, and API revisions named by their methods. Each rule is shown refusing a builder that has the bug and
accepting one that does not."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import Any

import pytest
import torch

from pytest_kvprofile import Backend, run_lifecycle
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.engines.adapter import EngineAdapter
from pytest_kvprofile.engines.batches import mixed_warmup_batch
from pytest_kvprofile.engines.vllm import workspace as vw
from pytest_kvprofile.engines.vllm.flashinfer import VLLM_POLICY, engine_refusal, make_vllm_builders
from pytest_kvprofile.engines.vllm.pull_request import backends, pull_request_builder
from pytest_kvprofile.engines.vllm.selector import backend_class_of
from pytest_kvprofile.lifecycle.driver import close_parts
from pytest_kvprofile.lifecycle.record import LEGACY
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

CASES = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
MTP1 = "qwen3-8b-tp1-dcp1-mtp1-l40s-gmu0.90"
NVFP4_L40S = "llama-3.1-8b-tp1-dcp1-mtp0-l40s-gmu0.90-kvnvfp4"
BACKENDS = {b.name: b for b in backends()}


# -- 1. vLLM's kernel warmup before the lock -------------------------------------------------------------------

def test_the_warmup_batch_is_vllms_mixed_dummy_batch():
    """``_dummy_run(16, create_mixed_batch=True)``: 8 single-token decodes at context 1, one 8-token prefill at 9;
    under DCP every context grows by the DCP size."""
    rb = mixed_warmup_batch(CASES[MTP1])
    assert rb.query_lens == (1,) * 8 + (8,) and rb.seq_lens == (1,) * 8 + (9,)
    dcp = next(c for c in CASES.values() if c.dcp == 2)
    rb = mixed_warmup_batch(dcp)
    assert rb.query_lens == (1,) * 8 + (8,) and rb.seq_lens == (3,) * 8 + (10,)


@contextlib.contextmanager
def _without_kernel_warmup() -> Any:
    """The lifecycle as it was before: no kernel warmup step for vLLM's builders."""
    saved = EngineAdapter.kernel_warmup
    EngineAdapter.kernel_warmup = lambda self, ctx: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        EngineAdapter.kernel_warmup = saved  # type: ignore[method-assign]


def test_a_lazy_arena_sized_by_vllms_kernel_warmup_is_not_refused_on_the_legacy_path(
        vllm_flashinfer, profile_window_vllm):
    """The pull request's builder on a gated MTP case takes its arena from vLLM's manager lazily; vLLM's kernel warmup
    sizes micro-batch 0's slot before ``capture_model()`` locks it (piecewise graphs capture no attention here)."""
    result = run_lifecycle(BACKENDS["vllm-pr-unplanned"], CASES[MTP1])
    try:
        assert result.path == LEGACY and not result.builders[0].captures_attention()
        assert failing_checks(result) == {}
        assert result.builders[0].built["kernel_warmup"] == 1
        arena = [a for a in result.allocations if a.owner == "workspace-manager"]
        assert arena and {a.phase for a in arena} == {"warmup"}  # before capture and the lock
    finally:
        close_parts(result)
    with _without_kernel_warmup():  # the incomplete model of vLLM's order: the false refusal of issue 50
        result = run_lifecycle(BACKENDS["vllm-pr-unplanned"], CASES[MTP1])
    try:
        failing = failing_checks(result)
        assert set(failing) == {"legacy_path_unchanged"}, failing
        assert "Workspace is locked" in failing["legacy_path_unchanged"][0]
        assert "in ubatch 0, current size is 0.00 MiB" in failing["legacy_path_unchanged"][0]
    finally:
        close_parts(result)


def test_a_real_lazy_growth_after_the_lock_is_still_refused(vllm_flashinfer):
    """A builder whose arena grows with the batch: vLLM's 16-token warmup batch sizes it small, the first large
    serving step grows it after the lock; vLLM refuses that, and so does the suite."""
    base: Any = pull_request_builder(False)

    class GrowsWithTheBatch(base):  # type: ignore[misc,valid-type]
        def build(self, common_prefix_len: int, common_attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            from vllm.v1.worker.workspace import current_workspace_manager

            tokens = int(common_attn_metadata.num_actual_tokens)
            current_workspace_manager().get_simultaneous(((tokens * 2**17,), torch.uint8))  # 1 GiB at 8192
            return super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)

    backend = Backend(name="grows-with-the-batch", torch_mode=True, policy=VLLM_POLICY,
                      make_builders=lambda case: make_vllm_builders(case, builder_cls=GrowsWithTheBatch))
    result = run_lifecycle(backend, CASES[MTP1])
    try:
        assert result.path == LEGACY
        failing = failing_checks(result)
        assert "legacy_path_unchanged" in failing, failing
        assert "Workspace is locked" in failing["legacy_path_unchanged"][0]
        assert result.refusals and {r.phase for r in result.refusals} == {"serving"}
    finally:
        close_parts(result)


# -- 2. vLLM's WorkspaceManager from its signature ------------------------------------------------------------

class _TriStateRevision:
    """The shape of the pull request's tri-state revision's manager: no ``alloc_context``."""

    def __init__(self, device: Any, num_ubatches: int | None = None, num_lanes: int = 1):
        self.args = dict(device=device, num_ubatches=num_ubatches, num_lanes=num_lanes)


class _Release033:
    def __init__(self, device: Any, num_ubatches: int | None = None, num_lanes: int = 1,
                 alloc_context: Any = contextlib.nullcontext):
        self.args = dict(device=device, num_ubatches=num_ubatches, num_lanes=num_lanes, alloc_context=alloc_context)


class _KeywordOnly:
    def __init__(self, device: Any, *, alloc_context: Any = None, num_lanes: int = 1, num_ubatches: int = 1):
        self.args = dict(device=device, num_ubatches=num_ubatches, num_lanes=num_lanes, alloc_context=alloc_context)


class _NeedsPool:
    def __init__(self, device: Any, pool: Any, num_ubatches: int = 1):
        pass


class _NoUbatches:
    def __init__(self, device: Any):
        pass


KNOWN = dict(device="cuda", num_ubatches=2, num_lanes=1, alloc_context=contextlib.nullcontext)


@pytest.mark.parametrize("cls, takes_context", [(_TriStateRevision, False), (_Release033, True), (_KeywordOnly, True)])
def test_the_manager_is_built_by_name_from_its_signature(cls, takes_context):
    manager, with_context = vw.make_manager(cls, **KNOWN)
    assert with_context is takes_context
    assert manager.args == {k: v for k, v in KNOWN.items() if k in manager.args}


@pytest.mark.parametrize("cls, text", [(_NeedsPool, "requires pool"), (_NoUbatches, "takes no num_ubatches")])
def test_a_manager_the_adapter_cannot_build_is_a_usage_error_naming_its_signature(cls, text):
    with pytest.raises(vw.UnusableWorkspaceManager) as err:
        vw.make_manager(cls, **KNOWN)
    assert text in str(err.value) and cls.__qualname__ in str(err.value) and "(device" in str(err.value)


def test_an_unusable_manager_stops_the_run_at_configure_as_a_usage_error(pytester, vllm_workspace, monkeypatch):
    workspace, _ = vllm_workspace

    class Unusable(workspace.WorkspaceManager):
        def __init__(self, device: Any, arena_pool: Any, num_ubatches: int = 1):
            raise AssertionError("never built")

    monkeypatch.setattr(workspace, "WorkspaceManager", Unusable)
    result = pytester.runpytest_inprocess("--kvprofile", "--kvprofile-matrix", str(packaged_matrix("ci")),
                                          "--kvprofile-backend", "vllm-flashinfer", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    result.stderr.fnmatch_lines(["*WorkspaceManager*Unusable(device*arena_pool*num_ubatches*requires arena_pool*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def _pull_request_workspace() -> Any:
    """The pull request's own ``vllm/v1/worker/workspace.py`` (the tri-state revision's: no ``alloc_context``), from
    a private copy named by ``KVPROFILE_PR_WORKSPACE``; the test skips without one (its code is not in this repo)."""
    path = os.environ.get("KVPROFILE_PR_WORKSPACE", "")
    if not os.path.isfile(path):
        pytest.skip("KVPROFILE_PR_WORKSPACE names no private copy of the pull request's vllm/v1/worker/workspace.py")
    spec = importlib.util.spec_from_file_location("vllm.v1.worker.workspace", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pull_requests_own_workspace_module_is_driven(vllm_workspace, monkeypatch):
    from pytest_kvprofile.lifecycle.driver import make_device

    module = _pull_request_workspace()
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.workspace", module)
    manager = vw.VllmWorkspaceManager(make_device(CASES[MTP1]), num_ubatches=2)
    try:
        assert not manager.has_alloc_context and type(manager.inner).__mro__[1] is module.WorkspaceManager
        views = [manager.get_workspace("b", 4096, u) for u in (0, 1)]
        assert views[0].ptr != views[1].ptr and manager.size(1) == 4096
        with manager.ubatch_scope(1):  # the pull request's use_workspace_ubatch_id reaches its own slot
            (tensor,) = module.current_workspace_manager().get_simultaneous(((8192,), torch.uint8))
        assert manager.size(1) == 8192 and manager.size(0) == 4096
        with manager.ubatch_scope(0):  # a call naming its micro-batch lands there, whatever the override says
            view = manager.get_workspace("b", 16384, 1)
        assert manager.size(1) == 16384 and manager.size(0) == 4096 and view.arena_size == 16384
        manager.lock()
        with pytest.raises(vw.VllmWorkspaceRefusal):
            manager.get_workspace("b", 1 << 20, 0)
    finally:
        manager.close()


# -- 3. the backend class driven refuses as vLLM's selector asks it ---------------------------------------------

def _nvfp4_on_sm100_only(vllm_flashinfer: Any) -> type:
    """A FlashInfer backend revision whose ``supports_kv_cache_dtype`` refuses NVFP4 below SM100 (as the pull
    request's two-pass revision does), and its builder class."""
    from vllm.platforms import current_platform

    class Nvfp4OnSm100Builder(vllm_flashinfer.FlashInferMetadataBuilder):  # type: ignore[misc,name-defined]
        pass

    class Nvfp4OnSm100Backend(vllm_flashinfer.FlashInferBackend):  # type: ignore[misc,name-defined]
        @classmethod
        def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
            if kv_cache_dtype is not None and kv_cache_dtype.startswith("nvfp4"):
                return bool(current_platform.is_device_capability_family(100))
            return bool(super().supports_kv_cache_dtype(kv_cache_dtype))

        @staticmethod
        def get_builder_cls() -> type:
            return Nvfp4OnSm100Builder

    globals()["Nvfp4OnSm100Backend"] = Nvfp4OnSm100Backend  # found in the builder's own module, as vLLM's is
    return Nvfp4OnSm100Builder


def test_the_backend_class_driven_refuses_its_own_layouts(vllm_flashinfer):
    builder = _nvfp4_on_sm100_only(vllm_flashinfer)
    assert backend_class_of(builder).__name__ == "Nvfp4OnSm100Backend"
    assert backend_class_of(vllm_flashinfer.FlashInferMetadataBuilder) is vllm_flashinfer.FlashInferBackend
    case = CASES[NVFP4_L40S]
    assert engine_refusal(case) is None  # the installed release's class reads NVFP4 with FA2 on the L40S
    refusal = engine_refusal(case, builder)
    assert refusal is not None and "kv_cache_dtype not supported" in refusal and "Nvfp4OnSm100Backend" in refusal
    assert "'nvfp4'" in refusal and "SM89" in refusal
    assert engine_refusal(CASES[MTP1], builder) is None  # its bf16 layouts stay accepted


class _PredicatesOnly:
    """A backend class without ``validate_configuration``: the selector's predicates are asked one by one."""

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in (64, 128)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return kv_cache_dtype != "nvfp4"


class _ValidatesWithAnUnknownParameter(_PredicatesOnly):
    @classmethod
    def validate_configuration(cls, head_size: int, quantum_mode: bool) -> list[str]:
        raise AssertionError("a parameter the selector does not fill: the predicates are asked instead")


class _Validates:
    @classmethod
    def validate_configuration(cls, head_size: int, kv_cache_dtype: Any, *, use_dcp: bool = False) -> list[str]:
        return ["DCP not supported"] if use_dcp else []


def test_the_selector_asks_what_the_class_has():
    from pytest_kvprofile.engines.vllm.selector import _ask

    values = {"head_size": 256, "kv_cache_dtype": "nvfp4", "dtype": None, "block_size": 16, "device_capability": None,
              "use_dcp": True}
    assert _ask(_PredicatesOnly, values) == ["head_size not supported", "kv_cache_dtype not supported"]
    assert _ask(_ValidatesWithAnUnknownParameter, values) == _ask(_PredicatesOnly, values)
    assert _ask(_Validates, values) == ["DCP not supported"]  # by its own parameter names, keyword-only too
    assert _ask(_Validates, {**values, "use_dcp": False}) == []
    assert backend_class_of(_PredicatesOnly) is None  # no backend class names it as its builder: nothing to ask
