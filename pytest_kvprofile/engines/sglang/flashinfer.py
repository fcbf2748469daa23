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
import copy
import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from pytest_kvprofile.contract.backends import Backend, EnginePolicy, Provenance
from pytest_kvprofile.contract.protocol import Batch
from pytest_kvprofile.engines.adapter import EngineAdapter, EngineBuildError, Patches, device_active, engine_backend
from pytest_kvprofile.engines.batches import capture_sizes, pad_to_capture, runner_batch
from pytest_kvprofile.engines.model_config import config_dir, decoder_config
from pytest_kvprofile.engines.sglang.facts import SGLANG_FACTS
from pytest_kvprofile.engines.sglang.standins import (
    SGLANG_INSTALL_HINT,
    import_sglang_flashinfer,
    sglang_standins,
)
from pytest_kvprofile.matrix.kv_dtypes import KV_DTYPES

if TYPE_CHECKING:
    from pytest_kvprofile.contract.protocol import BuilderContext
    from pytest_kvprofile.matrix.cases import Case

# An SGLang, torch or numpy object: each is imported lazily (never at plugin import), and SGLang ships no types
SglangValue = Any

__all__ = ["DRAFT", "SGLANG_BACKENDS", "TARGET", "SglangBuildError", "SglangEngine", "SglangFlashInferAdapter",
           "SglangRunner", "UnexpressibleSglangCase", "backends", "capture_bs_decode", "check_expressible",
           "engine_refusal", "hf_config", "make_sglang_engine", "mla_config", "sglang_backend",
           "server_args_kwargs", "speculative_kwargs"]

BACKEND_NAME = "sglang-flashinfer"
_MLA_MODULE = "sglang.srt.layers.attention.flashinfer_mla_backend"
TARGET, DRAFT = 0, 1  # the adapter's builder keys: the model runner's backend, the draft worker's (MTP)
# The HF architecture and model type a matrix model's name implies (SGLang branches on the architecture: Qwen2/Qwen3
# get a 512 MiB FlashInfer workspace); anything else is a plain Llama-like decoder.
_ARCHITECTURES = (("qwen3", "Qwen3ForCausalLM", "qwen3"), ("qwen2", "Qwen2ForCausalLM", "qwen2"),
                  ("glm-4", "Glm4ForCausalLM", "glm4"), ("llama", "LlamaForCausalLM", "llama"))
_DEFAULT_ARCHITECTURE = ("LlamaForCausalLM", "llama")


# SGLang's attention registry (attention_registry.py) refuses these (--attention-backend, is the model MLA) pairs
# when it makes the backend, after ServerArgs accepted them
_REGISTRY_REFUSALS = {("trtllm_mha", True): "trtllm_mha backend can only be used with non-MLA models.",
                      ("trtllm_mla", False): "trtllm_mla backend can only be used with MLA models."}


class UnexpressibleSglangCase(ValueError):
    """A case SGLang's FlashInfer backend, or this adapter on the simulated GPU, does not run; the message names it
    and why."""


class SglangBuildError(EngineBuildError):
    """SGLang's ``init_forward_metadata`` failed on a batch; the message names the case, the batch and SGLang's
    own error."""


# -- the case as SGLang's config ----------------------------------------------------------------------------------

def _architecture(case: Case) -> tuple[str, str]:
    name = case.model.name.lower()
    return next(((arch, kind) for prefix, arch, kind in _ARCHITECTURES if name.startswith(prefix)),
                _DEFAULT_ARCHITECTURE)


def model_dtype(case: Case) -> str:
    """The model's dtype (``KvDtype.model_torch``: the KV dtype where the cache is unquantized, bf16 under a quantized
    cache)."""
    return case.model.kv.model_torch


def kv_cache_dtype(case: Case) -> str:
    """SGLang's ``--kv-cache-dtype`` for the case (``engines/sglang/facts.py``); check_expressible refuses the rest."""
    spelled = SGLANG_FACTS.kv_cache_dtype(case.model.kv_dtype)
    if spelled is None:
        raise UnexpressibleSglangCase(f"case {case.id}: KV dtype {case.model.kv_dtype!r} has no SGLang "
                                      "--kv-cache-dtype (engines/sglang/facts.py)")
    return spelled


