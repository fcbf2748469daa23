"""The sizing report: the exact requirement of every (model, GPU, layout) next to the sizes in use.

Why: a fixed workspace is wrong in one direction or the other on almost every GPU; the report
says by how much, in MiB and in the KV-cache tokens the difference is worth on that rank. Every
row is :func:`pytest_kvprofile.sizing.for_case` of a case, so the report says what the check demands.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, TypeAlias

from pytest_kvprofile.matrix.cases import Case, Envelope, layout_case
from pytest_kvprofile.matrix.gpus import GpuSpec, lookup_gpu
from pytest_kvprofile.matrix.models import (
    ModelSpec,
    impossible_layout,
    kv_bytes_per_token,
)
from pytest_kvprofile.sizing.case import for_case
from pytest_kvprofile.sizing.rules import fixed_sizes, seed004_rule
from pytest_kvprofile.units import MiB

# one row of the report as JSON writes it: each key has its own type (case_row lists them), read by key
ReportRow: TypeAlias = dict[str, Any]
# a layout as sizing_report takes it: a TP int, a (tp, dcp[, mtp]) sequence, or a mapping or object with tp/dcp/mtp
LayoutSpec: TypeAlias = Any

# The report's capture sizes (tokens): 1, 2, 4, every 8 to 248, every 16 from 256 to 512 (an engine's usual default).
REPORT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
REPORT_ENVELOPE = Envelope(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32768, page_size=16,
                           cuda_graph_sizes=REPORT_CAPTURE_SIZES)


def _layouts(layouts: Iterable[LayoutSpec]) -> list[tuple[int, int, int]]:
    out = []
    for lay in layouts:
        if isinstance(lay, int):
            out.append((lay, 1, 0))
        elif isinstance(lay, Mapping):
            out.append((int(lay.get("tp", 1)), int(lay.get("dcp", 1)), int(lay.get("mtp", 0))))
        elif hasattr(lay, "tp"):
            out.append((int(lay.tp), int(getattr(lay, "dcp", 1)), int(getattr(lay, "mtp", 0))))
        else:
            seq = tuple(lay)
            out.append((int(seq[0]), int(seq[1]) if len(seq) > 1 else 1,
                        int(seq[2]) if len(seq) > 2 else 0))
    return out


def _compare(name: str, have: int, need: int, kv_tok: int) -> dict[str, object]:
    delta = have - need
    return {
        "name": name,
        "bytes": have,
        "mib": round(have / MiB, 2),
        "status": "overflow" if delta < 0 else ("exact" if delta == 0 else "waste"),
        "delta_bytes": delta,
        "delta_mib": round(delta / MiB, 2),
        "delta_kv_tokens": int(delta // kv_tok) if delta >= 0 else -int(-delta // kv_tok),
    }


def case_row(case: Case, *, use_oracle: bool | None = None) -> ReportRow:
    """One report row: what ``case`` needs, and how the common fixed sizes and the published rule
    (``seed004-rule``, docs/contract.md) compare."""
    model, gpu, heads = case.model, case.gpu, case.heads
    res = for_case(case, use_oracle=use_oracle)
    kv_tok = kv_bytes_per_token(model, case.tp, case.dcp)
    need = res.float_bytes
    comps = [_compare(n, b, need, kv_tok) for n, b in fixed_sizes().items()]
    comps.append(_compare("seed004-rule", seed004_rule(
        heads.heads_q, heads.heads_kv, model.head_dim, gpu.num_sm, head_dim_vo=model.head_dim_vo), need, kv_tok))
    qo, kv, graph = res.worst_batch if res.worst_batch else ((), (), False)
    return {
        "model": model.name,
        "gpu": gpu.name,
        "num_sm": gpu.num_sm,
        "tp": case.tp,
        "dcp": case.dcp,
        "mtp": case.mtp,
        "heads_q": heads.heads_q,
        "heads_kv": heads.heads_kv,
        "heads_q_decode": heads.heads_q_decode,
        "head_dim": model.head_dim,
        "head_dim_vo": model.head_dim_vo,
        "kv_dtype": model.kv_dtype,
        "kv_dtype_bytes": res.kv_dtype_bytes,
        "required_float_bytes": need,
        "required_float_mib": round(need / MiB, 2),
        "required_int_bytes": res.int_bytes,
        "worst_route": res.worst_route,
        "sized_routes": list(res.routes),
        "worst_batch": {"num_requests": len(qo), "tokens": sum(qo), "max_kv_len": max(kv, default=0),
                        "cuda_graph": graph},
        "exact": res.exact,
        "method": res.method,
        "flashinfer_version": res.flashinfer_version,
        "kv_bytes_per_token": kv_tok,
        "compare": comps,
    }


def sizing_report(models: Mapping[str, ModelSpec] | Iterable[ModelSpec], gpus: Iterable[GpuSpec | str],
                  layouts: Iterable[LayoutSpec], envelope: Envelope = REPORT_ENVELOPE, *,
                  use_oracle: bool | None = None) -> list[ReportRow]:
    """One row per possible (model, GPU, layout), each sized as a case with ``envelope``.

    ``layouts`` items are TP ints, (tp, dcp[, mtp]) tuples, or mappings/objects with tp/dcp/mtp.
    ``delta`` > 0 is waste, < 0 overflow; ``delta_kv_tokens`` converts it with the model's
    per-rank KV bytes per token.
    """
    specs = list(models.values()) if isinstance(models, Mapping) else list(models)
    gpu_specs = [g if isinstance(g, GpuSpec) else lookup_gpu(g) for g in gpus]
    return [
        case_row(layout_case(model, gpu, tp, dcp, mtp, envelope), use_oracle=use_oracle)
        for model in specs for gpu in gpu_specs for tp, dcp, mtp in _layouts(layouts)
        if impossible_layout(model, tp, dcp, mtp) is None
    ]


def report_headline(rows: list[ReportRow]) -> list[str]:
    """Which common sizes overflow where (one line per size)."""
    lines = []
    names = [c["name"] for c in rows[0]["compare"]] if rows else []
    for name in names:
        over: dict[str, float] = {}
        for row in rows:
            comp = next(c for c in row["compare"] if c["name"] == name)
            if comp["status"] == "overflow":
                over[row["gpu"]] = min(over.get(row["gpu"], 0.0), comp["delta_mib"])
        if over:
            where = ", ".join(f"{g} (worst {v:+.1f} MiB)" for g, v in sorted(over.items()))
            lines.append(f"{name}: overflows on {where}")
        else:
            lines.append(f"{name}: covers every case")
    return lines


TABLE_NAMES = {"seed004-rule": "published-rule"}  # the table's column for a comparison whose JSON name is an id


def format_report(rows: list[ReportRow]) -> str:
    """A plain-text table of the report (MiB; +waste / -overflow)."""
    if not rows:
        return "no cases"
    names = [TABLE_NAMES.get(c["name"], c["name"]) for c in rows[0]["compare"]]
    head = ["model", "gpu", "tp", "dcp", "mtp", "kv dtype", "heads", "need MiB", "route", *names]
    lines = ["\t".join(head)]
    for r in rows:
        deltas = [f"{c['delta_mib']:+.1f} ({c['delta_kv_tokens']:+d} tok)" for c in r["compare"]]
        lines.append("\t".join([r["model"], r["gpu"], str(r["tp"]), str(r["dcp"]), str(r["mtp"]), str(r["kv_dtype"]),
                                f"{r['heads_q']}/{r['heads_kv']}",
                                f"{r['required_float_mib']:.1f}", r["worst_route"], *deltas]))
    lines.append("")
    lines.append("one row per layout sizing reads: a matrix's gmu values share their row (the workspace does not "
                 "depend on gmu; the KV tokens per rank do not either)")
    lines.append(f"{TABLE_NAMES['seed004-rule']}: the rule docs/contract.md publishes (JSON name seed004-rule)")
    lines.extend(report_headline(rows))
    return "\n".join(lines)


def distinct_layout_cases(cases: Iterable[Case]) -> list[Case]:
    """The runnable, sizable cases that differ in something sizing reads (gmu never matters), first of each."""
    out: dict[tuple[object, ...], Case] = {}
    for case in cases:
        if case.skip_reason is None and case.unsized_reason is None:
            out.setdefault(case.layout_key, case)
    return list(out.values())


def unsized_layouts(cases: Iterable[Case]) -> list[dict[str, str]]:
    """The runnable layouts this suite does not size (``Case.unsized_reason``), first case of each, with why: the
    report names them rather than dropping them."""
    out: dict[tuple[object, ...], dict[str, str]] = {}
    for case in cases:
        if case.skip_reason is None and case.unsized_reason is not None:
            out.setdefault(case.layout_key, {"case": case.id, "reason": case.unsized_reason})
    return list(out.values())


def report_for_matrix(path: str, *, use_oracle: bool | None = None) -> list[ReportRow]:
    """The sizing report of every distinct runnable layout of a matrix file."""
    from pytest_kvprofile.matrix.schema import load_matrix

    return [case_row(case, use_oracle=use_oracle) for case in distinct_layout_cases(load_matrix(path).cases)]


def unsized_for_matrix(path: str) -> list[dict[str, str]]:
    """The layouts of a matrix file its sizing report leaves out, each with the reason (``unsized_layouts``)."""
    from pytest_kvprofile.matrix.schema import load_matrix

    return unsized_layouts(load_matrix(path).cases)
