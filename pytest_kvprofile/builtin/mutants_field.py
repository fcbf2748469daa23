"""Mutants re-created from incidents of the field (issue 51), each beside the correct twin it differs from.

| mutant | item | mechanism | twin |
|---|---|---|---|
| 07f | 1 | a graph captured in warmup, kept before its capture succeeded: a failed capture keeps its pool | resets it |
| 07g | 1 | a captured step kept on the builder until built: a failed capture keeps it in the graph pool | untracks it |
| 16d | 20 | wrappers bound to an arena a later growth gave back, reported honestly, never rebound | rebinds |
| 14e | 11 | a daemon thread started at serving whose frame holds a workspace, never stopped | joins it |
| 14f | 11 | an ``atexit`` handler registered at serving, its arguments holding a workspace | unregisters it |
| 14g | 11 | ``close()`` parks its workspace in a module-level dict (a process-global cache) | drops it |
| 14h | 19 | ``close()`` parks it in a value a module-level ``functools.lru_cache`` returns | as 14g's |
| 14i | 19 | ``close()`` parks it in a module-level ``threading.local()`` | as 14g's |
| 14j | 19 | ``close()`` parks it on a class made with ``type()``, kept in a module-level dict | as 14g's |
| 04e | 9 | a non-FlashInfer kernel (TurboQuant-like) asks the arena for batch-sized scratch after lock | asks early |
| 13d | 5 | a resource (``builtin/resources.py``) made in its warmup, first called after KV sizing | warmed in window |
| 10c | 2 | 36 MiB of runner buffers made in ``__init__``, before a fork's instance snapshot | snapshot first |
| 08b | 3 | a GDN chunked-scan scratch (72 KiB a token) freed in ``build()``, warmed at 64 tokens | warms at 8192 |

Mutant 10c is an engine's, not a builder's: its twin has the same builder, under an engine that takes its instance
snapshot before the parts are constructed (upstream vLLM's ``init_device``).

The workspace of 14e to 14j is made inside the profiling window (KV sizing counts it) and held by the builder; what
each mutant adds is a place that keeps it once every part's ``close()`` ran (torch mode).

Each mutant declares itself on its builder class (``@mutant``, ``builtin/mutant_declarations.py``), so this module
imports nothing of the catalog (``builtin/mutants.py``); ``FIELD_TWINS`` are the correct twins, which the tests run on
every ci case beside their mutants.
"""

from __future__ import annotations

import atexit
import functools
import threading
from typing import TYPE_CHECKING, Any, Callable

from pytest_kvprofile.builtin.mutant_declarations import mutant
from pytest_kvprofile.builtin.resources import WarmedInWindowDMAOutputWorkspace
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder, TorchFlashInferLikeBuilder, Wrapper
from pytest_kvprofile.contract.backends import Backend, EnginePolicy
from pytest_kvprofile.contract.protocol import WorkspaceDeclaration
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.memory.budget import InstanceSnapshotBudget
from pytest_kvprofile.units import KiB, MiB

if TYPE_CHECKING:
    from torch import Tensor

    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.protocol import Batch, Builder, BuilderContext
    from pytest_kvprofile.matrix.cases import Case

GROWTH_BYTES = 2 * MiB  # what the in-window warmup asks beyond the declaration: the growth that retires the arena


