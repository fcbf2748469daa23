"""The built-in ``flashinfer`` backend: FlashInfer's own wrappers, on the simulated GPU and on a real one, and its
mutants.

Why: the stubs model what FlashInfer allocates; this backend *is* FlashInfer. Its wrappers allocate their
int workspaces, pinned mirrors and ``kv_lens`` buffers themselves, ``plan()`` runs FlashInfer's planner
(compiled for the host, ``attention/host_plan.py``) against the float workspace, which is a view of the shared
arena, and overflows with FlashInfer's own error if the arena is short. So every lifecycle check judges
FlashInfer's real allocation behaviour, on CPU. It is a torch-mode backend: the driver serves its plain
``torch`` "cuda" calls from the run's device and ``simulated_gpu_on`` answers FlashInfer's device queries
and loaders for the case's GPU.

Per micro-batch the builder holds: a prefill wrapper (FA2), a decode wrapper (tensor-core or CUDA-core as
``sizing.decode_tensor_cores`` says), one CUDA-graph decode wrapper per captured decode step
(``Envelope.decode_captures``), and the page-table metadata buffers they plan from (device tensors, as an
engine keeps them, so ``plan()`` copies nothing new onto the device). ``RealFlashInferBuilder`` builds all of
it inside the profiling window and plans each non-graph wrapper once there at the envelope's largest batch
(so the device copies ``plan()`` keeps exist at their largest before the closing measurement);
``LazyRealFlashInferBuilder`` is the historical engine: everything appears on the first ``plan()``, after
KV sizing (bug class 1).

The same builders serve the GPU tier. A ``CudaDevice`` attributes no plain ``torch`` call, so there (a
``TensorDevice``) the builder makes every buffer of its own through ``ctx.allocate`` (each wrapper's int workspace,
the page-table buffers) so the ledger sees them, and its warmup runs FlashInfer's kernels on a split-KV batch and
compares them with the float32 reference (``attention/reference.py``): a wrong workspace pointer or an overflowed
float workspace fails loudly instead of passing silently. Nothing is planned inside a real capture (``plan()`` copies
host metadata and synchronizes; an engine plans before it captures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from pytest_kvprofile.attention.facts import FLASHINFER_INT_WORKSPACE_BYTES
from pytest_kvprofile.attention.reference import PagedLayout, paged_layout, scratch_bytes
from pytest_kvprofile.attention.wrappers import Route, run_checked
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.device import Allocation, TensorDevice
from pytest_kvprofile.contract.protocol import (
    Batch,
    BoundWorkspace,
    BuilderContext,
    WorkspaceDeclaration,
)
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.sizing.case import decode_tensor_cores, for_case

if TYPE_CHECKING:
    from torch import Tensor

    from pytest_kvprofile.attention.wrappers import PagedWrapper
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.contract.workspace import ArenaView
    from pytest_kvprofile.matrix.cases import Case

# a slot's FlashInfer wrapper (prefill, decode): made with the slot, None only as the dataclass default, so read
# without a None check
SlotWrapper: TypeAlias = Any

__all__ = [
    "FLASHINFER_INT_WORKSPACE_BYTES",
    "REAL_FLASHINFER_BACKENDS",
    "REAL_FLASHINFER_MUTANTS",
    "LazyRealFlashInferBuilder",
    "RealFlashInferBuilder",
    "DecodeIntIntoPrefillRealBuilder",
    "SharedIntWorkspaceRealBuilder",
]

WARMUP_KV_LEN = 4096  # the GPU tier's checked warmup: long enough that one decode request is split across CTAs


@dataclass
class Slot:
    """One micro-batch's wrappers, the arena view they share and the metadata buffers they plan from."""

    ubatch: int
    arena: ArenaView  # its tensor is every wrapper's float workspace
    qo_indptr: Tensor
    kv_indptr: Tensor
    kv_indices: Tensor
    last_page_len: Tensor
    prefill: SlotWrapper = None
    decode: SlotWrapper = None
    graph: dict[int, PagedWrapper] = field(default_factory=dict)  # captured decode step's requests -> wrapper
    # wrapper role -> its int workspace, where the builder allocated it through the context (a TensorDevice)
    int_workspaces: dict[str, tuple[Allocation, Tensor]] = field(default_factory=dict)

    def wrappers(self) -> list[tuple[str, PagedWrapper]]:
        out = [("prefill", self.prefill), ("decode", self.decode)]
        out += [(f"cuda-graph decode bs={n}", w) for n, w in sorted(self.graph.items())]
        return [(role, w) for role, w in out if w is not None]


