"""The built-in ``flashinfer`` backend: FlashInfer's own wrappers on the simulated GPU, and its lazy twin.

Why: the stubs model what FlashInfer allocates; this backend *is* FlashInfer. Its wrappers allocate their
int workspaces, pinned mirrors and ``kv_lens`` buffers themselves, ``plan()`` runs FlashInfer's planner
(compiled for the host, ``sizing/host_plan.py``) against the float workspace, which is a view of the shared
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import (
    Batch,
    BoundWorkspace,
    BuilderContext,
    WorkspaceDeclaration,
)
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.sizing.case import decode_tensor_cores, for_case
from pytest_kvprofile.sizing.facts import FLASHINFER_INT_WORKSPACE_BYTES

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.cases import Case

__all__ = [
    "FLASHINFER_INT_WORKSPACE_BYTES",
    "REAL_FLASHINFER_BACKENDS",
    "REAL_FLASHINFER_MUTANTS",
    "LazyRealFlashInferBuilder",
    "RealFlashInferBuilder",
    "SharedIntWorkspaceRealBuilder",
]



@dataclass
class Slot:
    """One micro-batch's wrappers, the arena view they share and the metadata buffers they plan from."""

    ubatch: int
    arena: Any  # the ArenaView whose tensor is every wrapper's float workspace
    qo_indptr: Any
    kv_indptr: Any
    kv_indices: Any
    last_page_len: Any
    prefill: Any = None
    decode: Any = None
    graph: dict[int, Any] = field(default_factory=dict)  # captured decode step's requests -> wrapper

    def wrappers(self) -> list[tuple[str, Any]]:
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
        import torch

        arena = ctx.get_workspace(self.float_bytes(), ubatch)
        if arena.tensor is None:
            raise TypeError(f"{self.name} runs FlashInfer's wrappers on the arena tensor: use Backend(torch_mode=True) "
                            "on a simulated device (or a CUDA device)")
        ws, reqs = arena.tensor, self._max_reqs()
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=self.tensor_cores,
                                                               backend="fa2")
        slot = Slot(
            ubatch, arena,
            qo_indptr=torch.zeros(reqs + 1, dtype=torch.int32, device="cuda"),
            kv_indptr=torch.zeros(reqs + 1, dtype=torch.int32, device="cuda"),
            kv_indices=torch.arange(self._max_pages(), dtype=torch.int32, device="cuda"),
            last_page_len=torch.zeros(reqs, dtype=torch.int32, device="cuda"),
            prefill=prefill, decode=decode,
        )
        for capture in self.case.envelope.decode_captures(self.case.mtp):
            n = capture.num_reqs
            slot.graph[n] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores, backend="fa2",
                paged_kv_indptr_buffer=slot.kv_indptr[:n + 1], paged_kv_indices_buffer=slot.kv_indices,
                paged_kv_last_page_len_buffer=slot.last_page_len[:n])
        need = for_case(self.case).int_bytes
        if need > FLASHINFER_INT_WORKSPACE_BYTES:
            for _, w in slot.wrappers():
                w.reset_workspace_buffer(ws, torch.empty(need, dtype=torch.uint8, device="cuda"))
        return slot

    def _materialize(self, ctx: BuilderContext) -> dict[int, Slot]:
        """The missing micro-batches' slots, not yet kept: a failure part-way drops them all with the exception."""
        return {ub: self._new_slot(ctx, ub) for ub in range(ctx.num_ubatches) if ub not in self.slots}

    def _slot(self, ctx: BuilderContext, ubatch: int) -> Slot:
        slot = self.slots.get(ubatch)
        if slot is None:
            raise RuntimeError(f"{self.name}: no wrappers for ubatch {ubatch}; reserve_persistent_workspace() "
                               "was not called")
        return slot

    def _plan(self, slot: Slot, wrapper: Any, route: str, qo: list[int], kv: list[int]) -> None:
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
    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        """Build (and prime) every wrapper now, so the closing measurement sees all of FlashInfer's memory.
        The builder keeps them after the lease is released: they are the serving wrappers."""
        made = self._materialize(ctx)
        self._prime(list(made.values()))
        self.slots.update(made)  # all or nothing: a reservation that raised above keeps none of them
        return ctx.lease(list(made.values()))

    def rebind(self, ctx: BuilderContext) -> None:
        """Point every wrapper at the final arena if it moved (it does not under a correct engine)."""
        for ub, slot in self.slots.items():
            arena = ctx.get_workspace(self.float_bytes(), ub)
            if (arena.ptr, arena.nbytes) != (slot.arena.ptr, slot.arena.nbytes):
                for _, w in slot.wrappers():
                    w.reset_workspace_buffer(arena.tensor, w._int_workspace_buffer)
                slot.arena = arena

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        """``plan()`` the batch on its wrapper: a captured decode step on its CUDA-graph wrapper (its buffers are
        the slot's, so nothing is allocated during capture), any other decode batch on the decode wrapper, the
        rest on the prefill wrapper (a graph-eligible batch of a size no graph was captured for runs eagerly)."""
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
                ptr, nbytes = _ledger_range(w._float_workspace_buffer, slot.arena)
                int_ptr, int_nbytes = _ledger_range(w._int_workspace_buffer)
                out.append(BoundWorkspace(ub, f"{role} float workspace", ptr, nbytes, int_ptr, int_nbytes))
        return out

    def close(self) -> None:
        """Drop the wrappers (and so their device buffers) once the run's figures are recorded."""
        self.slots.clear()


class LazyRealFlashInferBuilder(RealFlashInferBuilder):
    """Bug 1 with FlashInfer's own wrappers: REQUIRED, but the wrappers (their int workspaces, pinned mirrors and
    ``kv_lens`` buffers) are created on the first ``plan()``, after KV sizing, as engines historically did."""

    name = "flashinfer-lazy"

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
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
        shared = slot.prefill._int_workspace_buffer
        for _, w in slot.wrappers()[1:]:
            w.reset_workspace_buffer(slot.arena.tensor, shared)
        return slot


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def _ledger_range(tensor: Any, arena: Any = None) -> tuple[int, int]:
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


def _backend(name: str, cls: type, description: str, origin: str, bug: int | None = None) -> Backend:
    def make(case: Case) -> list[Any]:
        return [cls(case)]

    make.__qualname__ = f"make_{name.replace('-', '_')}"
    return Backend(name=name, make_builders=make, description=description, origin=origin, bug_class=bug,
                   torch_mode=True, refuses_layout=mla_refusal)


REAL_FLASHINFER_BACKENDS: tuple[Backend, ...] = (
    _backend("flashinfer", RealFlashInferBuilder, "FlashInfer's own prefill, decode and CUDA-graph decode wrappers "
             "on the arena, on the simulated GPU (REQUIRED)", "builtin"),
)
REAL_FLASHINFER_MUTANTS: tuple[Backend, ...] = (
    _backend("mutant-01d-flashinfer-lazy-wrappers", LazyRealFlashInferBuilder, (LazyRealFlashInferBuilder.__doc__ or "")
             .split("\n")[0], "mutant", bug=1),
    _backend("mutant-15i-flashinfer-shared-int-workspace", SharedIntWorkspaceRealBuilder,
             (SharedIntWorkspaceRealBuilder.__doc__ or "").split("\n")[0], "mutant", bug=15),
)