# -- item 20: a wrapper bound to an arena a later growth replaced ---------------------------------------------------
class _KeepsWrappersAcrossGrowth(FlashInferLikeBuilder):
    """Its lease keeps the wrappers (the release frees nothing); its in-window warmup asks each arena for 2 MiB more
    than it declared, so the arena grows under the wrappers' views. Its plans are told to the harness for the int
    workspace only: the float workspace a wrapper plans into is the one it is bound to, reported honestly through
    ``bound_workspaces()``."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        return ctx.lease(self._materialize(ctx))

    def warmup(self, ctx: BuilderContext) -> None:
        if ctx.profiling and not self.warmed:
            for ub in range(ctx.num_ubatches):
                ctx.get_workspace(self.float_bytes() + GROWTH_BYTES, ub)
        super().warmup(ctx)

    def _plan(self, ctx: BuilderContext, w: Wrapper) -> None:
        ctx.plan_into(w.int_workspace)  # the float plan goes where the wrapper is bound, unannounced


@mutant("mutant-16d-bound-to-replaced-arena", catches=("no_use_after_free",))
class BoundToReplacedArenaBuilder(_KeepsWrappersAcrossGrowth):
    """Bug 16d (issue 51, item 20): never rebinds, so every wrapper stays bound to the arena the growth gave back and
    plans into freed memory at serving; ``bound_workspaces()`` says so, no ``ctx.plan_into`` does."""


class RebindsAfterGrowthBuilder(_KeepsWrappersAcrossGrowth):
    """Correct twin of 16d: ``rebind()`` points every wrapper at a view of the live arena."""

    def rebind(self, ctx: BuilderContext) -> None:
        for w in self.wrappers.values():
            w.view = ctx.get_workspace(self.float_bytes(), w.ubatch)
            w.float_ptr, w.float_bytes = w.view.ptr, w.view.nbytes
        super().rebind(ctx)


# -- items 11 and 19: memory alive after close() ----------------------------------------------------------------------
SIDE_BYTES = 4 * MiB  # the side workspace each of these builders makes in its reservation (untouched zero pages)
_STOP = threading.Event()  # set by ``stop_field_threads``: every daemon thread 14e started ends (a test's cleanup)


def stop_field_threads() -> None:
    """End the daemon threads mutant 14e started and never stopped (a test suite's cleanup; a process may exit
    without it: the threads are daemons)."""
    _STOP.set()


def _poll(workspace: Tensor, stop: threading.Event) -> None:
    """A backend's background thread: its frame holds the workspace as long as it runs."""
    while not (stop.wait(0.5) or _STOP.is_set()):
        pass


def _flush(workspace: Tensor) -> None:
    """An exit handler that would flush the workspace's statistics: it only keeps the workspace alive."""


_PARKED: dict[int, Tensor] = {}  # 14g: a process-global cache of workspaces a closed engine left


@functools.lru_cache(maxsize=None)
def _parking(kind: str) -> list[Tensor]:
    """14h: a module-level cache whose value (a list) collects what closed engines leave."""
    return []


_PARKED_LOCAL = threading.local()  # 14i
# 14j: a class made with type() and kept in a module dict; Any: its attributes are made at run time
_PARK_CLASSES: dict[str, Any] = {"holder": type("ParkedWorkspaces", (), {"workspace": None})}


