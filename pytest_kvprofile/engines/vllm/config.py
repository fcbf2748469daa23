"""A harness case as vLLM sees it: a local HF ``config.json``, a ``VllmConfig``, a KV-cache spec and the
attention layers vLLM's metadata builder reads its hyperparameters from.

Why: vLLM's ``FlashInferMetadataBuilder`` takes everything from its config (scheduler limits, CUDA-graph
capture sizes, TP/DCP, speculative tokens) and from the model's registered attention layers (query heads,
``sm_scale``, window). The case supplies all of it; nothing is downloaded. The model class is a stand-in
registered under its own architecture name (vLLM's model inspection imports the real model classes, which
need the CUDA flash-attention extension); the layers are stand-ins holding vLLM's real ``FlashInferImpl``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, cast

from pytest_kvprofile.contract.backends import KvSizingMode
from pytest_kvprofile.engines.model_config import config_dir, decoder_config
from pytest_kvprofile.engines.vllm.facts import VLLM_FACTS
from pytest_kvprofile.engines.vllm.release import (
    EXTENSIBLE,
    PROFILE_WINDOW,
    extensible_kv_cache_request,
    has_extensible_kv_cache,
    vllm_version,
)
from pytest_kvprofile.matrix.cases import Case

if TYPE_CHECKING:
    from torch import Tensor
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from pytest_kvprofile.matrix.models import ModelSpec

__all__ = ["STANDIN_ARCHITECTURE", "UnexpressibleCase", "hf_config", "hf_config_dir", "kv_cache_spec",
           "kv_sizing_mode", "layer_names", "make_vllm_config", "resolve_cudagraph_mode", "resolve_kv_cache_layout",
           "standin_layers", "standin_model_registered"]

STANDIN_ARCHITECTURE = "KvprofileStandinForCausalLM"
# The stand-in model's own dtypes (torch names): an unquantized KV cache is the model's dtype; a quantized one (its
# KvDtype says so, matrix/kv_dtypes.py) sits under a bf16 model, as vLLM's --kv-cache-dtype puts it.
_MODEL_TORCH_DTYPES = ("bfloat16", "float16")


class UnexpressibleCase(ValueError):
    """A case this adapter cannot express as a vLLM FlashInfer configuration; the message names it and why."""


def check_expressible(case: Case) -> None:
    """Raise :class:`UnexpressibleCase` for a case vLLM's FlashInfer (non-MLA) builder does not serve."""
    model = case.model
    if model.attention == "mla":
        raise UnexpressibleCase(f"case {case.id}: MLA layouts are served by vLLM's FlashInfer MLA backend "
                                "(FlashInferMLAMetadataBuilder), not FlashInferMetadataBuilder")
    if case.unsized_reason is not None:
        raise UnexpressibleCase(f"case {case.id}: vLLM's FlashInfer backend plans no FA2 route here, and the "
                                f"simulated GPU has no host module for trtllm-gen ({case.unsized_reason}; run it on "
                                "the GPU tier)")
    refusal = _fp8_query_refusal(case) or _nvfp4_fa2_refusal(case)
    if refusal is not None:
        raise UnexpressibleCase(refusal)
    if model.kv.model_torch not in _MODEL_TORCH_DTYPES:
        raise UnexpressibleCase(f"case {case.id}: KV dtype {model.kv_dtype!r} ({model.kv.torch}) is not expressed by "
                                f"this adapter: its stand-in model is {' or '.join(_MODEL_TORCH_DTYPES)}, under any "
                                "quantized cache of matrix/kv_dtypes.py")
    if case.gpu.compute_capability == (9, 0) and not model.kv.quantized:
        raise UnexpressibleCase(
            f"case {case.id}: with a {model.kv_dtype} KV cache on {case.gpu.name} (SM90) FlashInfer's 'auto' backend "
            "plans vLLM's prefill on FA3, which the simulated GPU has no host planner for (run it on the GPU tier)")
    if model.dim_vo != model.head_dim:
        raise UnexpressibleCase(f"case {case.id}: head_dim_vo {model.dim_vo} != head_dim {model.head_dim}; "
                                "vLLM's FlashInfer builder plans one head size")
    if model.heads_q % case.tp:
        raise UnexpressibleCase(f"case {case.id}: {model.heads_q} query heads do not split over TP={case.tp}")
    if case.dcp > 1 and case.gpu.compute_capability[0] >= 10:
        raise UnexpressibleCase(
            f"case {case.id}: with DCP={case.dcp} on {case.gpu.name} (compute capability "
            f"{case.gpu.compute_capability[0]}.{case.gpu.compute_capability[1]}) vLLM's FlashInfer prefill plans "
            "FlashInfer's CUTLASS sm100 FMHA, which this adapter does not drive (the simulated GPU plans it, "
            "attention/host_cutlass.py, but vLLM's DCP prefill on it is not validated here; run it on the GPU tier)")


