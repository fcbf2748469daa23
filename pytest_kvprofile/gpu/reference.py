"""The float32 reference that keeps the GPU tier's FlashInfer kernels honest, and its test data.

Why here and not beside the builders: this is plain torch (it runs on CPU, where its tests check it
against a naive attention), and the builders, the sizing probe and the graph-replay test all
compare against it. Page tables map a batch of millions of KV tokens onto a small physical pool,
so worst-case batches need only a small real KV cache.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvprofile.contract.protocol import Batch

__all__ = [
    "BF16_TOLERANCE",
    "AttentionMismatch",
    "PagedLayout",
    "attention_error",
    "checked_requests",
    "input_shapes",
    "paged_layout",
    "random_inputs",
    "reference_attention",
    "scratch_bytes",
    "synthetic_lens",
]

BF16_TOLERANCE = 2e-2  # relative (Frobenius) error of bf16 attention against a float32 reference
CHECK_ROWS = 16  # query rows per checked request (the last ones: they see the most KV)
CHECK_REQUESTS = 8


class AttentionMismatch(AssertionError):
    """A kernel's output differs from the float32 reference beyond bf16 tolerance."""


@dataclass(frozen=True)
class PagedLayout:
    """One batch's paged-KV metadata as FlashInfer takes it (int32 lists; kv in pages)."""

    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_size: int
    qo_indptr: tuple[int, ...]
    kv_indptr: tuple[int, ...]
    kv_indices: tuple[int, ...]
    last_page_len: tuple[int, ...]
    num_physical_pages: int

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def total_q(self) -> int:
        return self.qo_indptr[-1]


