"""The reference engine, ``LifecycleRun``: the engine's phases (``phases.py``, docs/contract.md) driven over
a builder set.

One run takes a backend (builders + engine policy) and a case, drives the builders through
profiling, KV sizing and serving on a device, and records what the checks need: every allocation
with owner, phase and size, the arena at each phase boundary, leases, the budget, and any error
with the builder and phase that raised it. Runs never raise for a builder's fault; the checks turn
what was recorded into verdicts.
"""


from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable

from pytest_kvprofile.contract.backends import engine_gate
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.contract.lease import Lease
from pytest_kvprofile.contract.protocol import (
    Builder,
    BuilderContext,
    WorkspaceDeclaration,
)
from pytest_kvprofile.contract.resources import ResourceAdapter
from pytest_kvprofile.contract.support import (
    DeclarationError,
    ProfilingSupport,
    builder_name,
    declared_support,
    resolve_support,
)
from pytest_kvprofile.contract.workspace import (
    WorkspaceLockedError,
)
from pytest_kvprofile.lifecycle import state_watch
from pytest_kvprofile.lifecycle.phases import (
    BASELINE,
    CAPTURE,
    CLOSING,
    GRAPH_PROFILING,
    KV_SIZING,
    LEASE_RELEASE,
    LOCK,
    PROFILE_REPLAY,
    PROFILE_RUN,
    PROFILE_WARMUP,
    REBIND,
    RESERVATION,
    SERVING,
    SETUP,
    TEARDOWN,
    WARMUP,
    WARMUP_REPEAT,
)
from pytest_kvprofile.lifecycle.record import (
    LEGACY,
    PROFILING,
    LeaseRecord,
    LifecycleResult,
    ProbeTarget,
)
from pytest_kvprofile.lifecycle.recording import LOCK_PROBE
from pytest_kvprofile.lifecycle.run_state import _Abort, make_device, ran_out_of_memory
from pytest_kvprofile.lifecycle.run_steps import EngineSteps
from pytest_kvprofile.lifecycle.teardown import _teardown_error
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.memory.budget import (
    ProfileWindow,
)

if TYPE_CHECKING:

    from pytest_kvprofile.contract.backends import Backend







__all__ = ["LifecycleRun", "case_parts", "make_device", "ran_out_of_memory"]


