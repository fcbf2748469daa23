"""Seed 004's published rule, what those cases really need, and the buggy rules' shortfalls."""

from __future__ import annotations

import pytest

from pytest_kvprofile.matrix.gpus import lookup_gpu
from pytest_kvprofile.matrix.models import ModelSpec, rank_heads
from pytest_kvprofile.sizing import PlanEnvelope, required_workspace
from pytest_kvprofile.sizing.comparison import REPORT_CAPTURE_SIZES, REPORT_ENVELOPE, report_headline, sizing_report
from pytest_kvprofile.sizing.rules import (
    decode_shaped_heuristic,
    fixed_sizes,
    formula_06x,
    seed004_rule,
)
from pytest_kvprofile.units import MiB

SEED004 = [  # (label, heads_q per rank, heads_kv per rank, head_dim, num_sm, published MiB)
    ("Qwen3-8B, L40S", 32, 8, 128, 142, 96),
    ("Qwen3-8B, L40S, TP=2", 16, 4, 128, 142, 96),
    ("32q / 2kv, L40S", 32, 2, 128, 142, 304),
    ("64q / 8kv, B200", 64, 8, 128, 148, 176),
]


@pytest.mark.parametrize("label,hq,hkv,d,sm,mib", SEED004, ids=[r[0] for r in SEED004])
def test_seed004_table(label, hq, hkv, d, sm, mib):
    assert seed004_rule(hq, hkv, d, sm) == mib * MiB


def test_fixed_sizes():
    assert fixed_sizes() == {"flashinfer-default": 128 * MiB, "vllm-default": 394 * MiB,
                           "sglang": 384 * MiB, "tensorrt-llm": 320 * MiB}


# Raw plans over vLLM's capture sizes as full steps (a what-if, not a matrix case).
VLLM_GRAPHS = PlanEnvelope(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32768, page_size=16,
                           cuda_graph=True, cuda_graph_sizes=REPORT_CAPTURE_SIZES)


def test_seed004_cases_through_the_oracle(oracle, capsys):
    """What the four rows really need on the installed FlashInfer (no graphs / vLLM graphs)."""
    lines = []
    for label, hq, hkv, d, sm, mib in SEED004:
        plain = required_workspace(heads_q=hq, heads_kv=hkv, head_dim=d, num_sm=sm,
                                   envelope=PlanEnvelope())
        graph = required_workspace(heads_q=hq, heads_kv=hkv, head_dim=d, num_sm=sm,
                                   envelope=VLLM_GRAPHS)
        assert plain.method == graph.method == "oracle" and plain.exact and graph.exact
        # On 0.7.x the rule over-reserves without graphs (rows shrink by the GQA group) ...
        assert plain.float_bytes < mib * MiB
        lines.append(f"{label}: rule {mib} MiB, needs {plain.float_bytes / MiB:.2f} MiB "
                     f"(no graphs), {graph.float_bytes / MiB:.2f} MiB (vLLM graphs)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    # ... and under CUDA graphs Qwen3-8B needs more than the rule's 96 MiB.
    qwen = required_workspace(heads_q=32, heads_kv=8, head_dim=128, num_sm=142,
                              envelope=VLLM_GRAPHS)
    assert qwen.float_bytes > 96 * MiB


TYPICAL_MODELS = [
    ModelSpec("qwen3-8b", 32, 8, 128, 36),
    ModelSpec("llama-3-70b", 64, 8, 128, 80),
    ModelSpec("gqa-32q-2kv", 32, 2, 128, 32),
    ModelSpec("hd256", 16, 4, 256, 32),
]
TYPICAL_GPUS = ["L40S", "H100", "H200", "B200", "RTX PRO 6000 Blackwell"]
GRAPH_ENVELOPE = PlanEnvelope(max_num_seqs=256, max_num_batched_tokens=4096, cuda_graph=True,
                          cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))


