"""Every FlashInfer call the GPU tier makes: wrapper construction, ``plan()``/``run()`` arguments,
a checked run against the float32 reference, and a decode step captured in a real CUDA graph.

Why one module: the CPU tests check each keyword and positional argument passed here against the
installed FlashInfer's signatures (``tests/gpu/test_signatures.py``), so a renamed argument fails on
CPU instead of on first contact with a GPU. ``flashinfer`` and ``torch`` are imported inside the
functions: the plugin must import without them touching CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from pytest_kvprofile.attention.reference import (
    BF16_TOLERANCE,
    AttentionMismatch,
    PagedLayout,
    attention_error,
    checked_requests,
    paged_layout,
    random_inputs,
    reference_attention,
)

if TYPE_CHECKING:
    import torch
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
    from torch import Tensor

    PagedWrapper: TypeAlias = BatchPrefillWithPagedKVCacheWrapper | BatchDecodeWithPagedKVCacheWrapper

# plan()'s positional and keyword arguments (tensors, head counts, dtypes, by position): their types are FlashInfer's
# signature, which tests/gpu/test_signatures.py checks against the installed FlashInfer
PlanArgs: TypeAlias = tuple[tuple[Any, ...], dict[str, Any]]

Route = Literal["prefill", "decode"]  # the paged wrapper a call makes or plans: BatchPrefill... or BatchDecode...

__all__ = ["ReplayRecord", "Route", "capture_decode_replays", "make_wrapper", "plan_args", "run_checked"]


def _int32(values: Sequence[int]) -> Tensor:
    """Host int32 metadata: plan() reads it on the host and copies it into its own device buffers."""
    import torch

    return torch.tensor(list(values), dtype=torch.int32)


def make_wrapper(route: Route, float_buffer: Tensor, int_buffer: Tensor | None, *, tensor_cores: bool,
                 cuda_graph: bool = False, layout: PagedLayout | None = None) -> PagedWrapper:
    """A FlashInfer paged wrapper on ``float_buffer`` (uint8 CUDA tensor), FA2 backend, NHD layout.

    FA2 is named explicitly because it is the planner the sizing oracle runs; ``auto`` may choose
    FA3 for long prefill queries on Hopper, whose workspace is sized by another route. Under CUDA
    graphs the indptr/indices buffers are sized from ``layout``, as an engine sizes them for its
    largest captured batch.
    """
    import flashinfer
    import torch

    dev = float_buffer.device
    graph_kw: dict[str, Tensor] = {}
    if cuda_graph:
        if layout is None:
            raise ValueError("a CUDA-graph wrapper needs the batch layout to size its buffers")
        b = layout.batch_size
        if route == "prefill":
            graph_kw = dict(qo_indptr_buf=torch.empty(b + 1, dtype=torch.int32, device=dev),
                            paged_kv_indptr_buf=torch.empty(b + 1, dtype=torch.int32, device=dev),
                            paged_kv_indices_buf=torch.empty(len(layout.kv_indices), dtype=torch.int32, device=dev),
                            paged_kv_last_page_len_buf=torch.empty(b, dtype=torch.int32, device=dev))
        else:
            graph_kw = dict(paged_kv_indptr_buffer=torch.empty(b + 1, dtype=torch.int32, device=dev),
                            paged_kv_indices_buffer=torch.empty(len(layout.kv_indices), dtype=torch.int32, device=dev),
                            paged_kv_last_page_len_buffer=torch.empty(b, dtype=torch.int32, device=dev))
    w: PagedWrapper
    if route == "prefill":
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(float_buffer, "NHD", use_cuda_graph=cuda_graph,
                                                           backend="fa2", **graph_kw)
    else:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(float_buffer, "NHD", use_cuda_graph=cuda_graph,
                                                          use_tensor_cores=tensor_cores, backend="fa2", **graph_kw)
    if int_buffer is not None:
        w.reset_workspace_buffer(float_buffer, int_buffer)
    return w


def plan_args(route: Route, layout: PagedLayout, heads_q: int, heads_kv: int, head_dim: int,
              head_dim_vo: int, kv_data_type: str = "bfloat16") -> PlanArgs:
    """Positional and keyword arguments of ``plan()`` (and ``workspace_size()``) for a layout; ``kv_data_type`` is
    the torch dtype name of the KV cache (``KvDtype.torch``: the planner sees its size)."""
    import torch

    kv_indptr = _int32(layout.kv_indptr)
    kv_indices = _int32(layout.kv_indices)
    last = _int32(layout.last_page_len)
    dtypes = dict(q_data_type=torch.bfloat16, kv_data_type=getattr(torch, kv_data_type))
    if route == "prefill":
        args = (_int32(layout.qo_indptr), kv_indptr, kv_indices, last, heads_q, heads_kv, head_dim,
                layout.page_size)
        return args, dict(head_dim_vo=head_dim_vo, causal=True, **dtypes)
    q_len = layout.qo_lens[0]
    if any(q != q_len for q in layout.qo_lens):
        raise ValueError(f"a decode batch has one query length per request, got {sorted(set(layout.qo_lens))}")
    if head_dim_vo != head_dim:
        raise ValueError("the decode wrapper takes one head_dim; MLA-shaped layouts are prefill-only here")
    kw: dict[str, torch.dtype | int] = dict(dtypes)
    if q_len > 1:
        kw["q_len_per_req"] = q_len
    return (kv_indptr, kv_indices, last, heads_q, heads_kv, head_dim, layout.page_size), kw


def run_checked(route: Route, wrapper: PagedWrapper, layout: PagedLayout, heads_q: int, heads_kv: int, head_dim: int,
                head_dim_vo: int, device: torch.device | str, *, plan: bool = True, seed: int = 0,
                tolerance: float = BF16_TOLERANCE, buffer: Tensor | None = None) -> float:
    """Plan (unless already planned), run on random paged data, compare with the float32
    reference; returns the relative error, raises AttentionMismatch past ``tolerance``."""
    if plan:
        args, kw = plan_args(route, layout, heads_q, heads_kv, head_dim, head_dim_vo)
        wrapper.plan(*args, **kw)
    data = random_inputs(layout, heads_q, heads_kv, head_dim, head_dim_vo, device, seed, buffer)
    q, k, v = data["q"], data["k"], data["v"]
    out = wrapper.run(q, (k, v), out=data["out"])
    ref = reference_attention(q, k, v, layout, requests=checked_requests(layout))
    err = attention_error(out, ref, layout)
    if not err <= tolerance:
        raise AttentionMismatch(
            f"FlashInfer {route} output differs from the float32 reference: relative error {err:.3g} > "
            f"{tolerance:g} on {layout.batch_size} requests (qo {list(layout.qo_lens[:4])}..., kv "
            f"{list(layout.kv_lens[:4])}...); a wrong workspace pointer or an overflowed float workspace "
            "corrupts split-KV partial results like this"
        )
    return err


@dataclass(frozen=True)
class ReplayRecord:
    """One replay of a captured decode step: its error against the reference and the arena it saw."""

    replay: int
    relative_error: float
    arena_ptr: int
    arena_bytes: int
    replanned: bool


def capture_decode_replays(arena: Tensor, layout: PagedLayout, *, heads_q: int, heads_kv: int, head_dim: int,
                           tensor_cores: bool, replays: int = 4, tolerance: float = BF16_TOLERANCE,
                           seed: int = 0) -> list[ReplayRecord]:
    """Capture a CUDA-graph decode wrapper's ``run()`` in ``torch.cuda.graph`` on ``arena`` (the float
    workspace, a uint8 CUDA tensor), then replay it ``replays`` times with new q/K/V values written
    into the captured tensors (every other replay also re-plans shorter KV into the wrapper's fixed
    buffers, as an engine plans each step); each output is compared with the float32 reference.

    Why: a captured kernel holds raw pointers; a workspace that moves or shrinks after capture, or
    plan metadata that a replay does not see, corrupts attention silently. Raises AttentionMismatch."""
    import torch

    dev = arena.device
    wrapper = make_wrapper("decode", arena, None, tensor_cores=tensor_cores, cuda_graph=True, layout=layout)
    args, kw = plan_args("decode", layout, heads_q, heads_kv, head_dim, head_dim)
    wrapper.plan(*args, **kw)
    data = random_inputs(layout, heads_q, heads_kv, head_dim, head_dim, dev, seed)
    q, k, v, out = data["q"], data["k"], data["v"], data["out"]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch.cuda.Stream.__new__ is untyped
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wrapper.run(q, (k, v), out=out)  # warm up outside the capture (lazy init, module load)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, (k, v), out=out)
    shorter = paged_layout(layout.qo_lens, [max(q_len, kv // 2) for q_len, kv in zip(layout.qo_lens, layout.kv_lens)],
                           layout.page_size, max_physical_pages=layout.num_physical_pages, seed=seed + 1)
    records = []
    gen = torch.Generator(device=dev)
    try:
        for i in range(replays):
            current = shorter if i % 2 else layout
            if i % 2:
                args, kw = plan_args("decode", current, heads_q, heads_kv, head_dim, head_dim)
                wrapper.plan(*args, **kw)
            elif i:
                args, kw = plan_args("decode", layout, heads_q, heads_kv, head_dim, head_dim)
                wrapper.plan(*args, **kw)
            gen.manual_seed(seed + 100 + i)
            for t in (q, k, v):
                t.normal_(generator=gen)
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            ref = reference_attention(q, k, v, current, requests=checked_requests(current))
            err = attention_error(out, ref, current)
            records.append(ReplayRecord(i, err, int(arena.data_ptr()), int(arena.numel()), bool(i % 2)))
            if not err <= tolerance:
                raise AttentionMismatch(
                    f"replay {i} of a captured FlashInfer decode ({layout.batch_size} requests, q_len "
                    f"{layout.qo_lens[0]}, {'re-planned' if i % 2 else 'as captured'}) differs from the float32 "
                    f"reference: relative error {err:.3g} > {tolerance:g}")
    finally:
        graph.reset()
    return records