def _fp8_query_refusal(case: Case) -> str | None:
    """Where vLLM's FlashInfer builder quantizes the query to the FP8 cache's type (``get_q_data_type``: SM90 and
    SM100) and so plans a route the simulated GPU cannot serve, vLLM's route and FlashInfer's own refusal, or None."""
    kv, gpu = case.model.kv, case.gpu
    if not kv.name.startswith("fp8"):
        return None
    cc = gpu.compute_capability
    if cc == (9, 0):
        return (f"case {case.id}: with a {kv.name} KV cache on {gpu.name} (SM90) vLLM's FlashInfer builder quantizes "
                "the query to FP8, and FlashInfer plans its prefill on FA3, which the simulated GPU has no host "
                "planner for (run it on the GPU tier)")
    if cc[0] == 10 and kv.torch == "float8_e4m3fn":
        return (f"case {case.id}: with a {kv.name} KV cache on {gpu.name} (SM100) vLLM's FlashInfer builder quantizes "
                "the query to FP8 E4M3 for trtllm-gen attention; without FlashInfer's trtllm-gen cubins (offline, "
                "as on the simulated GPU) it plans FlashInfer's FA2 decode, which refuses an E4M3 query off SM120 "
                "(\"The fa2 tensor-core decode takes an e4m3 query only on SM120\"); run it on the GPU tier")
    return None


def _nvfp4_fa2_refusal(case: Case) -> str | None:
    """What vLLM's FlashInfer builder raises for an NVFP4 cache it reads with FA2 (off SM100), or None."""
    if case.model.kv_dtype != "nvfp4":
        return None
    if case.dcp > 1:
        return f"case {case.id}: vLLM refuses an NVFP4 KV cache with DCP on FA2 (\"The DCP prefill wrapper cannot " \
               "read NVFP4 block scales.\")"
    if case.model.head_dim == 64:
        return f"case {case.id}: vLLM refuses an NVFP4 KV cache at head size 64 on FA2 (\"fa2 prefill misreads " \
               "NVFP4 at head_size 64.\")"
    return None


def hf_config(case: Case) -> dict[str, object]:
    """The ``config.json`` of a plain GQA decoder with the case's head layout (a hybrid model's GDN keys added)."""
    return decoder_config(case, STANDIN_ARCHITECTURE, "llama", **_hybrid_keys(case.model))


def _hybrid_keys(model: ModelSpec) -> dict[str, object]:
    """A hybrid model's GDN geometry under Qwen3-Next's config names (what vLLM's GDN builder reads); none for a
    plain decoder, whose config stays as it was."""
    if not model.hybrid:
        return {}
    full = set(model.attention_layers)
    return {
        "full_attention_interval": model.full_attention_interval,
        "layer_types": ["full_attention" if i in full else "linear_attention" for i in range(model.num_layers)],
        "linear_num_key_heads": model.linear_heads_k,
        "linear_num_value_heads": model.linear_heads_v,
        "linear_key_head_dim": model.linear_head_dim,
        "linear_value_head_dim": model.linear_head_dim,
        "linear_conv_kernel_dim": model.linear_conv_kernel,
    }