class RealFlashInferBuilder:
    """REQUIRED: FlashInfer's wrappers for every route and captured step, all built inside the window."""

    name = "flashinfer"
    warmup_materializes_persistent = False
    torch_mode = True  # allocates with plain torch "cuda" calls; kvprofile_run serves them from the simulated GPU

    def __init__(self, case: Case) -> None:
        refusal = mla_refusal(case)
        if refusal is not None:
            raise ValueError(f"{self.name}: {refusal}")
        self.case = case
        self.slots: dict[int, Slot] = {}
        self.tensor_cores = decode_tensor_cores(case)
        self.errors: list[float] = []  # the relative errors of the GPU tier's checked warmup runs
        self._owned: list[tuple[BuilderContext, Allocation]] = []  # what it allocated through a context

    # -- sizing ----------------------------------------------------------------------------------
    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def float_bytes(self) -> int:
        return for_case(self.case).float_bytes

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=self.float_bytes(),
                                    int_bytes=max(FLASHINFER_INT_WORKSPACE_BYTES, for_case(self.case).int_bytes))

    # -- shapes ----------------------------------------------------------------------------------
    def _max_reqs(self) -> int:
        env = self.case.envelope
        return max(env.max_num_seqs, max((c.num_reqs for c in env.decode_captures(self.case.mtp)), default=1))

    def _max_pages(self) -> int:
        env = self.case.envelope
        return self._max_reqs() * math.ceil(env.max_model_len / env.page_size)

    def _lens(self, batch: Batch) -> tuple[list[int], list[int]]:
        """Query and KV lengths of a lifecycle batch: every request at the envelope's full context (the most
        split-KV work a plan can see); decode requests carry ``1 + mtp`` tokens."""
        env = self.case.envelope
        n = max(1, batch.num_reqs)
        if batch.kind == "decode":
            return [1 + self.case.mtp] * n, [env.max_model_len] * n
        base, extra = divmod(max(batch.num_tokens, n), n)
        return [min(env.max_model_len, base + (i < extra)) for i in range(n)], [env.max_model_len] * n

    # -- wrappers --------------------------------------------------------------------------------
    def _new_slot(self, ctx: BuilderContext, ubatch: int) -> Slot:
        """Everything one micro-batch needs, on the arena: FlashInfer allocates its own buffers here."""
        import flashinfer

        arena = ctx.get_workspace(self.float_bytes(), ubatch)
        ws, reqs = self._arena_tensor(ctx, arena), self._max_reqs()
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=self.tensor_cores,
                                                               backend="fa2")
        slot = Slot(
            ubatch, arena,
            qo_indptr=self._int32(ctx, reqs + 1, f"qo_indptr [ubatch {ubatch}]"),
            kv_indptr=self._int32(ctx, reqs + 1, f"kv_indptr [ubatch {ubatch}]"),
            kv_indices=self._int32(ctx, self._max_pages(), f"kv_indices [ubatch {ubatch}]", arange=True),
            last_page_len=self._int32(ctx, reqs, f"last_page_len [ubatch {ubatch}]"),
            prefill=prefill, decode=decode,
        )
        for capture in self.case.envelope.decode_captures(self.case.mtp):
            n = capture.num_reqs
            slot.graph[n] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores, backend="fa2",
                paged_kv_indptr_buffer=slot.kv_indptr[:n + 1], paged_kv_indices_buffer=slot.kv_indices,
                paged_kv_last_page_len_buffer=slot.last_page_len[:n])
        self._give_int_workspaces(ctx, slot)
        return slot

    def _give_int_workspaces(self, ctx: BuilderContext, slot: Slot) -> None:
        """In torch mode FlashInfer's own 8 MiB int workspace stays unless the case needs more; on a TensorDevice
        every wrapper gets its own int workspace through the context, so the ledger sees it."""
        import torch

        need = for_case(self.case).int_bytes
        device = self._tensor_device(ctx)
        ws = self._arena_tensor(ctx, slot.arena)
        if device is not None:
            nbytes = max(FLASHINFER_INT_WORKSPACE_BYTES, need)
            for role, w in slot.wrappers():
                alloc = self._allocate(ctx, nbytes, f"{role} int workspace [ubatch {slot.ubatch}]",
                                       Role.INT_WORKSPACE)
                slot.int_workspaces[role] = (alloc, device.tensor(alloc))
                w.reset_workspace_buffer(ws, slot.int_workspaces[role][1])
        elif need > FLASHINFER_INT_WORKSPACE_BYTES:
            for _, w in slot.wrappers():
                w.reset_workspace_buffer(ws, torch.empty(need, dtype=torch.uint8, device="cuda"))

    # -- the device's tensors ----------------------------------------------------------------------
    @staticmethod
    def _tensor_device(ctx: BuilderContext) -> TensorDevice | None:
        """The GPU tier's device, whose allocations are tensors; None in torch mode (plain torch calls)."""
        return ctx.device if isinstance(ctx.device, TensorDevice) else None

    def _arena_tensor(self, ctx: BuilderContext, arena: ArenaView) -> Tensor:
        if arena.tensor is not None:
            return arena.tensor
        device = self._tensor_device(ctx)
        if device is None:
            raise TypeError(f"{self.name} runs FlashInfer's wrappers on the arena tensor: use Backend(torch_mode=True) "
                            "on a simulated device (or a CUDA device)")
        return device.view(arena.ptr, arena.nbytes)

    def _allocate(self, ctx: BuilderContext, nbytes: int, tag: str, role: Role = Role.OTHER) -> Allocation:
        alloc = ctx.allocate(nbytes, tag, role=role)
        self._owned.append((ctx, alloc))
        return alloc

    def _int32(self, ctx: BuilderContext, n: int, tag: str, *, arange: bool = False) -> Tensor:
        """A page-table buffer of ``n`` int32 on the device: a plain torch call in torch mode, a ledger allocation
        on a TensorDevice."""
        import torch

        device = self._tensor_device(ctx)
        if device is None:
            if arange:
                return torch.arange(n, dtype=torch.int32, device="cuda")
            return torch.zeros(n, dtype=torch.int32, device="cuda")
        t = device.tensor(self._allocate(ctx, 4 * n, tag)).view(torch.int32)
        if arange:
            t.copy_(torch.arange(n, dtype=torch.int32))
        else:
            t.zero_()
        return t

    def _materialize(self, ctx: BuilderContext) -> dict[int, Slot]:
        """The missing micro-batches' slots, not yet kept: a failure part-way drops them all with the exception (and
        frees what they allocated through the context)."""
        mark = len(self._owned)
        try:
            return {ub: self._new_slot(ctx, ub) for ub in range(ctx.num_ubatches) if ub not in self.slots}
        except BaseException:
            self._free_owned(mark)
            raise

    def _free_owned(self, mark: int = 0) -> None:
        for ctx, alloc in self._owned[mark:]:
            if alloc.alive:
                ctx.free(alloc)
        del self._owned[mark:]

    def _slot(self, ctx: BuilderContext, ubatch: int) -> Slot:
        slot = self.slots.get(ubatch)
        if slot is None:
            raise RuntimeError(f"{self.name}: no wrappers for ubatch {ubatch}; reserve_persistent_workspace() "
                               "was not called")
        return slot

    def _plan(self, slot: Slot, wrapper: PagedWrapper, route: str, qo: list[int], kv: list[int]) -> None:
        """Write the batch's page table into the slot's device buffers and ``plan()`` ``wrapper`` on them."""
        import torch

        env, heads, model = self.case.envelope, self.case.heads, self.case.model
        page = env.page_size
        pages = [math.ceil(k / page) for k in kv]
        n = len(qo)
        slot.qo_indptr[:n + 1].copy_(torch.tensor([0, *_cumsum(qo)], dtype=torch.int32))
        slot.kv_indptr[:n + 1].copy_(torch.tensor([0, *_cumsum(pages)], dtype=torch.int32))
        slot.last_page_len[:n].copy_(torch.tensor([k - (p - 1) * page for k, p in zip(kv, pages)], dtype=torch.int32))
        kv_dtype = getattr(torch, self.case.fa2_kv_torch_dtype(self.name))  # the case's KV dtype, never another
        dtypes = {"q_data_type": torch.bfloat16, "kv_data_type": kv_dtype}
        indptr, indices, last = slot.kv_indptr[:n + 1], slot.kv_indices[:sum(pages)], slot.last_page_len[:n]
        if route == "prefill":
            wrapper.plan(slot.qo_indptr[:n + 1], indptr, indices, last, heads.heads_q, heads.heads_kv, model.head_dim,
                         page, head_dim_vo=model.dim_vo, causal=True, **dtypes)
            return
        extra = {"q_len_per_req": qo[0]} if qo[0] > 1 else {}
        wrapper.plan(indptr, indices, last, heads.heads_q_decode, heads.heads_kv, model.head_dim, page, **dtypes,
                     **extra)

    def _prime(self, slots: list[Slot]) -> None:
        """Plan each non-graph wrapper at the envelope's largest batch: what ``plan()`` keeps on the device
        (the decode wrapper's ``qo_indptr`` copy) exists at its largest inside the window."""
        env = self.case.envelope
        reqs = self._max_reqs()
        for slot in slots:
            self._plan(slot, slot.prefill, "prefill", *self._lens(Batch("prefill", reqs, env.max_num_batched_tokens)))
            self._plan(slot, slot.decode, "decode", *self._lens(Batch("decode", reqs, reqs * (1 + self.case.mtp))))

    # -- the protocol ----------------------------------------------------------------------------
    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        """Build (and prime) every wrapper now, so the closing measurement sees all of FlashInfer's memory.
        The builder keeps them after the lease is released: they are the serving wrappers."""
        mark = len(self._owned)
        made = self._materialize(ctx)
        try:
            self._prime(list(made.values()))
        except BaseException:
            self._free_owned(mark)
            raise
        self.slots.update(made)  # all or nothing: a reservation that raised above keeps none of them
        return ctx.lease(list(made.values()))

    def rebind(self, ctx: BuilderContext) -> None:
        """Point every wrapper at the final arena if it moved (it does not under a correct engine)."""
        for ub, slot in self.slots.items():
            arena = ctx.get_workspace(self.float_bytes(), ub)
            if (arena.ptr, arena.nbytes) != (slot.arena.ptr, slot.arena.nbytes):
                ws = self._arena_tensor(ctx, arena)
                for role, w in slot.wrappers():
                    own = slot.int_workspaces.get(role)
                    w.reset_workspace_buffer(ws, own[1] if own is not None else w._int_workspace_buffer)
                slot.arena = arena

    def warmup(self, ctx: BuilderContext) -> None:
        """On a real GPU (a TensorDevice), run each micro-batch's prefill and decode kernels on a split-KV batch and
        compare them with the float32 reference; the test data is allocated through the context and freed before
        returning, also when a step fails. In torch mode there is no kernel to run: nothing happens."""
        if self._tensor_device(ctx) is None or self.errors:
            return
        heads, env = self.case.heads, self.case.envelope
        kv_len = min(env.max_model_len, WARMUP_KV_LEN)
        errors = []
        for ub, slot in sorted(self.slots.items()):
            u = 1 + self.case.mtp
            decode = paged_layout([u], [max(kv_len, u)], env.page_size)
            prefill = paged_layout([min(64, kv_len), 1], [kv_len, kv_len], env.page_size)
            errors.append(self._check(ctx, "prefill", slot.prefill, prefill, heads.heads_q, ub))
            errors.append(self._check(ctx, "decode", slot.decode, decode, heads.heads_q_decode, ub))
        self.errors = errors

    def _check(self, ctx: BuilderContext, route: Route, wrapper: PagedWrapper, layout: PagedLayout, heads_q: int,
               ubatch: int) -> float:
        """One plan + run + reference comparison, with the test tensors' bytes in the ledger."""
        device = self._tensor_device(ctx)
        assert device is not None
        heads_kv, dim, dim_vo = self.case.heads.heads_kv, self.case.model.head_dim, self.case.model.dim_vo
        scratch = ctx.allocate(scratch_bytes(layout, heads_q, heads_kv, dim, dim_vo),
                               f"{route} warmup test data [ubatch {ubatch}]")
        try:
            buf = device.tensor(scratch)
            return run_checked(route, wrapper, layout, heads_q, heads_kv, dim, dim_vo, buf.device, seed=ubatch,
                               buffer=buf)
        finally:
            ctx.free(scratch)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        """``plan()`` the batch on its wrapper: a captured decode step on its CUDA-graph wrapper (its buffers are
        the slot's, so nothing is allocated during capture), any other decode batch on the decode wrapper, the
        rest on the prefill wrapper (a graph-eligible batch of a size no graph was captured for runs eagerly)."""
        if ctx.capturing and self._tensor_device(ctx) is not None:
            return
        slot = self._slot(ctx, batch.ubatch)
        qo, kv = self._lens(batch)
        graph = slot.graph.get(batch.num_reqs) if batch.cuda_graph and batch.kind == "decode" else None
        if graph is not None:
            self._plan(slot, graph, "decode", qo, kv)
        elif batch.kind == "decode":
            self._plan(slot, slot.decode, "decode", qo, kv)
        else:
            self._plan(slot, slot.prefill, "prefill", qo, kv)

    def bound_workspaces(self) -> list[BoundWorkspace]:
        """The float and int workspaces each wrapper really holds, located in the device's ledger."""
        out = []
        for ub, slot in sorted(self.slots.items()):
            for role, w in slot.wrappers():
                own = slot.int_workspaces.get(role)
                if own is not None:  # a TensorDevice: the ledger's own entries
                    ptr, nbytes = slot.arena.ptr, slot.arena.nbytes
                    int_ptr, int_nbytes = own[0].ptr, own[0].nbytes
                else:
                    ptr, nbytes = _ledger_range(w._float_workspace_buffer, slot.arena)
                    int_ptr, int_nbytes = _ledger_range(w._int_workspace_buffer)
                out.append(BoundWorkspace(ub, f"{role} float workspace", ptr, nbytes, int_ptr, int_nbytes))
        return out

    def close(self) -> None:
        """Drop the wrappers (and so their device buffers) once the run's figures are recorded."""
        self.slots.clear()
        self._free_owned()


