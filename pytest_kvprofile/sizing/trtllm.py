"""What a case's trtllm-gen routes carve from their workspace: the trtllm-gen side of the sizing, MHA and MLA.

``attention/trtllm.py`` holds FlashInfer's launcher carve; this module feeds it the case's worst launch, as the
engines call it:

- **decode, MHA** (an engine's FlashInfer attention with ``trtllm_batch_decode_with_kv_cache``): under DCP the query is
  all-gathered over the DCP group in the head dimension and LSE is asked for, so the slab is sized for
  ``heads_q x dcp`` heads, every decode request of a step (at most ``max_num_seqs``, and at most
  ``max_num_batched_tokens // (1 + mtp)``) at ``q_len = 1 + mtp``.
- **decode, MLA** (``trtllm_batch_decode_with_kv_cache_mla``; an engine's sparse MLA attention may size its workspace
  by this very rule): every token of a step at ``q_len = 1``, up to
  ``max_num_batched_tokens``, over ``heads_q x dcp`` heads. The scratch is over the latent (``kv_cache_head_dim``)
  with 2-CTA MMA.
- **prefill** (the context kernel): no multi-CTA KV scratch. Its LSE slab under DCP is asked only after the engine
  checks it fits (its DCP context wrapper's ``fits_workspace``) and falls back otherwise: no hard need.

Without DCP no LSE is asked, so only the scratch counts.
"""

from __future__ import annotations

from collections.abc import Iterable

from pytest_kvprofile.attention.trtllm import TrtllmCarve, scratch_bound, softmax_stats_bytes
from pytest_kvprofile.matrix.cases import Case

__all__ = ["trtllm_carve", "trtllm_need", "trtllm_routes"]

ROUTES = ("prefill", "decode")


def trtllm_routes(case: Case, native: Iterable[str]) -> tuple[str, ...]:
    """The routes a builder that holds a trtllm-gen workspace sends there: the case's routes it does not plan
    natively, and an MLA case's decode when it plans no route natively (FlashInfer's MLA decode planner is not FA2,
    so the harness cannot see where MLA decode goes; a builder with every route on trtllm-gen sends it there)."""
    from pytest_kvprofile.sizing.case import routes

    own = set(native)
    out = [r for r in routes(case) if r not in own]
    if case.model.attention == "mla" and not own and "decode" not in out:
        out.append("decode")
    return tuple(r for r in ROUTES if r in out)


def trtllm_carve(case: Case, route: str) -> TrtllmCarve:
    """The worst carve of one trtllm-gen launch of ``route`` on the case's rank."""
    if route not in ROUTES:
        raise ValueError(f"unknown trtllm-gen route {route!r} (known: {', '.join(ROUTES)})")
    heads, model, env = case.heads, case.model, case.envelope
    mla = model.attention == "mla"
    head_dim_v = (model.kv_cache_head_dim or model.head_dim) if mla else model.dim_vo
    if route == "prefill":
        return TrtllmCarve(route, False, heads.heads_q, 0, 0, head_dim_v, 0, 0, mla)
    lse = case.dcp > 1
    if mla:
        q_len, batch = 1, env.max_num_batched_tokens
    else:
        q_len = 1 + case.mtp
        batch = max(1, min(env.max_num_seqs, env.max_num_batched_tokens // q_len))
    slab = softmax_stats_bytes(heads.heads_q_decode, batch, q_len) if lse else 0
    return TrtllmCarve(route, lse, heads.heads_q_decode, batch, q_len, head_dim_v, slab,
                       scratch_bound(case.gpu.num_sm, head_dim_v, mla), mla)


def trtllm_need(case: Case, route_names: Iterable[str]) -> tuple[int, TrtllmCarve | None]:
    """The workspace bytes the case's trtllm-gen routes need (routes share one workspace and launch one after
    another: the maximum) and the carve that decides; (0, None) for no route."""
    carves = [trtllm_carve(case, r) for r in route_names]
    worst = max(carves, key=lambda c: c.total_bytes, default=None)
    return (worst.total_bytes if worst is not None else 0), worst