def _cache_root() -> Path:
    from pytest_kvprofile.attention.oracle_build import cache_root

    return cache_root() / "vllm-hf-configs"


def hf_config_dir(case: Case, root: Path | None = None) -> Path:
    """A directory holding the case's ``config.json`` (written once per layout, atomically)."""
    return config_dir(hf_config(case), root or _cache_root())


def _standin_model_cls() -> type:
    import torch

    class KvprofileStandinForCausalLM(torch.nn.Module):
        """The interface vLLM's model inspection checks; never instantiated by the harness."""

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__()

        def embed_input_ids(self, input_ids: Tensor) -> Tensor:
            raise NotImplementedError

        def forward(self, input_ids: Tensor, positions: Tensor, intermediate_tensors: object = None,
                    inputs_embeds: Tensor | None = None) -> Tensor:
            raise NotImplementedError

        def compute_logits(self, hidden_states: Tensor) -> Tensor:
            raise NotImplementedError

    KvprofileStandinForCausalLM.__name__ = STANDIN_ARCHITECTURE
    return KvprofileStandinForCausalLM


@contextlib.contextmanager
def standin_model_registered() -> Iterator[None]:
    """vLLM's model registry knows :data:`STANDIN_ARCHITECTURE` for the block."""
    from vllm.model_executor.models.registry import ModelRegistry

    models = ModelRegistry.models
    had = models.get(STANDIN_ARCHITECTURE)
    if had is None:
        ModelRegistry.register_model(STANDIN_ARCHITECTURE, _standin_model_cls())
    try:
        yield
    finally:
        if had is None:
            models.pop(STANDIN_ARCHITECTURE, None)


def model_dtype(case: Case) -> Literal["bfloat16", "float16"]:
    """The model's dtype: the KV dtype where the cache is unquantized, bf16 under a quantized cache."""
    kv = case.model.kv
    # cast: KvDtype.model_torch is a str; check_expressible lets a case through only where it is in _MODEL_TORCH_DTYPES
    return cast('Literal["bfloat16", "float16"]', kv.model_torch)


def cache_dtype(case: Case) -> str:
    """vLLM's ``--kv-cache-dtype`` for the case ("auto": the model's dtype)."""
    spelled = VLLM_FACTS.kv_cache_dtype(case.model.kv_dtype)
    if spelled is None:
        raise UnexpressibleCase(f"case {case.id}: KV dtype {case.model.kv_dtype!r} has no vLLM --kv-cache-dtype "
                                "(engines/vllm/facts.py)")
    return spelled


def _torch_dtype(case: Case) -> Any:  # Any: a torch.dtype, read by name with getattr
    """The KV cache's storage dtype as vLLM's runner allocates it (quantized caches are uint8 storage)."""
    import torch
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    if case.model.kv.quantized:
        return STR_DTYPE_TO_TORCH_DTYPE[cache_dtype(case)]
    return getattr(torch, model_dtype(case))