class LazyRealFlashInferBuilder(RealFlashInferBuilder):
    """Bug 1 with FlashInfer's own wrappers: REQUIRED, but the wrappers (their int workspaces, pinned mirrors and
    ``kv_lens`` buffers) are created on the first ``plan()``, after KV sizing, as engines historically did."""

    name = "flashinfer-lazy"

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        return ctx.lease([])

    def _slot(self, ctx: BuilderContext, ubatch: int) -> Slot:
        slot = self.slots.get(ubatch)
        if slot is None:
            slot = self.slots[ubatch] = self._new_slot(ctx, ubatch)
        return slot


class SharedIntWorkspaceRealBuilder(RealFlashInferBuilder):
    """Bug 15 with FlashInfer's own wrappers: every wrapper of a micro-batch is handed the prefill wrapper's int
    workspace (``reset_workspace_buffer``), so each plan overwrites the others' plan info."""

    name = "flashinfer-shared-int"

    def _new_slot(self, ctx: BuilderContext, ubatch: int) -> Slot:
        slot = super()._new_slot(ctx, ubatch)
        own = slot.int_workspaces.get("prefill")
        shared = own[1] if own is not None else slot.prefill._int_workspace_buffer
        ws = self._arena_tensor(ctx, slot.arena)
        for role, w in slot.wrappers()[1:]:
            w.reset_workspace_buffer(ws, shared)
            if own is not None:
                slot.int_workspaces[role] = own
        return slot


