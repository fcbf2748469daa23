"""Real FlashInfer builders for the GPU tier, and the reference attention that keeps them honest.

``FlashInferCudaBuilder`` follows the stub's protocol (``stubs.FlashInferLikeBuilder``) with real
``flashinfer`` wrappers: one prefill and one decode wrapper per micro-batch, whose float workspace
is a uint8 view of the workspace manager's CUDA arena and whose int workspace and plan metadata
buffers are allocated through the BuilderContext (so the ledger sees them). Warmup plans a batch
that forces split-KV (so the float workspace is really written), runs the kernels on random paged
KV data and compares with a float32 reference: a wrong pointer or an overflowed workspace fails
loudly instead of passing silently. ``LazyFlashInferCudaBuilder`` is the bug-1 mutant: it builds
its wrappers on the first plan(), after KV sizing.

The layout and reference helpers are plain torch and run on CPU; only the builders need CUDA.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.sizing.case import decode_tensor_cores, for_case, routes
from pytest_kvprofile.contract.protocol import Batch, BoundWorkspace, BuilderContext, WorkspaceDeclaration
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.units import MiB

__all__ = [
    "BF16_TOLERANCE",
    "AttentionMismatch",
    "FlashInferCudaBuilder",
    "LazyFlashInferCudaBuilder",
    "PagedLayout",
    "attention_error",
    "gpu_backends",
    "gpu_mutant_backends",
    "paged_layout",
    "reference_attention",
    "synthetic_lens",
]

INT_WORKSPACE_BYTES = 8 * MiB  # FlashInfer's default int workspace per wrapper
BF16_TOLERANCE = 2e-2  # relative (Frobenius) error of bf16 attention against a float32 reference
CHECK_ROWS = 16  # query rows per checked request (the last ones: they see the most KV)
CHECK_REQUESTS = 8
WARMUP_KV_LEN = 4096  # long enough that a single decode request is split across CTAs


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


def _checked_requests(layout: PagedLayout, limit: int = CHECK_REQUESTS) -> list[int]:
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


# -- wrappers -------------------------------------------------------------------------------------

def _int32(values: Sequence[int]) -> Any:
    """Host int32 metadata: plan() reads it on the host and copies it into its own device buffers."""
    import torch

    return torch.tensor(list(values), dtype=torch.int32)


@dataclass
class RealWrapper:
    """One FlashInfer wrapper and the ledger entries behind its buffers."""

    route: str  # "prefill" or "decode"
    ubatch: int
    wrapper: Any
    float_ptr: int
    float_bytes: int
    int_alloc: Any
    tensor_cores: bool


def make_wrapper(route: str, float_buffer: Any, int_buffer: Any, *, tensor_cores: bool, cuda_graph: bool = False,
                 layout: PagedLayout | None = None) -> Any:
    """A FlashInfer paged wrapper on ``float_buffer`` (uint8 CUDA tensor), FA2 backend, NHD layout.

    FA2 is named explicitly because it is the planner the sizing oracle runs; ``auto`` may choose
    FA3 for long prefill queries on Hopper, whose workspace is sized by another route. Under CUDA
    graphs the indptr/indices buffers are sized from ``layout``, as an engine sizes them for its
    largest captured batch.
    """
    import flashinfer
    import torch

    dev = float_buffer.device
    graph_kw: dict[str, Any] = {}
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
    if route == "prefill":
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(float_buffer, "NHD", use_cuda_graph=cuda_graph,
                                                           backend="fa2", **graph_kw)
    else:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(float_buffer, "NHD", use_cuda_graph=cuda_graph,
                                                          use_tensor_cores=tensor_cores, backend="fa2", **graph_kw)
    if int_buffer is not None:
        w.reset_workspace_buffer(float_buffer, int_buffer)
    return w


def plan_args(route: str, layout: PagedLayout, heads_q: int, heads_kv: int, head_dim: int,
              head_dim_vo: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of ``plan()`` (and ``workspace_size()``) for a layout."""
    import torch

    kv_indptr = _int32(layout.kv_indptr)
    kv_indices = _int32(layout.kv_indices)
    last = _int32(layout.last_page_len)
    dtypes = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    if route == "prefill":
        args = (_int32(layout.qo_indptr), kv_indptr, kv_indices, last, heads_q, heads_kv, head_dim,
                layout.page_size)
        return args, dict(head_dim_vo=head_dim_vo, causal=True, **dtypes)
    q_len = layout.qo_lens[0]
    if any(q != q_len for q in layout.qo_lens):
        raise ValueError(f"a decode batch has one query length per request, got {sorted(set(layout.qo_lens))}")
    if head_dim_vo != head_dim:
        raise ValueError("the decode wrapper takes one head_dim; MLA-shaped layouts are prefill-only here")
    kw: dict[str, Any] = dict(dtypes)
    if q_len > 1:
        kw["q_len_per_req"] = q_len
    return (kv_indptr, kv_indices, last, heads_q, heads_kv, head_dim, layout.page_size), kw