def make_vllm_config(case: Case, *, hf_dir: Path | None = None) -> VllmConfig:
    """The ``VllmConfig`` of one case's rank: TP/DCP, MTP as ``num_speculative_tokens`` (the n-gram proposer:
    the builder only reads the count), the envelope's scheduler limits and capture sizes (tokens), full
    CUDA graphs for decode."""
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        ModelConfig,
        ParallelConfig,
        PassConfig,
        SchedulerConfig,
        VllmConfig,
    )

    check_expressible(case)
    env = case.envelope
    folder = hf_dir or hf_config_dir(case)
    with standin_model_registered():
        model_config = ModelConfig(model=str(folder), tokenizer=str(folder), skip_tokenizer_init=True,
                                   dtype=model_dtype(case), max_model_len=env.max_model_len)
    parallel = ParallelConfig(tensor_parallel_size=case.tp, decode_context_parallel_size=case.dcp)
    scheduler = SchedulerConfig(max_num_seqs=env.max_num_seqs, max_num_batched_tokens=env.max_num_batched_tokens,
                                max_model_len=env.max_model_len, is_encoder_decoder=False)
    passes = {}
    if "fuse_allreduce_rms" in getattr(PassConfig, "__dataclass_fields__", {}):
        passes["fuse_allreduce_rms"] = False  # sizing it imports fusion passes bound to vllm._C's CUDA ops
    compilation = CompilationConfig(cudagraph_capture_sizes=sorted(env.cuda_graph_sizes),
                                    # vLLM's pydantic validator parses the mode from its name (as from its CLI)
                                    cudagraph_mode="FULL_AND_PIECEWISE",  # type: ignore[arg-type,unused-ignore]
                                    pass_config=PassConfig(**passes))
    kwargs: dict[str, Any] = {}  # Any: VllmConfig's optional sub-configs, by name, each of its own type
    if case.mtp:
        from vllm.config import SpeculativeConfig

        kwargs["speculative_config"] = SpeculativeConfig(method="ngram", num_speculative_tokens=case.mtp,
                                                         prompt_lookup_max=2, prompt_lookup_min=1)
    # Any: a CacheConfig field the installed vLLM may not have (0.34's enable_extensible_kv_cache), passed by name
    request: dict[str, Any] = dict(extensible_kv_cache_request(case))
    cache = CacheConfig(block_size=env.page_size, cache_dtype=cache_dtype(case), **request)
    try:
        return VllmConfig(model_config=model_config, parallel_config=parallel, scheduler_config=scheduler,
                          compilation_config=compilation, cache_config=cache, **kwargs)
    except ValueError as exc:  # pydantic's ValidationError: vLLM's own refusal of the layout
        errors_of = getattr(exc, "errors", None)  # pydantic's ValidationError.errors(); a plain ValueError has none
        errors = errors_of() if callable(errors_of) else [{"msg": str(exc)}]
        reason = " ".join(str(errors[0].get("msg", exc)).split())
        raise UnexpressibleCase(f"case {case.id}: vLLM rejects this layout: {reason}") from None


def resolve_kv_cache_layout(case: Case, vllm_config: VllmConfig) -> None:
    """What vLLM's engine core does once before profiling (``resolve_kv_cache_layout``): the layout the FlashInfer
    backend prefers on this GPU, recorded on the cache config. Older vLLMs without the field read it lazily."""
    cache = vllm_config.cache_config
    if getattr(cache, "kv_cache_layout", "absent") is not None:
        return
    from vllm.v1.attention.backends import utils
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    layouts = FlashInferBackend.supported_kv_cache_layouts()
    names = [layout.name for layout in layouts] if layouts else ["LBNHC"]
    utils.resolve_kv_cache_layout(vllm_config, [names], [kv_cache_spec(case)])


# Any: vLLM's builder class, an AttentionMetadataBuilder[M] of a metadata type M that differs per backend
def resolve_cudagraph_mode(case: Case, vllm_config: VllmConfig, builder_cls: type[Any]) -> None:
    """What vLLM's model runner does before it makes its builders (``_check_and_update_cudagraph_mode``): the
    CUDA-graph mode the builder class supports on this layout, resolved by vLLM's own
    ``resolve_cudagraph_mode_and_sizes`` and recorded on the config. With speculative decoding (MTP) and a builder
    that graphs single-token decodes only (FlashInfer under DCP, or where no trtllm-gen/XQA decode takes the
    layout), vLLM falls back to piecewise graphs: attention is then never captured, and the builder never makes its
    CUDA-graph decode wrappers. The capture sizes stay the case's (the driver captures those)."""
    compilation = vllm_config.compilation_config
    resolve = getattr(compilation, "resolve_cudagraph_mode_and_sizes", None)
    if resolve is None:  # a vLLM that resolves the mode elsewhere: the config's mode as it is
        return
    from vllm.config import set_current_vllm_config

    sizes, largest = compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size
    try:
        with set_current_vllm_config(vllm_config):
            resolve(builder_cls.get_cudagraph_support(vllm_config, kv_cache_spec(case)), builder_cls.__name__,
                    1 + case.mtp)
    finally:
        compilation.cudagraph_capture_sizes, compilation.max_cudagraph_capture_size = sizes, largest


