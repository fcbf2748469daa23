"""The case as SGLang's config: the HF ``config.json`` of its head layout, SGLang's ``ServerArgs``, its runtime
context and ``ModelConfig`` (:func:`make_sglang_engine`), and what SGLang or the simulated GPU refuses
(:func:`check_expressible`, :func:`engine_refusal`). The ``sglang-flashinfer`` backend (``flashinfer.py``) and its
trtllm siblings run on it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_kvprofile.engines.batches import capture_sizes
from pytest_kvprofile.engines.model_config import config_dir, decoder_config
from pytest_kvprofile.engines.sglang.facts import SGLANG_FACTS
from pytest_kvprofile.engines.sglang.standins import (
    sglang_standins,
)
from pytest_kvprofile.matrix.kv_dtypes import KV_DTYPES

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.cases import Case

# An SGLang, torch or numpy object: each is imported lazily (never at plugin import), and SGLang ships no types
SglangValue = Any

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