def hf_config(case: Case) -> dict[str, object]:
    """The ``config.json`` of a plain GQA decoder with the case's head layout, under the architecture its model name
    implies."""
    model = case.model
    if model.attention == "mla":
        return mla_config(case)
    architecture, model_type = _architecture(case)
    # pad_token_id: an architecture's default may lie outside the stand-in vocabulary (GLM-4: 151329)
    return decoder_config(case, architecture, model_type, pad_token_id=None)


# DeepSeek-V2/V3's decoupled RoPE width: the query/key head is ``qk_nope + rope`` wide, the cached latent
# ``kv_lora_rank + rope`` (576 = 512 + 64)
_MLA_ROPE_DIM = 64


def mla_config(case: Case) -> dict[str, object]:
    """An MLA layout as SGLang recognizes one (``DeepseekV2ForCausalLM``: ``ModelConfig`` reads the latent rank and the
    RoPE/no-RoPE split): the query head of ``head_dim``, the value head of ``head_dim_vo``, the cached latent of
    ``kv_cache_head_dim``, no query compression (DeepSeek-V2-Lite's), dense layers (the experts are not attention)."""
    model = case.model
    if model.kv_cache_head_dim is None or model.kv_cache_head_dim <= _MLA_ROPE_DIM < model.head_dim:
        raise UnexpressibleSglangCase(
            f"case {case.id}: an MLA layout needs a cached latent wider than the {_MLA_ROPE_DIM}-wide RoPE part "
            f"(kv_cache_head_dim {model.kv_cache_head_dim}) and a query head wider than it (head_dim {model.head_dim})")
    return decoder_config(
        case, "DeepseekV2ForCausalLM", "deepseek_v2", pad_token_id=None, kv_lora_rank=model.kv_cache_head_dim -
        _MLA_ROPE_DIM, qk_rope_head_dim=_MLA_ROPE_DIM, qk_nope_head_dim=model.head_dim - _MLA_ROPE_DIM,
        v_head_dim=model.dim_vo, q_lora_rank=None, first_k_dense_replace=model.num_layers)


def hf_config_dir(case: Case, root: Path | None = None) -> Path:
    """A directory holding the case's ``config.json`` (written once per layout, atomically, under the project
    cache; never a download)."""
    from pytest_kvprofile.attention.oracle_build import cache_root

    return config_dir(hf_config(case), root or cache_root() / "sglang-hf-configs")


def server_args_kwargs(case: Case, model_path: str, attention_backend: str = "flashinfer") -> dict[str, SglangValue]:
    """``ServerArgs`` of one rank of the case: the envelope as SGLang's scheduler limits, TP/DCP, the capture sizes
    (SGLang's decode graphs are captured per batch size), the case's utilization as ``mem_fraction_static``, and the
    attention backend (``flashinfer``, or ``trtllm_mha``: ``engines/sglang/trtllm_mha.py``)."""
    env = case.envelope
    return dict(
        model_path=model_path, skip_tokenizer_init=True, load_format="dummy", device="cuda", random_seed=0,
        attention_backend=attention_backend, dtype=model_dtype(case), kv_cache_dtype=kv_cache_dtype(case),
        page_size=env.page_size, context_length=env.max_model_len, max_running_requests=env.max_num_seqs,
        chunked_prefill_size=env.max_num_batched_tokens, max_prefill_tokens=env.max_num_batched_tokens,
        tp_size=case.tp, dcp_size=case.dcp, mem_fraction_static=case.gmu,
        cuda_graph_bs_decode=capture_bs_decode(case), disable_cuda_graph=not env.cuda_graph_sizes,
        **speculative_kwargs(case, model_path),
    )


def capture_bs_decode(case: Case) -> list[int]:
    """SGLang's decode capture sizes, in requests: the case's sizes (tokens) as they are without MTP; with MTP the
    requests of each captured step (``Envelope.decode_captures``: a graph of ``bs`` requests runs ``bs x (1 + mtp)``
    tokens, SGLang's ``captured_req_width``)."""
    if not case.mtp:
        return capture_sizes(case)
    return sorted(c.num_reqs for c in case.envelope.decode_captures(case.mtp))


def speculative_kwargs(case: Case, model_path: str) -> dict[str, SglangValue]:
    """MTP with ``k`` speculative tokens as SGLang runs it: EAGLE, a chain (top-1) of ``k`` draft steps verifying
    ``k + 1`` tokens per request, with a draft model of the target's attention layout (an MTP head or an EAGLE head
    is one decoder layer of the target's head layout); none without MTP."""
    if not case.mtp:
        return {}
    return dict(speculative_algorithm="EAGLE", speculative_draft_model_path=model_path,
                speculative_num_steps=case.mtp, speculative_eagle_topk=1, speculative_num_draft_tokens=case.mtp + 1)


