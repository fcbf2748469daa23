"""Closed-form worst cases of FlashInfer's workspace carving over an envelope of batches.

Why: a backend must size its float arena before it has seen a batch, so it needs the maximum
over every batch the scheduler can form (the *envelope*), not the size of one plan. For each route
a backend enables, this module computes that maximum in closed form from the planner's structure
and constructs a batch that attains it; the batch is checked with the Python port
(:mod:`.planner`) and, when available, with the compiled oracle. Where no attaining batch is
found inside the envelope the result is an upper bound (``exact=False``, ``gap_bytes`` says by
how much the best batch found falls short).

Route names:
  ``prefill``                 FA2 paged prefill, no CUDA graph
  ``prefill_cuda_graph``      FA2 paged prefill planned for a CUDA graph (tokens up to the largest
                              capture size, or max_num_batched_tokens when none is given)
  ``decode_tc``/``decode_tc_cuda_graph``  tensor-core decode: the prefill planner with what the
                              generation's wrapper passes (``planner.decode_uniform_args``)
  ``decode_cc``/``decode_cc_cuda_graph``  CUDA-core decode (``DecodePlan``), occupancy as input
  ``fa3_int``                 FA3 ``PrefillSM90Plan`` int arrays (no float workspace)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pytest_kvprofile.attention.facts import FLASHINFER_INT_WORKSPACE_BYTES
from pytest_kvprofile.attention.planner import (
    PlannerDevice,
    PlanSize,
    ceil_div,
    cta_tile_q,
    decode_blocks_per_sm_bound,
    decode_plan,
    decode_uniform_args,
    generation,
    max_batch_size_if_split,
    max_cta_tile_q,
    prefill_float_bytes,
    prefill_int_bytes,
    prefill_plan,
    prefill_split_rows,
)

DEFAULT_INT_WORKSPACE = FLASHINFER_INT_WORKSPACE_BYTES  # per wrapper


@dataclass(frozen=True)
class PlanEnvelope:
    """Every batch the engine's scheduler can hand one ``plan()``.

    ``cuda_graph_sizes`` are capture sizes in tokens (the engine pads a step to the next one); under
    CUDA graphs they bound the tokens of a graph-planned step. ``mtp`` is the number of
    speculative tokens: decode requests carry ``1 + mtp`` query tokens.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    page_size: int = 16
    cuda_graph: bool = False
    cuda_graph_sizes: tuple[int, ...] = ()
    mtp: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlanEnvelope.{name} must be >= 1")
        if self.mtp < 0:
            raise ValueError("PlanEnvelope.mtp must be >= 0")
        if any(s < 1 for s in self.cuda_graph_sizes):
            raise ValueError("PlanEnvelope.cuda_graph_sizes must be positive")
        object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(self.cuda_graph_sizes))))

    @property
    def q_decode(self) -> int:
        return 1 + self.mtp

    @property
    def graph_tokens(self) -> int:
        """Most tokens a graph-planned step carries."""
        if self.cuda_graph_sizes:
            return min(max(self.cuda_graph_sizes), self.max_num_batched_tokens)
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class PlanBatch:
    """One batch as a plan sees it (kv_lens in tokens, including the new ones)."""

    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    cuda_graph: bool
    uniform_q_len: int = 0
    fixed_uniform_q_len: bool = False

    def as_tuple(self) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        return (self.qo_lens, self.kv_lens, self.cuda_graph)


@dataclass(frozen=True)
class Layout:
    """What one wrapper is planned with, on one rank."""

    heads_q: int
    heads_kv: int
    head_dim_qk: int
    head_dim_vo: int
    num_sm: int
    cc_major: int = 9
    cc_minor: int = 0
    smem_optin: int = 101376
    kv_bytes: int = 2  # sizeof(DTypeKV): the prefill planner's CTA tile and the decode kernel's occupancy

    @property
    def device(self) -> PlannerDevice:
        return PlannerDevice(self.num_sm, self.cc_major, self.cc_minor, self.smem_optin)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv


@dataclass(frozen=True)
class RouteResult:
    """Worst case of one route over the envelope."""

    route: str
    planner: str  # "prefill" | "decode" | "fa3"
    layout: Layout
    float_bytes: int
    int_bytes: int
    batch: PlanBatch | None
    exact: bool
    gap_bytes: int = 0
    blocks_per_sm: int | None = None
    notes: tuple[str, ...] = field(default=())


