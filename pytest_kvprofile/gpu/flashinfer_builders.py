"""Real FlashInfer builders for the GPU tier.

``FlashInferCudaBuilder`` follows the stub's protocol (``stubs.FlashInferLikeBuilder``) with real
``flashinfer`` wrappers: one prefill and one decode wrapper per micro-batch, whose float workspace
is a uint8 view of the workspace manager's CUDA arena and whose int workspace and plan metadata
buffers are allocated through the BuilderContext (so the ledger sees them). Warmup plans a batch
that forces split-KV (so the float workspace is really written), runs the kernels on random paged
KV data and compares with the float32 reference (``reference.py``): a wrong pointer or an
overflowed workspace fails loudly instead of passing silently. ``LazyFlashInferCudaBuilder`` is
the bug-1 mutant: it builds its wrappers on the first plan(), after KV sizing. The FlashInfer calls
themselves live in ``wrappers.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.device import TensorDevice
from pytest_kvprofile.contract.protocol import (
    Batch,
    BoundWorkspace,
    BuilderContext,
    WorkspaceDeclaration,
)
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.gpu.reference import (
    PagedLayout,
    paged_layout,
    scratch_bytes,
    synthetic_lens,
)
from pytest_kvprofile.gpu.wrappers import make_wrapper, plan_args, run_checked
from pytest_kvprofile.sizing.case import decode_tensor_cores, for_case, routes
from pytest_kvprofile.sizing.facts import FLASHINFER_INT_WORKSPACE_BYTES

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.cases import Case

__all__ = [
    "FlashInferCudaBuilder",
    "LazyFlashInferCudaBuilder",
    "RealWrapper",
    "gpu_backends",
    "gpu_mutant_backends",
]

WARMUP_KV_LEN = 4096  # long enough that a single decode request is split across CTAs


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


class FlashInferCudaBuilder:
    """REQUIRED: real FlashInfer wrappers, all materialized inside the profiling window."""

    name = "flashinfer-cuda"
    warmup_materializes_persistent = True

    def __init__(self, case: Case) -> None:
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
        return max(FLASHINFER_INT_WORKSPACE_BYTES, for_case(self.case).int_bytes)

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=self.float_bytes(), int_bytes=self.int_bytes())

    def routes(self) -> tuple[str, ...]:
        return routes(self.case)

    @property
    def _heads(self) -> tuple[int, int, int, int, int]:
        h, m = self.case.heads, self.case.model
        return h.heads_q, h.heads_q_decode, h.heads_kv, m.head_dim, m.dim_vo

    # -- wrappers --------------------------------------------------------------------------
    def _tensor_device(self, ctx: BuilderContext) -> TensorDevice:
        if not isinstance(ctx.device, TensorDevice):
            raise TypeError(f"{self.name} runs real FlashInfer kernels and needs a CUDA device (the GPU tier), "
                            f"not {type(ctx.device).__name__}")
        return ctx.device

    def _new_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> RealWrapper:
        arena = ctx.get_workspace(self.float_bytes(), ubatch)
        float_buf = self._tensor_device(ctx).view(arena.ptr, arena.nbytes)
        int_alloc = ctx.allocate(self.int_bytes(), f"{route} int workspace [ubatch {ubatch}]", role=Role.INT_WORKSPACE)
        try:
            int_buf = self._tensor_device(ctx).tensor(int_alloc)
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
            buf = self._tensor_device(ctx).tensor(scratch)
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
        args, kw = plan_args(route, layout, hq, heads_kv, dim, dim_vo, self.case.fa2_kv_torch_dtype(self.name))
        w.wrapper.plan(*args, **kw)

    def _lazy_wrapper(self, ctx: BuilderContext, route: str, ubatch: int) -> RealWrapper:
        return self._wrapper_for(ctx, route, ubatch)

    def dummy_run(self, ctx: BuilderContext) -> None:
        """The layers' dummy forward allocates nothing of the builder's own."""

    def bound_workspaces(self) -> list[BoundWorkspace]:
        return [BoundWorkspace(w.ubatch, f"{w.route} float workspace", w.float_ptr, w.float_bytes, w.int_alloc.ptr,
                               w.int_alloc.nbytes) for w in self.wrappers.values()]

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
    def make(case: Case) -> list[Any]:
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
