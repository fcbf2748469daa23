"""examples/vllm-flashinfer-reserving: vLLM's released FlashInferMetadataBuilder taught the contract passes every
check (issue 24): at the planner's exact arena on one case in the plain run, at both arenas on every ci case vLLM
accepts with ``-m slow``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.backends import layout_refusal
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

pytestmark = pytest.mark.usefixtures("vllm_flashinfer")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "vllm-flashinfer-reserving"))
from vllm_flashinfer_reserving import backends  # noqa: E402 - the example is not installed by the test command

BACKENDS = {b.name: b for b in backends()}
CI = [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None]
FIRST = next(c for c in CI if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90")


def _failures(name: str, case) -> dict[str, list[str]]:
    result = run_lifecycle(BACKENDS[name], case)
    close_parts(result)
    assert result.builders[0].get_persistent_workspace_memory_profiling_support().name == "REQUIRED"
    return failing_checks(result)


def test_the_reserving_builder_at_the_planners_arena_passes_every_check():
    assert _failures("vllm-flashinfer-reserving-exact", FIRST) == {}


def test_the_reserving_builder_passes_where_vllm_captures_no_attention_graph():
    """DCP with MTP: vLLM's runner captures piecewise graphs only, so nothing FlashInfer stages while planning is
    under a captured graph (once refused by ``captured_memory_stays``)."""
    case = next(c for c in CI if c.id == "glm-4-9b-32q2kv-tp4-dcp2-mtp1-l40s-gmu0.90")
    assert _failures("vllm-flashinfer-reserving", case) == {}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("case", CI, ids=lambda c: c.id)
def test_the_reserving_builders_pass_every_ci_case_vllm_accepts(name, case):
    if layout_refusal(BACKENDS[name], case) is not None:
        pytest.skip(f"vLLM refuses the layout: {layout_refusal(BACKENDS[name], case)}")
    assert _failures(name, case) == {}