def check_expressible(case: Case, attention_backend: str = "flashinfer") -> None:
    """Raise :class:`UnexpressibleSglangCase` for a case SGLang's ``FlashInferAttnBackend`` (or this adapter on the
    simulated GPU) does not run, naming why; ``trtllm_mha`` plans no FlashInfer route, so the planner's limits (an
    unsized case, SM90's FA3) are not its."""
    model = case.model
    registry = _REGISTRY_REFUSALS.get((attention_backend, model.attention == "mla"))
    if registry is not None:
        raise UnexpressibleSglangCase(f"case {case.id}: SGLang rejects this layout: its attention registry makes no "
                                      f"{attention_backend} backend for it (\"{registry}\", attention_registry.py)")
    if case.unsized_reason is not None and attention_backend == "flashinfer":
        raise UnexpressibleSglangCase(f"case {case.id}: FlashInfer plans no FA2 route here, and the simulated GPU has "
                                      f"no host module for it ({case.unsized_reason}; run it on the GPU tier)")
    if case.mtp > 1:
        raise UnexpressibleSglangCase(
            f"case {case.id}: MTP with {case.mtp} speculative tokens runs SGLang's FlashInferMultiStepDraftBackend "
            f"({case.mtp - 1} draft decode backends, fed by the Triton kernel generate_draft_decode_kv_indices, which "
            "has no host version here); MTP 1 runs (target verify and draft extend)")
    if SGLANG_FACTS.kv_cache_dtype(model.kv_dtype) is None:
        expressed = sorted(name for name in KV_DTYPES if SGLANG_FACTS.kv_cache_dtype(name) is not None)
        raise UnexpressibleSglangCase(f"case {case.id}: KV dtype {model.kv_dtype!r} is not expressed by this adapter "
                                      f"(SGLang's FP4 caches take a KV quantization method and a dequant workspace; "
                                      f"expressed: {', '.join(expressed)})")
    if model.dim_vo != model.head_dim and model.attention != "mla":
        raise UnexpressibleSglangCase(f"case {case.id}: head_dim_vo {model.dim_vo} != head_dim {model.head_dim}; "
                                      "SGLang's FlashInfer backend plans one head size")
    if model.heads_q % case.tp:
        raise UnexpressibleSglangCase(f"case {case.id}: {model.heads_q} query heads do not split over TP={case.tp}")
    cc = case.gpu.compute_capability
    if cc == (9, 0) and attention_backend == "flashinfer":
        raise UnexpressibleSglangCase(
            f"case {case.id}: on {case.gpu.name} (SM90) SGLang's ragged prefill wrapper is made with FlashInfer's "
            "'auto' backend, which plans FA3, and the simulated GPU has no host planner for FA3 (run it on the GPU "
            "tier)")


@dataclasses.dataclass
class SglangEngine:
    """One case as SGLang sees it: its ``ServerArgs``, its runtime context (SGLang's process config, made current
    around every call), its ``ModelConfig`` and KV dtype."""

    server_args: SglangValue
    context: SglangValue
    model_config: SglangValue
    kv_cache_dtype: SglangValue  # torch dtype of the KV cache
    kv_cache_dtype_str: str
    dtype: SglangValue  # the model's torch dtype
    capture_bs: list[int]  # SGLang's decode capture batch sizes (its own filtering of the case's)
    attention_backend: str = "flashinfer"  # SGLang's --attention-backend
    page_size: int = 0  # as SGLang's model runner reads it (get_schedule().page_size: after SGLang's overrides)


