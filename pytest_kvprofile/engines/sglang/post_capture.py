"""The ``sglang-flashinfer-post-capture`` backend: SGLang's unmodified ``FlashInferAttnBackend`` on SGLang's
post-capture KV sizing path (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1``).

Why a second backend: on this path SGLang sizes its KV pool where the contract's closing measurement is. Its runner
makes the KV pool with a virtual backing (no physical memory yet), then the attention backend
(``FlashInferAttnBackend(model_runner)``), ``init_cuda_graph_state`` and every decode CUDA graph (one decode wrapper
set per captured size), then measures free memory and backs the pool from what is left
(``model_runner_components/kv_pool_runtime.py``, ``compute_post_capture_kv_resize``). Memory the backend makes
before that point is seen by KV sizing; memory it makes after (a lazily made wrapper or buffer on the first
request: sglang#38596 is an OOM of that kind) is not, and nothing reserves it. That is the contract's question, so
the contract's checks apply with SGLang's sizing point as the closing measurement:

- in the window (the harness's ``reserve_persistent_workspace``): the backend is made, its CUDA-graph state made,
  and every decode capture size captured (``init_forward_metadata_out_graph(batch, in_capture=True)``), in SGLang's
  order; the lease holds the backend, and so does the runner (SGLang never drops it);
- after KV sizing: nothing is made again (the pool's virtual addresses stay, so the graphs stay valid); the
  harness's capture is SGLang's replay of the captured sizes, and its serving steps are SGLang's
  ``init_forward_metadata``. Anything the backend allocates there is a post-KV allocation the checks refuse.

SGLang's backend declares nothing; the declaration is the engine's (its runner puts the backend before the sizing
point), so the adapter answers REQUIRED with the workspace SGLang's backend reserves of its own (its float workspace
is its own buffer, planned into, so the waste check measures it against the exact need of the routes planned).
Where SGLang does not size post-capture (``post_capture_kv_sizing_planned``: DCP, MLA, ...), the engine's gate keeps
the case on the static path, whose cost ``sglang-flashinfer`` reports.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import traceback
from typing import TYPE_CHECKING, Iterator

from pytest_kvprofile.attention.facts import FLASHINFER_INT_WORKSPACE_BYTES
from pytest_kvprofile.contract.backends import Backend, EnginePolicy
from pytest_kvprofile.contract.protocol import Batch, WorkspaceDeclaration
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.engines.adapter import EngineAdapter
from pytest_kvprofile.engines.sglang.budget import sglang_budget
from pytest_kvprofile.engines.sglang.flashinfer import (
    DRAFT,
    SglangEngine,
    SglangFlashInferAdapter,
    SglangValue,
    make_sglang_engine,
    sglang_backend,
)
from pytest_kvprofile.engines.sglang.standins import sglang_standins
from pytest_kvprofile.engines.sglang.trtllm_mha import SglangTrtllmMhaAdapter
from pytest_kvprofile.engines.sglang.trtllm_mla import SglangTrtllmMlaAdapter

if TYPE_CHECKING:
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.protocol import BuilderContext
    from pytest_kvprofile.matrix.cases import Case

__all__ = ["POST_CAPTURE_ENV", "SGLANG_POST_CAPTURE_BACKENDS", "SglangPostCaptureAdapter",
           "SglangTrtllmMlaPostCaptureAdapter", "SglangTrtllmPostCaptureAdapter", "post_capture_gate",
           "post_capture_scope"]

BACKEND_NAME = "sglang-flashinfer-post-capture"
TRTLLM_BACKEND_NAME = "sglang-trtllm-mha-post-capture"
TRTLLM_MLA_BACKEND_NAME = "sglang-trtllm-mla-post-capture"
# the static path's backend of each attention backend, which reports that path's cost
STATIC_BACKENDS = {"flashinfer": "sglang-flashinfer", "trtllm_mha": "sglang-trtllm-mha",
                   "trtllm_mla": "sglang-trtllm-mla"}
POST_CAPTURE_ENV = "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"
# FlashInfer's int workspace per wrapper, as SGLang's backend makes each wrapper (FlashInfer's default)
_INT_WORKSPACE_BYTES = FLASHINFER_INT_WORKSPACE_BYTES  # SGLang keeps FlashInfer's default int workspace


@contextlib.contextmanager
def post_capture_scope() -> Iterator[None]:
    """SGLang's opt-in for the block (the caller's ``sglang_standins`` puts the environment back after)."""
    previous = os.environ.get(POST_CAPTURE_ENV)
    os.environ[POST_CAPTURE_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(POST_CAPTURE_ENV, None)
        else:
            os.environ[POST_CAPTURE_ENV] = previous


def post_capture_gate(case: Case, attention_backend: str = "flashinfer") -> str | None:
    """SGLang's own answer (``post_capture_kv_sizing_planned`` on the case's resolved ``ServerArgs``): None when it
    sizes KV after capture, else why the case stays on the static path."""
    with sglang_standins(case.gpu), post_capture_scope():
        from sglang.srt.arg_groups.overrides import post_capture_kv_sizing_planned
        from sglang.srt.runtime_context import use_context

        engine = make_sglang_engine(case, attention_backend=attention_backend)
        with use_context(engine.context):
            planned = post_capture_kv_sizing_planned(engine.server_args)
    if planned:
        return None
    why = (f"dcp_size {case.dcp} != 1" if case.dcp != 1 else
           "MLA" if case.model.attention == "mla" else "see its conditions in sglang/srt/arg_groups/overrides.py")
    static = STATIC_BACKENDS[attention_backend]
    return (f"SGLang sizes {case.id} statically: post_capture_kv_sizing_planned() is False ({why}); the static "
            f"path's cost is {static}'s")


class SglangPostCaptureAdapter(SglangFlashInferAdapter):
    """SGLang's backend with SGLang's post-capture KV sizing: made and captured inside the window, replayed and
    served after KV sizing. Placed before another SGLang adapter in a class's bases, it puts that adapter's backend
    on the post-capture path (:class:`SglangTrtllmPostCaptureAdapter`)."""

    name = BACKEND_NAME

    def __init__(self, case: Case, builder_cls: type | None = None) -> None:
        super().__init__(case, builder_cls)
        self.sized_after_capture = False  # the window captured every decode size

    def standins(self) -> SglangValue:
        return _post_capture_standins(super().standins())

    def make_engine_config(self) -> SglangEngine:
        with post_capture_scope():
            return super().make_engine_config()

    # -- the declaration (the engine's: its runner measures after the backend and its graphs) ---------------
    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        """SGLang's float workspace is its backend's own buffer (measured where it is planned into); each wrapper
        has FlashInfer's default int workspace."""
        return WorkspaceDeclaration(float_bytes=0, int_bytes=_INT_WORKSPACE_BYTES)

    # -- SGLang's runner, before its sizing point -----------------------------------------------------------
    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        """The backend, its CUDA-graph state and every decode capture size, in SGLang's order; the runner keeps
        the backend (the lease holds it too, until the closing measurement). All or nothing: a failure drops the
        backend it made (SGLang's start-up would end there; its process-wide float workspace stays cached)."""
        try:
            self.capturing = True
            with self.construction_scope():
                for key in self.builder_keys(0):  # the target worker made and captured, then the draft worker
                    self.builders[key] = self.make_engine_builder(key)
                    for bs in sorted(self.config().capture_bs, reverse=True):  # SGLang captures the largest first
                        self.build_for_capture(self.builders[key], self.runner_batch(bs, draft=key == DRAFT))
        except BaseException as exc:
            self.builders.clear()
            self.captured.clear()
            self.last_metadata = None
            # what the failed start-up made is freed now, as SGLang's process exit frees it: the error's frames
            # (the backend's __init__, FlashInfer's wrappers) let go of it, and the backend and its wrappers, which
            # hold each other, are collected here rather than whenever the collector next runs
            traceback.clear_frames(exc.__traceback__)
            gc.collect()
            raise
        finally:
            self.capturing = False
        self.sized_after_capture = True
        return ctx.lease(list(self.builders.values()))

    def runner_batch(self, bs: int, draft: bool = False) -> SglangValue:
        assert self.runner is not None
        tokens = bs * (1 + self.case.mtp)
        batch = Batch("decode", bs, tokens, cuda_graph=True)
        return self.runner.forward_batch(batch, self.config().capture_bs, graph=True, capture=True, draft=draft)

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        """After the sizing point SGLang captures nothing again: the harness's capture replays the sizes the window
        captured."""
        if batch.ubatch != 0:
            return
        self.capturing = ctx.capturing and not self.sized_after_capture
        EngineAdapter.build(self, ctx, batch)


