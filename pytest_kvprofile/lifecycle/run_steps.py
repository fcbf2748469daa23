"""The engine's own steps between the parts' calls: dummy and captured forwards, serving steps, CUDA-graph profiling
and capture, the budget terms and KV sizing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pytest_kvprofile.contract.protocol import (
    Batch,
    BatchKind,
)
from pytest_kvprofile.lifecycle.run_uses import UseTracking
from pytest_kvprofile.matrix.cases import DecodeCapture
from pytest_kvprofile.matrix.models import kv_bytes_per_token
from pytest_kvprofile.memory.budget import (
    Budget,
    available_kv_bytes,
    tokens_for,
)
from pytest_kvprofile.memory.device import Allocation

if TYPE_CHECKING:

    from pytest_kvprofile.contract.device import GraphPoolHandle








class EngineSteps(UseTracking):
    """The model side of a run: what the engine allocates and sizes itself."""

    def _dummy_forward(self, num_tokens: int, batch: Batch | None) -> None:
        """A dummy forward: activations, each builder's layer hooks and, with a batch, planning."""
        self.in_dummy_forward = True
        act = self._alloc_engine(self._activation_bytes(num_tokens), "model", "activations")
        try:
            for b in self.builders:
                self._call(b, "dummy_run", self.ctx(b))
                if batch is not None:
                    self._call(b, "build", self.ctx(b), batch)
        finally:
            self.device.free(act)
            self.in_dummy_forward = False

    def _alloc_engine(self, nbytes: int, owner: str, tag: str) -> Allocation:
        try:
            return self.device.allocate(nbytes, owner=owner, tag=tag)
        except Exception as exc:  # noqa: BLE001 - an engine-side OOM is a recorded outcome
            self._fail(f"engine ({owner}: {tag})", exc)

    def _serve_step(self, batch: Batch) -> None:
        """One serving step as a runner takes it: the attention metadata is built first, then the forward runs.

        So what ``build()`` allocates and frees before it returns never coexists with the step's activations: it
        is transient, within the headroom the closing measurement kept for the profiled activation peak (vLLM's
        ``non_kv = consumed + transient peak``); what it keeps stays alive through the forward."""
        for b in self.builders:
            for ub in range(self.manager.num_ubatches):
                self._call(b, "build", self.ctx(b), _with_ubatch(batch, ub))
        act = self._alloc_engine(self._activation_bytes(batch.num_tokens), "model", "activations")
        self.device.free(act)

    @contextlib.contextmanager
    def _max_split(self) -> Iterator[None]:
        """The allocator's split limit where the engine scopes it (``EnginePolicy.profile_max_split_mib``); a device
        without the caching-allocator model (the GPU tier's) keeps its own configuration."""
        # Any: SimDevice's CachingAllocator or a device's own (not part of Device), used where it has the method
        allocator: Any = getattr(self.device, "allocator", None)
        limit = self.policy.profile_max_split_mib
        if limit is None or not hasattr(allocator, "set_max_split_size"):
            yield
            return
        previous = allocator.max_split_size
        allocator.set_max_split_size(limit << 20)
        try:
            yield
        finally:
            allocator.set_max_split_size(previous)

    def _captures(self) -> tuple[DecodeCapture, ...]:
        """The decode steps captured in CUDA graphs, largest first (capture sizes are tokens)."""
        return self.case.envelope.decode_captures(self.case.mtp)

    def _graph_profile(self) -> GraphPoolHandle:
        """Capture dummy graphs in a private pool and estimate the pool's footprint."""
        pool = None
        for capture in self._captures():
            with self.device.graph_capture(pool) as pool:
                self._graph_forward(capture, plan=False)
        if pool is not None:
            self.result.graph_pool_high_water = pool.high_water_reserved
            self.result.graph_pool_retained = pool.reserved
        return pool

    def _graph_forward(self, capture: DecodeCapture, plan: bool) -> None:
        """One captured decode step: the same allocations in graph profiling and in the real capture."""
        batch = _graph_batch(capture)
        self.in_dummy_forward = True
        act = self._alloc_engine(self._activation_bytes(batch.num_tokens), "model", "activations")
        try:
            for b in self.builders:
                self._call(b, "dummy_run", self.ctx(b))
                if plan:
                    for ub in range(self.manager.num_ubatches):
                        self._call(b, "build", self.ctx(b), _with_ubatch(batch, ub))
            out = self._alloc_engine(batch.num_tokens * self.case.model.hidden * 2, "model",
                                     f"graph output bs={capture.num_reqs}")
        finally:
            self.device.free(act)
            self.in_dummy_forward = False
        self.device.free(out)

    def _engine_terms(self) -> None:
        """The engine's budget as terms (``result.engine_terms``): its own arithmetic's, else the harness's."""
        assert self.result.window is not None
        if self._arithmetic is None:
            self.result.engine_terms = self.result.window.terms()
            return
        try:
            self.result.engine_terms = self._arithmetic.terms()
        except Exception as exc:  # noqa: BLE001
            self._fail(f"engine (budget arithmetic {self._arithmetic.name})", exc)

    def _size_kv(self) -> None:
        case, dev, window = self.case, self.device, self.result.window
        assert window is not None
        if self.policy.graph_estimate == "gross_minus_retained":
            estimate = self.result.graph_pool_high_water - self.result.graph_pool_retained
        elif self.policy.graph_estimate == "none":  # CUDA graphs not accounted at all
            estimate = 0
        else:
            estimate = self.result.graph_pool_high_water
        per_token = kv_bytes_per_token(case.model, case.tp, case.dcp)
        rule = self.result.kv_sizing.rule
        available = available_kv_bytes(dev.total_memory, case.gmu, window.non_kv, estimate)
        persistent = window.consumed
        self.result.budget = Budget(
            total=dev.total_memory, gmu=case.gmu, weights=window.weights, nontorch=window.nontorch,
            persistent_workspace=window.persistent_allocated(self._baseline_allocated),
            persistent_reserved=persistent, peak_activation=window.transient_headroom, non_kv=window.non_kv,
            graph_pool_estimate=estimate, graph_pool_high_water=self.result.graph_pool_high_water,
            available_kv=available, kv_bytes_per_token=per_token, kv_tokens=available // per_token,
            reservation_kv_tokens=tokens_for(persistent, per_token), rule=rule,
        )
        dev.empty_cache()
        dev.reset_peak_memory_stats()
        self._post_kv = True
        self._peak_used = dev.memory_reserved() + dev.nontorch_bytes
        if available > 0:
            self.result.kv_allocation = self._alloc_engine(available, "kv-cache", "kv cache")

    def _capture(self, pool: GraphPoolHandle) -> None:
        """The real capture; in torch mode every storage its calls touch is noted (what the graphs read)."""
        sim = self._torch
        if sim is not None:
            sim.watch_all = True
        try:
            for capture in self._captures():
                with self.device.graph_capture(pool) as pool:
                    self._graph_forward(capture, plan=True)
        finally:
            if sim is not None:
                sim.watch_all = False

    def _serving_batches(self) -> list[Batch]:
        """A deterministic sweep of the envelope, so that a lazily created wrapper meets its shape.

        Every captured decode step; 1, 2, 4, ... up to ``max_num_seqs`` requests in prefill, mixed and
        decode batches (decode carries ``1 + mtp`` tokens per request: the MTP verify shape); the
        longest prefill and a chunked one; the planner's worst batch per route. ``_serve_step`` builds
        each for every micro-batch. Largest first: the engine's activations then reuse the first step's
        cached block instead of fragmenting the caching allocator ahead of a larger step.
        """
        env = self.case.envelope
        q = 1 + self.case.mtp
        budget = env.max_num_batched_tokens
        batches = [_graph_batch(c) for c in self._captures()]
        n = 1
        while n <= env.max_num_seqs and n <= budget:
            batches.append(Batch("prefill", n, budget))
            batches.append(Batch("mixed", n, budget))
            if n * q <= budget:
                batches.append(Batch("decode", n, n * q))
            n *= 2
        batches.append(Batch("prefill", 1, max(1, min(env.max_model_len, budget))))
        batches.append(Batch("prefill", 1, max(1, budget // 2)))
        batches.extend(self._worst_batches())
        return sorted(dict.fromkeys(batches), key=lambda b: -b.num_tokens)

    def _worst_batches(self) -> list[Batch]:
        """The sizing module's worst batch per route, within the envelope."""
        from pytest_kvprofile.sizing.case import for_case

        env = self.case.envelope
        try:
            need = for_case(self.case)
        except Exception:  # noqa: BLE001 - a case the sizing cannot model is swept without its worst batches
            return []
        out = []
        for route, sizing in need.routes.items():
            if not sizing.worst_batch:
                continue
            qo, _kv, graph = sizing.worst_batch
            reqs, tokens = len(qo), sum(qo)
            if 0 < reqs <= env.max_num_seqs and reqs <= tokens <= env.max_num_batched_tokens:
                # routes: decode_tc, decode_cc_cuda_graph, ...
                kind: BatchKind = "decode" if route.startswith("decode") else "prefill"
                out.append(Batch(kind, reqs, tokens, cuda_graph=bool(graph)))
        return out


def _graph_batch(capture: DecodeCapture) -> Batch:
    return Batch("decode", capture.num_reqs, capture.num_tokens, cuda_graph=True)


def _with_ubatch(batch: Batch, ubatch: int) -> Batch:
    return Batch(batch.kind, batch.num_reqs, batch.num_tokens, batch.cuda_graph, ubatch)

