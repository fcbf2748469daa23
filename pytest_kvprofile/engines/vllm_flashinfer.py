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

import dataclasses
import math
import sys
from typing import Any, Iterator

from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.contract.protocol import (
    Batch,
    BuilderContext,
    WorkspaceDeclaration,
)
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.engines.vllm_config import (
    UnexpressibleCase,
    check_expressible,
    kv_cache_spec,
    layer_names,
    make_vllm_config,
    resolve_kv_cache_layout,
    standin_layers,
)
from pytest_kvprofile.engines.vllm_standins import (
    _BACKEND_MODULE,
    VLLM_INSTALL_HINT,
    import_vllm_flashinfer,
    vllm_standins,
)
from pytest_kvprofile.sizing.facts import FLASHINFER_INT_WORKSPACE_BYTES

__all__ = ["DECLARATION_NAMES", "RESERVATION_NAMES", "VLLM_BACKENDS", "ReservationApi", "ReservingVllmBuilder",
           "VllmBuildError", "VllmFlashInferBuilder", "VllmFlashInferV2Builder", "engine_refusal", "make_vllm_builders",
           "reservation_api"]

DECLARATION_NAMES = ("get_persistent_workspace_memory_profiling_support",  # the contract's
                     "persistent_workspace_profiling_support")  # the pull request's earlier name
RESERVATION_NAMES = ("reserve_persistent_workspace", "prepare_workspace_for_profiling")


@dataclasses.dataclass(frozen=True)
class ReservationApi:
    """The names one vLLM builder class carries for profiling-time reservation."""

    declaration: str
    reservation: str
    rebind: str | None  # re-attach after the reservation (the pull request's rebind_workspace_after_reservation)


def reservation_api(builder_cls: type) -> ReservationApi | None:
    """What ``builder_cls`` declares, or None (every released vLLM): then the adapter declares nothing."""
    declaration = next((n for n in DECLARATION_NAMES if callable(getattr(builder_cls, n, None))), None)
    reservation = next((n for n in RESERVATION_NAMES if callable(getattr(builder_cls, n, None))), None)
    if declaration is None or reservation is None:
        return None
    rebind = "rebind_workspace_after_reservation"
    return ReservationApi(declaration, reservation, rebind if callable(getattr(builder_cls, rebind, None)) else None)


def map_support(answer: Any) -> Any:
    """vLLM's answer as a ProfilingSupport: an enum member by name, or the pull request's ``True`` (REQUIRED),
    ``False`` (NEUTRAL), ``None`` (UNSUPPORTED). Anything else is passed through for the harness to reject."""
    name = getattr(answer, "name", None)
    if isinstance(name, str) and name in ProfilingSupport.__members__:
        return ProfilingSupport[name]
    if answer is True:
        return ProfilingSupport.REQUIRED
    if answer is False:
        return ProfilingSupport.NEUTRAL
    if answer is None:
        return ProfilingSupport.UNSUPPORTED
    return answer


class VllmBuildError(RuntimeError):
    """vLLM's ``build()`` failed on a batch; the message names the case, the batch and vLLM's own error (for
    example a route the simulated device does not serve, such as DCP prefill's CUTLASS FMHA on SM100)."""


