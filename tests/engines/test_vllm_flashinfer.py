"""vLLM's own FlashInferMetadataBuilder (the installed wheel, unmodified) under the harness: the stand-ins, the
config a case becomes, both runner integrations, the reservation mapping, and cases the adapter refuses."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.engines.vllm import config as vc
from pytest_kvprofile.engines.vllm import standins as vs
from pytest_kvprofile.engines.vllm.flashinfer import (
    VLLM_BACKENDS,
    ReservingVllmBuilder,
    VllmFlashInferBuilder,
    make_vllm_builders,
    map_support,
    reservation_api,
)
from pytest_kvprofile.lifecycle.driver import run_lifecycle
from pytest_kvprofile.lifecycle.phases import CAPTURE, POST_KV_PHASES, RESERVATION
from pytest_kvprofile.lifecycle.record import LEGACY, PROFILING
from pytest_kvprofile.matrix.cases import Envelope, layout_case
from pytest_kvprofile.matrix.gpus import lookup_gpu
from pytest_kvprofile.matrix.models import ModelSpec
from pytest_kvprofile.units import MiB

pytestmark = pytest.mark.usefixtures("vllm_flashinfer")

FI_MODULE = "vllm.v1.attention.backends.flashinfer"
SMALL = Envelope(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048, page_size=16,
                 cuda_graph_sizes=(1, 2, 4, 8), num_ubatches=1, kv_sizing="profile")
"""The profiling window on every vLLM (0.34 is asked to turn its extensible KV cache off): these tests are about how
vLLM's builders meet that window; test_vllm_releases.py has 0.34's default."""
QWEN = ModelSpec("qwen3-8b", heads_q=32, heads_kv=8, head_dim=128, num_layers=4, weights_gib=1.0, hidden_size=4096)
GLM = ModelSpec("glm-32q2kv", heads_q=32, heads_kv=2, head_dim=128, num_layers=4, weights_gib=1.0, hidden_size=4096)


def small_case(model=QWEN, gpu="L40S", tp=1, dcp=1, mtp=0, envelope=SMALL):
    return layout_case(model, lookup_gpu(gpu), tp, dcp, mtp, envelope)


@pytest.fixture(scope="module")
def fi_module():
    return vs.import_vllm_flashinfer()


# -- import and registry -------------------------------------------------------------------------------------

def test_registry_lists_the_backends_without_importing_vllm():
    program = ("import sys; from pytest_kvprofile.registry import builtin_backends; b = builtin_backends(); "
               "print(sorted(n for n in b if n.startswith('vllm')), 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    assert "['vllm-flashinfer', 'vllm-flashinfer-v2'] False" in out


# -- the stand-ins, one test each ----------------------------------------------------------------------------

def test_standin_platform_answers_the_gpu_and_is_undone(fi_module):
    import vllm.platforms as platforms

    before = platforms._current_platform
    with vs.standin_platform(lookup_gpu("B200"), ranks=4) as platform:
        from vllm.platforms import current_platform

        assert current_platform is platform and platform.is_cuda()
        assert tuple(platform.get_device_capability()) == (10, 0)
        assert platform.is_device_capability_family(100) and platform.device_count() == 4
        assert platform.support_static_graph_mode()
    assert platforms._current_platform is before


def test_no_nvidia_artifactory_answers_false_without_network_and_is_undone(fi_module):
    import vllm.utils.flashinfer as fi_utils

    original = fi_utils.has_nvidia_artifactory
    with vs.no_nvidia_artifactory():
        assert fi_utils.has_nvidia_artifactory() is False
    assert fi_utils.has_nvidia_artifactory is original


def test_host_copy_page_indices_does_the_triton_kernels_copy_and_is_undone(fi_module):
    original = fi_module._copy_page_indices_kernel
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    out = torch.full((5,), -1, dtype=torch.int32)
    with vs.host_copy_page_indices():
        fi_module._copy_page_indices_kernel[(3,)](out, table, table.stride(0), indptr, BLOCK_SIZE=1024)
    assert out.tolist() == [0, 1, 8, 9, 10]
    assert fi_module._copy_page_indices_kernel is original


def test_dcp_group_is_rank_zero_of_the_case_group_and_is_undone(fi_module):
    import vllm.distributed.parallel_state as ps

    before = ps._DCP
    with vs.dcp_group(2):
        assert (ps._DCP.world_size, ps._DCP.rank_in_group) == (2, 0)
    with vs.dcp_group(1):
        assert ps._DCP is before
    assert ps._DCP is before


def test_vllm_caches_are_cleared_on_entry_and_exit(fi_module):
    import vllm.utils.flashinfer as fi_utils

    with vs.standin_platform(lookup_gpu("L40S")), vs.no_nvidia_artifactory():
        fi_utils.supports_trtllm_attention(False)
        assert fi_utils.supports_trtllm_attention.cache_info().currsize == 1
        with vs.vllm_caches_cleared():
            assert fi_utils.supports_trtllm_attention.cache_info().currsize == 0
            fi_utils.supports_trtllm_attention(False)
        assert fi_utils.supports_trtllm_attention.cache_info().currsize == 0


def test_cuda_version_is_set_only_when_torch_has_none(monkeypatch):
    import torch.version

    monkeypatch.setattr(torch.version, "cuda", None)
    with vs.cuda_version():
        assert torch.version.cuda == "13.0"
    assert torch.version.cuda is None
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with vs.cuda_version():
        assert torch.version.cuda == "12.8"


def test_standin_model_is_registered_only_inside(fi_module):
    from vllm.model_executor.models.registry import ModelRegistry

    with vc.standin_model_registered():
        assert vc.STANDIN_ARCHITECTURE in ModelRegistry.models
    assert vc.STANDIN_ARCHITECTURE not in ModelRegistry.models


# -- the config a case becomes --------------------------------------------------------------------------------

def test_a_case_becomes_vllms_config_from_a_local_hf_config(tmp_path):
    case = small_case(model=GLM, tp=4, dcp=2, mtp=1)
    folder = vc.hf_config_dir(case, root=tmp_path)
    assert (folder / "config.json").exists()
    with vs.vllm_standins(case.gpu, dcp=case.dcp, ranks=case.tp):
        config = vc.make_vllm_config(case, hf_dir=folder)
    assert config.model_config.get_num_attention_heads(config.parallel_config) == 8
    assert config.parallel_config.decode_context_parallel_size == 2
    assert config.num_speculative_tokens == 1
    assert config.scheduler_config.max_num_batched_tokens == 512
    assert config.compilation_config.cudagraph_mode.decode_mode().name == "FULL"


def test_an_mla_case_is_refused_with_the_case_and_the_reason():
    mla = dataclasses.replace(QWEN, name="mla", attention="mla")
    with pytest.raises(vc.UnexpressibleCase, match="FlashInferMLAMetadataBuilder"):
        VllmFlashInferBuilder(small_case(model=mla))


def test_a_dcp_layout_vllm_rejects_is_an_error_naming_the_case_not_a_crash():
    case = small_case(tp=4, dcp=2)  # 8 KV heads > TP=4: vLLM's own DCP check refuses it
    result = run_lifecycle(VLLM_BACKENDS[0], case)
    assert len(result.errors) == 1
    assert case.id in result.errors[0].message and "vLLM rejects this layout" in result.errors[0].message


def test_the_backends_name_the_layouts_vllm_refuses_so_the_suite_skips_them():
    """vLLM's own DCP rule (TP above the KV heads) and the adapter's MLA refusal are refusals, not failures."""
    refuses = VLLM_BACKENDS[0].refuses_layout
    assert all(b.refuses_layout is refuses and b.requires == ("vllm",) for b in VLLM_BACKENDS)
    reason = refuses(small_case(tp=4, dcp=2))  # 8 KV heads: vLLM refuses DCP
    assert "vLLM rejects this layout" in reason and "Decode context parallelism" in reason
    assert refuses(small_case(model=GLM, tp=4, dcp=2)) is None  # 2 KV heads < TP=4: accepted
    blackwell = refuses(small_case(model=GLM, gpu="B200", tp=4, dcp=2))  # vLLM's DCP prefill: CUTLASS sm100 FMHA
    assert "CUTLASS sm100 FMHA" in blackwell and "does not drive" in blackwell
    assert refuses(small_case()) is None
    assert "FlashInferMLAMetadataBuilder" in refuses(small_case(model=dataclasses.replace(QWEN, name="mla",
                                                                                          attention="mla")))


def test_an_fp8_cache_is_refused_where_vllm_plans_an_fp8_query_the_simulated_gpu_cannot_serve():
    """vLLM's get_q_data_type: an FP8 query on SM90 (FlashInfer's FA3 prefill: no host planner) and an E4M3 query
    on SM100 (trtllm-gen; offline, FlashInfer's FA2 decode refuses it); model-dtype queries elsewhere run."""
    refuses = VLLM_BACKENDS[0].refuses_layout

    def fp8(kv: str, gpu: str) -> str | None:
        return refuses(small_case(model=dataclasses.replace(QWEN, kv_dtype=kv), gpu=gpu))

    assert "FA3" in (fp8("fp8_e4m3", "H100") or "") and "FA3" in (fp8("fp8_e5m2", "H100") or "")
    assert "takes an e4m3 query only on SM120" in (fp8("fp8", "B200") or "")
    assert fp8("fp8_e5m2", "B200") is None and fp8("fp8_e4m3", "L40S") is None
    assert fp8("fp8_e4m3", "RTX PRO 6000 Blackwell") is None


@pytest.mark.parametrize("kv", ["bf16", "fp16"])
def test_a_model_dtype_cache_on_sm90_is_refused_by_name_where_flashinfer_plans_fa3(kv):
    """FlashInfer's 'auto' prefill backend is FA3 on SM90 for a bf16/fp16 cache: vLLM's builder cannot serve a
    prefill on the simulated device, so the layout is refused by name at collection (it failed every H100/H200 case
    of the default matrix in serving before); an NVFP4 cache there is FA2 and runs."""
    case = small_case(model=dataclasses.replace(QWEN, kv_dtype=kv), gpu="H100")
    reason = VLLM_BACKENDS[0].refuses_layout(case) or ""
    assert "(SM90) FlashInfer's 'auto' backend plans vLLM's prefill on FA3" in reason
    nvfp4 = small_case(model=dataclasses.replace(QWEN, kv_dtype="nvfp4"), gpu="H100")
    assert VLLM_BACKENDS[0].refuses_layout(nvfp4) is None
    result = run_lifecycle(VLLM_BACKENDS[0], nvfp4)
    assert not result.errors, result.errors[0].traceback


def test_an_nvfp4_cache_runs_vllms_fa2_path_off_sm100_and_is_refused_by_name_on_it():
    """vLLM 0.33 reads NVFP4 with FA2 on packed uint8 off SM100 (and refuses it there with DCP, in its own words);
    on SM100 it is trtllm-gen only, which the simulated GPU cannot plan, so the layout is refused by name."""
    nvfp4 = dataclasses.replace(QWEN, kv_dtype="nvfp4")
    refuses = VLLM_BACKENDS[0].refuses_layout
    assert "trtllm-gen kernels only on sm_100" in (refuses(small_case(model=nvfp4, gpu="B200")) or "")
    assert "The DCP prefill wrapper cannot read NVFP4 block scales." in (
        refuses(small_case(model=dataclasses.replace(nvfp4, heads_kv=2), tp=4, dcp=2)) or "")
    case = small_case(model=nvfp4)
    assert refuses(case) is None
    result = run_lifecycle(VLLM_BACKENDS[0], case)
    assert not result.errors, result.errors[0].traceback
    builders = list(result.builders[0].builders.values())
    assert builders and all(b.nvfp4_fa2 and b.kv_cache_dtype == torch.uint8 for b in builders)


@pytest.mark.slow  # a subprocess classifying every ci case with vLLM's builders
def test_the_suite_lists_a_refused_layout_as_skipped_and_the_verdict_does_not_count_it(pytester):
    ci = Path(__file__).resolve().parents[2] / "matrices" / "ci.yaml"
    refused = "qwen3-8b-tp4-dcp2-mtp0-l40s-gmu0.90"
    out = pytester.path / "verdict.json"
    result = pytester.runpytest_subprocess(
        "--pyargs", "pytest_kvprofile.suite", "--kvprofile-matrix", str(ci), "-p", "no:cacheprovider", "-rs",
        "--kvprofile-backend", "vllm-flashinfer", "-k", refused, "--kvprofile-verdict", str(out))
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"SKIPPED*the layout is refused: case {refused}: vLLM rejects this layout: "
                                 "*Decode context parallelism*", "*1 skipped*"])
    (b,) = json.loads(out.read_text())["backends"]
    assert b["results"] == [] and "failed" not in b["counts"]
    # 64 runnable ci cases: vLLM's config rejects 4 DCP layouts, 8 are MLA (vLLM's FlashInfer MLA backend's), 8 are DCP2
    # on B200 (its CUTLASS FMHA prefill), 2 fp8 on B200 go to trtllm-gen only, 2 plan no FA2 route: 24 refused by name
    assert len(b["refused_layouts"]) == 24 and refused in {r["case"] for r in b["refused_layouts"]}
    assert b["coverage"]["cases_in_matrix"] == 40


