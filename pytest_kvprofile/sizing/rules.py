"""Workspace sizes people use today, and the published rules the suite measures them against (the engines' own
sizes are registered by their packages: ``matrix.engine_facts``).

Why: the sizing report puts the exact requirement next to these, and the suite's mutant builders
size their workspace with the two buggy rules (bug classes 11 and 12) so the sizing check can be
shown to catch them.
"""

from __future__ import annotations

from pytest_kvprofile.attention.facts import FLASHINFER_RECOMMENDED_FLOAT_BYTES, TENSORRT_LLM_FLOAT_BYTES
from pytest_kvprofile.attention.planner import ceil_div
from pytest_kvprofile.matrix.engine_facts import workspace_rules
from pytest_kvprofile.units import MiB


def fixed_sizes() -> dict[str, int]:
    """The fixed float workspaces the report compares, by name: FlashInfer's recommended one, each registered engine's
    default (``EngineFacts.float_workspaces``, largest first, whatever order plugins register in), TensorRT-LLM's
    published one."""
    engines = sorted(workspace_rules(), key=lambda rule: (-rule.fixed_bytes, rule.name))
    return {"flashinfer-default": FLASHINFER_RECOMMENDED_FLOAT_BYTES,
            **{rule.name: rule.fixed_bytes for rule in engines},
            "tensorrt-llm": TENSORRT_LLM_FLOAT_BYTES}


def _align(x: int, a: int) -> int:
    return ceil_div(x, a) * a


def _cta_tile_q_06(head_dim: int) -> int:
    return 128 if head_dim < 256 else 64


def seed004_rule(heads_q: int, heads_kv: int, head_dim: int, num_sm: int,
                 base: int = 80 * MiB, head_dim_vo: int | None = None) -> int:
    """The published rule of docs/contract.md ("Sizing rules in use"): ceil split bound, 16 MiB slack,
    16 MiB alignment, base floor.

    ``padded = ceil(2 * num_sm / heads_kv)`` (FlashInfer rounds down), ``cta_tile_q`` 128 (64 for
    head_dim >= 256), the 0.6.x ``tmp_v + tmp_s``; 96/96/304/176 MiB for its four example rows.
    """
    dvo = head_dim_vo or head_dim
    padded = ceil_div(2 * num_sm, heads_kv)
    cta = _cta_tile_q_06(dvo)
    tmp = heads_q * padded * cta * dvo * 4 + heads_q * padded * cta * 4
    return max(base, _align(tmp + 16 * MiB, 16 * MiB))


def decode_shaped_heuristic(heads_q: int, heads_kv: int, head_dim: int, num_sm: int,
                            max_requests: int = 256, *, tp: int = 1,
                            base: int = 80 * MiB, head_dim_vo: int | None = None) -> int:
    """The rule that published rule replaced (bug class 11): sized as if every plan were a decode.

    ``cta_tile_q = 16`` and the padded batch keyed on ``max_requests``, ignoring the SM count; it
    returns ``base`` outright for TP > 1 and for GQA ratios outside the decode fast path. It
    over-provisions only by accident (large max_requests) and overflows prefill split-KV and any
    CUDA-graph plan on high-SM GPUs or low-KV-head layouts.
    """
    del num_sm  # the bug: the device is ignored
    group = heads_q // max(heads_kv, 1)
    if tp > 1 or group not in (1, 2, 4, 8):
        return base
    dvo = head_dim_vo or head_dim
    padded = _align(max_requests, 16)
    tmp = heads_q * padded * 16 * dvo * 4 + heads_q * padded * 16 * 4
    return _align(tmp, MiB)


def formula_06x(heads_q: int, heads_kv: int, head_dim: int, num_sm: int,
                head_dim_vo: int | None = None) -> int:
    """The FlashInfer 0.6.x prefill bound (bug class 12 when applied to 0.7.x).

    ``tmp_v = H_qo * padded * cta_tile_q * D_vo * 4`` with ``padded = floor(2 * num_sm / H_kv)``:
    exact for 0.6.x without CUDA graphs, but 0.7.x under CUDA graphs pads to
    ``max(padded, total_num_tiles_q)``, which grows with tokens and batch size, so the 0.6.x
    number under-reserves there (and over-reserves by the GQA group size elsewhere).
    """
    dvo = head_dim_vo or head_dim
    padded = (2 * num_sm) // heads_kv
    cta = _cta_tile_q_06(dvo)
    tmp_v = heads_q * padded * cta * dvo * 4
    return _align(tmp_v, 16) + heads_q * padded * cta * 4
