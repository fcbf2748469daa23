"""The workspace a case really needs, asked of the sizing oracle (or its analytic model)."""

from __future__ import annotations

import functools
from typing import Any

DECODE_TC_MIN_GROUP = 4  # vLLM plans decode on tensor cores from a GQA group of 4 (and always under MTP)


def decode_tensor_cores(case: Any) -> bool:
    heads = case.heads
    return case.mtp > 0 or heads.heads_q // heads.heads_kv >= DECODE_TC_MIN_GROUP


def routes(case: Any) -> tuple[str, ...]:
    """MLA decode runs FlashInfer's MLA planner, which the oracle does not model; its prefill is FA2."""
    return ("prefill",) if case.model.attention == "mla" else ("prefill", "decode")


def sizing_envelope(case: Any) -> Any:
    from pytest_kvprofile.sizing import Envelope

    env = case.envelope
    return Envelope(
        max_num_seqs=env.max_num_seqs,
        max_num_batched_tokens=env.max_num_batched_tokens,
        max_model_len=env.max_model_len,
        page_size=env.page_size,
        cuda_graph=bool(env.cuda_graph_sizes),
        cuda_graph_sizes=tuple(s for s in env.cuda_graph_sizes if s <= env.max_num_seqs),
        mtp=case.mtp,
    )


@functools.lru_cache(maxsize=4096)
def _required(heads_q: int, heads_kv: int, heads_q_decode: int, head_dim: int, head_dim_vo: int, num_sm: int,
              envelope: Any, route_names: tuple[str, ...], tc: bool, capability: tuple[int, int]) -> Any:
    from pytest_kvprofile.sizing import required_workspace

    return required_workspace(
        heads_q=heads_q, heads_kv=heads_kv, heads_q_decode=heads_q_decode, head_dim=head_dim,
        head_dim_vo=head_dim_vo, num_sm=num_sm, envelope=envelope, routes=route_names, decode_tensor_cores=tc,
        compute_capability=capability,
    )


@functools.lru_cache(maxsize=4096)
def required_for_case(case: Any) -> Any:
    """The SizingResult (float/int bytes, worst batch, method) for one case's per-rank layout."""
    heads = case.heads
    return _required(
        heads.heads_q, heads.heads_kv, heads.heads_q_decode, case.model.head_dim, case.model.dim_vo,
        case.gpu.num_sm, sizing_envelope(case), routes(case), decode_tensor_cores(case),
        case.gpu.compute_capability if case.gpu.compute_capability != (0, 0) else (9, 0),
    )