class _SideWorkspace(TorchFlashInferLikeBuilder):
    """A side workspace (``SIDE_BYTES``) made in the reservation, inside the window, and kept on the builder; its
    ``close()`` drops the builder's reference. Subclasses add the place that outlives ``close()``."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.side: Tensor | None = None
        self.started = False

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        import torch

        if self.side is None:
            self.side = torch.empty(SIDE_BYTES, dtype=torch.uint8, device="cuda")
        return super().reserve_persistent_workspace(ctx)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if not self.started and ctx.phase == "serving" and self.side is not None:
            self.started = True
            self.on_first_serving_step(self.side)

    def on_first_serving_step(self, workspace: Tensor) -> None:
        """What starts at the first real step (a thread, an exit handler)."""

    def close(self) -> None:
        side, self.side = self.side, None
        if side is not None:
            self.park(side)

    def park(self, workspace: Tensor) -> None:
        """Where ``close()`` leaves the workspace (nowhere: the correct twins)."""


@mutant("mutant-14e-torch-daemon-thread-holds-workspace", catches=("no_state_outlives_case",))
class DaemonThreadBuilder(_SideWorkspace):
    """Bug 14e (issue 51, item 11): a daemon thread started at the first serving step polls with the workspace in its
    frame; ``close()`` never stops it, so the workspace outlives the engine."""

    def on_first_serving_step(self, workspace: Tensor) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=_poll, args=(workspace, self.stop), daemon=True,
                                       name="kvprofile-field-poller")
        self.thread.start()


class StoppedThreadBuilder(DaemonThreadBuilder):
    """Correct twin of 14e: ``close()`` stops the thread and joins it."""

    def close(self) -> None:
        thread = getattr(self, "thread", None)
        if thread is not None:
            self.stop.set()
            thread.join()
            del self.thread
        super().close()


@mutant("mutant-14f-torch-atexit-holds-workspace", catches=("no_state_outlives_case",))
class AtexitHandlerBuilder(_SideWorkspace):
    """Bug 14f (issue 51, item 11): registers an exit handler at the first serving step with the workspace as its
    argument; ``close()`` never unregisters it, so the workspace lives until the process exits."""

    def on_first_serving_step(self, workspace: Tensor) -> None:
        self.handler = functools.partial(_flush, workspace)
        atexit.register(self.handler)


class UnregisteredAtexitBuilder(AtexitHandlerBuilder):
    """Correct twin of 14f: ``close()`` unregisters the handler."""

    def close(self) -> None:
        handler = getattr(self, "handler", None)
        if handler is not None:
            atexit.unregister(handler)
            del self.handler
        super().close()


@mutant("mutant-14g-torch-close-parks-in-module-dict", catches=("no_state_outlives_case",))
class ParksInModuleDictBuilder(_SideWorkspace):
    """Bug 14g (issue 51, item 11): ``close()`` parks its workspace in a module-level dict (a process-global cache
    for a later engine that never looks there): the workspace outlives the engine."""

    def park(self, workspace: Tensor) -> None:
        _PARKED[id(self)] = workspace


@mutant("mutant-14h-torch-close-parks-in-lru-cache", catches=("no_state_outlives_case",))
class ParksInLruCacheBuilder(_SideWorkspace):
    """Bug 14h (issue 51, item 19): ``close()`` appends its workspace to the list a module-level
    ``functools.lru_cache`` returns: a cached value keeps it."""

    def park(self, workspace: Tensor) -> None:
        _parking("workspaces").append(workspace)


@mutant("mutant-14i-torch-close-parks-in-thread-local", catches=("no_state_outlives_case",))
class ParksInThreadLocalBuilder(_SideWorkspace):
    """Bug 14i (issue 51, item 19): ``close()`` leaves its workspace on a module-level ``threading.local()``."""

    def park(self, workspace: Tensor) -> None:
        _PARKED_LOCAL.workspace = workspace


@mutant("mutant-14j-torch-close-parks-on-type-class", catches=("no_state_outlives_case",))
class ParksOnTypeClassBuilder(_SideWorkspace):
    """Bug 14j (issue 51, item 19): ``close()`` leaves its workspace on a class made with ``type()`` and kept in a
    module-level dict."""

    def park(self, workspace: Tensor) -> None:
        _PARK_CLASSES["holder"].workspace = workspace


class DropsOnCloseBuilder(_SideWorkspace):
    """Correct twin of 14g to 14j: ``close()`` drops the workspace and parks it nowhere."""


# -- item 1: a failed CUDA-graph capture that keeps its private pool -------------------------------------------------
GRAPH_SCRATCH_BYTES = 6 * MiB  # what the captured step allocates first inside the capture (freed when it fails)
GRAPH_OUTPUT_BYTES = 2 * MiB  # the captured step's output, which the graph keeps


class _CapturesItsOwnGraph(TorchFlashInferLikeBuilder):
    """Captures one decode graph of its own (``torch.cuda.graph``, a private pool) in its warmup inside the profiling
    window, so KV sizing counts the pool; the capture allocates its scratch, then the output the graph keeps."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.graphs: list[Any] = []  # Any: torch.cuda.CUDAGraph (the simulator's in torch mode)
        self.graph_output: Tensor | None = None

    def warmup(self, ctx: BuilderContext) -> None:
        super().warmup(ctx)
        if ctx.profiling and self.graph_output is None:
            self.capture_graph()

    def capture_graph(self) -> None:
        raise NotImplementedError

    @staticmethod
    def _captured_step(graph: Any) -> Tensor:  # Any: torch.cuda.CUDAGraph, the simulator's in torch mode
        import torch

        with torch.cuda.graph(graph):
            scratch = torch.empty(GRAPH_SCRATCH_BYTES, dtype=torch.uint8, device="cuda")
            output = torch.empty(GRAPH_OUTPUT_BYTES, dtype=torch.uint8, device="cuda")
            del scratch
        return output