def kv_cache_spec(case: Case) -> FullAttentionSpec:
    """The rank's full-attention KV-cache spec (KV heads per rank, page size, dtype)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    return FullAttentionSpec(block_size=case.envelope.page_size, num_kv_heads=case.heads.heads_kv,
                             head_size=case.model.head_dim, dtype=_torch_dtype(case),
                             kv_quant_mode=get_kv_quant_mode(cache_dtype(case)))


def layer_names(case: Case) -> list[str]:
    """The full-attention layers (all of them but a hybrid model's GDN layers)."""
    return [f"model.layers.{i}.self_attn.attn" for i in case.model.attention_layers]


def standin_layers(case: Case, vllm_config: VllmConfig) -> None:
    """Register one attention layer per model layer in ``vllm_config``'s forward context, each holding vLLM's
    real ``FlashInferImpl`` with the rank's heads (what ``get_per_layer_parameters`` and the query-head count
    read)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferImpl

    heads = case.heads
    spec = kv_cache_spec(case)

    class StandinAttentionLayer(AttentionLayerBase):  # type: ignore[misc,unused-ignore]  # Any without vLLM
        def __init__(self) -> None:
            self.impl = FlashInferImpl(num_heads=heads.heads_q, head_size=case.model.head_dim,
                                       scale=case.model.head_dim ** -0.5, num_kv_heads=heads.heads_kv,
                                       alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")

        def get_attn_backend(self) -> type[FlashInferBackend]:
            backend: type[FlashInferBackend] = FlashInferBackend
            return backend

        def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FullAttentionSpec:
            return spec

    from vllm.config import set_current_vllm_config

    context = vllm_config.compilation_config.static_forward_context
    with set_current_vllm_config(vllm_config):
        for name in layer_names(case):
            context[name] = StandinAttentionLayer()


def kv_sizing_mode(case: Case, config: VllmConfig | None = None) -> KvSizingMode:
    """Where the installed vLLM sizes the KV cache on ``case``, as vLLM resolves it (``VllmConfig``'s own
    ``_resolve_extensible_kv_cache`` on the case's config, made on the stand-in platform), and why."""
    if not has_extensible_kv_cache():
        return KvSizingMode(PROFILE_WINDOW, "profile", f"vLLM {vllm_version()} has no extensible KV cache")
    if config is None:
        from pytest_kvprofile.engines.vllm.standins import vllm_standins

        with vllm_standins(case.gpu, dcp=case.dcp, ranks=case.tp):
            config = make_vllm_config(case)
    if getattr(config.cache_config, "enable_extensible_kv_cache", False):  # a field of 0.34 and later
        return KvSizingMode(EXTENSIBLE, "post_warmup")
    return KvSizingMode(PROFILE_WINDOW, "profile", _off_reason(case, config))


def _off_reason(case: Case, config: VllmConfig) -> str:
    """Why vLLM turned its extensible KV cache off on this case, in its ``_resolve_extensible_kv_cache``'s terms."""
    cache = config.cache_config
    if case.envelope.kv_sizing == "profile":
        return ("the matrix asks for the profiling window (envelope.kv_sizing: profile): "
                "enable_extensible_kv_cache=False")
    if cache.kv_cache_memory_bytes is not None:
        return "kv_cache_memory_bytes is set, which the extensible KV cache's measurement would override"
    if cache.num_gpu_blocks_override is not None:
        return "num_gpu_blocks_override is set, which the extensible KV cache's measurement would override"
    if config.parallel_config.enable_elastic_ep:
        return "elastic EP reuses the profiled KV cache size"
    return "vLLM's _resolve_extensible_kv_cache turned it off on this config"
