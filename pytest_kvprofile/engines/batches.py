"""A harness batch as any engine's model runner lays it out: per-request query and sequence lengths, the block
table, the slot mapping, the runner's padding of decode steps to a captured size, and the batches an adapter
plans inside the profiling window (one of every shape the engine runs).

Why a module of its own: every engine adapter turns the lifecycle's :class:`~pytest_kvprofile.contract.protocol.Batch`
into its runner's inputs, and the layout is the engine's scheduler arithmetic, not the engine's code. An adapter
copies the host arrays of :class:`RunnerBatch` into its own buffers and wraps them in its own metadata class (vLLM's
``CommonAttentionMetadata``, ``engines/vllm/flashinfer.py``); nothing here imports an engine, numpy or torch.

The layout: every request sits at the envelope's full context (the most split-KV work a plan can see); a decode
request carries ``1 + mtp`` query tokens; a mixed batch puts its decodes first, as runners reorder them; request
``i`` owns pages ``i * pages_per_request ... (i + 1) * pages_per_request - 1``; token ``t`` goes to slot ``t``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from pytest_kvprofile.contract.protocol import Batch
from pytest_kvprofile.matrix.cases import Case

__all__ = ["RunnerBatch", "block_table", "capture_batches", "capture_sizes", "mixed_warmup_batch", "pad_to_capture",
           "pages_per_request", "query_lens", "runner_batch", "window_batches"]


def pages_per_request(case: Case) -> int:
    """Block-table columns per request: a request at the envelope's full context."""
    env = case.envelope
    return math.ceil(env.max_model_len / env.page_size)


def capture_sizes(case: Case) -> list[int]:
    """The case's CUDA-graph capture sizes in tokens, ascending (an engine may adjust them: pass its own to
    :func:`pad_to_capture`)."""
    return sorted(case.envelope.cuda_graph_sizes)


def pad_to_capture(batch: Batch, sizes: Sequence[int], mtp: int) -> Batch:
    """A pure decode batch within the captured sizes (tokens, ascending), padded to the next one, as runners pad
    a step to replay a captured graph; any other batch, or a size that holds no whole request, as it is."""
    q = 1 + mtp
    if batch.kind != "decode" or not sizes or batch.num_tokens > sizes[-1]:
        return batch
    size = next(s for s in sizes if s >= batch.num_tokens)
    if size % q:
        return batch
    return Batch("decode", size // q, size, batch.cuda_graph, batch.ubatch)


def query_lens(case: Case, batch: Batch, max_reqs: int | None = None) -> list[int]:
    """Each request's query tokens: ``1 + mtp`` per decode request (a mixed batch's first half), the rest of the
    batch's tokens spread evenly over its prefill requests; at least one request, at most ``max_reqs`` (the
    envelope's ``max_num_seqs`` by default)."""
    q = 1 + case.mtp
    n = max(1, min(batch.num_reqs, case.envelope.max_num_seqs if max_reqs is None else max_reqs))
    if batch.kind == "decode":
        return [q] * n
    decodes = n // 2 if batch.kind == "mixed" else 0
    rest = max(batch.num_tokens - decodes * q, n - decodes)
    base, extra = divmod(rest, n - decodes)
    return [q] * decodes + [base + (i < extra) for i in range(n - decodes)]


@dataclass(frozen=True)
class RunnerBatch:
    """One batch's runner inputs on the host: what an adapter copies into its engine's buffers."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    pages_per_request: int

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    @property
    def query_start_loc(self) -> list[int]:
        """Cumulative query tokens, starting at 0 (``num_reqs + 1`` entries)."""
        return [0, *itertools.accumulate(self.query_lens)]

    @property
    def num_computed_tokens(self) -> list[int]:
        """Tokens already in each request's KV cache: its sequence less its query."""
        return [s - q for s, q in zip(self.seq_lens, self.query_lens)]

    @property
    def slot_mapping(self) -> range:
        """Token ``t``'s KV slot: ``t``."""
        return range(self.num_tokens)

    def block_table(self) -> list[range]:
        """Each request's pages: request ``i`` owns ``i * pages_per_request`` onwards (the first ``num_reqs`` rows
        of :func:`block_table`)."""
        return block_table(self.pages_per_request, self.num_reqs)


def runner_batch(case: Case, batch: Batch, max_reqs: int | None = None) -> RunnerBatch:
    """``batch``'s runner inputs (pad it first with :func:`pad_to_capture` where the runner pads)."""
    qlens = query_lens(case, batch, max_reqs)
    seq = tuple(max(case.envelope.max_model_len, q) for q in qlens)
    return RunnerBatch(tuple(qlens), seq, pages_per_request(case))


def mixed_warmup_batch(case: Case, num_tokens: int = 16, dcp_interleave: int = 1) -> RunnerBatch:
    """The dummy batch a runner's kernel warmup builds to load both attention paths (vLLM's V1
    ``_dummy_run(num_tokens, create_mixed_batch=True)``): ``min(num_tokens, batched tokens, model length)`` tokens,
    single-token decodes first (at most half of them, one request fewer than ``max_num_seqs``) at a context of one
    token, then one prefill of the rest with one token already computed; under DCP every context grows by the DCP
    size times its interleave (vLLM's ``get_dcp_dummy_context_len``)."""
    env = case.envelope
    n = min(num_tokens, env.max_num_batched_tokens, env.max_model_len)
    decodes = min(env.max_num_seqs - 1, n // 2)
    context = case.dcp * dcp_interleave if case.dcp > 1 else 0
    prefill = n - decodes
    seq = (1 + context,) * decodes + (prefill + (context or 1),)
    return RunnerBatch((1,) * decodes + (prefill,), seq, pages_per_request(case))


def block_table(pages: int, rows: int) -> list[range]:
    """The runner's block table, filled once: row ``i`` holds pages ``i * pages ... (i + 1) * pages - 1`` (a case's
    whole table is ``block_table(pages_per_request(case), case.envelope.max_num_seqs)``)."""
    return [range(i * pages, (i + 1) * pages) for i in range(rows)]


def capture_batches(case: Case) -> list[Batch]:
    """Every captured decode step (``Envelope.decode_captures``), largest first, as CUDA-graph batches."""
    return [Batch("decode", c.num_reqs, c.num_tokens, cuda_graph=True)
            for c in case.envelope.decode_captures(case.mtp)]


def window_batches(case: Case) -> list[Batch]:
    """One batch of every shape the engine runs, for an adapter that plans inside the profiling window: every
    captured decode step first, then the eager routes at their most requests (a mixed and a prefill step of the
    whole token budget, a decode step of as many requests as fit), last, since an eager wrapper's plan resizes
    its index buffers for the batch and the window must end on the largest."""
    env, q = case.envelope, 1 + case.mtp
    budget = env.max_num_batched_tokens
    reqs = max(1, min(env.max_num_seqs, budget // q))
    return [*capture_batches(case),
            Batch("mixed", min(env.max_num_seqs, budget), budget),
            Batch("prefill", min(env.max_num_seqs, budget), budget),
            Batch("decode", reqs, reqs * q)]