@mutant("mutant-07f-torch-failed-capture-keeps-pool", catches=("warmup_retryable",))
class KeepsFailedCapturePoolBuilder(_CapturesItsOwnGraph):
    """Bug 7f (issue 51, item 1): keeps the graph before its capture succeeds, so a capture that runs out of memory
    leaves a graph that still holds its private pool; the retry captures into a new pool beside it."""

    def capture_graph(self) -> None:
        import torch

        graph = torch.cuda.CUDAGraph()
        self.graphs.append(graph)  # the bug: kept before the capture succeeded
        self.graph_output = self._captured_step(graph)


class ResetsFailedCaptureBuilder(_CapturesItsOwnGraph):
    """Correct twin of 7f: a graph is kept once captured; a failed one is reset, which releases its pool (PyTorch's
    own fix frees a failed capture's pool the same way)."""

    def capture_graph(self) -> None:
        import torch

        graph = torch.cuda.CUDAGraph()
        try:
            self.graph_output = self._captured_step(graph)
        except BaseException:
            graph.reset()
            raise
        self.graphs.append(graph)


# -- item 1, in the engine's own capture: a failed capture keeps what its step made --------------------------------
# Both under 1 MiB: the caching allocator serves them from a 2 MiB small-block segment, which the graph pool's
# reserve covers (a 1 to 10 MiB request takes a 20 MiB segment, beyond what graph profiling estimated).
STEP_PARTIAL_BYTES = 512 * KiB  # a decode step's split-KV partial output, made first while build() plans the step
STEP_LSE_BYTES = 64 * KiB  # then the merge's log-sum-exp; both freed before build() returns


class _TracksStepsInFlight(TorchFlashInferLikeBuilder):
    """Plans each decode step with two scratch tensors (the split-KV partial output, then the merge's log-sum-exp),
    tracked in ``in_flight`` while the step is built and freed before ``build()`` returns. In the engine's capture they
    come from its CUDA-graph pool; when serving, from the default pool (the same source lines: real traffic)."""

    def __init__(self, case: Case):
        super().__init__(case)
        self.in_flight: dict[int, list[Tensor]] = {}
        self.steps = 0

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        if batch.kind == "decode":
            self.steps += 1
            self.build_step(self.steps)

    def build_step(self, step: int) -> None:
        raise NotImplementedError


@mutant("mutant-07g-torch-failed-capture-keeps-step", catches=("capture_retryable", "no_post_kv_overrun"))
class KeepsFailedStepBuilder(_TracksStepsInFlight):
    """Bug 7g (issue 51, item 1, in the engine's capture): a step is tracked before it is built and untracked only
    once it is; a capture that runs out of memory at the log-sum-exp keeps the step's partial output in builder state,
    so its block stays in the engine's graph pool after the failed graph is reset, and every retry keeps one more."""

    def build_step(self, step: int) -> None:
        import torch

        self.in_flight[step] = [torch.empty(STEP_PARTIAL_BYTES, dtype=torch.uint8, device="cuda")]  # kept if
        self.in_flight[step].append(torch.empty(STEP_LSE_BYTES, dtype=torch.uint8, device="cuda"))  # this raises
        del self.in_flight[step]


class UntracksFailedStepBuilder(_TracksStepsInFlight):
    """Correct twin of 7g: a step is untracked whether it was built or raised, so a failed capture keeps nothing.

    Its step scratch is still fresh memory in capture, after KV sizing: the 2 MiB block it leaves cached in the graph
    pool is counted by no term of the budget (graph profiling builds nothing, as in vLLM). Where the KV cache's
    rounding leaves less than that under total x gmu (36 of the default matrix's 1812 cases: gemma-2-9b at TP 8,
    gmu 0.90 and 0.98), ``no_post_kv_overrun`` refuses it, and 7g, on those cases. Scratch from the arena avoids it."""

    def build_step(self, step: int) -> None:
        import torch

        self.in_flight[step] = [torch.empty(STEP_PARTIAL_BYTES, dtype=torch.uint8, device="cuda")]
        try:
            self.in_flight[step].append(torch.empty(STEP_LSE_BYTES, dtype=torch.uint8, device="cuda"))
        finally:
            del self.in_flight[step]