class VllmFlashInferBuilder:
    """vLLM's ``FlashInferMetadataBuilder`` as the V1 runner integrates it: builders made with the KV cache,
    each with its own lazily created float workspace. Declares nothing (UNSUPPORTED)."""

    name = "vllm-flashinfer"
    torch_mode = True
    shares_workspace = False

    def __init__(self, case: Any, builder_cls: type | None = None) -> None:
        check_expressible(case)
        self.case = case
        self.builder_cls = builder_cls
        self.vllm_config: Any = None
        self.builders: dict[int, Any] = {}
        self.inputs: Any = None
        self.built: dict[str, int] = {}  # batches built per route, for reports and tests
        self.last_metadata: Any = None  # what vLLM's last build() returned (its routes: native or trtllm-gen)
        if _device_active():
            self._make_inputs()

    def _make_inputs(self) -> None:
        """The runner's input buffers exist from the runner's construction (before profiling) when a device is
        there; otherwise (configure-time inspection) from the first call."""
        with self._standins():
            self.inputs = RunnerInputs(self.case, self._config())

    # -- vLLM's objects ----------------------------------------------------------------------------
    def _standins(self) -> Any:
        return vllm_standins(self.case.gpu, dcp=self.case.dcp, ranks=self.case.tp)

    def _cls(self, module: Any) -> type:
        return self.builder_cls or module.FlashInferMetadataBuilder

    def _config(self) -> Any:
        if self.vllm_config is None:
            config = make_vllm_config(self.case)
            resolve_kv_cache_layout(self.case, config)
            standin_layers(self.case, config)
            self.vllm_config = config
        return self.vllm_config

    def _make_builders(self, num_ubatches: int) -> list[Any]:
        """One vLLM builder per micro-batch (as the runners make them); returns the new ones."""
        import torch
        from vllm.config import set_current_vllm_config

        made = []
        with self._standins() as module:
            config = self._config()
            with set_current_vllm_config(config):
                for ub in range(num_ubatches):
                    if ub not in self.builders:
                        self.builders[ub] = self._cls(module)(kv_cache_spec(self.case), layer_names(self.case), config,
                                                              torch.device("cuda"))
                        made.append(self.builders[ub])
                self._after_make(made)
        if self.inputs is None:
            self._make_inputs()
        return made

    def _after_make(self, made: list[Any]) -> None:
        """V1: nothing; the float workspace appears on each builder's first wrapper."""

    # -- the protocol --------------------------------------------------------------------------------
    def rebind(self, ctx: BuilderContext) -> None:
        """The runner's ``initialize_kv_cache``: the builders are made now, after KV sizing."""
        self._make_builders(ctx.num_ubatches)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        """vLLM's ``build()`` on the batch's micro-batch builder, with the runner's padding of decode batches."""
        from vllm.config import set_current_vllm_config

        if batch.ubatch not in self.builders:
            self._make_builders(ctx.num_ubatches)
        builder = self.builders[batch.ubatch]
        with self._standins(), set_current_vllm_config(self.vllm_config):
            metadata = self.inputs.metadata(self.inputs.padded(batch))
            try:
                if batch.cuda_graph and batch.kind == "decode":  # vLLM captures full graphs of uniform decode only
                    self.last_metadata = builder.build_for_cudagraph_capture(metadata)
                else:
                    self.last_metadata = builder.build(common_prefix_len=0, common_attn_metadata=metadata)
            except Exception as exc:  # noqa: BLE001 - named with the case and batch; the driver records it
                raise VllmBuildError(f"case {self.case.id}: vLLM's FlashInferMetadataBuilder.build() of {batch.label} "
                                     f"(ubatch {batch.ubatch}) failed on the simulated {self.case.gpu.name}: "
                                     f"{type(exc).__name__}: {exc}") from exc
        self.built[batch.kind] = self.built.get(batch.kind, 0) + 1
        _role_trtllm_workspace()

    def wrappers(self) -> Iterator[tuple[int, str, Any]]:
        """Every FlashInfer wrapper vLLM's builders hold: (ubatch, role, wrapper)."""
        for ub, b in sorted(self.builders.items()):
            for role, attr in (("prefill", "_prefill_wrapper"), ("decode", "_decode_wrapper")):
                if getattr(b, attr, None) is not None:
                    yield ub, role, getattr(b, attr)
            for key, w in sorted(getattr(b, "_decode_wrappers_cudagraph", {}).items()):
                yield ub, f"cuda-graph decode {key}", w

    def close(self) -> None:
        self.builders.clear()
        self.inputs = None
        self.last_metadata = None


class VllmFlashInferV2Builder(VllmFlashInferBuilder):
    """The V2 runner's integration: the first builder's float workspace is made eagerly with the builders and
    shared with the others through ``set_workspace_buffer``. Declares nothing (UNSUPPORTED)."""

    name = "vllm-flashinfer-v2"
    shares_workspace = True

    def _after_make(self, made: list[Any]) -> None:
        first = self.builders[min(self.builders)]
        workspace = first._get_workspace_buffer()
        for b in made:
            if b is not first:
                b.set_workspace_buffer(workspace)


