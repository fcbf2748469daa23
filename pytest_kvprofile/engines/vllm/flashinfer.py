"""The built-in ``vllm-flashinfer`` and ``vllm-flashinfer-v2`` backends: vLLM's own, unmodified
``FlashInferMetadataBuilder`` driven through the lifecycle on the simulated GPU.

Why: the stubs and the ``flashinfer`` backend model an engine; these run the engine's released builder, so
the lifecycle measures what vLLM really allocates and when. How vLLM's runners integrate the builder:

- V1 (``vllm-flashinfer``): one builder per micro-batch, created with the KV cache (after KV sizing); each
  creates its own float workspace lazily in ``_get_workspace_buffer()`` on the first wrapper it needs.
- V2 (``vllm-flashinfer-v2``): the same builders, but the first one's workspace is created eagerly when the
  builders are made and handed to the others with ``set_workspace_buffer`` (one shared float workspace).

In both, every FlashInfer wrapper (prefill, decode, one CUDA-graph decode wrapper per captured size) is made
inside ``build()``. The harness's phases map onto vLLM's calls: ``rebind`` (the first call after KV sizing)
is where the runner creates its builders; capture and serving batches go through ``build()`` with a real
``CommonAttentionMetadata`` (decode batches padded to the captured size as the runner pads them); nothing of
vLLM's runs in the profiling window, as in every released vLLM.

Where the installed vLLM's builder class declares profiling-time reservation (the contract's names or the
open pull request's, :func:`reservation_api`), the adapter maps them onto the harness protocol and the model
takes the reservation path; otherwise the adapter declares nothing and the model stays on the legacy path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

from pytest_kvprofile.attention.facts import FLASHINFER_INT_WORKSPACE_BYTES
from pytest_kvprofile.contract.backends import Backend, EnginePolicy, KvSizingMode
from pytest_kvprofile.contract.protocol import Batch, BuilderContext, WorkspaceDeclaration
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.engines.adapter import (
    EngineAdapter,
    EngineBuildError,
    ReservingAdapter,
    device_active,
    engine_backend,
)
from pytest_kvprofile.engines.batches import (
    RunnerBatch,
    capture_batches,
    mixed_warmup_batch,
    pad_to_capture,
    pages_per_request,
    runner_batch,
)
from pytest_kvprofile.engines.contract_api import (
    CONTRACT_DECLARATION,
    CONTRACT_RESERVATION,
    ReservationApi,
    find_revision,
    map_support,
)
from pytest_kvprofile.engines.vllm.config import (
    UnexpressibleCase,
    check_expressible,
    kv_cache_spec,
    kv_sizing_mode,
    layer_names,
    make_vllm_config,
    resolve_cudagraph_mode,
    resolve_kv_cache_layout,
    standin_layers,
)
from pytest_kvprofile.engines.vllm.memory import vllm_budget
from pytest_kvprofile.engines.vllm.release import EXTENSIBLE, has_v1_runner, vllm_provenance
from pytest_kvprofile.engines.vllm.selector import backend_class_of, selector_refusal
from pytest_kvprofile.engines.vllm.standins import (
    _BACKEND_MODULE,
    VLLM_INSTALL_HINT,
    import_vllm_flashinfer,
    vllm_standins,
)
from pytest_kvprofile.engines.vllm.workspace import recording_manager

if TYPE_CHECKING:
    from types import ModuleType

    import torch
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.protocol import Builder, BuilderContext
    from pytest_kvprofile.engines.adapter import BuilderKey, EngineObject
    from pytest_kvprofile.matrix.cases import Case

__all__ = ["DECLARATION_NAMES", "REVISIONS", "TRI_STATE", "TWO_PASS", "VLLM_BACKENDS", "VLLM_POLICY",
           "ExtensibleVllmAdapter", "ReservationApi",
           "ReservingVllmBuilder",
           "VllmAdapter", "VllmBuildError", "VllmFlashInferBuilder", "VllmFlashInferV2Builder", "engine_refusal",
           "make_vllm_builders", "map_support", "reservation_api", "speculative_gate"]

TRI_STATE = ReservationApi(
    CONTRACT_DECLARATION, "reserve_workspace_for_memory_profiling", "rebind_workspace_after_reservation", ((),),
    revision="vLLM pull request, tri-state API (get_persistent_workspace_memory_profiling_support / "
             "reserve_workspace_for_memory_profiling)",
    capture_reservation="reserve_workspace_for_cudagraph_capture")
TWO_PASS = ReservationApi(
    "persistent_workspace_profiling_support", "prepare_workspace_for_profiling", None, ((False,), (True,)),
    revision="vLLM pull request, two-pass API (persistent_workspace_profiling_support / "
             "prepare_workspace_for_profiling)")
HARNESS_NAMES = ReservationApi(CONTRACT_DECLARATION, CONTRACT_RESERVATION, "rebind_workspace_after_reservation",
                               ((),), revision="the contract's own names (get_persistent_workspace_memory_profiling_"
                                               "support / reserve_persistent_workspace)")
REVISIONS = (TRI_STATE, TWO_PASS, HARNESS_NAMES)
"""Every revision of the reservation API a vLLM builder class may carry, in the order the adapter looks for them, each
named by its methods (which revision is newer is not known; docs/vllm.md)."""
DECLARATION_NAMES = tuple(dict.fromkeys(r.declaration for r in REVISIONS))


def reservation_api(builder_cls: type, case: Case | None = None) -> ReservationApi | None:
    """The revision of the pull request's API ``builder_cls`` carries, or None (every released vLLM): then the
    adapter declares nothing. A class that looks taught but cannot be driven raises ``UnusableContract``
    (``engines/adapter.py``, :func:`find_revision`); its REQUIRED declaration is asked on ``case``."""
    def declared(name: str) -> object:
        if case is None:
            return None
        with vllm_standins(case.gpu, dcp=case.dcp, ranks=case.tp):
            return getattr(builder_cls, name)(make_vllm_config(case), kv_cache_spec(case))

    return find_revision(builder_cls, REVISIONS, "vLLM builder class", declared)


def speculative_gate(case: Case) -> str | None:
    """vLLM's runner takes the profiling path only without speculative decoding and elastic EP
    (``requires_persistent_attention_workspace_profiling``): an MTP case is a legacy-path case."""
    if case.mtp:
        return (f"speculative decoding (MTP, {case.mtp} speculative token(s)) keeps vLLM's runner on the legacy path "
                "(requires_persistent_attention_workspace_profiling)")
    return None


def vllm_kv_sizing(case: Case) -> KvSizingMode:
    """Where the installed vLLM sizes the KV cache on ``case`` (``engines/vllm/release.py``); a layout vLLM rejects
    is never run, so its mode is the profile window's."""
    try:
        return kv_sizing_mode(case)
    except UnexpressibleCase as exc:
        return KvSizingMode("profile window", "profile", str(exc))