class DecodeIntIntoPrefillRealBuilder(RealFlashInferBuilder):
    """Bug 15 with FlashInfer's own wrappers: the eager decode wrapper plans into the prefill wrapper's int workspace
    (its ``_int_workspace_buffer`` pointed there after construction), while ``bound_workspaces()`` reports every
    wrapper's own int workspace, the decode wrapper's kept alive and never planned into."""

    name = "flashinfer-decode-into-prefill-int"

    def __init__(self, case: Case) -> None:
        super().__init__(case)
        self._own_decode_int: dict[int, Tensor] = {}  # ubatch -> the decode wrapper's own int workspace, reported

    def _new_slot(self, ctx: BuilderContext, ubatch: int) -> Slot:
        slot = super()._new_slot(ctx, ubatch)
        self._own_decode_int[ubatch] = slot.decode._int_workspace_buffer
        slot.decode._int_workspace_buffer = slot.prefill._int_workspace_buffer
        return slot

    def bound_workspaces(self) -> list[BoundWorkspace]:
        out = []
        for w in super().bound_workspaces():
            own = self._own_decode_int.get(w.ubatch)
            if w.role == "decode float workspace" and own is not None:
                w = BoundWorkspace(w.ubatch, w.role, w.ptr, w.nbytes, *_ledger_range(own))
            out.append(w)
        return out