def make_sglang_engine(case: Case, hf_dir: Path | None = None, attention_backend: str = "flashinfer") -> SglangEngine:
    """The case's ``ServerArgs`` (resolved by SGLang's own pipeline), a runtime context made from it, its
    ``ModelConfig`` and KV dtype. Call inside :func:`sglang_standins`; SGLang's own errors propagate."""
    import torch
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache import kv_cache_dtype
    from sglang.srt.server_args import ServerArgs

    check_expressible(case, attention_backend)
    folder = hf_dir or hf_config_dir(case)
    server_args = ServerArgs(**server_args_kwargs(case, str(folder), attention_backend))
    context = runtime_context.create_context(server_args, role="scheduler")
    with runtime_context.use_context(context):
        model_config = ModelConfig.from_server_args(server_args)
        dtype = getattr(torch, model_dtype(case))
        resolved, kv_dtype = kv_cache_dtype.configure_kv_cache_dtype(
            server_args_kv_cache_dtype=runtime_context.get_model().kv_cache_dtype, model=None, model_dtype=dtype,
            is_draft_worker=False, is_dflash=False, speculative_draft_attention_backend=None)
        kv_str = resolved if resolved is not None else runtime_context.get_model().kv_cache_dtype
        capture_bs = _capture_bs(case, runtime_context)
        page_size = int(runtime_context.get_schedule().page_size)
        refusal = _route_refusal(case) if attention_backend == "flashinfer" else None
    if refusal is not None:
        raise UnexpressibleSglangCase(refusal)
    return SglangEngine(server_args, context, model_config, kv_dtype, kv_str, dtype, capture_bs, attention_backend,
                        page_size)


def _route_refusal(case: Case) -> str | None:
    """Where SGLang's backend plans on a FlashInfer module the simulated GPU has no host planner for, what and why,
    from SGLang's own answers in the case's context; None otherwise. (On SM100 its ragged prefill wrapper is made
    with FlashInfer's CUTLASS FMHA, whose plan the simulated GPU serves: ``attention/host_cutlass.py``.)"""
    from sglang.srt.runtime_context import get_platform

    if get_platform().is_sm100 and case.model.attention == "mla":
        return (f"case {case.id}: on {case.gpu.name} (SM100) SGLang's FlashInferMLAAttnBackend plans on FlashInfer's "
                "MLA wrapper with backend 'auto', whose SM100 policy picks CuTe-DSL or trtllm-gen "
                "(flashinfer/mla/_batch_mla/_auto_policy.py, ordered_sm100_backends), which the simulated GPU has no "
                "host module for; run it on the GPU tier (SGLang's MLA default there, trtllm_mla, runs: "
                "sglang-trtllm-mla)")
    return None


def _capture_bs(case: Case, runtime_context: SglangValue) -> list[int]:
    """SGLang's decode capture sizes: the configured list (``cuda_graph_bs_decode``, as resolved) within the request
    pool (``max_running_requests``), as ``get_batch_sizes_to_capture`` filters them."""
    graph = runtime_context.get_exec().graph.cuda_graph_config.decode
    sizes = list(getattr(graph, "bs", None) or capture_sizes(case))
    return sorted({s for s in sizes if 1 <= s <= case.envelope.max_num_seqs})


# -- the runner ---------------------------------------------------------------------------------------------------