# -- the two runner integrations ------------------------------------------------------------------------------

def _post_kv(result):
    return [a for a in result.allocations if a.phase in POST_KV_PHASES and a.stack]


@pytest.mark.parametrize("backend", VLLM_BACKENDS, ids=lambda b: b.name)
def test_vllms_builder_runs_every_phase_on_the_legacy_path(backend):
    result = run_lifecycle(backend, small_case())
    assert not result.errors, result.errors[0].traceback
    assert result.path == LEGACY
    assert result.resolution is not None and not result.resolution.enabled
    builder = result.builders[0]
    assert set(builder.built) == {"prefill", "mixed", "decode", "kernel_warmup"}  # vLLM's warmup batch, once
    assert builder.built["kernel_warmup"] == 1
    stacks = [a.stack for a in _post_kv(result)]
    assert any("vllm/v1/attention/backends/flashinfer.py:" in s for s in stacks)
    assert any("/flashinfer/prefill.py:" in s for s in stacks) and any("/flashinfer/decode.py:" in s for s in stacks)
    assert all(a.phase not in ("reservation", "profile_run") or a.owner != builder.name for a in result.allocations)


def _float_workspaces(result):
    return [a for a in result.allocations if "_get_workspace_buffer" in (a.stack or "")]


def test_v1_makes_one_lazy_float_workspace_per_micro_batch_builder(v1_runner):
    case = small_case(envelope=dataclasses.replace(SMALL, num_ubatches=2))
    result = run_lifecycle(VLLM_BACKENDS[0], case)
    assert not result.errors, result.errors[0].traceback
    spaces = _float_workspaces(result)
    # micro-batch 0's in vLLM's kernel warmup (before capture and the lock), micro-batch 1's in capture
    assert len(spaces) == 2 and [a.phase for a in spaces] == ["warmup", "capture"]
    assert all(a.nbytes >= 394 * MiB for a in spaces)


