"""``engines/sglang/memory.py`` and ``scripts/sglang_table.py``: SGLang's static-path cost rows, its own default
``mem_fraction_static``, the tables of results/sglang-ci.md and the script's resumable journal.

The rows and the table need no SGLang; the default fraction and a row from a real run skip without it, naming the
install (scripts/install_sglang_cpu.sh)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from pytest_kvprofile.engines.sglang.memory import (
    SGLANG_ATTENTION_RESERVE,
    PostCaptureRow,
    SglangCostRow,
    post_capture_table,
    sglang_table,
)
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]
CASES = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
QWEN_L40S = CASES["qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"]
GLM_B200 = CASES["glm-4-9b-32q2kv-tp1-dcp1-mtp0-b200-gmu0.90"]


def _row(backend: int, fraction: float = 0.695) -> SglangCostRow:
    gpu = QWEN_L40S.gpu.memory_bytes
    return SglangCostRow(QWEN_L40S.id, gpu, backend, 4669, 512 * MiB, 13 * 8 * MiB, 13, 124 * MiB, 64 << 10,
                         (512 - 124) * MiB + 13 * (8 * MiB - (64 << 10)), 3490, fraction, int(gpu * (1 - fraction)))


def test_a_row_says_what_the_default_covers():
    over, under = _row(656 * MiB), _row(SGLANG_ATTENTION_RESERVE)
    assert not over.attention_share_covers and over.reserve_covers and under.attention_share_covers
    assert not _row(656 * MiB, fraction=0.99).reserve_covers  # 0.01 of 44.7 GiB is 458 MiB
    assert over.must_leave_fraction == pytest.approx(656 * MiB / QWEN_L40S.gpu.memory_bytes)


def test_the_table_has_a_line_per_row_and_names_each_refusal_once():
    lines = sglang_table([_row(656 * MiB)], {"m-tp1": "case m-tp1: MLA layouts are served by another backend"})
    assert lines[0].startswith("| case |") and lines[2].startswith(f"| {QWEN_L40S.id} | 656.0 MiB (4669 KV tokens)")
    assert "| no | yes |" in lines[2] and "13 x 8 MiB" in lines[2]
    assert lines[-1] == "- m-tp1: MLA layouts are served by another backend"


def test_a_row_whose_route_the_suite_does_not_size_reports_no_waste():
    unsized = dataclasses.replace(_row(512 * MiB), float_need_bytes=None, int_need_bytes=None, waste_bytes=None,
                                  waste_kv_tokens=None)
    line = sglang_table([unsized], {})[2]
    assert "not sized (FlashInfer's MLA planner" in line and "need" not in line.split("|")[4]


def test_the_script_resumes_from_its_journal_and_renders_without_running(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import sglang_table as script
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    journal = tmp_path / "rows.jsonl"
    row = dataclasses.asdict(_row(656 * MiB))  # a first-release line: no path, so the static one
    post = PostCaptureRow(QWEN_L40S.id, QWEN_L40S.gpu.memory_bytes, None, (), 0, 449 * MiB, 12794, 640 * MiB, 0.95)
    lines = [json.dumps(dict(row, seconds=1.0)), json.dumps({"case": "m", "refused": "why"}),
             json.dumps(dict(dataclasses.asdict(post), path="post_capture")),
             '{"case": "cut sh']  # a run killed part-way leaves a line cut short
    journal.write_text("\n".join(lines))
    rows, refused, posts = script.read_rows(journal)
    assert list(rows) == [QWEN_L40S.id] and rows[QWEN_L40S.id] == _row(656 * MiB) and refused == {"m": "why"}
    assert posts == {QWEN_L40S.id: post}
    out = tmp_path / "table.md"
    assert script.main(["--from-json", str(journal), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.count(f"| {QWEN_L40S.id} |") == 2 and "- m: why" in text and "Post-capture path:" in text


def test_a_post_capture_row_says_whether_sglangs_default_headroom_holds_the_serving_peak():
    gpu = QWEN_L40S.gpu.memory_bytes
    fits = PostCaptureRow(QWEN_L40S.id, gpu, headroom_bytes=640 * MiB, default_fraction=0.95)
    assert fits.default_headroom_bytes == int(gpu * 0.05) and fits.default_covers
    assert not dataclasses.replace(fits, default_fraction=0.99).default_covers  # 458 MiB < 640 MiB
    static = PostCaptureRow("m-dcp2", gpu, static_reason="SGLang sizes m-dcp2 statically: "
                            "post_capture_kv_sizing_planned() is False (dcp_size 2 != 1); the static path's cost is x")
    failing = dataclasses.replace(fits, failed=("persistent_memory_visible_at_closing",), late_bytes=64 * MiB)
    lines = post_capture_table([fits, static, failing])
    assert "| all pass | 0.00 MiB | 0.0 MiB (0 KV tokens) | 640.0 MiB | 0.950 (2289 MiB) | yes |" in lines[2]
    assert lines[3] == ("| m-dcp2 | sized statically: post_capture_kv_sizing_planned() is False (dcp_size 2 != 1) "
                        "| - | - | - | - | - |")
    assert "fails persistent_memory_visible_at_closing | 64.00 MiB" in lines[4]


# -- with SGLang -------------------------------------------------------------------------------------------------------

def test_sglangs_default_fraction_is_its_heuristic_on_the_cases_gpu(sglang_flashinfer):
    from pytest_kvprofile.engines.sglang.memory import default_mem_fraction

    l40s = default_mem_fraction(QWEN_L40S)
    reserve = (1 - l40s) * QWEN_L40S.gpu.memory_bytes
    # 512 MiB + 1.5 MiB per activation token (the chunked prefill, 8192) + TP and graph slack, no floor under 60 GiB
    assert 512 * MiB + 1.5 * 8192 * MiB <= reserve < 16 * GiB and l40s != 0.95  # 0.95: SGLang found no GPU memory
    b200 = default_mem_fraction(GLM_B200)
    assert (1 - b200) * GLM_B200.gpu.memory_bytes >= 10 * GiB - 0.001 * GLM_B200.gpu.memory_bytes  # its 10 GiB floor
    # with post-capture sizing planned SGLang reserves no activation or graph share: 1536 MiB + TP slack only (the
    # fraction is rounded to 3 places)
    post = default_mem_fraction(QWEN_L40S, post_capture=True)
    assert post > l40s and (1 - post) * QWEN_L40S.gpu.memory_bytes == pytest.approx((1536 + 128) * MiB, rel=0.02)


def test_a_row_from_a_run_reads_the_backends_workspaces_by_role(sglang_flashinfer):
    from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
    from pytest_kvprofile.engines.sglang.flashinfer import BACKEND_NAME, SGLANG_BACKENDS
    from pytest_kvprofile.engines.sglang.memory import cost_row
    from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
    from pytest_kvprofile.sizing.case import for_case

    result = run_lifecycle(SGLANG_BACKENDS[0], QWEN_L40S)
    try:
        row = cost_row(result, BACKEND_NAME, 0.695)
        cost = post_kv_cost(result)
    finally:
        close_parts(result)
    assert row is not None and row.float_workspace_bytes == 512 * MiB  # a Qwen3 architecture's workspace
    assert cost is not None and row.backend_bytes == sum(s.nbytes for s in cost.sources if s.owner == BACKEND_NAME)
    captures = len(QWEN_L40S.envelope.decode_captures(QWEN_L40S.mtp))
    assert row.int_workspaces == 4 + captures and row.int_workspace_bytes == row.int_workspaces * 8 * MiB
    assert row.float_need_bytes == for_case(QWEN_L40S).float_bytes < row.float_workspace_bytes
    assert row.waste_bytes == (512 * MiB - row.float_need_bytes) + row.int_workspaces * (8 * MiB - row.int_need_bytes)
    assert row.backend_bytes > row.float_workspace_bytes + row.int_workspace_bytes and not row.attention_share_covers


def test_an_mla_run_reads_sglangs_mla_workspace_and_sizes_no_waste(sglang_flashinfer):
    from pytest_kvprofile.engines.sglang.flashinfer import BACKEND_NAME, SGLANG_BACKENDS
    from pytest_kvprofile.engines.sglang.memory import cost_row, planner_need
    from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle

    case = CASES["deepseek-v2-lite-mla-tp1-dcp1-mtp0-l40s-gmu0.90-kvbf16"]
    result = run_lifecycle(SGLANG_BACKENDS[0], case)
    try:
        row = cost_row(result, BACKEND_NAME, 0.685)
        assert planner_need(result, BACKEND_NAME) is None  # it planned FlashInfer's MLA route, which is not sized
    finally:
        close_parts(result)
    assert row is not None and row.float_workspace_bytes == 384 * MiB  # get_buffer("flashinfer_mla_workspace")
    assert row.waste_bytes is None and row.float_need_bytes is None