class ReservingVllmBuilder(VllmFlashInferBuilder):
    """A vLLM builder class that declares profiling-time reservation, mapped onto the harness protocol: the
    declaration is vLLM's classmethod on the case's config and KV spec; ``reserve_persistent_workspace`` makes
    the builders inside the window and runs vLLM's reservation; the lease keeps them alive."""

    api: ReservationApi

    def __init__(self, case: Any, builder_cls: type, api: ReservationApi) -> None:
        super().__init__(case, builder_cls)
        self.api = api

    def get_persistent_workspace_memory_profiling_support(self) -> Any:
        with self._standins():
            declare = getattr(self.builder_cls, self.api.declaration)
            return map_support(declare(self._config(), kv_cache_spec(self.case)))

    def declared_workspace(self, case: Any) -> WorkspaceDeclaration:
        """vLLM's builders own their float workspace; the int workspace is FlashInfer's default per wrapper."""
        return WorkspaceDeclaration(float_bytes=0, int_bytes=FLASHINFER_INT_WORKSPACE_BYTES)

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        from vllm.config import set_current_vllm_config

        self._make_builders(ctx.num_ubatches)
        with self._standins(), set_current_vllm_config(self.vllm_config):
            for b in self.builders.values():
                method = getattr(b, self.api.reservation)
                if self.api.reservation == "prepare_workspace_for_profiling":
                    method(False)  # reserve the shared arena
                    method(True)  # materialize wrappers and their int workspaces
                else:
                    method()
        return ctx.lease(list(self.builders.values()))

    def rebind(self, ctx: BuilderContext) -> None:
        self._make_builders(ctx.num_ubatches)
        if self.api.rebind is not None:
            with self._standins(), _current_config(self.vllm_config):
                for b in self.builders.values():
                    getattr(b, self.api.rebind)()


def _role_trtllm_workspace() -> None:
    """vLLM's process-wide trtllm-gen workspace (a module global its builders make on first use) gets its role:
    FlashInfer's wrappers give theirs in torch mode, this one no wrapper takes."""
    from pytest_kvprofile.memory.torch_mode import assign_role

    module = sys.modules.get(_BACKEND_MODULE)
    assign_role(getattr(module, "trtllm_workspace_buffer", None), Role.TRTLLM_WORKSPACE)


def _current_config(config: Any) -> Any:
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(config)