class LifecycleRun(EngineSteps):
    """Drives one backend over one case on one device. Use ``run_lifecycle``.

    It is the :class:`~pytest_kvprofile.contract.protocol.BuilderHost` of its builders' contexts: ``case``,
    ``device``, ``manager``, ``in_window``, ``in_dummy_forward``, ``arena_view`` and ``note_plan``. The phases are
    here, in order (``_run``); what a run records is ``RunState``'s, its memory uses ``UseTracking``'s, and the
    engine's own forwards and sizing ``EngineSteps``'.
    """

    def construct(self) -> list[Builder]:
        """The backend's parts for the case, made from a fresh view of process-wide state; raises what the
        backend's factory raises."""
        self._fresh_module_state()
        self.builders = _parts_of(self.backend, self.case)
        self._parts = {id(p): builder_name(p) for p in self.builders}
        self._parts.update((id(p.resource), builder_name(p)) for p in self.builders if isinstance(p, ResourceAdapter))
        return self.builders

    def make_builders(self) -> None:
        """Construct the backend's parts for the case, once, on this run's device (phase ``setup``)."""
        self._enter(SETUP)
        self._snapshot("device_start")
        self._snapshot("before_instance")
        try:
            self.construct()
        except Exception as exc:  # noqa: BLE001 - a raising factory is reported by every check
            self._fail(f"backend {self.result.backend!r} factory", exc)
        for alloc in self.result.allocations[self.result.snapshot_marks["before_instance"]:]:
            self.result.alloc_origin.setdefault(alloc.id, "__init__")  # what the parts' constructors made
        self._snapshot("after_init")
        modules: dict[str, set[str]] = {}
        for p in self.builders:
            modules.setdefault(type(getattr(p, "resource", p)).__module__, set()).add(builder_name(p))
        self._part_modules = {m: next(iter(names)) for m, names in modules.items() if len(names) == 1}
        self.result.builders = self.builders
        self._contexts = {builder_name(b): BuilderContext(self, builder_name(b)) for b in self.builders}

    def run(self) -> LifecycleResult:
        try:
            with self.device_mode():
                try:
                    self.make_builders()
                    self._run()
                finally:
                    self._observe_module_state()
        except _Abort:
            pass
        finally:
            self._teardown()
        self.result.closer = self.close
        self._start_second_engine()
        return self.result

    def close(self) -> None:
        """The parts' optional ``close()``, once, in phase ``teardown`` on the run's device (in torch mode inside
        the simulation again, so a torch call in ``close()`` reaches the simulated GPU). What it frees is marked
        freed in ``teardown``, which checks read as alive at the end; what it raises (a double free included)
        is recorded in ``result.errors`` with phase ``teardown``, for ``teardown_clean``."""
        self.result.closer = None
        self._enter(TEARDOWN)
        with self.device_mode():
            for part in self.builders:
                close = getattr(part, "close", None)
                if not callable(close):
                    continue
                try:
                    with self._as_part(builder_name(part), "close"):
                        close()
                except Exception as exc:  # noqa: BLE001 - the record is complete; the error is kept with it
                    self.result.errors.append(_teardown_error(builder_name(part), exc))
            self._observe_after_close()

    def _observe_after_close(self) -> None:
        """What process-wide state holds of this run once its parts closed (``state_watch.py``)."""
        state_watch.observe_after_close(self.result, self.builders, set(self._parts.values()), self._memory_of,
                                          self._atexit)

    def _fresh_module_state(self) -> None:
        """Give this run the process-wide state a fresh process starts from (``module_state.fresh_view``)."""
        from pytest_kvprofile.lifecycle.module_state import fresh_view

        fresh_view(self._memory_of)

    def _observe_module_state(self) -> None:
        """What process-wide state holds after the run (``state_watch.py``)."""
        state_watch.observe(self.result, self.builders, set(self._parts.values()), self._memory_of)

    def _start_second_engine(self) -> None:
        """A second engine in the same process when this run left memory in process-wide state
        (``state_watch.second_engine``)."""
        second = state_watch.second_engine(self.result, self.device, set(self._parts.values()), _second_run)
        if second is not None:
            self.result.second_engine = second

    def _resolve(self) -> None:
        try:
            self.result.resolution = resolve_support(self.builders, engine_gate(self.policy, self.case))
        except Exception as exc:  # noqa: BLE001 - a declaration that raises is reported like a bad answer
            self.result.declaration_error = (
                str(exc) if isinstance(exc, DeclarationError)
                else f"get_persistent_workspace_memory_profiling_support() raised {type(exc).__name__}: {exc}"
            )
            self.result.resolution = None
        for b in self.builders:
            fn = getattr(b, "declared_workspace", None)
            if fn is not None:
                try:
                    declared = fn(self.case)
                    if not isinstance(declared, WorkspaceDeclaration):
                        raise TypeError(
                            f"declared_workspace() returned {type(declared).__name__}, not a WorkspaceDeclaration"
                        )
                    self.result.declared[builder_name(b)] = declared
                except Exception as exc:  # noqa: BLE001
                    self._enter(SETUP)
                    self._fail(builder_name(b), exc)
        enabled = self.result.resolution is not None and self.result.resolution.enabled
        self.result.path = PROFILING if enabled else LEGACY

    def _warmed_in_window(self) -> list[Builder]:
        """The parts the engine warms up inside the profiling window: each part where its engine warms it (its
        ``warmup_materializes_persistent``), so a part whose engine first warms it after KV sizing is warmed there
        even when another part is warmed in the window; every part, or none, where the policy says so
        (``EnginePolicy.warmup_in_window``)."""
        if self.policy.warmup_in_window is not None:
            return list(self.builders) if self.policy.warmup_in_window else []
        return [b for b in self.builders if getattr(b, "warmup_materializes_persistent", False)]

    def _run(self) -> None:
        """The engine's phases in order (``phases.py``), each step a call to a part or a helper method.

        Long because it is the one place a reader sees the whole order of the phases, top to bottom, and
        splitting it would scatter that order across functions."""
        case, dev = self.case, self.device
        self._enter(SETUP)
        self._resolve()
        profiling = self.result.path == PROFILING
        for observer in self.observers:
            observer.before_instance(dev)
        with self._max_split():
            self._alloc_engine(case.weights_bytes, "model", "weights")
        self._snapshot("after_weights")
        self._record_phase(SETUP)

        self._enter(BASELINE)
        dev.empty_cache()
        dev.reset_peak_memory_stats()
        baseline_reserved = dev.memory_reserved()
        self._baseline_allocated = dev.memory_allocated()
        self.in_window = True
        self._snapshot("baseline")
        for observer in self.observers:
            observer.window_opens(dev)
        self._record_phase(BASELINE)

        if profiling:
            self._enter(RESERVATION)
            arena = max((d.float_bytes for d in self.result.declared.values()), default=0)
            if arena:
                try:
                    self.manager.reserve("engine", arena)
                except Exception as exc:  # noqa: BLE001
                    self._fail("engine (float arena reservation)", exc)
            for b in self.builders:
                if declared_support(b) is ProfilingSupport.REQUIRED:
                    before = len(self.result.allocations)
                    lease = self._call(b, "reserve_persistent_workspace", self.ctx(b))
                    if not isinstance(lease, Lease):
                        self._fail(
                            builder_name(b),
                            TypeError(f"reserve_persistent_workspace() returned {type(lease).__name__}, not a Lease"),
                        )
                    ids = tuple(  # what the reservation made and still holds: its own transients are not leased
                        a.id for a in self.result.allocations[before:] if a.owner == builder_name(b) and a.alive
                    )
                    if not lease.released:
                        self._note_foreign_resources(builder_name(b), lease.resources)
                    self.result.leases.append(LeaseRecord(builder_name(b), lease, ids))
            self._record_phase(RESERVATION)

        self._enter(PROFILE_RUN)
        # vLLM's profile run: ``_dummy_run(self.max_num_tokens, is_profile=True)`` (v1/worker/gpu_model_runner.py:6132),
        # which builds no attention metadata (force_attention is False: :5637), so a GDN layer warms its chunked
        # scan at T = FLA_CHUNK_SIZE = 64 tokens instead (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:1350,
        # from its forward's early return at :1522): the activations are max_num_batched_tokens', a layer's own
        # scratch is the shape its dummy_run warms (issue 51, item 3)
        self.result.profile_tokens = case.envelope.max_num_batched_tokens
        with self._max_split():
            self._dummy_forward(case.envelope.max_num_batched_tokens, None)
        self._record_phase(PROFILE_RUN)

        in_window = self._warmed_in_window() if profiling else []
        if in_window:
            self._enter(PROFILE_WARMUP)
            for b in in_window:
                self._call(b, "warmup", self.ctx(b))
            self._record_phase(PROFILE_WARMUP)
            if self.policy.replay_after_warmup:
                self._enter(PROFILE_REPLAY)
                with self._max_split():
                    self._dummy_forward(case.envelope.max_num_batched_tokens, None)
                self._record_phase(PROFILE_REPLAY)

        self._enter(CLOSING)
        for observer in self.observers:
            self.result.observed_non_kv[observer.name] = observer.window_closes(dev)
        peak_allocated = dev.max_memory_allocated()
        self._snapshot("closing")
        dev.empty_cache()
        self.result.window = ProfileWindow(
            weights=case.weights_bytes,
            nontorch=dev.nontorch_bytes,
            baseline_reserved=baseline_reserved,
            closing_reserved=dev.memory_reserved(),
            closing_allocated=dev.memory_allocated(),
            peak_allocated=peak_allocated,
        )
        self._engine_terms()
        self.in_window = False
        self.result.released_before_closing = tuple(r.owner for r in self.result.leases if r.lease.released)
        self._record_phase(CLOSING)

        if profiling:
            self._enter(LEASE_RELEASE)
            # the engine's release, then its ``finally`` releasing again: release must be idempotent
            for rec in [*self.result.leases, *self.result.leases]:
                try:
                    with self._as_part(rec.owner, "lease.release"):
                        rec.lease.release()
                except Exception as exc:  # noqa: BLE001
                    self._fail(rec.owner, exc)
            self._record_phase(LEASE_RELEASE)

        self._enter(GRAPH_PROFILING)
        pool = self._graph_profile()
        self._record_phase(GRAPH_PROFILING)

        self._enter(KV_SIZING)
        self._size_kv()
        self._record_phase(KV_SIZING)

        self._enter(REBIND)
        for b in self.builders:
            self._call(b, "rebind", self.ctx(b))
        self._record_phase(REBIND)

        self._enter(WARMUP)
        for b in self.builders:
            self._call(b, "warmup", self.ctx(b))
        self._record_phase(WARMUP)

        self._enter(CAPTURE)
        self._capture(pool)
        self._record_phase(CAPTURE)

        self._enter(LOCK)
        self.manager.lock()
        try:
            self.manager.get_workspace(LOCK_PROBE, self.manager.size(0) + self.manager.alignment, 0)
        except WorkspaceLockedError as exc:
            self.result.lock_probe_error = str(exc)
        self._record_phase(LOCK)

        self._enter(SERVING)
        for batch in self._serving_batches():
            self._serve_step(batch)
        self._record_phase(SERVING)

        self._enter(WARMUP_REPEAT)
        for b in self.builders:
            self._call(b, "warmup", self.ctx(b))
        self._record_phase(WARMUP_REPEAT)

    def _teardown(self) -> None:
        self.manager.release()  # vLLM's manager: its module global put back
        self._post_kv = False
        self.result.post_kv_peak_used = self._peak_used
        self._unsubscribe()


