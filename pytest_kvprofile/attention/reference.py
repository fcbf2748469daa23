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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = [
    "BF16_TOLERANCE",
    "attend",
    "AttentionMismatch",
    "PagedLayout",
    "attention_error",
    "checked_requests",
    "input_shapes",
    "paged_layout",
    "random_inputs",
    "reference_attention",
    "scratch_bytes",
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


def checked_requests(layout: PagedLayout, limit: int = CHECK_REQUESTS) -> list[int]:
    """The requests a check compares: all of a small batch, else the first and last ``limit // 2``."""
    n = layout.batch_size
    if n <= limit:
        return list(range(n))
    half = limit // 2
    return sorted(set(range(half)) | set(range(n - half, n)))


def attend(q: Tensor, k: Tensor, v: Tensor, kv_len: int, *, scale: float, causal: bool = True, window_left: int = -1,
           logits_soft_cap: float = 0.0) -> Tensor:
    """Float32 attention of one request's last ``q.shape[0]`` query rows over its first ``kv_len`` KV rows, as
    FlashInfer's kernels compute it: GQA heads mapped by group, the causal mask aligned to the end of the KV, the
    sliding window, the soft cap. ``q`` is [rows, H_q, D]; ``k``/``v`` [kv_len, H_kv, D]; returns [rows, H_q, D_vo].

    The one reference both tiers compare against: the simulated device's ``run()`` (``host_plan.py``) and the GPU
    tier's checked kernels (``reference_attention``)."""
    import torch

    rows, heads_q = int(q.shape[0]), int(q.shape[1])
    group = heads_q // int(k.shape[1])
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if logits_soft_cap and logits_soft_cap > 0:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    pos_q = torch.arange(rows, device=q.device).unsqueeze(1) + (kv_len - rows)
    pos_k = torch.arange(kv_len, device=q.device).unsqueeze(0)
    mask = torch.zeros(rows, kv_len, dtype=torch.bool, device=q.device)
    if causal:
        mask |= pos_k > pos_q
    if window_left is not None and window_left >= 0:
        mask |= pos_k < pos_q - window_left
    logits = logits.masked_fill(mask.unsqueeze(0), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1).nan_to_num(0.0), v)


def reference_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, layout: PagedLayout, *,
                        sm_scale: float | None = None, requests: Sequence[int] | None = None,
                        rows: int = CHECK_ROWS) -> dict[int, Tensor]:
    """Float32 causal (bottom-right aligned) attention over a paged NHD cache, for the last
    ``rows`` query rows of each request in ``requests``: {request: [rows, H_q, D_vo]}.

    ``q`` is [total_q, H_q, D]; ``k_pages``/``v_pages`` are [pages, page_size, H_kv, D].
    """
    import torch

    heads_kv, dim = int(k_pages.shape[2]), int(q.shape[2])
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(dim)
    out: dict[int, Tensor] = {}
    for r in (requests if requests is not None else range(layout.batch_size)):
        q_len, kv_len = layout.qo_lens[r], layout.kv_lens[r]
        take = min(rows, q_len)
        q0 = layout.qo_indptr[r] + q_len - take
        idx = torch.tensor(layout.kv_indices[layout.kv_indptr[r]:layout.kv_indptr[r + 1]], dtype=torch.long,
                           device=k_pages.device)
        k = k_pages.index_select(0, idx).reshape(-1, heads_kv, k_pages.shape[-1])[:kv_len]
        v = v_pages.index_select(0, idx).reshape(-1, heads_kv, v_pages.shape[-1])[:kv_len]
        out[r] = attend(q[q0:q0 + take], k, v, kv_len, scale=scale)
    return out


def attention_error(out: Tensor, reference: dict[int, Tensor], layout: PagedLayout, rows: int = CHECK_ROWS) -> float:
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
                  device: torch.device | str, seed: int = 0, buffer: Tensor | None = None) -> dict[str, Tensor]:
    """bf16 q, paged K/V (``layout.num_physical_pages`` pages) and an output tensor, filled with
    N(0, 1) (out with zeros). With ``buffer`` (a uint8 tensor of at least ``scratch_bytes``), all
    four are carved out of it, so the ledger's one allocation is the test data's real footprint."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out: dict[str, Tensor] = {}
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