VLLM_POLICY = EnginePolicy(workspace_manager="vllm", manager_factory=recording_manager, gate=speculative_gate,
                           kv_sizing_for=vllm_kv_sizing, budget=vllm_budget)
"""How vLLM's runner integrates its builders: vLLM's own WorkspaceManager as the arena (the pull request's builder
reserves nothing without it), its runner's gate, the sizing point of the installed release on each case, and vLLM's
own KV budget arithmetic (``memory_profiling`` from its ``init_device`` snapshot), which ``budget_counts_every_byte``
reads against the ledger."""


class VllmBuildError(EngineBuildError):
    """vLLM's ``build()`` failed on a batch; the message names the case, the batch and vLLM's own error (for
    example a route the simulated device does not serve, such as DCP prefill's CUTLASS FMHA on SM100)."""


class VllmAdapter(EngineAdapter):
    """What every vLLM builder's adapter shares: vLLM's stand-ins around each call, ``set_current_vllm_config``
    around the builders' calls, the builders' ``(kv_cache_spec, layer_names, vllm_config, device)`` constructor
    and ``build_for_cudagraph_capture``/``build(common_prefix_len=0, ...)``."""

    build_error = VllmBuildError

    @property
    def vllm_config(self) -> EngineObject:
        return self.engine_config

    def standins(self) -> ContextManager[ModuleType]:
        return vllm_standins(self.case.gpu, dcp=self.case.dcp, ranks=self.case.tp)

    def make_engine_config(self) -> VllmConfig:
        return make_vllm_config(self.case)

    def engine_scope(self) -> ContextManager[ModuleType]:
        return self._scope()

    @contextlib.contextmanager
    def _scope(self, *more: Callable[[], ContextManager[object]]) -> Iterator[ModuleType]:
        """The stand-ins, then ``more``, then the config (made inside them) current; yields vLLM's FlashInfer
        backend module."""
        from vllm.config import set_current_vllm_config

        with contextlib.ExitStack() as stack:
            module = stack.enter_context(self.standins())
            for make in more:
                stack.enter_context(make())
            stack.enter_context(set_current_vllm_config(self.config()))
            yield module

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        """vLLM's runner builds every micro-batch's metadata on its main thread, outside the DBO threads: vLLM code
        that reaches the manager by itself there resolves micro-batch 0's slot, as in vLLM."""
        with self._in_ubatch(ctx, 0):
            super().build(ctx, batch)

    def build_for_capture(self, builder: EngineObject, metadata: EngineObject) -> EngineObject:
        return builder.build_for_cudagraph_capture(metadata)

    def build_serving(self, builder: EngineObject, metadata: EngineObject) -> EngineObject:
        return builder.build(common_prefix_len=0, common_attn_metadata=metadata)


