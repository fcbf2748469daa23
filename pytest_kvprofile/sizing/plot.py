"""Requirement vs tokens per step, one line per GPU (matplotlib is the optional ``plot`` extra).

Why: under CUDA graphs FlashInfer's padding grows with the tokens of a step, so a single number
hides where each fixed size stops being enough.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from pytest_kvprofile.sizing.analytic import PlanEnvelope
from pytest_kvprofile.sizing.requirement import required_workspace
from pytest_kvprofile.sizing.rules import fixed_sizes
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from pytest_kvprofile.sizing.comparison import ReportRow

DEFAULT_TOKENS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384)


def requirement_curves(rows: Sequence[ReportRow], tokens: Sequence[int] = DEFAULT_TOKENS,
                       envelope: PlanEnvelope = PlanEnvelope()) -> dict[str, list[tuple[int, float]]]:
    """Per GPU: (tokens per step, MiB) of the largest requirement over the report's layouts.

    A what-if, not a case's requirement (that is :func:`pytest_kvprofile.sizing.for_case`): each point
    plans CUDA graphs over full steps of that many tokens, so it shows where each fixed size stops
    being enough as captured steps grow.
    """
    curves: dict[str, list[tuple[int, float]]] = {}
    for gpu in dict.fromkeys(r["gpu"] for r in rows):
        layouts = {(r["heads_q"], r["heads_kv"], r.get("head_dim", 128), r.get("head_dim_vo"),
                    r["num_sm"], r["heads_q_decode"] if r["dcp"] > 1 else None)
                   for r in rows if r["gpu"] == gpu}
        points = []
        for n in tokens:
            env = PlanEnvelope(max_num_seqs=min(envelope.max_num_seqs, n), max_num_batched_tokens=n,
                           max_model_len=envelope.max_model_len, page_size=envelope.page_size,
                           cuda_graph=True, cuda_graph_sizes=(n,), mtp=envelope.mtp)
            need = max(required_workspace(heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_vo=dvo,
                                          num_sm=sm, envelope=env, heads_q_decode=hqd).float_bytes
                       for hq, hkv, d, dvo, sm, hqd in layouts)
            points.append((n, need / MiB))
        curves[gpu] = points
    return curves


def plot_requirement(rows: Sequence[ReportRow], out: Path,
                     tokens: Sequence[int] = DEFAULT_TOKENS) -> Path:
    """Write a PNG of :func:`requirement_curves` with the common fixed sizes as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = requirement_curves(rows, tokens)
    fig, ax = plt.subplots(figsize=(8, 5))
    for gpu, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=gpu)
    for name, size in fixed_sizes().items():
        ax.axhline(size / MiB, linestyle="--", linewidth=0.8, color="grey")
        ax.annotate(name, (tokens[0], size / MiB), fontsize=7, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step (CUDA graphs)")
    ax.set_ylabel("FlashInfer float workspace needed (MiB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