class SglangTrtllmPostCaptureAdapter(SglangPostCaptureAdapter, SglangTrtllmMhaAdapter):
    """SGLang's ``TRTLLMHAAttnBackend`` (its MHA default on Blackwell) on the post-capture path."""

    name = TRTLLM_BACKEND_NAME


class SglangTrtllmMlaPostCaptureAdapter(SglangPostCaptureAdapter, SglangTrtllmMlaAdapter):
    """SGLang's ``TRTLLMMLABackend`` (its MLA default on Blackwell) under the post-capture opt-in: SGLang sizes MLA
    statically (``post_capture_kv_sizing_planned``), so the gate keeps every such case on the static path."""

    name = TRTLLM_MLA_BACKEND_NAME


@contextlib.contextmanager
def _post_capture_standins(inner: contextlib.AbstractContextManager[SglangValue]) -> Iterator[SglangValue]:
    with inner as module, post_capture_scope():
        yield module


def _post_capture_backend(name: str, adapter: type[SglangPostCaptureAdapter], what: str) -> Backend:
    attention = adapter.attention_backend
    return sglang_backend(
        name, adapter, f"SGLang's own {what} on SGLang's post-capture KV sizing path (SGLANG_ENABLE_POST_CAPTURE_KV_"
        "SIZING=1: KV sized after the backend and its graphs), unmodified, on the simulated GPU",
        EnginePolicy(gate=functools.partial(post_capture_gate, attention_backend=attention), kv_sizing="post_capture",
                     budget=sglang_budget))


SGLANG_POST_CAPTURE_BACKENDS: tuple[Backend, ...] = (
    _post_capture_backend(BACKEND_NAME, SglangPostCaptureAdapter, "FlashInferAttnBackend"),
    _post_capture_backend(TRTLLM_BACKEND_NAME, SglangTrtllmPostCaptureAdapter,
                          "TRTLLMHAAttnBackend (--attention-backend trtllm_mha)"),
    _post_capture_backend(TRTLLM_MLA_BACKEND_NAME, SglangTrtllmMlaPostCaptureAdapter,
                          "TRTLLMMLABackend (--attention-backend trtllm_mla)"),
)


def backends() -> list[Backend]:
    return list(SGLANG_POST_CAPTURE_BACKENDS)
