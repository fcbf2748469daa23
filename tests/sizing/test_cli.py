"""``kvprofile size``: exit codes, JSON keys, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_kvprofile.cli import main

MATRIX = """\
name: tiny
envelope:
  max_num_seqs: 64
  max_num_batched_tokens: 2048
  cuda_graph_sizes: [1, 2, 4, 8, 64]
models:
  qwen3-8b: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36, weights_gib: 16}
gpus: [L40S, B200]
tp: [1, 2]
"""


def _json(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out)


def test_acceptance_command_json(oracle, capsys):
    rc = main(["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "128", "--sm", "142",
               "--json"])
    assert rc == 0
    data = _json(capsys)
    for key in ("float_workspace_bytes", "int_workspace_bytes", "worst_batch", "method",
                "flashinfer_version", "num_sm", "heads_q", "heads_kv"):
        assert key in data
    assert set(data["worst_batch"]) == {"qo_lens", "kv_lens", "cuda_graph"}
    assert data["method"] == "oracle" and data["exact"] and data["num_sm"] == 142
    assert "compiled for the host" in data["method_reason"]  # sizing_method's reason (docs/sizing.md)
    batch = data["worst_batch"]
    oracle.set_device(142)
    got, _ = oracle.prefill(batch["qo_lens"], batch["kv_lens"], heads_q=32, heads_kv=8,
                            head_dim=128, page_size=16, cuda_graph=batch["cuda_graph"])
    assert got == data["float_workspace_bytes"]


def test_gpu_tp_dcp_and_table(capsys):
    rc = main(["size", "--heads-q", "64", "--heads-kv", "8", "--head-dim", "128", "--gpu", "B200",
               "--tp", "4", "--dcp", "2", "--no-oracle", "--json"])
    assert rc == 0
    data = _json(capsys)
    assert (data["num_sm"], data["heads_q"], data["heads_kv"], data["heads_q_decode"]) == (
        148, 16, 2, 32)
    assert data["method"] == "analytic" and data["worst_batch"]["cuda_graph"] is True
    assert data["method_reason"].startswith("use_oracle=False")
    rc = main(["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "128", "--sm", "77",
               "--no-oracle"])
    out = capsys.readouterr().out
    assert rc == 0 and "required" in out and "prefill" in out


@pytest.mark.parametrize("argv", [
    ["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "128"],
    ["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "128", "--sm", "142", "--tp", "3"],
    ["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "x", "--sm", "142"],
    ["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "128", "--sm", "0"],
    ["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "128", "--gpu", "Z999"],
    ["size", "--model", "nope", "--sm", "142"],
    ["size", "--heads-q", "30", "--heads-kv", "8", "--head-dim", "128", "--sm", "142"],
    ["bogus"],
])
def test_bad_arguments_exit_2(argv, capsys, tmp_path):
    if "--model" in argv:
        path = tmp_path / "m.yaml"
        path.write_text(MATRIX)
        argv = [*argv, "--matrix", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "error" in err[-1]


def test_model_from_matrix(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(MATRIX)
    rc = main(["size", "--model", "qwen3-8b", "--matrix", str(path), "--gpu", "L40S", "--tp", "2",
               "--no-oracle", "--json"])
    assert rc == 0
    data = _json(capsys)
    assert (data["heads_q"], data["heads_kv"], data["num_sm"]) == (16, 4, 142)


def test_report(tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(MATRIX)
    assert main(["size", "--report", str(path), "--no-oracle", "--json"]) == 0
    data = _json(capsys)
    assert len(data["rows"]) == 4 and data["headline"]
    assert {r["gpu"] for r in data["rows"]} == {"L40S", "B200"}
    assert main(["size", "--report", str(path), "--no-oracle"]) == 0
    out = capsys.readouterr().out
    assert "flashinfer-default" in out and "seed004-rule" in out
    head = out.splitlines()[0].split("\t")
    assert "kv dtype" in head and "published-rule" in head and "seed004-rule" not in head  # issue 52, item 21
    assert "a matrix's gmu values share their row" in out


def test_kv_dtype_is_sized_for_and_reported(oracle, capsys):
    """``--kv-dtype``: the planner sees sizeof(DTypeKV); MHA CUDA-core decode splits wider on one-byte KV."""
    args = ["size", "--heads-q", "32", "--heads-kv", "32", "--head-dim", "128", "--gpu", "H100", "--routes", "decode",
            "--json"]
    assert main(args) == 0
    bf16 = _json(capsys)
    assert main([*args, "--kv-dtype", "fp8_e4m3"]) == 0
    fp8 = _json(capsys)
    assert (bf16["kv_dtype"], bf16["kv_dtype_bytes"], fp8["kv_dtype"], fp8["kv_dtype_bytes"]) == ("bf16", 2,
                                                                                                  "fp8_e4m3", 1)
    assert fp8["float_workspace_bytes"] > bf16["float_workspace_bytes"] > 0


def test_nvfp4_is_sized_where_fa2_reads_it_and_refused_by_name_on_sm100(capsys):
    """vLLM plans NVFP4 with FA2 on packed uint8 on Hopper (1 B to the planner) and on trtllm-gen only on SM100."""
    layout = ["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "128", "--kv-dtype", "nvfp4", "--json"]
    assert main([*layout, "--gpu", "H100"]) == 0
    data = _json(capsys)
    assert (data["kv_dtype"], data["kv_dtype_bytes"]) == ("nvfp4", 1) and data["float_workspace_bytes"] > 0
    assert main([*layout, "--gpu", "B200"]) == 1
    assert "nvfp4 runs on FlashInfer's trtllm-gen kernels only on sm_100" in capsys.readouterr().err


def test_the_report_names_the_layouts_it_does_not_size(capsys):
    """ci.yaml's NVFP4 cache on the B200 runs on trtllm-gen only: its layouts are named with the reason, never
    sized (as bf16 or otherwise) and never dropped; on the L40S it is FA2's, and sized."""
    ci = str(Path(__file__).resolve().parents[2] / "matrices" / "ci.yaml")
    assert main(["size", "--report", ci, "--no-oracle", "--json"]) == 0
    data = _json(capsys)
    assert [u["case"] for u in data["unsized"]] == ["llama-3.1-8b-tp1-dcp1-mtp0-b200-gmu0.90-kvnvfp4",
                                                    "llama-3.1-8b-tp4-dcp1-mtp0-b200-gmu0.90-kvnvfp4"]
    assert {r["gpu"] for r in data["rows"] if r["kv_dtype"] == "nvfp4"} == {"L40S"}  # FA2 there, 1 B a value
    assert main(["size", "--report", ci, "--no-oracle"]) == 0
    assert "not sized: llama-3.1-8b-tp1-dcp1-mtp0-b200-gmu0.90-kvnvfp4: unsized by the suite: KV dtype nvfp4" in \
        capsys.readouterr().out


def test_plot_without_matplotlib_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    """``--plot`` imports matplotlib when it plots: without it, one line naming the extra, never a traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without matplotlib answers
    matrix = tmp_path / "m.yaml"
    matrix.write_text(MATRIX)
    rc = main(["size", "--report", str(matrix), "--no-oracle", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 1 and "--plot needs matplotlib: pip install 'pytest-kvprofile[plot]'" in err
    assert "Traceback" not in err and not (tmp_path / "x.png").exists()


def test_list_names_every_backend_by_group(capsys):
    rc = main(["list"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("stubs (") and "  stub-flashinfer\n" in out and "mutants (" in out
    assert main(["list", "--group", "nope"]) == 2 and "groups: stubs, mutants" in capsys.readouterr().err
