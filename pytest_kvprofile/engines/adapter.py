"""What every engine adapter needs, whatever the engine: the mapping of an engine's own metadata builders onto the
harness's builder protocol, the mapping of a reservation API an engine's builder class may carry, stand-ins
installed for a block and undone after, the engine's import (lazy, on its own thread) and its ``Backend``.

Why: an adapter runs a serving engine's released builders unmodified (``engines/vllm/flashinfer.py`` runs vLLM's).
Most of what it does is the engine's runner, not the engine: make one builder per micro-batch (and KV-cache group)
when the runner makes them, hand each build the runner's inputs of the batch (``engines/batches.py``), send captured
decode steps to the builder's capture call and the rest to its build call, count what was built, name a failed
build with the case and the batch. :class:`EngineAdapter` is that part; an engine's module subclasses it and
provides only what is its own (docs/engines.md):

- :meth:`EngineAdapter.make_engine_config`: the case as the engine's config;
- :meth:`EngineAdapter.make_engine_builder`: one of the engine's builders (for one micro-batch, or one key of
  :meth:`EngineAdapter.builder_keys`);
- :meth:`EngineAdapter.engine_metadata`: a batch's runner inputs as the engine's metadata object;
- :meth:`EngineAdapter.build_for_capture` and :meth:`EngineAdapter.build_serving`: the builder's two calls;
- optionally :meth:`EngineAdapter.standins` (what a CPU-only machine lacks), :meth:`EngineAdapter.engine_scope`
  (the engine's "current config" around its calls), the hooks ``after_make``/``after_build``/``ensure_inputs`` and
  :meth:`EngineAdapter.key_metadata` (a builder key's own inputs).

A builder class that declares profiling-time reservation is mapped by :class:`ReservingAdapter` with the names
``contract_api.reservation_api`` finds on it. Nothing here imports an engine, and the base class defines no optional
hook of the protocol but ``rebind``, ``build`` and ``close`` (a missing hook keeps its meaning: an adapter that declares
nothing stays on the legacy path).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ContextManager,
    Iterable,
    Iterator,
    Sequence,
    TypeAlias,
    TypeVar,
)

from pytest_kvprofile.contract.backends import Backend, EnginePolicy, Provenance
from pytest_kvprofile.contract.device import Device
from pytest_kvprofile.contract.protocol import Batch, BuilderContext
from pytest_kvprofile.engines.contract_api import ReservationApi, map_support

if TYPE_CHECKING:
    from types import ModuleType

    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.matrix.cases import Case

# an engine's own object (its config, one of its metadata builders, its metadata, what a build returns): this module
# imports no engine, so it cannot name the type; each engine's adapter uses it as its engine's
EngineObject: TypeAlias = Any
# a key of the runner's builders: the micro-batch by default, (micro-batch, KV-cache group) for a hybrid runner;
# each adapter reads the keys it makes as its own type
BuilderKey: TypeAlias = Any
Loaded = TypeVar("Loaded")  # what an engine's import returns

__all__ = ["EngineAdapter", "EngineBuildError", "EngineUnavailable", "Patches", "ReservingAdapter", "device_active",
           "engine_backend", "import_engine", "module_standin"]

# -- the engine's import and its backend ------------------------------------------------------------------------

class EngineUnavailable(ImportError):
    """The engine (or one of its pure-Python dependencies) is not importable; the message names the install."""


def import_engine(load: Callable[[], Loaded], *, what: str, install_hint: str,
                  unavailable: type[EngineUnavailable] = EngineUnavailable,
                  thread_name: str = "kvprofile-engine-import") -> Loaded:
    """``load()`` (the engine's import, with whatever stand-ins it needs current) on its own thread; an
    ``ImportError`` becomes ``unavailable`` naming ``what`` and ``install_hint``.

    Why a thread: an engine may keep the tracebacks of optional imports that failed (vLLM's placeholder modules);
    on the caller's thread those tracebacks would keep the caller's frames (a whole lifecycle run, with every
    simulated tensor) alive for the life of the process."""
    outcome: list[Loaded | BaseException] = []

    def target() -> None:
        try:
            outcome.append(load())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(exc)

    worker = threading.Thread(target=target, name=thread_name)
    worker.start()
    worker.join()
    result = outcome[0] if outcome else ImportError("the import thread died")
    if isinstance(result, ImportError):
        raise unavailable(f"{what} is not importable ({type(result).__name__}: {result}); "
                          f"install it with {install_hint}") from result
    if isinstance(result, BaseException):
        raise result
    return result


def engine_backend(name: str, make_builders: Callable[[Case], Iterable[Builder]], *, engine: str, install_hint: str,
                   description: str = "", refuses_layout: Callable[[Case], str | None] | None = None,
                   origin: str = "", version: str = "", policy: EnginePolicy | None = None,
                   provenance: Callable[[], Provenance] | None = None) -> Backend:
    """A torch-mode ``Backend`` needing the top-level module ``engine``: without it the run is a usage error
    naming ``install_hint`` before collection; the engine is imported by ``make_builders`` only, never here.
    ``policy``: how the engine's runner integrates the builders (its arena manager, its gate); ``provenance``:
    what the verdict names about the installed engine (read without importing it)."""
    return Backend(name=name, make_builders=make_builders, origin=origin, version=version, torch_mode=True,
                   refuses_layout=refuses_layout, requires=(engine,), install_hint=install_hint,
                   description=description, policy=policy or EnginePolicy(), provenance=provenance)


@contextlib.contextmanager
def torch_on(device: Device) -> Iterator[None]:
    """torch "cuda" (and ``torch.accelerator``) answered by ``device``, for an engine's own memory code: the run's
    simulation when it is in torch mode on this device, a scope of its own otherwise; the GPU tier's device already
    is torch's."""
    from pytest_kvprofile.memory.device import SimDevice
    from pytest_kvprofile.memory.torch_mode import SimulatedCuda, active_simulation

    sim = active_simulation()
    if not isinstance(device, SimDevice) or (sim is not None and sim.device is device):
        yield
        return
    with SimulatedCuda(device):
        yield


def device_active() -> bool:
    """A lifecycle's simulated device is serving torch now (the builders are constructed on the run's device),
    rather than configure-time inspection."""
    from pytest_kvprofile.memory.torch_mode import active_simulation

    return active_simulation() is not None


def _in_window() -> bool:
    """The run's simulated device is inside the profiling window (its phase is a window phase)."""
    from pytest_kvprofile.lifecycle.phases import WINDOW_PHASES
    from pytest_kvprofile.memory.torch_mode import active_simulation

    sim = active_simulation()
    return sim is not None and getattr(sim.device, "phase", None) in WINDOW_PHASES


# -- stand-ins ------------------------------------------------------------------------------------------------

class Patches:
    """Attribute patches undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, object]] = []

    def set(self, obj: object, name: str, value: object) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        while self._undo:
            obj, name, value = self._undo.pop()
            setattr(obj, name, value)


@contextlib.contextmanager
def module_standin(name: str, make: Callable[[], ModuleType]) -> Iterator[None]:
    """For the block, ``sys.modules[name]`` is ``make()`` (a stand-in for a module whose own imports need what a
    CPU-only machine lacks), unless the real module is already imported."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = make()
    try:
        yield
    finally:
        sys.modules.pop(name, None)


# -- the adapter ----------------------------------------------------------------------------------------------

class EngineBuildError(RuntimeError):
    """An engine builder's build failed on a batch; the message names the case, the batch and the engine's own
    error (the driver records it)."""


class EngineAdapter:
    """An engine's metadata builders as the engine's model runner integrates them, as one harness part.

    The runner makes its builders with the KV cache: :meth:`rebind` (the first call after KV sizing) makes one per
    :meth:`builder_keys` of every micro-batch; nothing of the engine runs in the profiling window. :meth:`build`
    hands the batch's builders the engine's metadata of the batch (:meth:`engine_metadata`, on the runner's inputs),
    a captured decode step through :meth:`build_for_capture`, any other batch through :meth:`build_serving`.
    Declares nothing (UNSUPPORTED: the legacy path); :class:`ReservingAdapter` maps a reservation API."""

    name: str
    torch_mode = True
    builder_label = "the engine's metadata builder"  # "vLLM's FlashInferMetadataBuilder", in messages
    build_error: type[EngineBuildError] = EngineBuildError

    def __init__(self, case: Case, builder_cls: type | None = None) -> None:
        self.case = case
        self.builder_cls = builder_cls
        self.engine_config: EngineObject = None
        self.builders: dict[BuilderKey, EngineObject] = {}  # builder key -> the engine's builder
        self.built: dict[str, int] = {}  # batches built per kind, for reports and tests
        self.last_metadata: EngineObject = None  # what the engine's last build returned
        self.kernel_warmed = False  # the engine's kernel warmup ran (EngineAdapter.kernel_warmup)
        self.made_in_window = False  # builders were made inside the profiling window (a reservation: not legacy)

    # -- what an engine's module provides ------------------------------------------------------------------
    def make_engine_config(self) -> EngineObject:
        """The case as the engine's config (asked once, inside :meth:`standins`)."""
        raise NotImplementedError(f"{type(self).__name__} makes no engine config")

    def make_engine_builder(self, key: BuilderKey) -> EngineObject:
        """One engine builder for ``key`` (called inside :meth:`construction_scope`)."""
        raise NotImplementedError(f"{type(self).__name__} makes no engine builder")

    def engine_metadata(self, batch: Batch) -> EngineObject:
        """``batch``'s runner inputs as the engine's metadata object (inside :meth:`engine_scope`)."""
        raise NotImplementedError(f"{type(self).__name__} makes no metadata")

    def build_for_capture(self, builder: EngineObject, metadata: EngineObject) -> EngineObject:
        """The builder's call for a captured (CUDA-graph) decode step."""
        raise NotImplementedError(f"{type(self).__name__} has no capture build")

    def build_serving(self, builder: EngineObject, metadata: EngineObject) -> EngineObject:
        """The builder's call for any other batch."""
        raise NotImplementedError(f"{type(self).__name__} has no build")

    # -- what an engine's module may change ----------------------------------------------------------------
    def standins(self) -> ContextManager[object]:
        """The stand-ins the engine needs on a CPU-only machine, installed for the block and undone after."""
        return contextlib.nullcontext()

    def engine_scope(self) -> ContextManager[object]:
        """Around every call into the engine's builders: the stand-ins (and, for an engine with one, its current
        config)."""
        return self.standins()

    def construction_scope(self) -> ContextManager[object]:
        """Around the builders' construction: :meth:`engine_scope` unless the constructor needs more."""
        return self.engine_scope()

    def builder_keys(self, ubatch: int) -> list[BuilderKey]:
        """The builders one micro-batch has (one; a hybrid runner has one per KV-cache group)."""
        return [ubatch]

    def ubatch_of(self, key: BuilderKey) -> int:
        return int(key)

    def describe_key(self, key: BuilderKey) -> str:
        return f"ubatch {key}"

    def captures_attention(self) -> bool:
        """Whether the engine captures full graphs of uniform decode (attention inside them) on this layout; an
        engine that falls back to piecewise graphs builds no attention metadata while capturing, and serves its
        decode steps eagerly."""
        return True

    def is_capture(self, batch: Batch) -> bool:
        """Engines capture full graphs of uniform decode only, where they capture attention at all."""
        return batch.cuda_graph and batch.kind == "decode" and self.captures_attention()

    def key_metadata(self, key: BuilderKey, batch: Batch, metadata: EngineObject) -> EngineObject:
        """The metadata the builder of ``key`` is handed for ``batch``, asked just before its build: the batch's
        (:meth:`engine_metadata`) unless a key's builder reads other inputs (SGLang's draft worker)."""
        return metadata

    def after_make(self, made: list[EngineObject]) -> None:
        """The builders just made (inside :meth:`construction_scope`)."""

    def ensure_inputs(self) -> None:
        """The runner's input buffers exist before a build (outside :meth:`engine_scope`)."""

    def after_build(self, batch: Batch) -> None:
        """After every build of ``batch``."""

    def kernel_warmup_metadata(self) -> EngineObject:
        """The engine metadata of the dummy batch the engine's own kernel warmup builds on micro-batch 0 before it
        captures and locks its arena (vLLM's ``kernel_warmup``: a mixed prefill and decode batch), or None when the
        engine builds none (inside :meth:`engine_scope`)."""
        return None

    # -- the engine ------------------------------------------------------------------------------------------
    def config(self) -> EngineObject:
        """The engine's config of the case, made once."""
        if self.engine_config is None:
            self.engine_config = self.make_engine_config()
        return self.engine_config

    def make_engine_builders(self, num_ubatches: int) -> list[EngineObject]:
        """The runner's builders for every micro-batch (as the runner makes them); returns the new ones."""
        made: list[EngineObject] = []
        self.made_in_window = self.made_in_window or _in_window()
        with self.construction_scope():
            for ub in range(num_ubatches):
                for key in self.builder_keys(ub):
                    if key not in self.builders:
                        self.builders[key] = self.make_engine_builder(key)
                        made.append(self.builders[key])
            self.after_make(made)
        return made

    def builders_of(self, ubatch: int) -> list[tuple[BuilderKey, EngineObject]]:
        """(key, builder) of one micro-batch, in key order."""
        return [(k, b) for k, b in sorted(self.builders.items()) if self.ubatch_of(k) == ubatch]

    # -- the protocol --------------------------------------------------------------------------------------
    def rebind(self, ctx: BuilderContext) -> None:
        """The runner's KV-cache initialisation: the builders are made now, after KV sizing."""
        self.make_engine_builders(ctx.num_ubatches)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        """The engine's build of ``batch`` on every builder of its micro-batch."""
        if not self.builders_of(batch.ubatch):
            self.make_engine_builders(ctx.num_ubatches)
        if ctx.capturing and not self.captures_attention():
            return  # piecewise capture: the runner builds no attention metadata for it
        self.ensure_inputs()
        with self.engine_scope():
            metadata = self.engine_metadata(batch)
            for key, builder in self.builders_of(batch.ubatch):
                try:
                    own = self.key_metadata(key, batch, metadata)
                    if self.is_capture(batch):
                        self.last_metadata = self.build_for_capture(builder, own)
                    else:
                        self.last_metadata = self.build_serving(builder, own)
                except Exception as exc:  # noqa: BLE001 - named with the case and batch; the driver records it
                    raise self.build_error(f"case {self.case.id}: {self.builder_label}.build() of {batch.label} "
                                           f"({self.describe_key(key)}) failed on the simulated "
                                           f"{self.case.gpu.name}: {type(exc).__name__}: {exc}") from exc
        self.built[batch.kind] = self.built.get(batch.kind, 0) + 1
        self.after_build(batch)

    def kernel_warmup(self, ctx: BuilderContext) -> None:
        """The engine's own kernel warmup after KV sizing, before capture and the lock, once: its dummy batch
        (:meth:`kernel_warmup_metadata`) built eagerly on micro-batch 0's builders, in micro-batch 0's arena slot.
        What the builders make there lazily (an arena taken from the engine's manager) exists before the lock, as in
        the engine; a failed build is named with the case, as any build. Modelled on the legacy path only: builders
        made inside the profiling window (a reservation) are judged on what that reservation made, and the engine's
        reservation after kernel warmup re-sizes their arena anyway."""
        if self.kernel_warmed or self.made_in_window or ctx.phase != "warmup":
            return
        if not self.builders_of(0):
            self.make_engine_builders(ctx.num_ubatches)
        self.ensure_inputs()
        with self.engine_scope(), self._in_ubatch(ctx, 0):
            metadata = self.kernel_warmup_metadata()
            if metadata is None:
                self.kernel_warmed = True
                return
            for key, builder in self.builders_of(0):
                try:
                    self.last_metadata = self.build_serving(builder, metadata)
                except Exception as exc:  # noqa: BLE001 - named with the case; the driver records it
                    raise self.build_error(f"case {self.case.id}: {self.builder_label}.build() of the engine's "
                                           f"kernel-warmup batch ({self.describe_key(key)}) failed on the simulated "
                                           f"{self.case.gpu.name}: {type(exc).__name__}: {exc}") from exc
        self.built["kernel_warmup"] = self.built.get("kernel_warmup", 0) + 1
        self.kernel_warmed = True  # only once it succeeded: a failed warmup is retried whole

    def _in_ubatch(self, ctx: BuilderContext, ubatch: int) -> ContextManager[object]:
        """The engine's workspace slot of ``ubatch`` current (vLLM's ``use_workspace_ubatch_id``), where the run's
        arena manager has slots the engine's code reaches by itself."""
        scope = getattr(ctx.workspace, "ubatch_scope", None)
        return scope(ubatch) if callable(scope) else contextlib.nullcontext()

    def close(self) -> None:
        self.builders.clear()
        self.last_metadata = None


class ReservingAdapter(EngineAdapter):
    """An engine builder class that declares profiling-time reservation (:func:`find_revision`), driven in the order
    vLLM's pull request's runner drives it (docs/vllm.md, "The pull request's runner order"):

    - in the window (``reserve_persistent_workspace``): builders made for the profile; each reserves under its
      micro-batch id, then every one rebinds; the lease keeps them and the runner drops its own references, so the
      lease release frees what only they hold;
    - CUDA-graph profiling (``dummy_run``): the arena has not grown since the window;
    - after KV sizing (``rebind``): fresh builders, as KV-cache initialisation makes them, reserve and rebind again,
      within the arena the window measured;
    - after kernel warmup (the first ``warmup``): reserve and rebind again, then the reservation before CUDA-graph
      capture where the revision has one; the engine locks the arena after capture.

    A growth beyond the profiled arena raises the runner's ``AssertionError``, which the lifecycle records."""

    api: ReservationApi

    def __init__(self, case: Case, builder_cls: type | None = None) -> None:
        super().__init__(case, builder_cls)
        self.profiled: tuple[int, ...] | None = None  # the arena's size per micro-batch at the end of the window
        self.warmed = False

    @property
    def contract_api(self) -> str:
        """The API revision driven, as the verdict reports it."""
        return self.api.describe()

    def declaration_args(self) -> Sequence[object]:
        """What the class's declaration is called with (vLLM's: the config and the KV-cache spec)."""
        return ()

    def get_persistent_workspace_memory_profiling_support(self) -> object:
        with self.standins():
            declare = getattr(self.builder_cls, self.api.declaration)
            return map_support(declare(*self.declaration_args()))

    # -- the runner's steps ----------------------------------------------------------------------------
    def _reserve_all(self, ctx: BuilderContext, method: str | None = None) -> None:
        """Every builder's reservation under its micro-batch id (each call of the revision on all builders before
        the next), then every builder's rebind under the same id."""
        builders = sorted(self.builders.items())
        calls = self.api.calls if method is None else ((),)
        with self.engine_scope():
            for args in calls:
                for key, b in builders:
                    with self._in_ubatch(ctx, self.ubatch_of(key)):
                        getattr(b, method or self.api.reservation)(*args)
            if self.api.rebind is not None:
                for key, b in builders:
                    with self._in_ubatch(ctx, self.ubatch_of(key)):
                        getattr(b, self.api.rebind)()

    def _arena(self, ctx: BuilderContext) -> tuple[int, ...]:
        return tuple(ctx.workspace.size(u) for u in range(ctx.num_ubatches))

    def _within_profile(self, ctx: BuilderContext, when: str) -> None:
        """vLLM's runner: the arena never exceeds what the window measured (its ``AssertionError``)."""
        if self.profiled is None:
            return
        now = self._arena(ctx)
        if any(n > p for n, p in zip(now, self.profiled)):
            raise AssertionError(f"Attention workspace arena grew {when}: {list(now)} bytes per micro-batch against "
                                 f"the profiled {list(self.profiled)}")

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        """Exception-safe: the builders a failed reservation made are dropped before the error propagates."""
        before = set(self.builders)
        try:
            self.make_engine_builders(ctx.num_ubatches)
            self._reserve_all(ctx)
        except BaseException:
            for key in [k for k in self.builders if k not in before]:
                del self.builders[key]
            self.last_metadata = None
            raise
        leased = [b for _, b in sorted(self.builders.items())]
        self.builders.clear()  # the runner tears down its profiling state: only the lease keeps the builders
        self.last_metadata = None
        self.profiled = self._arena(ctx)
        return ctx.lease(leased)

    def dummy_run(self, ctx: BuilderContext) -> None:
        if ctx.phase == "graph_profiling":
            self._within_profile(ctx, "during CUDA graph profiling after persistent workspace profiling")

    def rebind(self, ctx: BuilderContext) -> None:
        """KV-cache initialisation makes fresh builders; they reserve and rebind within the profiled arena."""
        self.builders.clear()
        self.make_engine_builders(ctx.num_ubatches)
        if self.profiled is None:  # the legacy path: the runner never reserved, and does not now
            return
        self._within_profile(ctx, "before persistent workspace finalization")
        self._reserve_all(ctx)
        self._within_profile(ctx, "during persistent workspace finalization")

    def warmup(self, ctx: BuilderContext) -> None:
        """After kernel warmup, once: reserve and rebind again, then the reservation for CUDA-graph capture. On the
        legacy path the engine's own kernel warmup alone (:meth:`EngineAdapter.kernel_warmup`): the builder's lazy
        arena is sized there, before the lock, as in the engine."""
        if self.profiled is None:
            self.kernel_warmup(ctx)
            return
        if self.warmed or ctx.phase != "warmup":
            return
        self._reserve_all(ctx)
        self._within_profile(ctx, "after kernel warmup")
        if self.api.capture_reservation is not None:
            self._reserve_all(ctx, self.api.capture_reservation)
        self.warmed = True  # only once it succeeded: a failed warmup is retried whole