def paged_layout(qo_lens: Sequence[int], kv_lens: Sequence[int], page_size: int,
                 max_physical_pages: int | None = None, seed: int = 0) -> PagedLayout:
    """Page tables for a batch. Logical pages map onto at most ``max_physical_pages`` physical
    ones (shuffled, reused modulo the pool), so a worst batch of millions of KV tokens needs only
    a small real KV cache; the kernel and the reference read the same pages either way."""
    if len(qo_lens) != len(kv_lens) or not qo_lens:
        raise ValueError("qo_lens and kv_lens must be non-empty and of equal length")
    for q, k in zip(qo_lens, kv_lens):
        if q < 1 or k < q:
            raise ValueError(f"every request needs 1 <= qo_len <= kv_len, got qo={q}, kv={k}")
    pages = [-(-k // page_size) for k in kv_lens]
    total = sum(pages)
    physical = total if max_physical_pages is None else max(1, min(total, max_physical_pages))
    order = list(range(physical))
    random.Random(seed).shuffle(order)
    indices = tuple(order[i % physical] for i in range(total))
    qo_indptr = [0]
    kv_indptr = [0]
    for q, p in zip(qo_lens, pages):
        qo_indptr.append(qo_indptr[-1] + q)
        kv_indptr.append(kv_indptr[-1] + p)
    last = tuple(k - (p - 1) * page_size for k, p in zip(kv_lens, pages))
    return PagedLayout(tuple(qo_lens), tuple(kv_lens), page_size, tuple(qo_indptr), tuple(kv_indptr),
                       indices, last, physical)


def synthetic_lens(batch: Batch, max_model_len: int, q_per_decode: int = 1) -> tuple[list[int], list[int]]:
    """Query and KV lengths for a lifecycle Batch: prefill spreads its tokens over its requests
    (KV = its own tokens); decode requests carry ``q_per_decode`` tokens over a 1024-token context."""
    n = max(1, batch.num_reqs)
    if batch.kind == "decode":
        qo = [q_per_decode] * n
        kv = [min(max_model_len, max(q_per_decode, 1024))] * n
        return qo, kv
    tokens = max(batch.num_tokens, n)
    base, extra = divmod(tokens, n)
    qo = [min(max_model_len, base + (1 if i < extra else 0)) for i in range(n)]
    return qo, list(qo)


def checked_requests(layout: PagedLayout, limit: int = CHECK_REQUESTS) -> list[int]:
    """The requests a check compares: all of a small batch, else the first and last ``limit // 2``."""
    n = layout.batch_size
    if n <= limit:
        return list(range(n))
    half = limit // 2
    return sorted(set(range(half)) | set(range(n - half, n)))


def reference_attention(q: Any, k_pages: Any, v_pages: Any, layout: PagedLayout, *, sm_scale: float | None = None,
                        requests: Sequence[int] | None = None, rows: int = CHECK_ROWS) -> dict[int, Any]:
    """Float32 causal (bottom-right aligned) attention over a paged NHD cache, for the last
    ``rows`` query rows of each request in ``requests``: {request: [rows, H_q, D_vo]}.

    ``q`` is [total_q, H_q, D]; ``k_pages``/``v_pages`` are [pages, page_size, H_kv, D].
    """
    import torch

    heads_q, dim = int(q.shape[1]), int(q.shape[2])
    heads_kv = int(k_pages.shape[2])
    group = heads_q // heads_kv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(dim)
    out: dict[int, Any] = {}
    for r in (requests if requests is not None else range(layout.batch_size)):
        q_len, kv_len = layout.qo_lens[r], layout.kv_lens[r]
        take = min(rows, q_len)
        q0 = layout.qo_indptr[r] + q_len - take
        qr = q[q0:q0 + take].float()  # [take, Hq, D]
        idx = torch.tensor(layout.kv_indices[layout.kv_indptr[r]:layout.kv_indptr[r + 1]], dtype=torch.long,
                           device=k_pages.device)
        k = k_pages.index_select(0, idx).reshape(-1, heads_kv, k_pages.shape[-1])[:kv_len].float()
        v = v_pages.index_select(0, idx).reshape(-1, heads_kv, v_pages.shape[-1])[:kv_len].float()
        k = k.repeat_interleave(group, dim=1)  # [kv, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qr, k) * scale
        # Row i of the request is query position q_len - take + i; it sees kv positions <= kv_len - q_len + that.
        pos_q = torch.arange(q_len - take, q_len, device=q.device) + (kv_len - q_len)
        pos_k = torch.arange(kv_len, device=q.device)
        mask = pos_k[None, :] > pos_q[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        out[r] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out


def attention_error(out: Any, reference: dict[int, Any], layout: PagedLayout, rows: int = CHECK_ROWS) -> float:
    """Largest relative Frobenius error over the checked requests (``out`` is [total_q, H_q, D_vo])."""
    worst = 0.0
    for r, ref in reference.items():
        take = ref.shape[0]
        q0 = layout.qo_indptr[r] + layout.qo_lens[r] - take
        got = out[q0:q0 + take].float()
        if not bool(got.isfinite().all()):
            return float("inf")
        denom = float(ref.norm()) or 1.0
        worst = max(worst, float((got - ref).norm()) / denom)
    return worst


def input_shapes(layout: PagedLayout, heads_q: int, heads_kv: int, head_dim: int,
                 head_dim_vo: int) -> dict[str, tuple[int, ...]]:
    """Shapes of q, the paged K and V caches (NHD) and the output for one checked run."""
    pages = (layout.num_physical_pages, layout.page_size, heads_kv)
    return {"q": (layout.total_q, heads_q, head_dim), "k": (*pages, head_dim), "v": (*pages, head_dim_vo),
            "out": (layout.total_q, heads_q, head_dim_vo)}


def scratch_bytes(layout: PagedLayout, heads_q: int, heads_kv: int, head_dim: int, head_dim_vo: int) -> int:
    """bf16 bytes of q, K, V and out, each 256-byte aligned: what a checked run carves from one buffer."""
    total = 0
    for shape in input_shapes(layout, heads_q, heads_kv, head_dim, head_dim_vo).values():
        total += -(-2 * math.prod(shape) // 256) * 256
    return total


def random_inputs(layout: PagedLayout, heads_q: int, heads_kv: int, head_dim: int, head_dim_vo: int,
                  device: Any, seed: int = 0, buffer: Any = None) -> dict[str, Any]:
    """bf16 q, paged K/V (``layout.num_physical_pages`` pages) and an output tensor, filled with
    N(0, 1) (out with zeros). With ``buffer`` (a uint8 tensor of at least ``scratch_bytes``), all
    four are carved out of it, so the ledger's one allocation is the test data's real footprint."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out: dict[str, Any] = {}
    offset = 0
    for name, shape in input_shapes(layout, heads_q, heads_kv, head_dim, head_dim_vo).items():
        nbytes = 2 * math.prod(shape)
        if buffer is None:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        else:
            t = buffer[offset:offset + nbytes].view(torch.bfloat16).view(shape)
            offset += -(-nbytes // 256) * 256
        if name == "out":
            t.zero_()
        else:
            t.normal_(generator=gen)
        out[name] = t
    return out
