"""The GPU tier's pure parts on CPU: the route probes, and the built-in ``flashinfer`` builders (the GPU tier's too)
declaring like the stub without touching CUDA."""

from __future__ import annotations

from pytest_kvprofile.builtin.flashinfer_real import (
    REAL_FLASHINFER_BACKENDS,
    REAL_FLASHINFER_MUTANTS,
    LazyRealFlashInferBuilder,
)
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.matrix.schema import load_matrix_text

CASE = load_matrix_text(
    "name: t\nenvelope: {max_num_seqs: 8, max_num_batched_tokens: 512, max_model_len: 4096}\nmodels:\n"
    "  m: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 4, weights_gib: 2}\ngpus: [H200]\ntp: [1]\n"
    "mtp: [0, 1]\ngmu: [0.9]\n", "inline.yaml").cases


def test_builders_declare_like_the_stub_without_touching_cuda():
    case = CASE[0]
    b = REAL_FLASHINFER_BACKENDS[0].make_builders(case)[0]
    assert b.get_persistent_workspace_memory_profiling_support() is ProfilingSupport.REQUIRED
    from pytest_kvprofile.sizing.case import for_case

    assert b.declared_workspace(case).float_bytes == for_case(case).float_bytes
    lazy = REAL_FLASHINFER_MUTANTS[0].make_builders(case)[0]
    assert isinstance(lazy, LazyRealFlashInferBuilder) and lazy.warmup_materializes_persistent is False


def test_builder_on_a_device_without_tensors_says_what_it_needs():
    """Outside torch mode the simulated device hands out no tensor: the builder names what it runs on."""
    from pytest_kvprofile.lifecycle.driver import run_lifecycle

    real = REAL_FLASHINFER_BACKENDS[0]
    plain = Backend(name="no-torch-mode", make_builders=real.make_builders)
    result = run_lifecycle(plain, CASE[0])
    assert result.aborted_in == "reservation"
    assert "use Backend(torch_mode=True) on a simulated device (or a CUDA device)" in result.errors[0].message


def test_route_probes_cover_prefill_and_decode():
    from pytest_kvprofile.gpu.sizing_probe import route_probes

    probes = route_probes(CASE[1])  # mtp=1: tensor-core decode with 2 query tokens per request
    routes = {p.route for p in probes}
    assert any(r.startswith("prefill") for r in routes) and any(r.startswith("decode_tc") for r in routes)
    assert sum(p.binding for p in probes) == 1
    for p in probes:
        assert p.float_bytes > 0 and len(p.qo_lens) == len(p.kv_lens)
        assert p.layout().num_physical_pages <= 4096


def test_the_gpu_tier_skips_a_layout_the_real_builders_refuse_by_name():
    """An MLA case on the GPU tier is skipped with the builders' reason, not failed in their constructor."""
    import pytest

    from pytest_kvprofile.gpu_suite.test_gpu_tier import _skip_refused
    from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

    mla = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.model.attention == "mla")
    with pytest.raises(pytest.skip.Exception, match="MLA layouts run FlashInfer's MLA planner"):
        _skip_refused(REAL_FLASHINFER_BACKENDS[0], mla)
    _skip_refused(REAL_FLASHINFER_BACKENDS[0], CASE[0])  # a GQA case runs
