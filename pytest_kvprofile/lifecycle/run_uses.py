"""What a run sees the parts use: plans into views and allocations (``ctx.plan_into``), torch calls on freed or
foreign memory, FlashInfer's ``plan()`` calls and the int workspaces wrappers share; and torch mode, the simulated
device plain ``torch`` calls reach while the parts run.

The records feed ``no_use_after_free``, ``ubatch_arenas_disjoint`` and ``int_workspace_per_wrapper``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable

from pytest_kvprofile.contract.protocol import (
    Batch,
)
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.workspace import (
    ArenaView,
)
from pytest_kvprofile.lifecycle.record import (
    IntPlanShare,
    MemoryUse,
    PlanRecord,
    SharedInt,
    ViewPlan,
)
from pytest_kvprofile.lifecycle.run_state import RunState
from pytest_kvprofile.lifecycle.sites import _caller_site
from pytest_kvprofile.memory.device import Allocation

if TYPE_CHECKING:
    from torch import Tensor









class UseTracking(RunState):
    """A run's record of memory uses, and its torch mode."""

    def note_plan(self, owner: str, target: object, part: Batch | None = None) -> None:
        """``ctx.plan_into(target, part)``: judge the use from the manager's generations and the ledger."""
        if part is not None and not isinstance(part, Batch):
            raise TypeError(f"ctx.plan_into(part=) takes the Batch part planned into the target, not "
                            f"{type(part).__name__}")
        batch = self._current_batch
        tokens = part.num_tokens if part is not None else batch.num_tokens if batch is not None else 0
        graph = part.cuda_graph if part is not None else batch.cuda_graph if batch is not None else False
        if isinstance(target, ArenaView):
            if batch is not None:
                known = self._grant_of.get(id(target))
                grant = known[1] if known is not None and known[0] is target else next(
                    (g for g in reversed(self.result.grants)
                     if g.requester == owner and g.ubatch == target.ubatch and g.ptr == target.ptr
                     and g.nbytes == target.nbytes), None)
                self.result.view_plans.append(ViewPlan(self.device.phase, owner, target.ubatch, target.nbytes,
                                                       grant.route if grant is not None else None, batch.kind,
                                                       self._build_serial, part.kind if part else None, "view",
                                                       tokens, graph, grant.cuda_graph if grant is not None else None,
                                                       _caller_site()))
            freed = None if self.manager.is_current(target) else self.manager.retired.get(
                (target.ubatch, target.generation), "?")
            self._note_use(owner, self._current_call, target.ubatch, target.nbytes, freed, "ctx.plan_into",
                           lambda: f"its view of micro-batch {target.ubatch}'s float arena (generation "
                                   f"{target.generation})", _caller_site)
        elif isinstance(target, Allocation):
            if batch is not None and target.role in (Role.TRTLLM_WORKSPACE, Role.FLOAT_WORKSPACE):
                self.result.view_plans.append(ViewPlan(self.device.phase, owner, batch.ubatch, target.nbytes, None,
                                                       batch.kind, self._build_serial, part.kind if part else None,
                                                       target.role.name, tokens, graph))
            self._note_int_use(target)
            if target.alive and self.device.capturing:
                self.result.captured_reads.add(target.id)
            freed = None if target.alive else (target.freed_phase or "?")
            ubatch = self.manager.ubatch_of(target) if target.role is Role.FLOAT_ARENA else None
            self._note_use(owner, self._current_call, ubatch, target.nbytes, freed, "ctx.plan_into",
                           lambda: f"allocation {target.tag!r}", _caller_site)
        else:
            raise TypeError(f"ctx.plan_into() takes an ArenaView or an Allocation, not {type(target).__name__}")

    def _on_int_holder(self, alloc: Allocation, wrapper: object, attr: str) -> None:
        """A FlashInfer wrapper took ``alloc`` as its int workspace: another live wrapper still planning into it
        shares it (``int_workspace_per_wrapper``), whatever ``bound_workspaces()`` says."""
        holders = self._int_holders.setdefault(alloc.id, [])
        for ref in holders:
            other = ref()
            if other is None or other is wrapper:
                continue
            held = getattr(other, attr, None)
            if held is not None and self._memory_of(held) is alloc:
                self.result.shared_ints.append(SharedInt(self.device.phase, alloc.id,
                                                         (type(other).__name__, type(wrapper).__name__)))
                break
        try:
            holders.append(weakref.ref(wrapper))
        except TypeError:  # a wrapper without weak references: nothing to compare it with later
            pass

    def _note_int_use(self, alloc: Allocation) -> None:
        """A build of one micro-batch planning into an int workspace: micro-batches run concurrently, so one int
        workspace built into by two is shared between them (``int_workspace_per_wrapper``)."""
        if alloc.role is Role.INT_WORKSPACE and self._current_ubatch is not None and alloc.alive:
            self.result.int_ubatches.setdefault(alloc.id, set()).add(self._current_ubatch)

    def _on_torch_use(self, alloc: Allocation, api: str) -> None:
        """A torch call read or wrote a freed storage, an arena or an int workspace (``SimulatedCuda.on_use``)."""
        if self._in_manager:
            return
        if alloc.alive and self.device.capturing:
            self.result.captured_reads.add(alloc.id)
        if alloc.role is Role.INT_WORKSPACE and alloc.alive:
            self._note_int_use(alloc)
            return
        ubatch = self.manager.ubatch_of(alloc)
        given_back = self.manager.stale_since(alloc) if alloc.alive else None  # an old arena a kept view keeps alive
        if alloc.alive and given_back is None and (self._current_ubatch is None
                                                   or ubatch in (None, self._current_ubatch)):
            return  # the common case, decided without attributing the call
        retired = self.manager.generation_of(alloc)
        if retired is not None:
            ubatch = retired[0]
        sim = self._torch
        owner, method, stack = sim.attribution(api) if sim is not None else ("<unknown>", None, "")

        def what() -> str:
            if retired is not None:
                return f"micro-batch {retired[0]}'s float arena (generation {retired[1]})"
            return f"allocation {alloc.tag!r} of {alloc.owner}"

        freed = given_back if given_back is not None else None if alloc.alive else (alloc.freed_phase or "?")
        self._note_use(owner, method, ubatch, alloc.nbytes, freed, api, what, lambda: stack)

    def _note_use(self, owner: str, method: str | None, ubatch: int | None, nbytes: int, freed: str | None, via: str,
                  what: Callable[[], str], site: Callable[[], str]) -> None:
        """Record a use a check refuses: of freed memory, or of another micro-batch's arena while building a batch.
        ``what`` and ``site`` are called only then (most uses are neither)."""
        cross = self._current_ubatch is not None and ubatch is not None and ubatch != self._current_ubatch
        if freed is None and not cross:
            return
        use = MemoryUse(self.device.phase, owner, method, self._current_ubatch, ubatch, what(), nbytes, freed, via,
                        site())
        at = self._use_index.get(use.key)
        if at is None:
            self._use_index[use.key] = len(self.result.uses)
            self.result.uses.append(use)
        else:
            prev = self.result.uses[at]
            self.result.uses[at] = dataclasses.replace(prev, count=prev.count + 1)

    @contextlib.contextmanager
    def device_mode(self) -> Iterator[None]:
        """Serve plain ``torch`` "cuda" calls from this run's simulated device (``Backend.torch_mode``), with
        FlashInfer's device queries answering the case's GPU and its batch planners running on the host; and
        record the ``atexit`` handlers the parts register (``module_state.atexit_recorded``) for ``close()``."""
        from pytest_kvprofile.lifecycle.module_state import atexit_recorded

        with atexit_recorded(self._atexit), self._device_mode():
            yield

    @contextlib.contextmanager
    def _device_mode(self) -> Iterator[None]:
        from pytest_kvprofile.memory.device import SimDevice

        if not getattr(self.backend, "torch_mode", False) or not isinstance(self.device, SimDevice):
            yield  # on a real CUDA device plain torch calls already reach it
            return
        from pytest_kvprofile.attention.host_plan import observe_plans
        from pytest_kvprofile.memory.simulated_gpu import simulated_gpu_on
        from pytest_kvprofile.memory.torch_mode import SimulatedCuda

        if self._sim is None:
            self._sim = SimulatedCuda(self.device, self._part_owner)
        sim = self._sim
        sim.owner_resolver = self._part_owner  # leaving the mode drops it
        noted = len(sim.foreign)
        with simulated_gpu_on(self.device, self.case.gpu), sim:
            self._torch = sim
            sim.on_use = self._on_torch_use
            sim.on_int_holder = self._on_int_holder
            stop = observe_plans(self._on_plan)
            self.result.plans_observed = True
            try:
                yield
            finally:
                stop()
                sim.on_use = None  # the simulation outlives the run (it knows every simulation's tensors): let go
                sim.on_int_holder = None
                self.result.foreign_uses.extend(list(sim.foreign.values())[noted:])
                self._torch = None

    def _on_plan(self, device: object, route: str, float_ws: Tensor, cuda_graph: bool, int_ws: Tensor | None = None,
                 wrapper: object = None) -> None:
        """Record a FlashInfer ``plan()`` of this run: the route, the builder being called, the float and int buffers
        planned into and the wrapper planning; a plan into int-workspace bytes another live wrapper planned into
        is recorded too (``IntPlanShare``)."""
        if device is not self.device or self._torch is None:
            return
        alloc = self._torch.memory_of(float_ws)
        builder = self.result.calls[-1].builder if self.result.calls else None
        int_alloc = self._torch.memory_of(int_ws) if int_ws is not None else None
        int_nbytes = int(int_ws.numel()) * int(int_ws.element_size()) if int_ws is not None else 0
        label = self._wrapper_label(wrapper, route) if wrapper is not None else ""
        self.result.plans.append(PlanRecord(self.device.phase, builder, route, alloc.id if alloc else None,
                                            int(float_ws.numel()) * int(float_ws.element_size()), cuda_graph,
                                            self._current_ubatch, int_alloc.id if int_alloc else None, int_nbytes,
                                            label))
        if int_alloc is not None and wrapper is not None and int_ws is not None:
            start = self._torch.simulated_ptr(int_ws.data_ptr(), int_nbytes) or int_alloc.ptr
            self._note_int_plan(int_alloc, wrapper, label, start, start + int_nbytes)

    def _wrapper_label(self, wrapper: object, route: str) -> str:
        """``ClassName#n (route)``: the wrapper's class and its number among the wrappers that planned in this run."""
        known = self._wrapper_labels.get(id(wrapper))
        if known is not None and known[0]() is wrapper:
            return known[1]
        label = f"{type(wrapper).__name__}#{len(self._wrapper_labels) + 1} ({route})"
        try:
            self._wrapper_labels[id(wrapper)] = (weakref.ref(wrapper), label)
        except TypeError:  # no weak references: label it afresh each time
            pass
        return label

    def _note_int_plan(self, alloc: Allocation, wrapper: object, label: str, start: int, end: int) -> None:
        """A wrapper's plan() wrote ``[start, end)`` of int workspace ``alloc``: another wrapper, alive and still
        holding that int workspace, that planned into overlapping bytes shares it with this one."""
        planners = self._int_planners.setdefault(alloc.id, [])
        for ref, other_label, s, e in planners:
            other = ref()
            if other is None or other is wrapper or not (s < end and start < e):
                continue
            held = getattr(other, "_int_workspace_buffer", None)
            if held is not None and self._torch is not None and self._torch.memory_of(held) is not alloc:
                continue  # it moved to another int workspace since (a rebind): not shared any more
            if not any(x.alloc_id == alloc.id and {x.holder, x.planner} == {other_label, label}
                       for x in self.result.int_plan_shares):  # once per pair: serving re-plans every step
                self.result.int_plan_shares.append(IntPlanShare(self.device.phase, alloc.id, other_label, label,
                                                                self._current_ubatch))
            break
        planners[:] = [p for p in planners if p[0]() is not None and p[0]() is not wrapper]
        try:
            planners.append((weakref.ref(wrapper), label, start, end))
        except TypeError:
            pass