class RunnerInputs:
    """The model runner's persistent input buffers (vLLM's ``CpuGpuBuffer``), sized for the envelope, and the
    ``CommonAttentionMetadata`` of one harness batch built on them.

    A batch's requests all sit at the envelope's full context (the most split-KV work a plan can see);
    decode requests carry ``1 + mtp`` query tokens; a mixed batch puts its decodes first, as the runner
    reorders them; request ``i`` owns pages ``i * pages_per_req ...``.
    """

    def __init__(self, case: Any, vllm_config: Any) -> None:
        from vllm.v1.utils import CpuGpuBuffer

        env = case.envelope
        self.case = case
        self.max_reqs = env.max_num_seqs
        self.pages_per_req = math.ceil(env.max_model_len / env.page_size)
        captures = sorted(vllm_config.compilation_config.cudagraph_capture_sizes or [])
        self.capture_sizes = captures
        dev = "cuda"
        self.query_start_loc = CpuGpuBuffer(self.max_reqs + 1, dtype=_int32(), device=dev, pin_memory=False)
        self.seq_lens = CpuGpuBuffer(self.max_reqs, dtype=_int32(), device=dev, pin_memory=False)
        self.block_table = CpuGpuBuffer(self.max_reqs, self.pages_per_req, dtype=_int32(), device=dev,
                                        pin_memory=False)
        self.slot_mapping = CpuGpuBuffer(env.max_num_batched_tokens, dtype=_int64(), device=dev, pin_memory=False)
        import torch

        self.block_table.cpu.copy_(torch.arange(self.max_reqs * self.pages_per_req, dtype=torch.int32)
                                   .view(self.max_reqs, self.pages_per_req))
        self.block_table.copy_to_gpu()

    def padded(self, batch: Batch) -> Batch:
        """A pure decode batch within the captured sizes, padded to the next one (tokens), as the runner does."""
        q = 1 + self.case.mtp
        if batch.kind != "decode" or not self.capture_sizes or batch.num_tokens > self.capture_sizes[-1]:
            return batch
        size = next(s for s in self.capture_sizes if s >= batch.num_tokens)
        if size % q:
            return batch
        return Batch("decode", size // q, size, batch.cuda_graph, batch.ubatch)

    def query_lens(self, batch: Batch) -> list[int]:
        q = 1 + self.case.mtp
        n = max(1, min(batch.num_reqs, self.max_reqs))
        if batch.kind == "decode":
            return [q] * n
        decodes = n // 2 if batch.kind == "mixed" else 0
        rest = max(batch.num_tokens - decodes * q, n - decodes)
        base, extra = divmod(rest, n - decodes)
        return [q] * decodes + [base + (i < extra) for i in range(n - decodes)]

    def metadata(self, batch: Batch) -> Any:
        import numpy as np
        from vllm.v1.attention.backend import CommonAttentionMetadata

        env = self.case.envelope
        qlens = self.query_lens(batch)
        n = len(qlens)
        seq = [max(env.max_model_len, q) for q in qlens]
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1:n + 1] = np.cumsum(qlens)
        self.seq_lens.np[:n] = seq
        tokens = int(sum(qlens))
        self.slot_mapping.np[:tokens] = np.arange(tokens)
        values = {
            "query_start_loc": self.query_start_loc.copy_to_gpu(n + 1),
            "query_start_loc_cpu": self.query_start_loc.cpu[:n + 1],
            "seq_lens": self.seq_lens.copy_to_gpu(n),
            "seq_lens_cpu": self.seq_lens.cpu[:n],
            "seq_lens_cpu_upper_bound": self.seq_lens.cpu[:n],
            "num_computed_tokens_cpu": self.seq_lens.cpu[:n] - self.query_start_loc.cpu[1:n + 1].diff(
                prepend=self.query_start_loc.cpu[:1]),
            "num_reqs": n,
            "num_actual_tokens": tokens,
            "max_query_len": max(qlens),
            "max_seq_len": max(seq),
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


def _device_active() -> bool:
    from pytest_kvprofile.memory.torch_mode import active_simulation

    return active_simulation() is not None


def _int32() -> Any:
    import torch

    return torch.int32


def _int64() -> Any:
    import torch

    return torch.int64


def make_vllm_builders(case: Any, v2: bool = False, builder_cls: type | None = None) -> list[Any]:
    """The adapter for ``case``: a reserving one when vLLM's builder class declares reservation, otherwise the
    V1 (or V2) integration that declares nothing. Imports vLLM (with the stand-in platform current)."""
    check_expressible(case)
    cls = builder_cls or import_vllm_flashinfer().FlashInferMetadataBuilder
    api = reservation_api(cls)
    if api is not None:
        return [ReservingVllmBuilder(case, cls, api)]
    return [(VllmFlashInferV2Builder if v2 else VllmFlashInferBuilder)(case, builder_cls)]


def _make_v1(case: Any) -> list[Any]:
    return make_vllm_builders(case)


def _make_v2(case: Any) -> list[Any]:
    return make_vllm_builders(case, v2=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return ""


def engine_refusal(case: Any) -> str | None:
    """Why vLLM (or this adapter, for MLA and other layouts ``FlashInferMetadataBuilder`` does not serve) refuses
    ``case``, from vLLM's own config validation on the stand-in platform; None when it accepts the layout."""
    try:
        check_expressible(case)
        with vllm_standins(case.gpu, dcp=case.dcp, ranks=case.tp):
            make_vllm_config(case)
    except UnexpressibleCase as exc:
        return str(exc)
    return None


VLLM_BACKENDS: tuple[Backend, ...] = (
    Backend(name="vllm-flashinfer", make_builders=_make_v1, origin="builtin", torch_mode=True,
            refuses_layout=engine_refusal, requires=("vllm",), install_hint=VLLM_INSTALL_HINT,
            description="vLLM's own FlashInferMetadataBuilder (V1 runner: per-builder lazy float workspace), "
                        "unmodified, on the simulated GPU"),
    Backend(name="vllm-flashinfer-v2", make_builders=_make_v2, origin="builtin", torch_mode=True,
            refuses_layout=engine_refusal, requires=("vllm",), install_hint=VLLM_INSTALL_HINT,
            description="vLLM's own FlashInferMetadataBuilder (V2 runner: one eager float workspace shared "
                        "with set_workspace_buffer), unmodified, on the simulated GPU"),
)