def _second_run(target: ProbeTarget) -> LifecycleResult:
    return _SecondEngineRun(target, target.device_factory(target.case)).run()


class _SecondEngineRun(LifecycleRun):
    """A later engine in the same process: it finds the state the case's run left, and starts no third."""

    def _fresh_module_state(self) -> None:
        pass

    def _start_second_engine(self) -> None:
        pass


@contextlib.contextmanager
def case_parts(backend: Backend, case: Case, device_factory: Callable[[Case], Device] = make_device,
               ) -> Iterator[Callable[[], list[Builder]]]:
    """Construct a backend's parts for ``case`` on the case's device, as the lifecycle constructs them.

    Yields the constructor: what it raises is the backend factory's; what entering or leaving the device
    (torch mode on the simulated GPU) raises is the harness's and propagates as such. The parts are meant to be
    dropped inside the block (collection and inspection only ask their declarations). Construction starts from a
    fresh view of process-wide state, and what it leaves there (a buffer a constructor makes once per process) is
    remembered, so the case's own run makes it again instead of meeting this one's.
    """
    run = LifecycleRun(ProbeTarget(backend, case, device_factory), device_factory(case))
    try:
        with run.device_mode():
            try:
                yield run.construct
            finally:
                if run.result.allocations:  # what construction left in process-wide state: a later run's fresh view
                    run._observe_module_state()
    finally:
        run._teardown()


def _parts_of(backend: Backend, case: Case) -> list[Builder]:
    from pytest_kvprofile.lifecycle.parts import model_parts

    return model_parts(backend, case)