def test_v2_makes_one_eager_float_workspace_shared_by_every_builder():
    case = small_case(envelope=dataclasses.replace(SMALL, num_ubatches=2))
    result = run_lifecycle(VLLM_BACKENDS[1], case)
    assert not result.errors, result.errors[0].traceback
    spaces = _float_workspaces(result)
    assert len(spaces) == 1 and spaces[0].phase == "rebind"
    first, second = (b._workspace_buffer for b in result.builders[0].builders.values())
    assert first is second


@pytest.mark.parametrize("backend", VLLM_BACKENDS, ids=lambda b: b.name)
def test_vllms_wrapper_buffers_carry_their_roles(backend):
    """FlashInfer's wrappers give the buffers vLLM hands them their roles: vLLM's own float workspace is a float
    workspace beside the arena (it counts as float workspace), each wrapper's int workspace and pinned mirror."""
    result = run_lifecycle(backend, small_case())
    assert not result.errors, result.errors[0].traceback
    assert {a.role for a in _float_workspaces(result)} == {Role.FLOAT_WORKSPACE}
    roles = {a.role for a in result.allocations if a.owner == result.builders[0].name}
    assert {Role.FLOAT_WORKSPACE, Role.INT_WORKSPACE, Role.PINNED_MIRROR} <= roles
    ints = [a for a in result.allocations if a.role is Role.INT_WORKSPACE]
    assert ints and all("/flashinfer/" in (a.stack or "") for a in ints)


