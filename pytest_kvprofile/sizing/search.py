"""Adversarial search: random and extreme batches inside the envelope, run through a planner.

Why: the analytic worst case is a claim; this tries to refute it with batches the construction
did not think of (ragged lengths, tiny and huge KV, full and single-request steps).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pytest_kvprofile.attention.planner import ceil_div, decode_plan, prefill_plan
from pytest_kvprofile.sizing.analytic import PlanBatch, PlanEnvelope, RouteResult

if TYPE_CHECKING:  # typing only: importing the oracle module at runtime is left to callers
    from pytest_kvprofile.attention.oracle import Oracle

Evaluator = Callable[[PlanBatch], tuple[int, int]]


@dataclass(frozen=True)
class SearchResult:
    tried: int
    max_float_bytes: int
    max_int_bytes: int
    batch: PlanBatch | None


def _kv_for(q: int, env: PlanEnvelope, rng: random.Random) -> int:
    lo, hi = max(q, 1), env.max_model_len
    if lo >= hi:
        return lo
    pick = rng.random()
    if pick < 0.2:
        return lo
    if pick < 0.4:
        return hi
    if pick < 0.6:
        step = 128
        return min(hi, max(lo, step * rng.randint(1, max(1, hi // step))))
    return rng.randint(lo, hi)


def _qo_lens(batch: int, budget: int, rng: random.Random, cap: int) -> list[int]:
    mode = rng.random()
    if mode < 0.25:
        return [1] * batch
    if mode < 0.5:
        first = max(1, min(cap, budget - (batch - 1)))
        return [first] + [1] * (batch - 1)
    if mode < 0.75:
        each = max(1, min(cap, budget // batch))
        return [each] * batch
    out, left = [], budget
    for i in range(batch):
        rest = batch - i - 1
        hi = max(1, min(cap, left - rest))
        q = rng.randint(1, hi)
        out.append(q)
        left -= q
    return out


def random_batches(route: str, env: PlanEnvelope, n: int, seed: int = 0) -> list[PlanBatch]:
    """``n`` batches the envelope allows for ``route`` (extremes first, then random)."""
    rng = random.Random(seed)
    graph = route.endswith("cuda_graph")
    u = env.q_decode
    out: list[PlanBatch] = []
    for i in range(n):
        if route.startswith("decode_tc"):
            cap = (env.graph_tokens // u if graph and env.cuda_graph_sizes else env.max_num_seqs)
            if not graph:
                cap = min(cap, env.max_num_batched_tokens // u)
            b_max = max(1, min(env.max_num_seqs, cap))
            b = [1, b_max, rng.randint(1, b_max)][i % 3]
            qo = [u] * b
            kv = [_kv_for(u, env, rng) for _ in range(b)]
            out.append(PlanBatch(tuple(qo), tuple(kv), graph, u, True))
            continue
        if route.startswith("decode_cc"):
            b_max = min(env.max_num_seqs, env.max_num_batched_tokens)
            b = [1, b_max, rng.randint(1, b_max)][i % 3]
            out.append(PlanBatch((1,) * b, tuple(_kv_for(1, env, rng) for _ in range(b)), graph))
            continue
        tokens = env.graph_tokens if graph else env.max_num_batched_tokens
        b_max = min(env.max_num_seqs, tokens)
        b = [1, b_max, rng.randint(1, b_max), rng.randint(1, min(8, b_max))][i % 4]
        budget = [tokens, rng.randint(b, tokens)][i % 2]
        qo = _qo_lens(b, budget, rng, env.max_model_len)
        kv = [_kv_for(q, env, rng) for q in qo]
        out.append(PlanBatch(tuple(qo), tuple(kv), graph))
    return out


def port_evaluator(family: str, result: RouteResult, env: PlanEnvelope) -> Evaluator:
    """Evaluate batches with the Python port of the planner."""
    lay = result.layout

    def run(batch: PlanBatch) -> tuple[int, int]:
        pages = [ceil_div(k, env.page_size) for k in batch.kv_lens]
        if result.planner == "decode":
            ps = decode_plan(lay.heads_q, lay.heads_kv, lay.head_dim_vo, pages,
                             page_size=env.page_size, num_sm=lay.num_sm,
                             blocks_per_sm=result.blocks_per_sm or 1, cuda_graph=batch.cuda_graph)
        else:
            ps = prefill_plan(family, batch.qo_lens, pages, heads_q=lay.heads_q,
                              heads_kv=lay.heads_kv, head_dim_qk=lay.head_dim_qk,
                              head_dim_vo=lay.head_dim_vo, page_size=env.page_size,
                              dev=lay.device, cuda_graph=batch.cuda_graph,
                              uniform_q_len=batch.uniform_q_len,
                              fixed_uniform_q_len=batch.fixed_uniform_q_len, kv_dtype_bytes=lay.kv_bytes)
        return ps.float_bytes, ps.int_bytes

    return run


def oracle_evaluator(oracle: Oracle, result: RouteResult, env: PlanEnvelope) -> Evaluator:
    """Evaluate batches with the compiled oracle (the installed FlashInfer's own planner)."""
    lay = result.layout

    def run(batch: PlanBatch) -> tuple[int, int]:
        oracle.set_device(lay.num_sm, lay.cc_major, lay.cc_minor, lay.smem_optin)
        if result.planner == "decode":
            return oracle.decode(batch.kv_lens, heads_q=lay.heads_q, heads_kv=lay.heads_kv,
                                 head_dim=lay.head_dim_vo, page_size=env.page_size,
                                 cuda_graph=batch.cuda_graph,
                                 blocks_per_sm=result.blocks_per_sm or 1, num_sm=lay.num_sm)
        return oracle.prefill(batch.qo_lens, batch.kv_lens, heads_q=lay.heads_q,
                              heads_kv=lay.heads_kv, head_dim=lay.head_dim_qk,
                              head_dim_vo=lay.head_dim_vo, page_size=env.page_size,
                              cuda_graph=batch.cuda_graph, uniform_q_len=batch.uniform_q_len,
                              fixed_uniform_q_len=batch.fixed_uniform_q_len, kv_dtype_bytes=lay.kv_bytes)

    return run


def adversarial_search(result: RouteResult, env: PlanEnvelope, evaluate: Evaluator,
                       n: int = 200, seed: int = 0) -> SearchResult:
    """The largest float (and int) bytes any of ``n`` envelope batches makes the planner carve."""
    if result.planner == "fa3":
        return SearchResult(0, 0, 0, None)
    best_f, best_i, best_b = 0, 0, None
    batches = random_batches(result.route, env, n, seed)
    for batch in batches:
        f, i = evaluate(batch)
        if f > best_f or best_b is None:
            best_f, best_b = max(f, best_f), batch
        best_i = max(best_i, i)
    return SearchResult(len(batches), best_f, best_i, best_b)