class VllmFlashInferBuilder(VllmAdapter):
    """vLLM's ``FlashInferMetadataBuilder`` as the V1 runner integrates it: builders made with the KV cache,
    each with its own lazily created float workspace. Declares nothing (UNSUPPORTED)."""

    name = "vllm-flashinfer"
    builder_label = "vLLM's FlashInferMetadataBuilder"
    shares_workspace = False

    def __init__(self, case: Case, builder_cls: type | None = None) -> None:
        check_expressible(case)
        super().__init__(case, builder_cls)
        self.inputs: Any = None  # Any: RunnerInputs, made before any build reads it (None until then)
        if device_active():
            self._make_inputs()

    def _make_inputs(self) -> None:
        """The runner's input buffers exist from the runner's construction (before profiling) when a device is
        there; otherwise (configure-time inspection) from the first call."""
        with self.standins():
            self.inputs = RunnerInputs(self.case, self.config())

    # -- vLLM's objects ----------------------------------------------------------------------------
    def _cls(self, module: ModuleType) -> type:
        return self.builder_cls or module.FlashInferMetadataBuilder

    def make_engine_config(self) -> VllmConfig:
        config = make_vllm_config(self.case)
        resolve_kv_cache_layout(self.case, config)
        standin_layers(self.case, config)
        resolve_cudagraph_mode(self.case, config, self._cls(import_vllm_flashinfer()))
        return config

    def captures_attention(self) -> bool:
        """Whether the runner captures full decode graphs (attention inside them) on this layout."""
        from vllm.config import CUDAGraphMode

        return bool(self.config().compilation_config.cudagraph_mode.decode_mode() == CUDAGraphMode.FULL)

    def make_engine_builder(self, key: BuilderKey) -> EngineObject:
        import torch

        return self._cls(import_vllm_flashinfer())(kv_cache_spec(self.case), layer_names(self.case), self.config(),
                                                   torch.device("cuda"))

    def make_engine_builders(self, num_ubatches: int) -> list[EngineObject]:
        """One vLLM builder per micro-batch (as the runners make them); returns the new ones."""
        made = super().make_engine_builders(num_ubatches)
        self.ensure_inputs()
        return made

    def after_make(self, made: list[EngineObject]) -> None:
        """V1: nothing; the float workspace appears on each builder's first wrapper."""

    def ensure_inputs(self) -> None:
        if self.inputs is None:
            self._make_inputs()

    def engine_metadata(self, batch: Batch) -> EngineObject:
        """vLLM's ``CommonAttentionMetadata`` of the batch, with the runner's padding of decode batches."""
        return self.inputs.metadata(self.inputs.padded(batch))

    def after_build(self, batch: Batch) -> None:
        _role_trtllm_workspace()

    def warmup(self, ctx: BuilderContext) -> None:
        """vLLM's ``kernel_warmup`` before ``capture_model()`` locks the arena (docs/vllm.md, "Kernel warmup")."""
        self.kernel_warmup(ctx)

    def kernel_warmup_metadata(self) -> EngineObject:
        """The V1 runner's FlashInfer warmup batch (``mixed_batch_attention_warmup``: ``_dummy_run(16,
        create_mixed_batch=True)``), eager."""
        return self.inputs.metadata_of(mixed_warmup_batch(self.case))

    def wrappers(self) -> Iterator[tuple[int, str, object]]:
        """Every FlashInfer wrapper vLLM's builders hold: (ubatch, role, wrapper)."""
        for ub, b in sorted(self.builders.items()):
            for role, attr in (("prefill", "_prefill_wrapper"), ("decode", "_decode_wrapper")):
                if getattr(b, attr, None) is not None:
                    yield ub, role, getattr(b, attr)
            for key, w in sorted(getattr(b, "_decode_wrappers_cudagraph", {}).items()):
                yield ub, f"cuda-graph decode {key}", w

    def close(self) -> None:
        super().close()
        self.inputs = None