def test_cuda_graph_decode_wrappers_are_vllms_own_per_captured_size():
    result = run_lifecycle(VLLM_BACKENDS[0], small_case())
    assert not result.errors, result.errors[0].traceback
    keys = sorted(result.builders[0].builders[0]._decode_wrappers_cudagraph)
    # vLLM 0.33 keys them (batch size, query length per request); 0.32 and older by batch size
    assert [k[0] if isinstance(k, tuple) else k for k in keys] == [1, 2, 4, 8]


@pytest.mark.parametrize("dcp, mtp, full", [(1, 1, True), (2, 0, True), (2, 1, False)])
def test_attention_is_captured_only_where_vllms_runner_resolves_full_decode_graphs(dcp, mtp, full):
    """Under DCP FlashInfer graphs single-token decodes only, so with MTP vLLM's runner falls back to piecewise
    graphs: its builders never make CUDA-graph decode wrappers and capture builds no attention metadata (building
    it anyway once refused the reserving example for a buffer vLLM never captures)."""
    case = small_case(model=GLM, tp=4, dcp=dcp, mtp=mtp)
    result = run_lifecycle(VLLM_BACKENDS[0], case)
    assert not result.errors, result.errors[0].traceback
    adapter = result.builders[0]
    assert adapter.captures_attention() is full
    assert adapter.builders[0].enable_cuda_graph is full  # vLLM's own reading of the resolved mode
    captured = [a for a in result.allocations if a.phase == CAPTURE and a.owner == adapter.name]
    assert bool(captured) is full


