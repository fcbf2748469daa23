"""vLLM judged as the installed release runs it (engines/vllm/release.py): the runner it ships, where it sizes the KV
cache on each case, and what the verdict names. CI runs this file in two venvs, vLLM 0.33.0 and 0.34.0 (.ci/run):
each branch below is the one its release takes, and the other venv runs the other."""

from __future__ import annotations

import dataclasses
from importlib import metadata

import pytest
import torch

from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.backends import Backend, kv_sizing_mode
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.engines.vllm.flashinfer import (
    VLLM_BACKENDS,
    VLLM_POLICY,
    ExtensibleVllmAdapter,
    ReservingVllmBuilder,
    VllmFlashInferBuilder,
    VllmFlashInferV2Builder,
    make_vllm_builders,
)
from pytest_kvprofile.engines.vllm.pull_request import pull_request_builder
from pytest_kvprofile.engines.vllm.release import (
    EXTENSIBLE,
    PROFILE_WINDOW,
    has_extensible_kv_cache,
    has_v1_runner,
)
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.phases import PHASE_INDEX, RESERVATION, SERVING
from pytest_kvprofile.lifecycle.record import PROFILING
from pytest_kvprofile.matrix.cases import Envelope, layout_case
from pytest_kvprofile.matrix.gpus import lookup_gpu
from pytest_kvprofile.matrix.models import ModelSpec
from pytest_kvprofile.units import KiB, MiB

pytestmark = pytest.mark.usefixtures("vllm_flashinfer")

SMALL = Envelope(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048, page_size=16,
                 cuda_graph_sizes=(1, 2, 4, 8), num_ubatches=1)
QWEN = ModelSpec("qwen3-8b", heads_q=32, heads_kv=8, head_dim=128, num_layers=4, weights_gib=1.0, hidden_size=4096)
SCRATCH = 3 * MiB + 12 * KiB  # a size no FlashInfer or vLLM buffer has, so its source line is the builder's own


def case_with(kv_sizing: str = "engine"):
    return layout_case(QWEN, lookup_gpu("L40S"), 1, 1, 0, dataclasses.replace(SMALL, kv_sizing=kv_sizing))


@pytest.fixture
def extensible() -> None:
    if not has_extensible_kv_cache():
        pytest.skip(f"vLLM {metadata.version('vllm')} has no extensible KV cache (0.34 added it); the 0.34 venv runs "
                    "this test")


def test_the_installed_release_decides_the_runner_and_the_sizing_point():
    version = metadata.version("vllm")
    mode = kv_sizing_mode(VLLM_POLICY, case_with())
    v1, v2 = (make_vllm_builders(case_with(), v2=flag)[0] for flag in (False, True))
    try:
        if has_extensible_kv_cache():  # 0.34: the V2 runner only, KV measured after warmup and capture
            assert not has_v1_runner()
            assert (mode.name, mode.rule, mode.reason) == (EXTENSIBLE, "post_warmup", "")
            assert type(v1) is type(v2) is ExtensibleVllmAdapter
            assert v1.get_persistent_workspace_memory_profiling_support() is ProfilingSupport.REQUIRED
        else:  # 0.33 and older: both runners, the profiling window
            assert has_v1_runner()
            assert (mode.name, mode.rule) == (PROFILE_WINDOW, "profile") and version in mode.reason
            assert type(v1) is VllmFlashInferBuilder and type(v2) is VllmFlashInferV2Builder
    finally:
        v1.close()
        v2.close()
    runners = {b.name: b.provenance() for b in VLLM_BACKENDS if b.provenance is not None}
    assert {p.engine for p in runners.values()} == {"vllm"}
    assert {p.engine_version for p in runners.values()} == {version}
    assert runners["vllm-flashinfer-v2"].runner == "V2"
    assert runners["vllm-flashinfer"].runner == ("V1" if has_v1_runner() else "V2")
    assert any("flashinfer" in note for note in runners["vllm-flashinfer"].notes)  # vLLM's own pin, beside the one run