def run_checked(route: str, wrapper: Any, layout: PagedLayout, heads_q: int, heads_kv: int, head_dim: int,
                head_dim_vo: int, device: Any, *, plan: bool = True, seed: int = 0,
                tolerance: float = BF16_TOLERANCE, buffer: Any = None) -> float:
    """Plan (unless already planned), run on random paged data, compare with the float32
    reference; returns the relative error, raises AttentionMismatch past ``tolerance``."""
    if plan:
        args, kw = plan_args(route, layout, heads_q, heads_kv, head_dim, head_dim_vo)
        wrapper.plan(*args, **kw)
    data = random_inputs(layout, heads_q, heads_kv, head_dim, head_dim_vo, device, seed, buffer)
    q, k, v = data["q"], data["k"], data["v"]
    out = wrapper.run(q, (k, v), out=data["out"])
    ref = reference_attention(q, k, v, layout, requests=_checked_requests(layout))
    err = attention_error(out, ref, layout)
    if not err <= tolerance:
        raise AttentionMismatch(
            f"FlashInfer {route} output differs from the float32 reference: relative error {err:.3g} > "
            f"{tolerance:g} on {layout.batch_size} requests (qo {list(layout.qo_lens[:4])}..., kv "
            f"{list(layout.kv_lens[:4])}...); a wrong workspace pointer or an overflowed float workspace "
            "corrupts split-KV partial results like this"
        )
    return err


# -- the builders ---------------------------------------------------------------------------------

class FlashInferCudaBuilder:
    """REQUIRED: real FlashInfer wrappers, all materialized inside the profiling window."""

    name = "flashinfer-cuda"
    warmup_materializes_persistent = True

    def __init__(self, case: Any) -> None:
        self.case = case
        self.wrappers: dict[tuple[str, int], RealWrapper] = {}
        self.warmed = False
        self.errors: list[float] = []  # relative errors of the warmup checks

    # -- sizing ----------------------------------------------------------------------------
    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def float_bytes(self) -> int:
        return for_case(self.case).float_bytes

    def int_bytes(self) -> int:
        return max(INT_WORKSPACE_BYTES, for_case(self.case).int_bytes)

    def declared_workspace(self, case: Any) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=self.float_bytes(), int_bytes=self.int_bytes())

    def routes(self) -> tuple[str, ...]:
        return routes(self.case)

    @property
    def _heads(self) -> tuple[int, int, int, int, int]:
        h, m = self.case.heads, self.case.model
        return h.heads_q, h.heads_q_decode, h.heads_kv, m.head_dim, m.dim_vo

    # -- wrappers --------------------------------------------------------------------------
    def _device_view(self, ctx: BuilderContext, ptr: int, nbytes: int) -> Any:
        view = getattr(ctx.device, "view", None)
        if view is None:
            raise TypeError(f"{self.name} runs real FlashInfer kernels and needs a CUDA device (the GPU tier), "
                            f"not {type(ctx.device).__name__}")
        return view(ptr, nbytes)

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> RealWrapper:
        arena = ctx.get_workspace(self.float_bytes(), ubatch)
        float_buf = self._device_view(ctx, arena.ptr, arena.nbytes)
        int_alloc = ctx.allocate(self.int_bytes(), f"{route} int workspace [ubatch {ubatch}]")
        try:
            int_buf = ctx.device.tensor(int_alloc)
            tc = route == "decode" and decode_tensor_cores(self.case)
            w = make_wrapper(route, float_buf, int_buf, tensor_cores=tc)
        except BaseException:
            ctx.free(int_alloc)
            raise
        return RealWrapper(route, ubatch, w, arena.ptr, arena.nbytes, int_alloc, tc)

    def _materialize(self, ctx: BuilderContext) -> list[RealWrapper]:
        made: list[RealWrapper] = []
        try:
            for route in self.routes():
                for ub in range(ctx.num_ubatches):
                    if (route, ub) not in self.wrappers:
                        w = self._new_wrapper(ctx, route, ub)
                        self.wrappers[(route, ub)] = w
                        made.append(w)
        except BaseException:
            self._drop(ctx, made)
            raise
        return made

    def _drop(self, ctx: BuilderContext, wrappers: list[RealWrapper]) -> None:
        for w in wrappers:
            if w.int_alloc.alive:
                ctx.free(w.int_alloc)
            w.wrapper = None
        for key in [k for k, v in self.wrappers.items() if any(v is w for w in wrappers)]:
            del self.wrappers[key]

    def _wrapper_for(self, ctx: BuilderContext, route: str, ubatch: int) -> RealWrapper:
        w = self.wrappers.get((route, ubatch))
        if w is None:
            raise RuntimeError(f"{self.name}: no {route} wrapper for ubatch {ubatch}; rebind() was not called")
        return w

    # -- the protocol ----------------------------------------------------------------------
    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        wrappers = self._materialize(ctx)
        return ctx.lease(wrappers, on_release=lambda: self._drop(ctx, wrappers))

    def rebind(self, ctx: BuilderContext) -> None:
        """Re-create the wrappers on the final arena (the profiling ones went with the lease)."""
        self._materialize(ctx)

    def warmup(self, ctx: BuilderContext) -> None:
        """Plan a split-KV batch on every wrapper, run it, compare with the reference. Test data is
        allocated through the context and freed before returning, also when a step fails."""
        if self.warmed:
            return
        if not self.wrappers:
            self._materialize(ctx)
        heads_q, heads_q_dec, heads_kv, dim, dim_vo = self._heads
        env = self.case.envelope
        kv_len = min(env.max_model_len, WARMUP_KV_LEN)
        errors = []
        for (route, ub), w in sorted(self.wrappers.items()):
            if route == "decode":
                u = 1 + self.case.mtp
                layout = paged_layout([u], [max(kv_len, u)], env.page_size)
                hq = heads_q_dec
            else:
                q_len = min(64, kv_len)
                layout = paged_layout([q_len, 1], [kv_len, kv_len], env.page_size)
                hq = heads_q
            errors.append(self._check(ctx, route, w, layout, hq, heads_kv, dim, dim_vo, seed=ub))
        self.errors = errors
        self.warmed = True

    def _check(self, ctx: BuilderContext, route: str, w: RealWrapper, layout: PagedLayout, heads_q: int,
               heads_kv: int, dim: int, dim_vo: int, seed: int) -> float:
        """One plan + run + reference comparison, with the test tensors' bytes in the ledger."""
        nbytes = scratch_bytes(layout, heads_q, heads_kv, dim, dim_vo)
        scratch = ctx.allocate(nbytes, f"{route} warmup test data [ubatch {w.ubatch}]")
        try:
            buf = ctx.device.tensor(scratch)
            return run_checked(route, w.wrapper, layout, heads_q, heads_kv, dim, dim_vo, buf.device, seed=seed,
                               buffer=buf)
        finally:
            ctx.free(scratch)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        """plan() for the step. Nothing is planned inside a capture: engines plan before capturing
        and replay the kernels; plan() copies host metadata and synchronizes."""
        if ctx.capturing:
            return
        route = "decode" if batch.kind == "decode" and "decode" in self.routes() else "prefill"
        w = self._lazy_wrapper(ctx, route, batch.ubatch)
        env = self.case.envelope
        qo, kv = synthetic_lens(batch, env.max_model_len, 1 + self.case.mtp if route == "decode" else 1)
        if route == "decode" and not w.tensor_cores and qo[0] > 1:
            qo = [1] * len(qo)
        layout = paged_layout(qo, kv, env.page_size)
        heads_q, heads_q_dec, heads_kv, dim, dim_vo = self._heads
        hq = heads_q_dec if route == "decode" else heads_q
        args, kw = plan_args(route, layout, hq, heads_kv, dim, dim_vo)
        w.wrapper.plan(*args, **kw)

    def _lazy_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> RealWrapper:
        return self._wrapper_for(ctx, route, ubatch)

    def dummy_run(self, ctx: BuilderContext) -> None:
        """The layers' dummy forward allocates nothing of the builder's own."""

    def bound_workspaces(self) -> list[BoundWorkspace]:
        return [BoundWorkspace(w.ubatch, f"{w.route} float workspace", w.float_ptr, w.float_bytes)
                for w in self.wrappers.values()]

    def close(self) -> None:
        """Drop the wrappers (and so their device buffers) once the run's figures are recorded."""
        for w in self.wrappers.values():
            w.wrapper = None
        self.wrappers.clear()


