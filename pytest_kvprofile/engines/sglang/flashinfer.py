"""The ``sglang-flashinfer`` backend: SGLang's own, unmodified ``FlashInferAttnBackend``
(``sglang/srt/layers/attention/flashinfer_backend.py``) driven through the lifecycle on the simulated GPU.

Why: SGLang is the other engine the suite's users run, and its memory model differs from vLLM's. SGLang makes no
profile run: it sizes the KV pool from a static fraction (``mem_fraction_static``), and its order is weights, the KV
pools, the attention backends, then the CUDA graphs. So everything the attention backend makes comes after KV
sizing, out of the static slack: its process-wide float workspace (``get_buffer("flashinfer_workspace")``, 384 MiB,
512 MiB for Qwen2/Qwen3 architectures), the int workspace and pinned mirror of every FlashInfer wrapper, its index
buffers, ``init_cuda_graph_state``'s CUDA-graph KV indices and custom mask, and one decode wrapper per captured batch
size. SGLang's backend declares nothing, so the adapter declares nothing: UNSUPPORTED, the legacy path, whose cost
(every post-KV allocation, by SGLang's and FlashInfer's source lines) the suite reports.

How SGLang's model runner integrates the backend, as the adapter drives it (docs/sglang.md):

- the engine config (:func:`make_sglang_engine`): a local ``config.json`` of the case's head layout (the architecture
  its model name implies: ``Qwen3ForCausalLM`` for a Qwen3, which SGLang gives the 512 MiB workspace), a real
  ``ServerArgs`` resolved by SGLang's own pipeline, a runtime context made with SGLang's ``create_context`` and made
  current around every call (``use_context``), SGLang's ``ModelConfig`` and KV dtype resolution;
- the runner (:class:`SglangRunner`, made when the adapter is constructed on the run's device, i.e. before KV sizing
  as SGLang makes its memory pools with the KV cache): a real ``ReqToTokenPool`` and ``KVIndexTranslator``, a KV pool
  stand-in that answers SGLang's KV quantization method (the harness owns the KV cache), the runner's capture-stable
  input buffers;
- ``rebind`` (the first call after KV sizing): ``FlashInferAttnBackend(model_runner)``, then ``init_cuda_graph_state(
  max_bs, max_num_tokens)`` as the decode CUDA-graph runner does at its construction; SGLang's runner has one
  attention backend (two-batch overlap, which makes one per micro-batch, is for MoE models): micro-batch 0 is driven,
  the harness's micro-batch 1 runs the same steps on it and is not repeated;
- builds: a real ``ForwardBatch`` (``DECODE``, ``EXTEND`` or ``MIXED``) with its ``KVLocPlan``;
  ``init_forward_metadata`` for eager steps, ``init_forward_metadata_out_graph(batch, in_capture=True)`` for a
  captured decode size (SGLang 0.5.23's capture entry point; older releases called it
  ``init_forward_metadata_capture_cuda_graph``) and ``init_forward_metadata_out_graph(batch)`` for a replay.

MTP ``k`` is SGLang's EAGLE chain (:func:`speculative_kwargs`): the model runner's backend captures ``TARGET_VERIFY``
graphs, and the draft worker's own backend (builder key :data:`DRAFT`, on :meth:`SglangRunner.draft_runner`) runs a
draft-extend step after every target step and captures ``DRAFT_EXTEND_V2`` graphs. An MLA layout becomes a
``DeepseekV2ForCausalLM`` config (:func:`mla_config`) and runs the class SGLang's registry makes for it
(``FlashInferMLAAttnBackend``). An FP4 cache answers SGLang's own KV quantization method.

What SGLang refuses, SGLang's own validation says (:func:`engine_refusal`); what the simulated GPU or the adapter
cannot do is refused by name: MTP beyond 1 token (the multi-step draft backend's Triton kernel), and the routes
FlashInfer plans on modules the simulated GPU has no host planner for (SM100's CUTLASS prefill and MLA policy, SM90's
FA3).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Iterator

from pytest_kvprofile.contract.backends import Backend, EnginePolicy, Provenance
from pytest_kvprofile.contract.protocol import Batch
from pytest_kvprofile.engines.adapter import EngineAdapter, EngineBuildError, device_active, engine_backend
from pytest_kvprofile.engines.sglang.case_config import (
    SglangEngine,
    SglangValue,
    UnexpressibleSglangCase,
    capture_bs_decode,
    check_expressible,
    engine_refusal,
    hf_config,
    hf_config_dir,
    make_sglang_engine,
    mla_config,
    server_args_kwargs,
    speculative_kwargs,
)
from pytest_kvprofile.engines.sglang.runner import HostKvIndices, SglangRunner, host_kv_indices
from pytest_kvprofile.engines.sglang.standins import (
    SGLANG_INSTALL_HINT,
    import_sglang_flashinfer,
    sglang_standins,
)

if TYPE_CHECKING:
    from pytest_kvprofile.contract.protocol import BuilderContext
    from pytest_kvprofile.matrix.cases import Case


__all__ = ["BACKEND_NAME", "DRAFT", "SGLANG_BACKENDS", "TARGET", "HostKvIndices", "SglangBuildError", "SglangEngine",
           "SglangFlashInferAdapter", "SglangRunner", "SglangValue", "UnexpressibleSglangCase", "backends",
           "capture_bs_decode", "check_expressible", "engine_refusal", "hf_config", "hf_config_dir",
           "make_sglang_engine", "mla_config", "server_args_kwargs", "sglang_backend", "speculative_kwargs"]
# Re-exported from case_config.py and runner.py: the trtllm and post-capture backends import them from here.

BACKEND_NAME = "sglang-flashinfer"
_MLA_MODULE = "sglang.srt.layers.attention.flashinfer_mla_backend"
TARGET, DRAFT = 0, 1  # the adapter's builder keys: the model runner's backend, the draft worker's (MTP)


class SglangBuildError(EngineBuildError):
    """SGLang's ``init_forward_metadata`` failed on a batch; the message names the case, the batch and SGLang's
    own error."""


# -- the adapter --------------------------------------------------------------------------------------------------

class SglangFlashInferAdapter(EngineAdapter):
    """SGLang's ``FlashInferAttnBackend`` as SGLang's model runner integrates it: made after the KV pools (the
    harness's ``rebind``), its CUDA-graph state made for the decode capture sizes, then
    ``init_forward_metadata`` per step and ``init_forward_metadata_out_graph`` per captured size. Declares nothing
    (UNSUPPORTED: the legacy path)."""

    name = BACKEND_NAME
    builder_label = "SGLang's FlashInferAttnBackend"
    build_error = SglangBuildError
    attention_backend = "flashinfer"  # SGLang's --attention-backend
    backend_module = ""  # the module of the class SGLang's registry makes for it ("": sglang_backend_class decides)
    backend_class = ""

    def __init__(self, case: Case, builder_cls: type | None = None) -> None:
        check_expressible(case, self.attention_backend)
        super().__init__(case, builder_cls)
        self.runner: SglangRunner | None = None
        self.capturing = False
        self.captured: list[tuple[str, int]] = []  # (SGLang's forward mode, batch size) captured, in order
        if device_active():
            self.ensure_inputs()

    # -- SGLang's objects ----------------------------------------------------------------------------
    def standins(self) -> SglangValue:
        return _standins_with_host_kernels(self.case, self.host_kernels())

    def host_kernels(self) -> contextlib.AbstractContextManager[None]:
        """The host versions of the backend module's own kernels, for the block (a trtllm backend's)."""
        return contextlib.nullcontext()

    def make_engine_config(self) -> SglangEngine:
        return make_sglang_engine(self.case, attention_backend=self.attention_backend)

    @contextlib.contextmanager
    def _scope(self) -> Iterator[SglangValue]:
        """The stand-ins, then the case's runtime context current (SGLang's ``use_context``)."""
        from sglang.srt.runtime_context import use_context

        with self.standins() as module, use_context(self.config().context):
            yield module

    def engine_scope(self) -> SglangValue:
        return self._scope()

    def ensure_inputs(self) -> None:
        if self.runner is None:
            with self._scope():
                self.runner = SglangRunner(self.case, self.config())

    def builder_keys(self, ubatch: int) -> list[SglangValue]:
        """SGLang's runner has one attention backend: it is micro-batch 0's. With MTP the draft worker's runner has
        its own (key :data:`DRAFT`), its draft-extend backend (MTP 1 makes no multi-step draft decode backend)."""
        if ubatch != 0:
            return []
        return [TARGET, DRAFT] if self.case.mtp else [TARGET]

    def ubatch_of(self, key: SglangValue) -> int:
        return 0

    def describe_key(self, key: SglangValue) -> str:
        return "the draft worker's draft-extend backend" if key == DRAFT else "the model runner's backend"

    def make_engine_builder(self, key: SglangValue) -> SglangValue:
        """``FlashInferAttnBackend(model_runner)``, then the decode CUDA-graph runner's ``init_cuda_graph_state``;
        the draft worker's ``FlashInferAttnBackend(draft_runner, skip_prefill=False)``, then its draft-extend graph
        runner's (both graph runners size for ``max_bs x (1 + mtp)`` tokens)."""
        self.ensure_inputs()
        runner = self.runner
        assert runner is not None
        cls = self.builder_cls or self.sglang_backend_class()
        backend = cls(runner.draft_runner(), skip_prefill=False) if key == DRAFT else cls(runner)
        sizes = self.config().capture_bs
        if sizes:
            max_bs = max(sizes)
            backend.init_cuda_graph_state(max_bs, max_bs * (1 + self.case.mtp))
        return backend

    def sglang_backend_class(self) -> type:
        """The class SGLang's attention registry makes for the adapter's attention backend: ``backend_class`` of
        ``backend_module`` where the adapter names one; for ``--attention-backend flashinfer``
        (``create_flashinfer_backend``) ``FlashInferMLAAttnBackend`` where the runner uses MLA, else
        ``FlashInferAttnBackend``."""
        import importlib

        if self.backend_module:
            named: type = getattr(importlib.import_module(self.backend_module), self.backend_class)
            return named
        if self.case.model.attention == "mla":
            mla: type = importlib.import_module(_MLA_MODULE).FlashInferMLAAttnBackend
            return mla
        mha: type = import_sglang_flashinfer().FlashInferAttnBackend
        return mha

    def key_metadata(self, key: SglangValue, batch: Batch, metadata: SglangValue) -> SglangValue:
        """The draft worker's step of the batch, made after the target's was built (the runner's buffers are
        shared, as SGLang's draft worker runs after the target's forward)."""
        if key != DRAFT:
            return metadata
        return self._forward_batch(batch, draft=True)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        """Micro-batch 0's steps on SGLang's one backend; the harness's micro-batch 1 repeats them and is not run
        again."""
        if batch.ubatch != 0:
            return
        self.capturing = ctx.capturing
        super().build(ctx, batch)

    def engine_metadata(self, batch: Batch) -> SglangValue:
        return self._forward_batch(batch)

    def _forward_batch(self, batch: Batch, draft: bool = False) -> SglangValue:
        assert self.runner is not None
        graph = batch.cuda_graph and batch.kind == "decode"
        return self.runner.forward_batch(batch, self.config().capture_bs, graph=graph, capture=graph and self.capturing,
                                         draft=draft)

    def build_for_capture(self, builder: SglangValue, metadata: SglangValue) -> SglangValue:
        """A captured decode size: SGLang's capture call (new decode wrappers for the size) while capturing, its
        replay call after."""
        if self.capturing:
            builder.init_forward_metadata_out_graph(metadata, in_capture=True)
            self.captured.append((metadata.forward_mode.name, metadata.batch_size))
        else:
            builder.init_forward_metadata_out_graph(metadata)
        return builder.forward_metadata

    def build_serving(self, builder: SglangValue, metadata: SglangValue) -> SglangValue:
        builder.init_forward_metadata(metadata)
        return builder.forward_metadata

    def wrappers(self) -> Iterator[tuple[str, SglangValue]]:
        """Every FlashInfer wrapper SGLang's backend holds: (role, wrapper). ``FlashInferAttnBackend`` keeps lists
        (one wrapper per sliding-window/cross-attention split), ``FlashInferMLAAttnBackend`` one wrapper each."""
        for backend in self.builders.values():
            yield "ragged prefill", backend.prefill_wrapper_ragged
            for role, attrs in (("paged prefill", ("prefill_wrappers_paged", "prefill_wrapper_paged")),
                                ("verify", ("prefill_wrappers_verify", "prefill_wrapper_verify")),
                                ("decode", ("decode_wrappers", "decode_wrapper"))):
                for attr in attrs:
                    yield from ((role, w) for w in _listed(getattr(backend, attr, None)))
            for role, attr in (("decode", "decode_cuda_graph_metadata"), ("verify", "prefill_cuda_graph_metadata"),
                               ("draft extend", "draft_extend_cuda_graph_metadata")):
                for bs, ws in sorted(getattr(backend, attr, {}).items()):
                    yield from ((f"cuda-graph {role} bs={bs}", w) for w in _listed(ws))

    def close(self) -> None:
        super().close()
        self.runner = None
        self.engine_config = None