def test_buggy_rules_fall_short_on_typical_layouts():
    """Mutants sized with bug classes 11 and 12 must fail the sizing check somewhere on every GPU."""
    short = {"decode_shaped": set(), "formula_06x": set()}
    for gpu_name in TYPICAL_GPUS:
        gpu = lookup_gpu(gpu_name)
        for model in TYPICAL_MODELS:
            for tp in (1, 2, 4, 8):
                if model.heads_q % tp:
                    continue
                h = rank_heads(model, tp, 1)
                need = required_workspace(heads_q=h.heads_q, heads_kv=h.heads_kv,
                                          head_dim=model.head_dim, num_sm=gpu.num_sm,
                                          envelope=GRAPH_ENVELOPE, use_oracle=False).float_bytes
                if decode_shaped_heuristic(h.heads_q, h.heads_kv, model.head_dim, gpu.num_sm,
                                           tp=tp) < need:
                    short["decode_shaped"].add((gpu.name, model.name, tp))
                if formula_06x(h.heads_q, h.heads_kv, model.head_dim, gpu.num_sm) < need:
                    short["formula_06x"].add((gpu.name, model.name, tp))
    for name, cases in short.items():
        gpus = {g for g, _, _ in cases}
        assert gpus == {lookup_gpu(g).name for g in TYPICAL_GPUS}, (name, sorted(cases))
    # The headline case: Qwen3-8B at TP=1 on every GPU, both rules.
    for gpu_name in TYPICAL_GPUS:
        name = lookup_gpu(gpu_name).name
        assert (name, "qwen3-8b", 1) in short["decode_shaped"]
        assert (name, "qwen3-8b", 1) in short["formula_06x"]
        assert (name, "llama-3-70b", 1) in short["decode_shaped"]


def test_sizing_report_rows_and_headline():
    rows = sizing_report(TYPICAL_MODELS[:2], ["L40S", "B200"], [1, 2, (8, 2)],
                         REPORT_ENVELOPE, use_oracle=False)
    assert len(rows) == 2 * 2 * 3
    row = rows[0]
    assert row["model"] == "qwen3-8b" and row["gpu"] == "L40S" and row["tp"] == 1
    names = [c["name"] for c in row["compare"]]
    assert names == [*fixed_sizes(), "seed004-rule"]
    for comp in row["compare"]:
        assert comp["delta_bytes"] == comp["bytes"] - row["required_float_bytes"]
        assert comp["status"] in ("overflow", "waste", "exact")
        assert abs(comp["delta_kv_tokens"] * row["kv_bytes_per_token"]) <= abs(comp["delta_bytes"])
    dcp_row = next(r for r in rows if r["dcp"] == 2)
    assert dcp_row["heads_q"] == 4 and dcp_row["heads_q_decode"] == 8
    headline = report_headline(rows)
    assert any(line.startswith("flashinfer-default: overflows on") for line in headline)


def test_requirement_curves_grow_with_tokens():
    from pytest_kvprofile.sizing.plot import requirement_curves

    rows = sizing_report(TYPICAL_MODELS[:1], ["L40S", "H100"], [1], REPORT_ENVELOPE,
                         use_oracle=False)
    curves = requirement_curves(rows, tokens=(512, 2048, 8192))
    assert set(curves) == {"L40S", "H100"}
    for pts in curves.values():
        values = [v for _, v in pts]
        assert values == sorted(values) and values[-1] > 128


def test_plot_writes_png(tmp_path):
    import matplotlib  # noqa: F401 - the test extra installs it; a missing one is a failure, not a skip

    from pytest_kvprofile.sizing.plot import plot_requirement

    rows = sizing_report(TYPICAL_MODELS[:1], ["L40S"], [1], REPORT_ENVELOPE, use_oracle=False)
    out = plot_requirement(rows, tmp_path / "req.png", tokens=(512, 4096))
    assert out.stat().st_size > 0