class VllmFlashInferV2Builder(VllmFlashInferBuilder):
    """The V2 runner's integration: the first builder's float workspace is made eagerly with the builders and
    shared with the others through ``set_workspace_buffer``. Declares nothing (UNSUPPORTED)."""

    name = "vllm-flashinfer-v2"
    shares_workspace = True

    def kernel_warmup_metadata(self) -> EngineObject:
        """The V2 runner's mixed warmup step (``run_mixed_prefill_decode_warmup``): one decode of a 2-token prompt and
        one prefill of the other 15 tokens; none below 2 requests or 3 tokens."""
        env = self.case.envelope
        n = min(16, env.max_num_batched_tokens, env.max_model_len)
        if env.max_num_seqs < 2 or n < 3:
            return None
        return self.inputs.metadata_of(RunnerBatch((1, n - 1), (3, n - 1), pages_per_request(self.case)))

    def after_make(self, made: list[EngineObject]) -> None:
        first = self.builders[min(self.builders)]
        workspace = first._get_workspace_buffer()
        for b in made:
            if b is not first:
                b.set_workspace_buffer(workspace)


class ExtensibleVllmAdapter(VllmFlashInferV2Builder):
    """vLLM 0.34's default (the extensible KV cache): the V2 runner makes its builders with a KV cache that has no
    size yet, runs kernel warmup (``warmup_kernels``: a prefill step, then decode steps, of every request the
    warmup may take), the sizing warmup (``run_kv_cache_sizing_warmup``: one mixed step of the whole token budget)
    and CUDA-graph capture, and only then measures the KV cache (``measure_kv_cache_blocks``), keeping the profiled
    activation peak free. So the harness's profiling window holds all of it and its closing measurement is vLLM's:
    memory made there is seen by the sizing; memory made on a serving step is not, and nothing reserves it.

    The declaration is the engine's (its runner puts the builders, their warmup and their graphs before the
    sizing point), as for SGLang's post-capture path: REQUIRED. After the sizing point vLLM makes and captures
    nothing again: the harness's rebind and capture find the builders and graphs made, its serving steps are
    vLLM's ``build()``."""

    def __init__(self, case: Case, builder_cls: type | None = None) -> None:
        super().__init__(case, builder_cls)
        self.measured = False  # the window made, warmed and captured the builders

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        """vLLM's builders own their float workspace (measured where it is planned into); each wrapper has
        FlashInfer's default int workspace."""
        return WorkspaceDeclaration(float_bytes=0, int_bytes=FLASHINFER_INT_WORKSPACE_BYTES)

    def warmup_batches(self) -> list[Batch]:
        """vLLM 0.34's steps before its sizing point, in its order: ``warmup_kernels``' prefill step (each request one
        token longer than a decode query, so it is not taken for a decode) and its decode step, the sizing warmup's
        mixed step of the whole token budget (one decode request verifying its drafts beside the prefill), then every
        captured decode step, largest first."""
        env, q = self.case.envelope, 1 + self.case.mtp
        reqs = max(1, min(env.max_num_seqs, env.max_num_batched_tokens // (q + 1)))
        prefill_reqs = -(-(env.max_num_batched_tokens - q) // max(1, env.max_model_len - 1))
        mixed = (Batch("mixed", prefill_reqs + 1, env.max_num_batched_tokens) if env.max_num_seqs >= 2 else
                 Batch("prefill", prefill_reqs, env.max_num_batched_tokens))
        captured = capture_batches(self.case) if self.captures_attention() else []
        return [Batch("prefill", reqs, reqs * (q + 1)), Batch("decode", reqs, reqs * q), mixed, *captured]

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        """The runner's builders, their warmup steps and their graphs, in vLLM's order, before the sizing point; the
        runner keeps the builders (the lease holds them too, until the closing measurement). All or nothing: a
        failure drops the builders it made (vLLM's start-up would end there)."""
        try:
            self.make_engine_builders(ctx.num_ubatches)
            for batch in self.warmup_batches():
                for ub in range(ctx.num_ubatches):
                    self.build(ctx, dataclasses.replace(batch, ubatch=ub))
        except BaseException:
            self.builders.clear()
            self.last_metadata = None
            raise
        self.measured = True
        return ctx.lease(list(self.builders.values()))

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        """After the sizing point vLLM captures nothing again: the harness's capture replays the graphs the window
        captured."""
        if ctx.capturing and self.measured:
            return
        super().build(ctx, batch)


class ReservingVllmBuilder(ReservingAdapter, VllmFlashInferBuilder):
    """A vLLM builder class that declares profiling-time reservation, mapped onto the harness protocol: the
    declaration is vLLM's classmethod on the case's config and KV spec; ``reserve_persistent_workspace`` makes
    the builders inside the window and runs vLLM's reservation; the lease keeps them alive."""

    def __init__(self, case: Case, builder_cls: type, api: ReservationApi) -> None:
        super().__init__(case, builder_cls)
        self.api = api

    def declaration_args(self) -> tuple[object, ...]:
        return self.config(), kv_cache_spec(self.case)

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        """vLLM's builders own their float workspace; the int workspace is FlashInfer's default per wrapper."""
        return WorkspaceDeclaration(float_bytes=0, int_bytes=FLASHINFER_INT_WORKSPACE_BYTES)


def _role_trtllm_workspace() -> None:
    """vLLM's process-wide trtllm-gen workspace (a module global its builders make on first use) gets its role:
    FlashInfer's wrappers give theirs in torch mode, this one no wrapper takes."""
    from pytest_kvprofile.memory.torch_mode import assign_role

    module = sys.modules.get(_BACKEND_MODULE)
    assign_role(getattr(module, "trtllm_workspace_buffer", None), Role.TRTLLM_WORKSPACE)


class RunnerInputs:
    """The model runner's persistent input buffers (vLLM's ``CpuGpuBuffer``), sized for the envelope, and the
    ``CommonAttentionMetadata`` of one harness batch built on them (the batch's layout: ``engines/batches.py``).

    The capture sizes are vLLM's (its config may adjust the case's); decode batches are padded to them.
    """

    def __init__(self, case: Case, vllm_config: VllmConfig) -> None:
        from vllm.v1.utils import CpuGpuBuffer

        env = case.envelope
        self.case = case
        self.max_reqs = env.max_num_seqs
        self.pages_per_req = pages_per_request(case)
        self.capture_sizes = sorted(vllm_config.compilation_config.cudagraph_capture_sizes or [])
        # Any: vLLM annotates CpuGpuBuffer's device as torch.device; the runtime value stays the string "cuda"
        # (torch takes either; the simulated device sees exactly what the harness always passed)
        dev: Any = "cuda"
        self.query_start_loc = CpuGpuBuffer(self.max_reqs + 1, dtype=_int32(), device=dev, pin_memory=False)
        self.seq_lens = CpuGpuBuffer(self.max_reqs, dtype=_int32(), device=dev, pin_memory=False)
        self.block_table = CpuGpuBuffer(self.max_reqs, self.pages_per_req, dtype=_int32(), device=dev,
                                        pin_memory=False)
        self.slot_mapping = CpuGpuBuffer(env.max_num_batched_tokens, dtype=_int64(), device=dev, pin_memory=False)
        import torch

        # batches.block_table(pages_per_req, max_reqs), filled at once
        self.block_table.cpu.copy_(torch.arange(self.max_reqs * self.pages_per_req, dtype=torch.int32)
                                   .view(self.max_reqs, self.pages_per_req))
        self.block_table.copy_to_gpu()

    def padded(self, batch: Batch) -> Batch:
        """A pure decode batch within the captured sizes, padded to the next one (tokens), as the runner does."""
        return pad_to_capture(batch, self.capture_sizes, self.case.mtp)

    def query_lens(self, batch: Batch) -> list[int]:
        return list(runner_batch(self.case, batch, self.max_reqs).query_lens)

    def metadata(self, batch: Batch) -> CommonAttentionMetadata:
        return self.metadata_of(runner_batch(self.case, batch, self.max_reqs))

    def metadata_of(self, rb: RunnerBatch) -> CommonAttentionMetadata:
        import numpy as np
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n, tokens = rb.num_reqs, rb.num_tokens
        self.query_start_loc.np[:n + 1] = rb.query_start_loc
        self.seq_lens.np[:n] = rb.seq_lens
        self.slot_mapping.np[:tokens] = np.arange(tokens)
        # Any: tensors, ints and a bool, passed by name to whichever fields this vLLM's dataclass has
        values: dict[str, Any] = {
            "query_start_loc": self.query_start_loc.copy_to_gpu(n + 1),
            "query_start_loc_cpu": self.query_start_loc.cpu[:n + 1],
            "seq_lens": self.seq_lens.copy_to_gpu(n),
            "seq_lens_cpu": self.seq_lens.cpu[:n],
            "seq_lens_cpu_upper_bound": self.seq_lens.cpu[:n],
            "num_computed_tokens_cpu": self.seq_lens.cpu[:n] - self.query_start_loc.cpu[1:n + 1].diff(
                prepend=self.query_start_loc.cpu[:1]),
            "num_reqs": n,
            "num_actual_tokens": tokens,
            "max_query_len": rb.max_query_len,
            "max_seq_len": rb.max_seq_len,
            "block_table_tensor": self.block_table.gpu[:n],
            "slot_mapping": self.slot_mapping.copy_to_gpu(tokens),
            "causal": True,
        }
        fields = {f.name: f for f in dataclasses.fields(CommonAttentionMetadata)}
        missing = [name for name, f in fields.items() if name not in values and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise TypeError(f"this vLLM's CommonAttentionMetadata requires fields the adapter does not fill: {missing}")
        return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in fields})


def _int32() -> torch.dtype:
    import torch

    return torch.int32


def _int64() -> torch.dtype:
    import torch

    return torch.int64


def make_vllm_builders(case: Case, v2: bool = False, builder_cls: type | None = None) -> list[Builder]:
    """The adapter for ``case``, as the installed vLLM runs it. Where vLLM sizes the KV cache after warmup and capture
    (0.34's extensible KV cache), the V2 runner with that sizing point, whatever the builder class declares (no
    released vLLM runs the pull request's reservation there); else a reserving one when the builder class declares
    reservation; else the V1 or V2 integration that declares nothing (V2 where the installed vLLM has no V1 runner).
    Imports vLLM (with the stand-in platform current)."""
    check_expressible(case)
    cls = builder_cls or import_vllm_flashinfer().FlashInferMetadataBuilder
    if vllm_kv_sizing(case).name == EXTENSIBLE:
        return [ExtensibleVllmAdapter(case, builder_cls)]
    api = reservation_api(cls, case)
    if api is not None:
        return [ReservingVllmBuilder(case, cls, api)]
    v1 = not v2 and has_v1_runner()
    return [(VllmFlashInferBuilder if v1 else VllmFlashInferV2Builder)(case, builder_cls)]


def _make_v1(case: Case) -> list[Builder]:
    return make_vllm_builders(case)


def _make_v2(case: Case) -> list[Builder]:
    return make_vllm_builders(case, v2=True)


def engine_refusal(case: Case, builder_cls: type | None = None) -> str | None:
    """Why vLLM (or this adapter, for MLA and other layouts ``FlashInferMetadataBuilder`` does not serve) refuses
    ``case``, from vLLM's own config validation on the stand-in platform, then from the attention selector's questions
    to the backend class of the builder driven (``builder_cls``, the installed module's by default;
    ``engines/vllm/selector.py``); None when it accepts the layout."""
    try:
        check_expressible(case)
        with vllm_standins(case.gpu, dcp=case.dcp, ranks=case.tp) as module:
            make_vllm_config(case)
            return selector_refusal(case, backend_class_of(builder_cls or module.FlashInferMetadataBuilder))
    except UnexpressibleCase as exc:
        return str(exc)


VLLM_BACKENDS: tuple[Backend, ...] = (
    engine_backend("vllm-flashinfer", _make_v1, engine="vllm", install_hint=VLLM_INSTALL_HINT, origin="builtin",
                   refuses_layout=engine_refusal, policy=VLLM_POLICY, provenance=vllm_provenance("vllm-flashinfer"),
                   description="vLLM's own FlashInferMetadataBuilder (V1 runner: per-builder lazy float workspace; "
                               "the V2 runner where the installed vLLM has no V1, from 0.34), unmodified, on the "
                               "simulated GPU, sized where the installed vLLM sizes KV"),
    engine_backend("vllm-flashinfer-v2", _make_v2, engine="vllm", install_hint=VLLM_INSTALL_HINT, origin="builtin",
                   refuses_layout=engine_refusal, policy=VLLM_POLICY, provenance=vllm_provenance("vllm-flashinfer-v2"),
                   description="vLLM's own FlashInferMetadataBuilder (V2 runner: one eager float workspace shared "
                               "with set_workspace_buffer), unmodified, on the simulated GPU, sized where the "
                               "installed vLLM sizes KV"),
)