def _listed(wrappers: SglangValue) -> list[SglangValue]:
    """A backend attribute holding no wrapper, one, or a list of them, as a list."""
    if wrappers is None:
        return []
    return list(wrappers) if isinstance(wrappers, (list, tuple)) else [wrappers]


@contextlib.contextmanager
def _standins_with_host_kernels(
        case: Case, kernels: contextlib.AbstractContextManager[None] | None = None) -> Iterator[SglangValue]:
    with sglang_standins(case.gpu) as module, host_kv_indices(), kernels or contextlib.nullcontext():
        yield module


# -- the backend ----------------------------------------------------------------------------------------------------

def sglang_provenance() -> Provenance:
    """``Backend.provenance`` of an SGLang backend: the installed SGLang (read from its metadata) and its
    ``ModelRunner``, with the FlashInfer SGLang pins beside the one that ran."""
    from importlib.metadata import PackageNotFoundError, requires, version

    try:
        installed = version("sglang")
        pins = [r for r in requires("sglang") or [] if r.replace("_", "-").startswith("flashinfer-python")]
    except PackageNotFoundError:
        return Provenance(engine="sglang", runner="ModelRunner")
    notes = (f"SGLang pins {pins[0].split(';')[0].strip()}",) if pins else ()
    return Provenance(engine="sglang", engine_version=installed, runner="ModelRunner", notes=notes)