def test_a_profile_window_request_turns_the_extensible_cache_off_and_the_verdict_says_why(extensible):
    mode = kv_sizing_mode(VLLM_POLICY, case_with("profile"))
    assert (mode.name, mode.rule) == (PROFILE_WINDOW, "profile")
    assert "enable_extensible_kv_cache=False" in mode.reason and "envelope.kv_sizing: profile" in mode.reason
    builder, = make_vllm_builders(case_with("profile"), v2=True)
    assert type(builder) is VllmFlashInferV2Builder  # the released builder declares nothing: the legacy path


def test_on_the_extensible_path_the_window_holds_the_builders_their_warmup_and_their_graphs(extensible):
    result = run_lifecycle(VLLM_BACKENDS[0], case_with())
    try:
        assert not result.errors, result.errors[0].traceback
        assert result.path == PROFILING and result.kv_sizing.name == EXTENSIBLE
        assert result.budget is not None and result.budget.rule == "post_warmup"
        adapter = result.builders[0]
        assert adapter.measured and set(adapter.built) >= {"prefill", "mixed", "decode"}
        made = {a.phase for a in result.allocations if a.owner == adapter.name and a.kind == "device"}
        assert RESERVATION in made  # vLLM's float workspace, its wrappers and its graphs' wrappers, before sizing
        workspace = [a for a in result.allocations if "_get_workspace_buffer" in (a.stack or "")]
        assert len(workspace) == 1 and workspace[0].phase == RESERVATION
        graphs = adapter.builders[0]._decode_wrappers_cudagraph
        assert len(graphs) == 4  # one per captured decode size, made in the window
    finally:
        close_parts(result)


def _late_builder(when: str) -> type:
    """The pull request's own builder (it builds its wrappers in the window without planning them), plus a persistent
    scratch that the builder makes on its first ``build()`` (``warmup``: vLLM 0.34 runs it before its sizing point,
    0.33's window never does) or on its first single-request prefill (``serving``: no warmup step has one)."""
    base = pull_request_builder(plan=False)

    class LateScratch(base):  # type: ignore[misc, valid-type]  # a class made at run time from the installed vLLM
        scratch: torch.Tensor | None = None

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):  # noqa: ANN001, ANN202
            first_prefill = common_attn_metadata.num_reqs == 1 and common_attn_metadata.max_query_len > 1
            if type(self).scratch is None and (when == "warmup" or first_prefill):
                type(self).scratch = torch.empty(SCRATCH, dtype=torch.uint8, device=self.device)
            return super().build(common_prefix_len, common_attn_metadata, fast_build)

    return LateScratch


@pytest.mark.parametrize("when", ["warmup", "serving"])
@pytest.mark.parametrize("kv_sizing", ["engine", "profile"])
def test_memory_made_after_the_engines_sizing_point_is_refused_in_either_mode(when, kv_sizing):
    """Memory made on a serving step is invisible under every vLLM and mode; memory made in warmup only where the
    profiling window sizes the cache (0.33, or 0.34 asked for the window). Judged on the scratch's own bytes."""
    cls = _late_builder(when)
    backend = Backend(name=f"late-{when}", torch_mode=True, policy=VLLM_POLICY,
                      make_builders=lambda case: make_vllm_builders(case, v2=True, builder_cls=cls))
    case = case_with(kv_sizing)
    result = run_lifecycle(backend, case)
    try:
        assert not result.errors, result.errors[0].traceback
        scratch, = [a for a in result.allocations if a.nbytes == SCRATCH]
        failures = failing_checks(result).get("persistent_memory_visible_at_closing", [])
        extensible = result.kv_sizing.name == EXTENSIBLE
        seen = not (when == "serving" or not extensible)
        assert (PHASE_INDEX[scratch.phase] < PHASE_INDEX["closing_measurement"]) is seen, scratch.phase
        named = [f for f in failures if f"({SCRATCH} bytes) from build()" in f and "test_vllm_releases.py:" in f]
        assert bool(named) is not seen, failures
        if when == "serving":
            assert scratch.phase == SERVING
        if not extensible:
            assert isinstance(result.builders[0], ReservingVllmBuilder)
    finally:
        cls.scratch = None
        close_parts(result)
