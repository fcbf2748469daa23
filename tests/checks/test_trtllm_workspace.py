"""Issue 51, item 4: trtllm-gen workspaces, MHA and MLA, sized from FlashInfer's own launcher.

A trtllm-gen workspace sized without the LSE slab that DCP asks for is refused on every ci case with DCP, with the
bytes, the formula and what to do; its correct twin (``stub-trtllm-gen-sized``) and vLLM's fixed 394 MiB workspace
pass on every ci case; an MLA DCP case is shown alone; the carve is tied to the installed launcher and to vLLM's own
formula; ``kvprofile size`` sizes an MLA case's decode."""

from __future__ import annotations

import json
from typing import Any

from pytest_kvprofile.attention.trtllm import LAUNCHER_TEXT, launcher_path, softmax_stats_bytes
from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.stubs import ROUTE_STUB_BACKENDS
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.report.sweep import sweep
from pytest_kvprofile.sizing.case import sizable_refusal
from pytest_kvprofile.sizing.trtllm import trtllm_carve, trtllm_need, trtllm_routes

BACKENDS = {b.name: b for b in (*MUTANT_BACKENDS, *ROUTE_STUB_BACKENDS)}
MUTANT, TWIN = "mutant-11e-trtllm-no-lse-slab", "stub-trtllm-gen-sized"
CHECK = "trtllm_workspace_covers_launcher"
MHA_ALONE = "qwen3-8b-tp4-dcp2-mtp1-b200-gmu0.90"
MLA_ALONE = "deepseek-v2-lite-mla-tp2-dcp2-mtp0-b200-gmu0.90"


def _cases(matrix: str) -> list[Any]:
    return [c for c in load_matrix(packaged_matrix(matrix)).cases if c.skip_reason is None
            and sizable_refusal(c) is None]


def _case(matrix: str, case_id: str) -> Any:
    return next(c for c in _cases(matrix) if c.id == case_id)


def _failed(name: str, case: Any) -> dict[str, list[str]]:
    result = run_lifecycle(BACKENDS[name], case)
    close_parts(result)
    return failing_checks(result)


def test_a_workspace_without_the_lse_slab_is_refused_on_every_ci_dcp_case_and_its_twin_passes_everywhere():
    cases = _cases("ci")
    dcp = {c.id for c in cases if c.dcp > 1}
    bad = sweep([BACKENDS[MUTANT]], cases)[0]
    assert bad.cases == 62 and dict(bad.failures) == {CHECK: len(dcp)} and len(dcp) == 16
    assert len(bad.escaped) == 62 - len(dcp)
    for name in (TWIN, "stub-trtllm-gen"):  # sized exactly; vLLM's fixed 394 MiB
        good = sweep([BACKENDS[name]], cases)[0]
        assert good.cases == 62 and len(good.escaped) == 62, (name, good.failures)


def test_mha_dcp_case_alone_names_the_bytes_the_slab_and_the_fix():
    case = _case("ci", MHA_ALONE)
    carve = trtllm_carve(case, "decode")
    assert carve.lse and carve.num_qo_heads == 16 and carve.batch_size == 256 and carve.max_q_len == 2
    assert carve.slab_bytes == 8 * 16 * 256 * 256 + (1 << 20)
    message = " ".join(_failed(MUTANT, case)[CHECK])
    assert message.startswith("builder 'flashinfer-trtllm-gen-sized': trtllm-gen workspace short by 9.00 MiB "
                              f"({carve.slab_bytes} bytes) for its decode launch when serving"), message
    assert f"({carve.total_bytes} bytes)" in message and "LSE slab 8 B x 16 q heads x 256 x round_up(2, 256)" in message
    assert "in phase 'reservation'" in message and "trtllm_fmha_kernel_launcher.cu" in message
    assert "Under DCP 2" in message and "--trtllm prefill,decode" in message
    assert _failed(TWIN, case) == {}


def test_mla_dcp_case_alone_the_slab_scales_with_heads_x_dcp_x_step_tokens():
    case = _case("blackwell", MLA_ALONE)
    assert trtllm_routes(case, ()) == ("prefill", "decode") and trtllm_routes(case, ("prefill",)) == ()
    need, carve = trtllm_need(case, ("decode",))
    assert carve is not None and carve.num_qo_heads == 8 * 2
    assert carve.batch_size == case.envelope.max_num_batched_tokens
    assert carve.slab_bytes == 8 * 16 * 8192 * 256 + (1 << 20) == 269484032
    message = " ".join(_failed(MUTANT, case)[CHECK])
    assert "short by 257.00 MiB (269484032 bytes)" in message and "2-CTA MMA" in message, message
    assert _failed(TWIN, case) == {} and _failed("stub-trtllm-gen", case) == {}


def test_without_dcp_no_lse_slab_is_carved():
    case = _case("ci", "deepseek-v2-lite-mla-tp4-dcp1-mtp0-b200-gmu0.90-kvbf16")
    carve = trtllm_carve(case, "decode")
    assert not carve.lse and carve.slab_bytes == 0 and carve.scratch_bytes > 0
    assert trtllm_carve(case, "prefill").total_bytes == 0


def test_the_carve_restates_the_installed_launcher():
    path = launcher_path()
    assert path is not None, "FlashInfer's csrc/trtllm_fmha_kernel_launcher.cu is not installed"
    text = path.read_text()
    missing = [line for line in LAUNCHER_TEXT if line not in text]
    assert not missing, f"FlashInfer's trtllm-gen launcher changed its carve: {missing}"


def test_the_mla_slab_is_vllms_own_formula():
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import compute_trtllm_sparse_mla_workspace_bytes

    for dcp, heads, tokens in ((2, 8, 8192), (4, 4, 2048), (8, 16, 8192)):
        assert compute_trtllm_sparse_mla_workspace_bytes(0, dcp, heads, tokens) == \
            softmax_stats_bytes(heads * dcp, tokens, 1)


def test_kvprofile_size_sizes_an_mla_decode_on_trtllm_gen(capsys):
    from pytest_kvprofile.cli import main

    assert main(["size", "--model", "deepseek-v2-lite-mla", "--gpu", "B200", "--routes", "decode", "--tp", "2",
                 "--dcp", "2", "--matrix", str(packaged_matrix("blackwell")), "--no-oracle", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    case = _case("blackwell", MLA_ALONE)
    assert out["trtllm_workspace_bytes"] == trtllm_need(case, ("decode",))[0] and out["trtllm_worst_route"] == "decode"
    assert out["trtllm"]["decode"]["lse_slab_bytes"] == 269484032
