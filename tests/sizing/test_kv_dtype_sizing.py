"""Sizing follows the KV dtype (issue 35, point 2-3): the oracle, built from the installed FlashInfer's planner with
``sizeof(DTypeKV)``, confirms every fp8 case of ``kv-dtypes.yaml`` and ``default.yaml``; the CLI and the sizing report
say the same; KV tokens use the dtype."""

from __future__ import annotations

import json

import pytest

from pytest_kvprofile.cli import main
from pytest_kvprofile.matrix.models import kv_bytes_per_token
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing.case import UnsizableCase, for_case
from pytest_kvprofile.sizing.comparison import distinct_layout_cases, report_for_matrix

KV = packaged_matrix("kv-dtypes")


def _fp8(matrix: str) -> list:
    pytest.importorskip("flashinfer")
    cases = [c for c in distinct_layout_cases(load_matrix(matrix).cases) if c.model.kv.planner_bytes == 1]
    assert len(cases) >= 20
    return cases


@pytest.fixture(scope="module")
def fp8_cases():
    return _fp8(KV)


@pytest.mark.parametrize("matrix", ["kv-dtypes", "default"])
def test_the_oracle_confirms_every_fp8_case(matrix):
    cases = _fp8(packaged_matrix(matrix))
    assert {c.model.attention for c in cases} == {"mha", "mla"}
    for case in cases:
        res = for_case(case, use_oracle=True)
        assert res.kv_dtype_bytes == 1 and res.method == "oracle", case.id
        assert all(r.confirmed_by_oracle for r in res.routes.values()), (case.id, res.notes)


def test_cli_and_report_say_what_the_check_sizes(fp8_cases, capsys):
    rows = {(r["model"], r["kv_dtype"], r["gpu"], r["tp"], r["mtp"]): r for r in report_for_matrix(str(KV))}
    assert {r["kv_dtype"] for r in rows.values()} == {"bf16", "fp8", "fp8_e4m3", "fp8_e5m2"}
    for case in fp8_cases[:6]:
        assert main(["size", "--matrix", str(KV), "--model", case.model.name, "--gpu", case.gpu.name, "--tp",
                     str(case.tp), "--mtp", str(case.mtp), "--kv-dtype", case.model.kv_dtype, "--json"]) == 0
        cli = json.loads(capsys.readouterr().out)
        row = rows[(case.model.name, case.model.kv_dtype, case.gpu.name, case.tp, case.mtp)]
        need = for_case(case).float_bytes
        assert cli["float_workspace_bytes"] == row["required_float_bytes"] == need, case.id
        assert cli["kv_dtype_bytes"] == row["kv_dtype_bytes"] == 1


def test_a_quantized_cache_is_worth_more_tokens_in_the_report():
    rows = report_for_matrix(str(KV), use_oracle=False)
    by = {(r["model"], r["kv_dtype"], r["gpu"], r["tp"], r["mtp"]): r for r in rows}
    for (model, dtype, gpu, tp, mtp), row in by.items():
        if dtype.startswith("fp8"):
            bf16 = by[(model, "bf16", gpu, tp, mtp)]
            assert 2 * row["kv_bytes_per_token"] == bf16["kv_bytes_per_token"]
            assert all(c["delta_kv_tokens"] == pytest.approx(2 * b["delta_kv_tokens"], abs=2)
                       for c, b in zip(row["compare"], bf16["compare"])), (model, dtype, gpu)


def test_nvfp4_routes_are_refused_never_sized_as_another_dtype():
    import dataclasses

    case = next(c for c in load_matrix(KV).cases if "b200" in c.id)
    nvfp4 = dataclasses.replace(case, model=dataclasses.replace(case.model, kv_dtype="nvfp4"))
    with pytest.raises(UnsizableCase, match="nvfp4 runs on FlashInfer's trtllm-gen kernels only on sm_100"):
        for_case(nvfp4)
    assert case.model.name == "qwen3-8b" and case.model.kv_dtype == "bf16"
    assert kv_bytes_per_token(nvfp4.model, 1, 1) * 32 == kv_bytes_per_token(case.model, 1, 1) * 9  # 72 of 256 B