# -- item 9: an arena user that is not FlashInfer ----------------------------------------------------------------------
WARMUP_CONTINUATION_TOKENS = 16  # the continuation prefill its kernel warmup runs (the JIT compile's small batch)


class _ContinuationPrefill:
    """REQUIRED, and no FlashInfer: a quantized-KV attention builder (TurboQuant-like) whose continuation prefill
    dequantizes the context's K and V into scratch it takes from the shared arena (``ctx.get_workspace``), sized from
    the batch. Torch mode: its kernel writes the view with torch calls; no FlashInfer ``plan()`` is ever made, so no
    view of it is FlashInfer workspace."""

    name = "turboquant"
    torch_mode = True
    warmup_materializes_persistent = True  # its kernel warmup asks the arena for scratch

    def __init__(self, case: Case):
        self.case = case

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def scratch_bytes(self, num_tokens: int) -> int:
        """Dequantized K and V of ``num_tokens`` context tokens in fp16, per rank."""
        dim = self.case.model.kv_cache_head_dim or self.case.model.head_dim
        return num_tokens * self.case.heads.kv_cache_heads * dim * 2 * 2

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=0, int_bytes=0)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        return ctx.lease()

    def warmup(self, ctx: BuilderContext) -> None:
        for ub in range(ctx.num_ubatches):
            self._dequantize(ctx, self.scratch_bytes(WARMUP_CONTINUATION_TOKENS), ub)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        if batch.kind != "decode" and not ctx.dummy:  # a prefill continuing a request reads its quantized context
            self._dequantize(ctx, self.scratch_bytes(batch.num_tokens), batch.ubatch)

    @staticmethod
    def _dequantize(ctx: BuilderContext, nbytes: int, ubatch: int) -> None:
        view = ctx.get_workspace(nbytes, ubatch)
        if view.tensor is not None:
            view.tensor[:64].zero_()


@mutant("mutant-04e-torch-non-flashinfer-scratch-after-lock", catches=("arena_not_grown_after_lock",))
class LateContinuationScratchBuilder(_ContinuationPrefill):
    """Bug 4e (issue 51, item 9): declares no float workspace and asks the arena for its continuation-prefill scratch
    at the batch's size, so the first long continuation at serving asks the locked arena to grow; it catches the
    refusal and dequantizes in chunks of the arena it has (slower, and the growth it asked for is the bug)."""

    @staticmethod
    def _dequantize(ctx: BuilderContext, nbytes: int, ubatch: int) -> None:
        from pytest_kvprofile.contract.workspace import WorkspaceLockedError

        try:
            _ContinuationPrefill._dequantize(ctx, nbytes, ubatch)
        except WorkspaceLockedError:
            _ContinuationPrefill._dequantize(ctx, ctx.workspace.size(ubatch), ubatch)


class DeclaredContinuationScratchBuilder(_ContinuationPrefill):
    """Correct twin of 4e: declares its scratch for ``max_num_batched_tokens`` and asks that view of every
    micro-batch's arena in its reservation, before lock; no FlashInfer sizing applies to it."""

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=self.scratch_bytes(case.envelope.max_num_batched_tokens), int_bytes=0)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        views = [ctx.get_workspace(self.scratch_bytes(self.case.envelope.max_num_batched_tokens), ub)
                 for ub in range(ctx.num_ubatches)]
        return ctx.lease(views)


# -- item 2: persistent buffers made before the engine's instance snapshot ------------------------------------------
RUNNER_INIT_BUFFERS: dict[str, int] = {  # what a model runner's __init__ keeps: 36 MiB per GPU, as the report saw
    "inputs_embeds staging": 24 * MiB, "positions": 8 * MiB, "input_ids": 4 * MiB}