class HostKvIndices:
    """SGLang's ``create_flashinfer_kv_indices_triton[grid](req_to_token, req_pool_indices, page_kernel_lens,
    kv_indptr, kv_start_idx, kv_indices, stride, ENTRY_PAGE_SIZE=, TOKEN_BLOCK_PARALLEL=, token_mapping=)`` (a Triton
    kernel) done on the host: lane ``b``'s ids ``[start_b, start_b + len_b)`` of its ``req_to_token`` row go to
    ``kv_indices[kv_indptr[b]:]``, a page-granular source expanded to tokens, mapped through ``token_mapping``."""

    def __getitem__(self, grid: SglangValue) -> SglangValue:
        return self._launch

    @staticmethod
    def _launch(req_to_token: SglangValue, req_pool_indices: SglangValue, page_kernel_lens: SglangValue,
                kv_indptr: SglangValue, kv_start_idx: SglangValue,
                kv_indices: SglangValue, stride: int, ENTRY_PAGE_SIZE: int = 1, TOKEN_BLOCK_PARALLEL: bool = False,  # noqa: N803
                token_mapping: SglangValue = None) -> None:
        import numpy as np

        lens = page_kernel_lens.numpy().astype(np.int64)
        bs = len(lens)
        if not bs:
            return
        rows = req_pool_indices.numpy()[:bs].astype(np.int64)
        starts = (kv_start_idx.numpy()[:bs].astype(np.int64) if kv_start_idx is not None
                  else np.zeros(bs, dtype=np.int64))
        offsets = kv_indptr.numpy()[:bs].astype(np.int64)
        table = req_to_token.reshape(-1).numpy()
        out = kv_indices.numpy()
        mapping = token_mapping.numpy() if token_mapping is not None else None
        page = int(ENTRY_PAGE_SIZE)
        for b in range(bs):
            n = int(lens[b])
            if n <= 0:
                continue
            pos = np.arange(starts[b], starts[b] + n, dtype=np.int64)
            ids = table[rows[b] * stride + pos // page].astype(np.int64)
            if page > 1:
                ids = ids * page + pos % page
            if mapping is not None:
                ids = np.where(ids >= 0, mapping[np.maximum(ids, 0)], ids)
            out[offsets[b]:offsets[b] + n] = ids


@contextlib.contextmanager
def host_kv_indices() -> Iterator[None]:
    """SGLang's KV index translator packs its CSR read stream with :class:`HostKvIndices` for the block."""
    import sglang.srt.mem_cache.kv_index_translator as translator

    patches = Patches()
    patches.set(translator, "create_flashinfer_kv_indices_triton", HostKvIndices())
    try:
        yield
    finally:
        patches.undo()


class _KvPoolStandin:
    """What SGLang's attention backend and index translator read of the KV pool: its KV quantization method (an
    unquantized or FP8 cache has none of its own: SGLang's ``UnquantizedKVCacheMethod``). The harness owns the KV
    cache itself, so no buffer is made here."""

    def __init__(self, quant_method: SglangValue, dtype: SglangValue, size: int) -> None:
        self.quant_method = quant_method
        self.dtype = dtype
        self.size = size

    def get_kv_cache_quant_method(self) -> SglangValue:
        return self.quant_method


class _AllocatorStandin:
    """SGLang's token-to-KV allocator as the backend reads it: its KV cache."""

    def __init__(self, kvcache: SglangValue, page_size: int) -> None:
        self._kvcache = kvcache
        self.page_size = page_size

    def get_kvcache(self) -> SglangValue:
        return self._kvcache


class _ModelStandin:
    """The runner's model as SGLang's attention backends read it: its modules (``TRTLLMHAAttnBackend`` looks for
    encoder-only attention layers; a plain decoder has none) and layers (an FP4 cache's method reads calibrated KV
    scales from them: none, so SGLang's neutral scales)."""

    layers: tuple[SglangValue, ...] = ()

    def modules(self) -> Iterator[SglangValue]:
        return iter(())


class SglangRunner:
    """SGLang's ``ModelRunner`` as its attention backend reads it: the request pool (SGLang's ``ReqToTokenPool``), the
    KV pool stand-in, SGLang's ``KVIndexTranslator``, its model config and dtypes, and the runner's capture-stable
    input buffers (``req_pool_indices``, ``seq_lens``, ``out_cache_loc``, ``positions``), made once, before KV
    sizing (SGLang makes its pools with the KV cache)."""

    def __init__(self, case: Case, engine: SglangEngine) -> None:
        import torch
        from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import UnquantizedKVCacheMethod
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        env = case.envelope
        self.case = case
        self.server_args = engine.server_args
        self.model_config = engine.model_config
        self.device = "cuda"
        self.gpu_id = 0
        self.dtype = engine.dtype
        self.kv_cache_dtype = engine.kv_cache_dtype
        self.kv_cache_dtype_str = engine.kv_cache_dtype_str
        self.page_size = engine.page_size  # SGLang's resolved one (trtllm_mla raises 16 to 64)
        self.sliding_window_size = None
        self.is_draft_worker = False
        self.use_mla_backend = case.model.attention == "mla"
        self.spec_algorithm = SpeculativeAlgorithm.from_string(engine.server_args.speculative_algorithm)
        self.draft_attention_backend = None  # --speculative-draft-attention-backend: the target's
        self.prefill_attention_backend_str = engine.attention_backend
        self.decode_attention_backend_str = engine.attention_backend
        self.max_running_requests = env.max_num_seqs
        self.model = _ModelStandin()
        self.req_to_token_pool = ReqToTokenPool(size=env.max_num_seqs, max_context_len=engine.model_config.context_len,
                                                device="cuda", enable_memory_saver=False)
        self.token_to_kv_pool = _KvPoolStandin(self._kv_quant_method(engine) or UnquantizedKVCacheMethod(),
                                               engine.kv_cache_dtype, 0)
        self.token_to_kv_pool_allocator = _AllocatorStandin(self.token_to_kv_pool, self.page_size)
        self.kv_index_translator = KVIndexTranslator(
            req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, token_to_kv_pool=self.token_to_kv_pool,
            page_size=self.page_size, device="cuda")
        q = 1 + case.mtp  # SGLang's captured_req_width
        max_bs = max(engine.capture_bs, default=1)
        tokens = max(env.max_num_batched_tokens, max_bs * q)
        reqs = env.max_num_seqs
        # the verify graphs' custom mask (base_runner.py: (max_bs x seq_len_fill_value + max_num_token) x width)
        self.verify_mask = (torch.ones((max_bs + max_bs * q) * q, dtype=torch.bool, device="cuda") if case.mtp
                            else None)
        self.req_pool_indices = torch.zeros(reqs, dtype=torch.int64, device="cuda")
        self.seq_lens = torch.ones(reqs, dtype=torch.int64, device="cuda")
        self.out_cache_loc = torch.zeros(tokens, dtype=torch.int64, device="cuda")
        self.positions = torch.zeros(tokens, dtype=torch.int64, device="cuda")
        self.prefix_lens = torch.zeros(reqs, dtype=torch.int32, device="cuda")
        self.extend_lens = torch.zeros(reqs, dtype=torch.int32, device="cuda")
        self.num_correct_drafts = torch.zeros(reqs, dtype=torch.int32, device="cuda")
        self.num_accept_tokens = torch.zeros(reqs, dtype=torch.int32, device="cuda")

    def _kv_quant_method(self, engine: SglangEngine) -> SglangValue:
        """SGLang's KV quantization method of an FP4 cache, made as its KV-cache configurator makes it
        (``_build_fp4_quant_method``: the recipe from ``--kv-cache-dtype``, one global scale per layer, the attention
        accesses of the resolved backends, the model's scales: none here, SGLang's neutral 1.0); None for any
        other cache (SGLang's ``UnquantizedKVCacheMethod``)."""
        from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
            get_kv_cache_quant_method,
            resolve_kv_cache_quant,
        )

        name = resolve_kv_cache_quant(engine.kv_cache_dtype_str)
        if name is None:
            return None
        method = get_kv_cache_quant_method(name, num_layers=self.case.model.num_layers, device="cuda",
                                           page_size=self.page_size)
        method.configure_attention_backends_from_server_args(engine.server_args)
        method.load_scales_from_model(self)
        return method

    def draft_runner(self) -> SglangRunner:
        """The draft worker's model runner as its backends read it: SGLang's draft runner shares the target's
        request pool and token allocator (the index translator over them, as the harness owns both KV caches) and
        is a draft worker."""
        draft = copy.copy(self)
        draft.is_draft_worker = True
        return draft

    def forward_batch(self, batch: Batch, capture_bs: list[int], *, graph: bool, capture: bool,
                      draft: bool = False) -> SglangValue:
        """The batch as SGLang's ``ForwardBatch`` on the runner's buffers, with its ``KVLocPlan``: request ``i`` on
        request-pool row ``i + 1`` (row 0 is SGLang's padding row), every request at the envelope's full context
        (``engines/batches.py``). A captured decode size is SGLang's dummy capture batch: rows 0, lengths of
        the backend's fill value.

        With MTP a decode step is SGLang's speculative step: on the target worker ``TARGET_VERIFY`` of the
        ``1 + mtp`` tokens of every request (an ``EagleVerifyInput`` with its tree mask; the lengths are the committed
        prefix), on the draft worker (``draft``) ``DRAFT_EXTEND_V2`` of the same window (an ``EagleDraftExtendInput``;
        the lengths include the window). A prefill or mixed step is an extend on either worker."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        case = self.case
        q = 1 + case.mtp
        if graph:
            batch = pad_to_capture(batch, [bs * q for bs in capture_bs], case.mtp)
        rb = runner_batch(case, batch, case.envelope.max_num_seqs)
        bs, tokens = rb.num_reqs, rb.num_tokens
        speculative = bool(case.mtp) and batch.kind == "decode"
        verify = speculative and not draft
        if capture:
            self.req_pool_indices[:bs].zero_()
            self.seq_lens[:bs].fill_(1)
            seq_lens_cpu = torch.ones(bs, dtype=torch.int64)
        else:
            # a verify step's lengths are the committed prefix: the window is appended by SGLang's verify input
            seq_lens_cpu = torch.tensor(rb.seq_lens, dtype=torch.int64) - (q if verify else 0)
            self.req_pool_indices[:bs].copy_(torch.arange(1, bs + 1, dtype=torch.int64))
            self.seq_lens[:bs].copy_(seq_lens_cpu)
        mode = {"decode": ForwardMode.DECODE, "prefill": ForwardMode.EXTEND, "mixed": ForwardMode.MIXED}[batch.kind]
        if speculative:
            mode = ForwardMode.DRAFT_EXTEND_V2 if draft else ForwardMode.TARGET_VERIFY
        values: dict[str, SglangValue] = dict(
            forward_mode=mode, batch_size=bs, input_ids=self.positions[:tokens], req_pool_indices=
            self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs], seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=self.out_cache_loc[:tokens], seq_lens_sum=int(seq_lens_cpu.sum()),
            positions=self.positions[:tokens], orig_seq_lens=self.seq_lens[:bs], spec_algorithm=self.spec_algorithm,
            can_run_decode_cuda_graph=graph, global_forward_mode=mode)
        if mode != ForwardMode.DECODE and not verify:
            extend = torch.tensor(rb.query_lens, dtype=torch.int32)
            prefix = (seq_lens_cpu.to(torch.int32) - extend).clamp(min=0)
            self.prefix_lens[:bs].copy_(prefix)
            self.extend_lens[:bs].copy_(extend)
            values.update(extend_num_tokens=tokens, extend_seq_lens=self.extend_lens[:bs],
                          extend_prefix_lens=self.prefix_lens[:bs], extend_prefix_lens_cpu=prefix.tolist(),
                          extend_seq_lens_cpu=extend.tolist())
        if verify:
            values["spec_info"] = self._verify_input(seq_lens_cpu, capture)
        elif speculative:
            values["spec_info"] = self._draft_extend_input(bs)
        forward_batch = ForwardBatch(**values)
        if capture:
            self.kv_index_translator.bind_runner_slots(forward_batch)
        else:
            self.kv_index_translator.own_plan(forward_batch).bind(forward_batch, self.kv_index_translator)
        return forward_batch

    def _verify_input(self, seq_lens_cpu: SglangValue, capture: bool) -> SglangValue:
        """SGLang's ``EagleVerifyInput`` of a verify step: a capture reads the graph runner's mask buffer (its
        ``get_spec_info``); a served step carries the tree mask its draft built (every prefix token, then the
        window's own ``(1 + mtp)^2``)."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        q = 1 + self.case.mtp
        bs = len(seq_lens_cpu)
        mask = (self.verify_mask if capture else
                torch.ones(int(seq_lens_cpu.sum()) * q + q * q * bs, dtype=torch.bool, device="cuda"))
        return EagleVerifyInput(
            draft_token=None, custom_mask=mask, positions=None, retrieve_index=None, retrieve_next_token=None,
            retrieve_next_sibling=None, retrieve_cum_len=None, spec_steps=self.case.mtp, topk=1, draft_token_num=q,
            capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=None, seq_lens_cpu=None)

    def _draft_extend_input(self, bs: int) -> SglangValue:
        """SGLang's ``EagleDraftExtendInput`` of a draft-extend step over the whole window (every draft token
        accepted: the longest extend)."""
        from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

        q = 1 + self.case.mtp
        self.num_correct_drafts[:bs].fill_(q - 1)
        self.num_accept_tokens[:bs].fill_(q)
        return EagleDraftExtendInput(num_correct_drafts=self.num_correct_drafts[:bs],
                                     num_accept_tokens=self.num_accept_tokens[:bs], num_tokens_per_req=q,
                                     num_tokens_for_logprob_per_req=1)


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


# -- the backend --------------------------------------------------------------------------------------------------

def engine_refusal(case: Case, attention_backend: str = "flashinfer") -> str | None:
    """Why SGLang (its own ``ServerArgs`` resolution and ``ModelConfig``, on the stand-in platform) or this adapter
    refuses ``case`` with ``attention_backend``; None when it runs."""
    try:
        check_expressible(case, attention_backend)
        with sglang_standins(case.gpu):
            make_sglang_engine(case, attention_backend=attention_backend)
    except UnexpressibleSglangCase as exc:
        return str(exc)
    except (ValueError, AssertionError, NotImplementedError) as exc:
        return f"case {case.id}: SGLang rejects this layout: {type(exc).__name__}: {exc}"
    return None


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