class PrivateFloatReportedAsArenaRealBuilder(RealFlashInferBuilder):
    """Bug 5 with FlashInfer's own wrappers: asks the arena for each micro-batch's view, but builds every wrapper
    over a private ``torch.empty`` float buffer of the view's size, plans into it, and reports the arena view through
    ``bound_workspaces()``: the arena's checks judge memory no wrapper uses."""

    name = "flashinfer-private-float-as-arena"

    def _new_slot(self, ctx: BuilderContext, ubatch: int) -> Slot:
        import torch

        slot = super()._new_slot(ctx, ubatch)
        for _, w in slot.wrappers():
            private = torch.empty(slot.arena.nbytes, dtype=torch.uint8, device="cuda")
            w.reset_workspace_buffer(private, w._int_workspace_buffer)
        return slot

    def bound_workspaces(self) -> list[BoundWorkspace]:
        """What it reports: the arena view, not the buffer its wrappers were built over."""
        out = []
        for w in super().bound_workspaces():
            slot = self.slots[w.ubatch]
            out.append(BoundWorkspace(w.ubatch, w.role, slot.arena.ptr, slot.arena.nbytes, w.int_ptr, w.int_nbytes))
        return out


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def _ledger_range(tensor: Tensor, arena: ArenaView | None = None) -> tuple[int, int]:
    """A workspace tensor's ``(ptr, nbytes)`` in the simulated ledger (its storage's allocation plus the view's
    offset); when no simulation is active, the arena view's own range, or ``(0, 0)`` without one."""
    from pytest_kvprofile.memory.torch_mode import active_simulation

    nbytes = int(tensor.numel()) * int(tensor.element_size())
    sim = active_simulation()
    alloc = sim.allocation_of(tensor) if sim is not None else None
    if alloc is None:
        return (arena.ptr, arena.nbytes) if arena is not None else (0, 0)
    return alloc.ptr + tensor.data_ptr() - tensor.untyped_storage().data_ptr(), nbytes


