"""``kv_dtype`` as a matrix axis (issue 35, point 1): a list, per model or for the whole file, expands the cases and
suffixes their ids with ``-kv<dtype>``; a single value keeps every id; the bytes a token costs follow the dtype."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_kvprofile.matrix.kv_dtypes import KV_DTYPES
from pytest_kvprofile.matrix.models import kv_bytes_per_token
from pytest_kvprofile.matrix.schema import MatrixError, load_matrix_text

ROOT = Path(__file__).resolve().parents[2]
CI = (ROOT / "matrices" / "ci.yaml").read_text()
FIRST = "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"


def _qwen_kv(value: str) -> str:
    return CI.replace("    kv_dtype: bf16\n    weights_gib: 15.3", f"    kv_dtype: {value}\n    weights_gib: 15.3", 1)


def test_a_model_list_is_an_axis_of_that_model_only():
    plain = load_matrix_text(CI, "ci.yaml").cases
    axis = load_matrix_text(_qwen_kv("[bf16, fp8_e4m3]"), "ci.yaml").cases
    qwen = [c for c in plain if c.model.name == "qwen3-8b"]
    assert len(axis) == len(plain) + len(qwen)
    assert [c.id for c in axis[:2]] == [f"{FIRST}-kvbf16", f"{FIRST}-kvfp8_e4m3"]
    assert [c.model.kv_dtype for c in axis[:2]] == ["bf16", "fp8_e4m3"]
    assert {c.id for c in axis if c.model.name != "qwen3-8b"} == {c.id for c in plain if c.model.name != "qwen3-8b"}


def test_a_file_list_applies_to_models_that_name_none_and_a_single_value_keeps_ids():
    text = CI.replace("    kv_dtype: bf16\n", "")
    text = text.replace("gpus: [L40S, B200]", "kv_dtype: [bf16, fp8]\ngpus: [L40S, B200]")
    cases = load_matrix_text(text, "ci.yaml").cases
    plain = load_matrix_text(CI, "ci.yaml").cases
    own = {"llama-3.1-8b", "deepseek-v2-lite-mla"}  # these list their own dtypes: the file's list is not theirs
    assert len([c for c in cases if c.model.name not in own]) == 2 * len([c for c in plain if c.model.name not in own])
    assert [c.id for c in cases if c.model.name in own] == [c.id for c in plain if c.model.name in own]
    assert {c.id.rsplit("-kv", 1)[1] for c in cases if c.model.name not in own} == {"bf16", "fp8"}
    single = load_matrix_text(_qwen_kv("fp8_e5m2"), "ci.yaml").cases
    assert single[0].id == FIRST and single[0].model.kv_dtype == "fp8_e5m2"


def test_fp8_halves_the_bytes_a_token_costs_and_nvfp4_counts_its_scales():
    case = load_matrix_text(_qwen_kv("[bf16, fp8_e4m3, nvfp4]"), "ci.yaml").cases
    bf16, fp8 = (kv_bytes_per_token(c.model, c.tp, c.dcp) for c in case[:2])
    assert bf16 == 2 * fp8 == 2 * 36 * 2 * 8 * 128
    assert KV_DTYPES["nvfp4"].row_bytes(128) == 64 + 8  # 4-bit values and one E4M3 scale per 16
    b200 = next(c for c in case if c.model.kv_dtype == "nvfp4" and "b200" in c.id)
    assert b200.skip_reason is None and kv_bytes_per_token(b200.model, 1, 1) == 36 * 2 * 8 * 72


def test_nvfp4_is_fa2_on_sm89_and_trtllm_gen_only_on_sm100_as_vllm_routes_it():
    cases = load_matrix_text(_qwen_kv("[nvfp4]"), "ci.yaml").cases
    l40s = next(c for c in cases if "l40s" in c.id)
    b200 = next(c for c in cases if "b200" in c.id)
    assert l40s.skip_reason is None and l40s.unsized_reason is None
    assert l40s.fa2_kv_torch_dtype("flashinfer") == "uint8" and l40s.model.kv_dtype_bytes == 1
    assert b200.skip_reason is None and "trtllm-gen kernels only on sm_100" in (b200.unsized_reason or "")


def test_nvfp4_on_a_gpu_not_known_to_read_it_is_an_impossible_layout_named():
    text = _qwen_kv("[nvfp4]").replace("gpus: [L40S, B200]", "gpus: [{name: T4, num_sm: 40, memory_gib: 16}]")
    case = load_matrix_text(text, "ci.yaml").cases[0]
    assert "nvfp4 needs compute capability 8.x or newer; T4 has an unknown compute capability" in (
        case.skip_reason or "")


def test_an_exclude_may_name_the_dtype():
    text = _qwen_kv("[bf16, fp8_e4m3]").replace("  - {tp: 1, dcp: 2}", "  - {tp: 1, dcp: 2}\n  - {kv_dtype: fp8_e4m3}")
    assert not any(c.model.kv_dtype == "fp8_e4m3" for c in load_matrix_text(text, "ci.yaml").cases)


@pytest.mark.parametrize("value, key", [
    ("[]", "models.qwen3-8b.kv_dtype"),
    ("[bf16, bf16]", "models.qwen3-8b.kv_dtype"),
    ("[bf16, fp7]", r"models.qwen3-8b.kv_dtype\[1\]"),
    ("fp7", "models.qwen3-8b.kv_dtype"),
    ("[bf16, 8]", r"models.qwen3-8b.kv_dtype\[1\]"),
])
def test_a_bad_dtype_names_file_and_key(value, key):
    with pytest.raises(MatrixError, match=rf"^ci\.yaml: {key}: "):
        load_matrix_text(_qwen_kv(value), "ci.yaml")


def test_a_dtype_without_an_fa2_route_names_who_asked_for_it():
    assert KV_DTYPES["fp8_e5m2"].fa2_torch_dtype("flashinfer", (10, 0), 128) == "float8_e5m2"
    assert KV_DTYPES["nvfp4"].fa2_torch_dtype("flashinfer", (12, 0), 256) == "uint8"
    with pytest.raises(ValueError, match="flashinfer: KV dtype nvfp4 runs on FlashInfer's trtllm-gen kernels only"):
        KV_DTYPES["nvfp4"].fa2_torch_dtype("flashinfer", (10, 0), 128)
    with pytest.raises(ValueError, match="flashinfer: KV dtype nvfp4 at head dim 512: FlashInfer builds its FA2"):
        KV_DTYPES["nvfp4"].fa2_torch_dtype("flashinfer", (9, 0), 512)