def fork_budget() -> InstanceSnapshotBudget:
    """Bug 10c (issue 51, item 2): a vLLM fork takes ``init_snapshot`` after it makes the model runner, so
    ``total_consumed`` starts after the runner's ``__init__`` buffers, and no other term counts them."""
    return InstanceSnapshotBudget("after_init", engine="a vLLM fork's memory_profiling")


def upstream_budget() -> InstanceSnapshotBudget:
    """Correct twin of 10c: upstream vLLM takes ``init_snapshot`` in ``init_device``, before the model runner."""
    return InstanceSnapshotBudget("before_instance")


FORK_POLICY = EnginePolicy(budget=fork_budget)
UPSTREAM_POLICY = EnginePolicy(budget=upstream_budget)


@mutant("mutant-10c-torch-runner-buffers-before-snapshot", policy=FORK_POLICY, catches=("budget_counts_every_byte",))
class RunnerInitBuffersBuilder(TorchFlashInferLikeBuilder):
    """The correct torch-mode stub, with a model runner's persistent buffers (``RUNNER_INIT_BUFFERS``, 36 MiB) made in
    its ``__init__`` and kept for the engine's life. Correct under an engine whose budget counts them."""

    def __init__(self, case: Case):
        import torch

        super().__init__(case)
        self.runner_buffers = {name: torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
                               for name, nbytes in RUNNER_INIT_BUFFERS.items()}


# -- item 3: a transient that meets the activations at serving size ------------------------------------------------
SCAN_BYTES_PER_TOKEN = 72 * KiB  # GDN/FLA's chunked-scan scratch per token, as the incident measured it
FLA_CHUNK_SIZE = 64  # vLLM's GDN warmup shape (third_party/flash_linear_attention/ops/utils.py:31)


class _ChunkedScanBuilder:
    """NEUTRAL, beside a FlashInfer builder (a hybrid model): its layers' chunked scan takes ``SCAN_BYTES_PER_TOKEN``
    per prefill token, made and given back in ``build()`` (the layer's forward, here); decode runs the recurrent
    kernel, with no scratch. Its ``dummy_run`` warms the scan beside the profile forward's activations, at
    ``profile_tokens`` tokens."""

    name = "gdn-scan"

    def __init__(self, case: Case):
        self.case = case

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.NEUTRAL

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=0, int_bytes=0)

    def profile_tokens(self) -> int:
        raise NotImplementedError

    def _scan(self, ctx: BuilderContext, tokens: int, ubatch: int = 0) -> None:
        scratch = ctx.allocate(tokens * SCAN_BYTES_PER_TOKEN, "chunked-scan scratch")
        ctx.free(scratch)

    def dummy_run(self, ctx: BuilderContext) -> None:
        if ctx.dummy and not ctx.capturing:
            self._scan(ctx, self.profile_tokens())

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        if batch.kind != "decode":
            self._scan(ctx, batch.num_tokens, batch.ubatch)


@mutant("mutant-08b-gdn-scan-warmed-at-64-tokens", extra=(FlashInferLikeBuilder,), catches=("no_post_kv_overrun",
        "transient_peak_profiled"))
class ScanWarmedAtChunkBuilder(_ChunkedScanBuilder):
    """Bug 8b (issue 51, item 3): warms the scan at T = 64 tokens, as vLLM's GDN layer does in the profile run
    (``_warmup_prefill_kernels``, ``T = FLA_CHUNK_SIZE``); serving scans ``max_num_batched_tokens``, whose scratch
    meets the activations beyond the peak KV sizing kept free."""

    def profile_tokens(self) -> int:
        return min(FLA_CHUNK_SIZE, self.case.envelope.max_num_batched_tokens)


class ScanWarmedAtServingShapeBuilder(_ChunkedScanBuilder):
    """Correct twin of 8b: warms the scan at the serving shape, ``max_num_batched_tokens`` tokens, so the profile
    run's peak holds the largest step's scratch beside its activations."""

    def profile_tokens(self) -> int:
        return self.case.envelope.max_num_batched_tokens