def mla_refusal(case: Case) -> str | None:
    """These builders plan FlashInfer's FA2 prefill/decode wrappers; an MLA layout needs its MLA wrapper, which the
    simulated device does not serve: the layout is refused by name (listed, not run), not failed on every check."""
    if case.model.attention != "mla":
        return None
    return (f"MLA layouts run FlashInfer's MLA planner (BatchMLAPagedAttentionWrapper), which this backend does not "
            f"build and the simulated device does not serve (case {case.id})")


def _backend(name: str, cls: type, description: str, origin: str) -> Backend:
    def make(case: Case) -> list[Builder]:
        return [cls(case)]

    make.__qualname__ = f"make_{name.replace('-', '_')}"
    return Backend(name=name, make_builders=make, description=description, origin=origin,
                   torch_mode=True, refuses_layout=mla_refusal)


REAL_FLASHINFER_BACKENDS: tuple[Backend, ...] = (
    _backend("flashinfer", RealFlashInferBuilder, "FlashInfer's own prefill, decode and CUDA-graph decode wrappers "
             "on the arena, on the simulated GPU (REQUIRED)", "builtin"),
)
REAL_FLASHINFER_MUTANTS: tuple[Backend, ...] = (
    _backend("mutant-01d-flashinfer-lazy-wrappers", LazyRealFlashInferBuilder, (LazyRealFlashInferBuilder.__doc__ or "")
             .split("\n")[0], "mutant"),
    _backend("mutant-15i-flashinfer-shared-int-workspace", SharedIntWorkspaceRealBuilder,
             (SharedIntWorkspaceRealBuilder.__doc__ or "").split("\n")[0], "mutant"),
    _backend("mutant-15k-flashinfer-decode-plans-into-prefill-int", DecodeIntIntoPrefillRealBuilder,
             (DecodeIntIntoPrefillRealBuilder.__doc__ or "").split("\n")[0], "mutant"),
    _backend("mutant-05f-flashinfer-private-float-reported-as-arena", PrivateFloatReportedAsArenaRealBuilder,
             (PrivateFloatReportedAsArenaRealBuilder.__doc__ or "").split("\n")[0], "mutant"),
)