def _version() -> str:
    """The installed SGLang and the FlashInfer its backend binds (SGLang 0.5.23 pins 0.7.2; the project's is used)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        sglang = version("sglang")
    except PackageNotFoundError:
        return ""
    try:
        return f"{sglang} (flashinfer-python {version('flashinfer-python')})"
    except PackageNotFoundError:
        return sglang


def sglang_backend(name: str, adapter: type[SglangFlashInferAdapter], description: str,
                   policy: EnginePolicy | None = None) -> Backend:
    """The ``Backend`` that runs ``adapter`` (one per case, SGLang imported with its stand-ins by ``make_builders``
    only): SGLang's own refusal of the adapter's attention backend at collection (:func:`engine_refusal`)."""
    attention = adapter.attention_backend

    def make_builders(case: Case) -> list[SglangValue]:
        check_expressible(case, attention)
        import_sglang_flashinfer()
        return [adapter(case)]

    return engine_backend(name, make_builders, engine="sglang", install_hint=SGLANG_INSTALL_HINT, origin="builtin",
                          refuses_layout=functools.partial(engine_refusal, attention_backend=attention),
                          version=_version(), policy=policy, description=description, provenance=sglang_provenance)


SGLANG_BACKENDS: tuple[Backend, ...] = (
    sglang_backend(BACKEND_NAME, SglangFlashInferAdapter,
                   "SGLang's own FlashInferAttnBackend (static KV sizing: everything it makes is after the KV pool), "
                   "unmodified, on the simulated GPU"),
)


def backends() -> list[Backend]:
    """``--kvprofile-backend pytest_kvprofile.engines.sglang.flashinfer:backends`` (before the backend is registered
    by ``engines/__init__.py``)."""
    return list(SGLANG_BACKENDS)