# -- the reservation mapping ----------------------------------------------------------------------------------

def test_support_answers_map_onto_the_protocol():
    class Answer:
        name = "NEUTRAL"

    assert map_support(Answer()) is ProfilingSupport.NEUTRAL
    assert map_support(True) is ProfilingSupport.REQUIRED
    assert map_support(False) is ProfilingSupport.NEUTRAL
    assert map_support(None) is ProfilingSupport.UNSUPPORTED
    assert map_support("REQUIRED") == "REQUIRED"  # passed through: the harness rejects it as invalid


def test_the_released_builder_declares_nothing(fi_module, v1_runner):
    assert reservation_api(fi_module.FlashInferMetadataBuilder) is None
    builder, = make_vllm_builders(small_case())
    assert type(builder) is VllmFlashInferBuilder
    assert not hasattr(builder, "get_persistent_workspace_memory_profiling_support")


@pytest.fixture(scope="module")
def pull_request_double(fi_module):
    """vLLM's real builder with the pull request's method names: a (vllm_config, kv_cache_spec) support
    classmethod and ``prepare_workspace_for_profiling(materialize)`` that makes the wrappers."""

    class PullRequestBuilder(fi_module.FlashInferMetadataBuilder):
        @classmethod
        def persistent_workspace_profiling_support(cls, vllm_config, kv_cache_spec):
            return True

        def prepare_workspace_for_profiling(self, materialize):
            self._get_workspace_buffer()
            if materialize:
                self._get_prefill_wrapper()
                self._get_decode_wrapper(self.max_num_reqs)

    return PullRequestBuilder


def test_a_builder_with_the_pull_requests_names_takes_the_reservation_path(pull_request_double):
    builder, = make_vllm_builders(small_case(), builder_cls=pull_request_double)
    assert isinstance(builder, ReservingVllmBuilder)
    backend = Backend(name="vllm-pr-double", make_builders=lambda case: make_vllm_builders(
        case, builder_cls=pull_request_double), torch_mode=True)
    result = run_lifecycle(backend, small_case())
    assert not result.errors, result.errors[0].traceback
    assert result.path == PROFILING
    lease, = result.leases
    assert lease.lease.released
    reserved = [a for a in result.allocations if a.phase == RESERVATION and a.owner == builder.name]
    assert any("_get_workspace_buffer" in (a.stack or "") for a in reserved)
    assert any("/flashinfer/prefill.py:" in (a.stack or "") for a in reserved)
