"""vllm-hybrid-gdn (examples/vllm-flashinfer-reserving): the reserving FlashInfer builder plus vLLM's released
GDNAttentionMetadataBuilder, declared NEUTRAL as the vLLM pull request declares it, on a Qwen3-Next-like hybrid
model (issue 24, point 3). What the suite finds: vLLM's GDN builder keeps CUDA-graph staging buffers of its own,
made in its constructor after KV sizing, so NEUTRAL does not hold."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
from pytest_kvprofile.contract.backends import layout_refusal
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.engines.vllm.gdn import gdn_groups, mamba_spec
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.models import kv_bytes_per_token
from pytest_kvprofile.matrix.schema import MatrixError, load_matrix, load_matrix_text

pytestmark = pytest.mark.usefixtures("vllm_flashinfer")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "vllm-flashinfer-reserving"))
from vllm_flashinfer_reserving import hybrid_backends  # noqa: E402 - the example is not installed by the test command

HYBRID = hybrid_backends()[0]
CASES = {c.id: c for c in load_matrix(ROOT / "matrices" / "hybrid.yaml").cases}
CASE = CASES["qwen3-next-80b-a3b-tp2-dcp1-mtp0-b200-gmu0.90"]


def test_the_hybrid_model_is_qwen3_next_shaped():
    model = CASE.model
    assert model.attention_layers == tuple(range(3, 48, 4))  # full attention every 4th layer
    assert len(model.linear_layers) == 36
    assert [len(g) for g in gdn_groups(CASE)] == [12, 12, 12]  # vLLM's uniform-page-size grouping
    # the GDN state is per request: only the 12 attention layers cost KV bytes per token (1 KV head of 256 at TP2)
    assert kv_bytes_per_token(model, 2, 1) == 12 * 2 * 1 * 256 * 2


def test_the_gdn_state_spec_is_vllms():
    spec = mamba_spec(CASE)
    conv, temporal = spec.shapes
    assert sorted(conv) == [3, (16 * 128 * 2 + 32 * 128) // 2]  # conv kernel 4 - 1, conv channels / TP
    assert temporal == (16, 128, 128)  # 32 value heads / TP, head dims


def test_a_hybrid_model_missing_a_gdn_key_names_it():
    text = (ROOT / "matrices" / "hybrid.yaml").read_text().replace("    linear_heads_v: 32\n", "")
    with pytest.raises(MatrixError, match=r"hybrid\.yaml: models\.qwen3-next-80b-a3b\.linear_heads_v: missing"):
        load_matrix_text(text, "hybrid.yaml")


def test_the_hybrid_backend_refuses_models_without_gdn_layers():
    ci = load_matrix(ROOT / "matrices" / "ci.yaml").cases[0]
    assert "no GDN layers" in (layout_refusal(HYBRID, ci) or "")
    assert layout_refusal(HYBRID, CASE) is None


def test_the_suite_finds_that_vllms_gdn_builder_is_not_neutral():
    result = run_lifecycle(HYBRID, CASE)
    try:
        declared = dict(result.resolution.declarations)
        assert declared == {"vllm-flashinfer-reserving": ProfilingSupport.REQUIRED,
                            "vllm-gdn": ProfilingSupport.NEUTRAL}
        assert result.path == "profiling" and not result.errors
        kept = [a for a in result.allocations if a.owner == "vllm-gdn" and a.kind == "device" and a.freed_phase is None]
        # 6 builders (2 micro-batches x 3 groups), 8 CUDA-graph staging buffers each, made in the constructor
        assert len(kept) == 48 and all(a.phase == lc.REBIND for a in kept)
        assert all("vllm/v1/attention/backends/gdn_attn.py" in a.stack and " in __init__" in a.stack for a in kept)
        failing = failing_checks(result)
        assert "support_declaration" in failing
        message = " ".join(failing["support_declaration"])
        assert "'vllm-gdn' declares NEUTRAL" in message and "gdn_attn.py" in message
        assert "builder 'vllm-gdn': " in " ".join(failing["persistent_memory_visible_at_closing"])
        # issue 51, item 3: GDN's chunked scan is the layer's; the builder's builds free metadata only, never a
        # scratch a profile-forward dummy_run warmed, so nothing is a forward scratch here
        assert "transient_peak_profiled" not in failing
        assert not [t for t in result.transients if t.builder == "vllm-gdn" and t.method == "dummy_run"]
        gdn_builds = [t.nbytes for t in result.transients if t.builder == "vllm-gdn" and t.method == "build"]
        assert gdn_builds and max(gdn_builds) < 1 << 20, gdn_builds
        cost = post_kv_cost(result)
        assert cost is not None
        assert sum(s.nbytes for s in cost.sources if s.owner == "vllm-gdn") == sum(a.nbytes for a in kept) == 44592
    finally:
        close_parts(result)