def _plan(family: str, lay: Layout, batch: PlanBatch, page_size: int) -> PlanSize:
    pages = [ceil_div(k, page_size) for k in batch.kv_lens]
    return prefill_plan(family, batch.qo_lens, pages, heads_q=lay.heads_q, heads_kv=lay.heads_kv,
                        head_dim_qk=lay.head_dim_qk, head_dim_vo=lay.head_dim_vo,
                        page_size=page_size, dev=lay.device, cuda_graph=batch.cuda_graph,
                        uniform_q_len=batch.uniform_q_len,
                        fixed_uniform_q_len=batch.fixed_uniform_q_len, kv_dtype_bytes=lay.kv_bytes)


def _split_witness(target: int, tiles_per_req: int, q_len: int, env: PlanEnvelope,
                   max_reqs: int | None = None) -> list[tuple[int, int]]:
    """Requests of ``q_len`` tokens whose KV splits into chunks totalling ``target`` work items.

    Each request gets ``c`` chunks of exactly the planner's minimum chunk (128 tokens' worth of
    pages), so the binary search lands on the minimum chunk and the split batch is
    ``tiles_per_req * sum(c)``.
    """
    page = env.page_size
    min_chunk = max(128 // page, 1)
    max_chunks = (env.max_model_len // page) // min_chunk
    limit = env.max_num_seqs if max_reqs is None else min(max_reqs, env.max_num_seqs)
    reqs: list[tuple[int, int]] = []
    remaining, tokens = target, 0
    while remaining >= tiles_per_req and len(reqs) < limit and max_chunks >= 1:
        chunks = min(max_chunks, remaining // tiles_per_req)
        kv_tokens = chunks * min_chunk * page
        if kv_tokens < q_len or tokens + q_len > env.max_num_batched_tokens:
            break
        reqs.append((q_len, kv_tokens))
        remaining -= tiles_per_req * chunks
        tokens += q_len
    return reqs


def _int_bound(family: str, lay: Layout, tokens: int, batch: int, cuda_graph: bool) -> int:
    """Upper bound of the prefill planner's int carving: every optional array, largest sizes."""
    max_bs = max_batch_size_if_split(lay.num_sm, lay.heads_kv)
    padded = max(max_bs, ceil_div(tokens * lay.group, 16) + batch)
    return prefill_int_bytes(family, padded, batch, tokens, True, cuda_graph)


def _finish(route: str, family: str, lay: Layout, env: PlanEnvelope, bound: int,
            cands: list[PlanBatch], int_bytes: int, notes: tuple[str, ...] = ()) -> RouteResult:
    best, best_batch = -1, None
    for cand in cands:
        got = _plan(family, lay, cand, env.page_size).float_bytes
        if got > best:
            best, best_batch = got, cand
    if best > bound:
        raise AssertionError(f"{route}: a constructed batch needs {best} > claimed bound {bound}")
    exact = best == bound
    extra = () if exact else (
        f"{route}: no batch inside the envelope attains the bound; best found is "
        f"{bound - max(best, 0)} bytes short",)
    return RouteResult(route, "prefill", lay, bound, int_bytes, best_batch, exact,
                       0 if exact else bound - max(best, 0), None, notes + extra)


def _q_for_tile(family: str, lay: Layout, target_cta: int, uniform: int = 0) -> int:
    if uniform:
        return uniform
    for q in range(1, 4097):
        if cta_tile_q(q * lay.group, lay.head_dim_vo, lay.head_dim_qk, lay.device, lay.kv_bytes, family) == target_cta:
            return q
    return 1


def prefill_nograph(family: str, lay: Layout, env: PlanEnvelope) -> RouteResult:
    """No CUDA graph: padded == the split batch <= max_batch_size_if_split; largest tile wins."""
    max_bs = max_batch_size_if_split(lay.num_sm, lay.heads_kv)
    cta = max_cta_tile_q(lay.head_dim_vo, lay.head_dim_qk, lay.device, family)
    bound = prefill_float_bytes(family, lay.heads_q, lay.heads_kv, lay.head_dim_vo, max_bs, cta)
    q = _q_for_tile(family, lay, cta)
    tiles = ceil_div(q * lay.group, cta)
    ib = _int_bound(family, lay, env.max_num_batched_tokens,
                    min(env.max_num_seqs, env.max_num_batched_tokens), False)
    reqs = _split_witness(max_bs, tiles, q, env)
    cands = [PlanBatch(tuple(r[0] for r in reqs), tuple(r[1] for r in reqs), False)] if reqs else []
    first = _finish("prefill", family, lay, env, bound, cands, ib)
    if first.exact:
        return first
    # Few requests or short sequences: give each request more query tiles instead.
    for t in range(tiles + 1, min(max_bs, 256) + 1):
        q_t = ((t - 1) * cta) // lay.group + 1
        reqs = _split_witness(max_bs, t, q_t, env)
        if reqs:
            cands.append(PlanBatch(tuple(r[0] for r in reqs), tuple(r[1] for r in reqs), False))
    return _finish("prefill", family, lay, env, bound, cands, ib)


def _graph_batch(tokens: int, batch: int, env: PlanEnvelope, cap: int) -> PlanBatch | None:
    """``batch`` requests sharing ``tokens`` query tokens, none longer than ``cap``."""
    if batch * cap < tokens or batch > tokens:
        return None
    base, extra = divmod(tokens, batch)
    qo = tuple(base + (1 if i < extra else 0) for i in range(batch))
    return PlanBatch(qo, qo, True)


def prefill_graph(family: str, lay: Layout, env: PlanEnvelope) -> RouteResult:
    """CUDA graph: padded = max(max_batch_size_if_split, total_num_tiles_q), always split.

    The tile estimate depends only on the token count N and batch size B (``ceil(N*g/cta) + B -
    1`` with cta chosen from ``N - B + 1``), so the maximum is found by enumerating B and, for each,
    the largest N of every tile-size regime.
    """
    g = lay.group
    max_bs = max_batch_size_if_split(lay.num_sm, lay.heads_kv)
    n_max = env.graph_tokens
    best_rows, best_nb, best_plan = -1, (n_max, 1), (max_bs, 0)
    dev, hq, hkv, dvo, dqk = lay.device, lay.heads_q, lay.heads_kv, lay.head_dim_vo, lay.head_dim_qk
    for b in range(1, min(env.max_num_seqs, n_max) + 1):
        ns = {n_max}
        for thr in (16, 32, 64):
            n = b - 1 + thr // g
            if b <= n < n_max:
                ns.add(n)
        for n in ns:
            cta = cta_tile_q((n - b + 1) * g, dvo, dqk, dev, lay.kv_bytes, family)
            padded = max(max_bs, ceil_div(n * g, cta) + b - 1)
            rows = prefill_split_rows(family, hq, hkv, padded, cta)
            if rows > best_rows:
                best_rows, best_nb, best_plan = rows, (n, b), (padded, cta)
    best = prefill_float_bytes(family, lay.heads_q, lay.heads_kv, lay.head_dim_vo, *best_plan)
    cand = _graph_batch(*best_nb, env, env.max_model_len)
    ib = _int_bound(family, lay, n_max, min(env.max_num_seqs, n_max), True)
    return _finish("prefill_cuda_graph", family, lay, env, best, [cand] if cand else [], ib)


def decode_tc(family: str, lay: Layout, env: PlanEnvelope, cuda_graph: bool) -> RouteResult:
    """Tensor-core decode: every request has ``u = 1 + mtp`` query tokens.

    What the wrapper tells the planner follows the generation (``decode_uniform_args``): from 0.7.4
    ``uniform_q_len = u`` with ``fixed_uniform_q_len``, so a captured batch past the split budget never splits;
    0.6.16-0.7.3 pass ``uniform_q_len`` only when ``u > 1`` and a captured batch always splits, with
    ``padded = max(M, B * tiles)``; earlier ones (and ``u == 1``) plan a captured batch as a ragged one."""
    u = env.q_decode
    g = lay.group
    max_bs = max_batch_size_if_split(lay.num_sm, lay.heads_kv)
    cta = cta_tile_q(u * g, lay.head_dim_vo, lay.head_dim_qk, lay.device, lay.kv_bytes, family)
    tiles = ceil_div(u * g, cta)
    uq, fixed = decode_uniform_args(family, u)
    if cuda_graph:
        cap = env.graph_tokens // u if env.cuda_graph_sizes else env.max_num_seqs
        b_max = max(1, min(env.max_num_seqs, cap))
    else:
        b_max = max(1, min(env.max_num_seqs, env.max_num_batched_tokens // u))
    route = "decode_tc_cuda_graph" if cuda_graph else "decode_tc"
    ib = _int_bound(family, lay, b_max * u, b_max, cuda_graph)
    if cuda_graph and not generation(family).fixed_uniform_q:
        kv = min(env.max_model_len, max(u, 128))
        if uq:
            padded = max(max_bs, b_max * tiles)
            best = prefill_float_bytes(family, lay.heads_q, lay.heads_kv, lay.head_dim_vo, padded, cta)
            cand = PlanBatch((u,) * b_max, (kv,) * b_max, True, uq, fixed)
            return _finish(route, family, lay, env, best, [cand], ib)
        best_rows, best_b, best_plan = -1, 1, (max_bs, 0)
        dev, hq, hkv, dvo, dqk = lay.device, lay.heads_q, lay.heads_kv, lay.head_dim_vo, lay.head_dim_qk
        for b in range(1, b_max + 1):
            n = b * u
            c = cta_tile_q((n - b + 1) * g, dvo, dqk, dev, lay.kv_bytes, family)
            padded = max(max_bs, ceil_div(n * g, c) + b - 1)
            rows = prefill_split_rows(family, hq, hkv, padded, c)
            if rows > best_rows:
                best_rows, best_b, best_plan = rows, b, (padded, c)
        best = prefill_float_bytes(family, lay.heads_q, lay.heads_kv, lay.head_dim_vo, *best_plan)
        cand = PlanBatch((u,) * best_b, (kv,) * best_b, True)
        return _finish(route, family, lay, env, best, [cand], ib)
    if tiles > max_bs:
        bound = 0
        cands = [PlanBatch((u,), (u,), cuda_graph, uq, fixed)]
    else:
        bound = prefill_float_bytes(family, lay.heads_q, lay.heads_kv, lay.head_dim_vo, max_bs, cta)
        if cuda_graph:
            kv = min(env.max_model_len, max(u, 128))
            cands = [PlanBatch((u,), (kv,), True, uq, fixed)]
        else:
            reqs = _split_witness(max_bs, tiles, u, env, b_max)
            cands = [PlanBatch(tuple(r[0] for r in reqs), tuple(r[1] for r in reqs), False, uq, fixed)]
            cands = [c for c in cands if c.qo_lens]
    return _finish(route, family, lay, env, bound, cands, ib)


def decode_cc(family: str, lay: Layout, env: PlanEnvelope, cuda_graph: bool,
              blocks_per_sm: int | None) -> RouteResult:
    """CUDA-core decode: the split batch is bounded by ``blocks_per_sm * num_sm / H_kv``."""
    notes: tuple[str, ...] = ()
    if blocks_per_sm is None:
        blocks_per_sm = decode_blocks_per_sm_bound(lay.head_dim_vo, lay.group, lay.cc_major, lay.kv_bytes)
        notes = (f"decode occupancy unknown: bounded at {blocks_per_sm} blocks/SM "
                 "(threads and shared memory only)",)
    max_grid = blocks_per_sm * lay.num_sm
    padded = max_grid // lay.heads_kv
    hq = lay.heads_q
    bound = 0
    if lay.heads_kv < max_grid:
        bound = (ceil_div(hq * padded * lay.head_dim_vo * 4, 16) * 16) + hq * padded * 4
    page = env.page_size
    route = "decode_cc_cuda_graph" if cuda_graph else "decode_cc"
    cands: list[tuple[tuple[int, ...], tuple[int, ...]]]
    if cuda_graph:
        kv_len = min(env.max_model_len, 128)
        cands = [((1,), (kv_len,))]
    else:
        reqs = _split_witness(padded, 1, 1, env)
        cands = [(tuple(r[0] for r in reqs), tuple(r[1] for r in reqs))] if reqs else []
    best, best_batch = 0, None
    for qo, kv in cands:
        got = decode_plan(hq, lay.heads_kv, lay.head_dim_vo, [ceil_div(k, page) for k in kv],
                          page_size=page, num_sm=lay.num_sm, blocks_per_sm=blocks_per_sm,
                          cuda_graph=cuda_graph).float_bytes
        if got >= best:
            best, best_batch = got, PlanBatch(qo, kv, cuda_graph)
    b_max = min(env.max_num_seqs, env.max_num_batched_tokens)
    ib = 3 * (ceil_div(4 * max(padded, b_max) + 4, 16) * 16) + 4 + 16 + max(padded, b_max) + 16
    exact = best == bound
    if not exact:
        notes += (f"{route}: best batch found is {bound - best} bytes short of the bound",)
    return RouteResult(route, "decode", lay, bound, ib, best_batch, exact,
                       bound - best, blocks_per_sm, notes)


def fa3_int(lay: Layout, env: PlanEnvelope, cuda_graph: bool) -> RouteResult:
    """FA3 ``PrefillSM90Plan`` int arrays (seven per-work arrays plus the per-SM indptr)."""
    cta = 192 if lay.head_dim_vo == 64 else 128
    n = env.graph_tokens if cuda_graph else env.max_num_batched_tokens
    b = min(env.max_num_seqs, n)
    per_head = ceil_div(n, cta) + b - 1
    works = max(min(per_head, 4096) * lay.heads_q, per_head)
    size = 0
    for _ in range(7):
        size = ceil_div(size, 16) * 16 + 4 * works
    size = ceil_div(size, 16) * 16 + 4 * (lay.num_sm + 1)
    notes: tuple[str, ...] = ()
    if size > DEFAULT_INT_WORKSPACE:
        notes = (f"FA3 int arrays need {size} bytes > the {DEFAULT_INT_WORKSPACE} byte default "
                 "int workspace",)
    return RouteResult("fa3_int", "fa3", lay, 0, size, None, False, 0, None, notes)