class LazyFlashInferCudaBuilder(FlashInferCudaBuilder):
    """Bug 1 on real hardware: REQUIRED, but the wrappers (int workspaces) appear on the first plan()."""

    name = "flashinfer-cuda-lazy"
    warmup_materializes_persistent = False

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        return ctx.lease([])

    def rebind(self, ctx: BuilderContext) -> None:
        """The legacy habit: nothing to rebind, wrappers come with the first plan."""

    def warmup(self, ctx: BuilderContext) -> None:
        if self.wrappers:
            super().warmup(ctx)

    def _lazy_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> RealWrapper:
        w = self.wrappers.get((route, ubatch))
        if w is None:
            w = self._new_wrapper(ctx, route, ubatch)
            self.wrappers[(route, ubatch)] = w
        return w


def _backend(name: str, cls: type, description: str, bug: int | None = None) -> Backend:
    def make(case: Any) -> list[Any]:
        return [cls(case)]

    make.__qualname__ = f"make_{name.replace('-', '_')}"
    return Backend(name=name, make_builders=make, description=description, origin="gpu", bug_class=bug)


def gpu_backends() -> list[Backend]:
    """``--kvprofile-backend pytest_kvprofile.gpu.flashinfer_builders:gpu_backends``: the real builder."""
    return [_backend("gpu-flashinfer", FlashInferCudaBuilder, "real FlashInfer wrappers on the CUDA arena (REQUIRED)")]


def gpu_mutant_backends() -> list[Backend]:
    """The lazy-workspace mutant on real FlashInfer; the GPU tier must catch it."""
    return [_backend("gpu-mutant-01-lazy-workspace", LazyFlashInferCudaBuilder,
                     "real FlashInfer wrappers created on first plan(), after KV sizing", bug=1)]