class ScanInReservedWorkspaceBuilder(_ChunkedScanBuilder):
    """Correct twin of 8b, the other way: the scan is carved from the reserved workspace. It declares the largest
    step's scratch as float bytes (the engine reserves the arena inside the window, so KV sizing counts it) and takes
    its scratch as a view of the micro-batch's arena; its dummy_run warms at 64 tokens, as 8b's does, in the arena."""

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=self.case.envelope.max_num_batched_tokens * SCAN_BYTES_PER_TOKEN,
                                    int_bytes=0)

    def profile_tokens(self) -> int:
        return min(FLA_CHUNK_SIZE, self.case.envelope.max_num_batched_tokens)

    def _scan(self, ctx: BuilderContext, tokens: int, ubatch: int = 0) -> None:
        ctx.plan_into(ctx.get_workspace(tokens * SCAN_BYTES_PER_TOKEN, ubatch))


def _hybrid(scan: type) -> Callable[[Case], list[Builder]]:
    """The scan builder beside a FlashInfer builder (the mutant's builder set, as the catalog's ``extra`` makes it)."""
    def make(case: Case) -> list[Builder]:
        return [scan(case), FlashInferLikeBuilder(case)]

    return make


def _twin(name: str, cls: type, policy: EnginePolicy | None = None) -> Backend:
    return Backend(name=name, make_builders=lambda case: [cls(case)], description=(cls.__doc__ or "").strip(),
                   origin="builtin", torch_mode=bool(getattr(cls, "torch_mode", False)),
                   policy=policy or EnginePolicy())


def _resource_twin(name: str, cls: type) -> Backend:
    """The FlashInfer-like stub beside a DMA output workspace of class ``cls`` (the case's parameters, else the
    defaults), as the catalog's resource mutants are made."""
    from pytest_kvprofile.builtin.resources import DEFAULT_PARAMS

    def resources(case: Case) -> list[Any]:  # Any: PersistentResource, a Protocol the resources satisfy
        carried = [dict(r.params) for r in case.resources if r.kind == "dma-output-workspace"]
        return [cls(case, carried[0] if carried else DEFAULT_PARAMS)]

    return Backend(name=name, make_builders=lambda case: [FlashInferLikeBuilder(case)], make_resources=resources,
                   description=(cls.__doc__ or "").strip(), origin="builtin")


FIELD_TWINS: tuple[Backend, ...] = (
    _twin("twin-07f-resets-failed-capture", ResetsFailedCaptureBuilder),
    _twin("twin-07g-untracks-failed-step", UntracksFailedStepBuilder),
    _twin("twin-16d-rebinds-after-growth", RebindsAfterGrowthBuilder),
    _twin("twin-14e-stops-its-thread", StoppedThreadBuilder),
    _twin("twin-14f-unregisters-its-handler", UnregisteredAtexitBuilder),
    _twin("twin-14g-drops-on-close", DropsOnCloseBuilder),
    _twin("twin-04e-declares-continuation-scratch", DeclaredContinuationScratchBuilder),
    _resource_twin("twin-13d-resource-warmed-in-window", WarmedInWindowDMAOutputWorkspace),
    _twin("twin-10c-torch-snapshot-before-runner", RunnerInitBuffersBuilder, UPSTREAM_POLICY),
    Backend(name="twin-08b-scan-warmed-at-serving-shape", make_builders=_hybrid(ScanWarmedAtServingShapeBuilder),
            description=(ScanWarmedAtServingShapeBuilder.__doc__ or "").strip(), origin="builtin"),
    Backend(name="twin-08b-scan-in-reserved-workspace", make_builders=_hybrid(ScanInReservedWorkspaceBuilder),
            description=(ScanInReservedWorkspaceBuilder.__doc__ or "").strip(), origin="builtin"),
)
"""The correct twin of each field mutant, by the mutant's id (``twin-<id>-...``)."""


def twins() -> list[Backend]:
    """The correct twins (``--kvprofile-backend pytest_kvprofile.builtin.mutants_field:twins``)."""
    return list(FIELD_TWINS)
