"""vLLM's own, unmodified ``GDNAttentionMetadataBuilder`` (Gated DeltaNet linear attention, the hybrid models'
second builder) driven through the lifecycle on the simulated GPU, beside a FlashInfer builder of the same
runner.

Why: a hybrid model (Qwen3-Next) runs one metadata builder per KV-cache group: FlashInfer for the full-attention
layers, GDN for the linear-attention ones. The vLLM pull request that teaches FlashInfer to reserve inside the
profiling window declares the GDN builder NEUTRAL (it reserves nothing of its own). Whether that holds is for
the suite to find: this adapter declares what the pull request declares and lets the lifecycle record what
vLLM's builder really allocates, and when.

How the runner integrates it (V1, ``initialize_kv_cache``): the builders are made with the KV cache, after KV
sizing (the harness's ``rebind``), one per micro-batch and KV-cache group. vLLM groups a hybrid model's layers
into groups of as many layers as it has full-attention layers (uniform page size), so Qwen3-Next's 36 GDN
layers are 3 groups of 12. Capture batches go through ``build_for_cudagraph_capture``, serving batches through
``build()``, on the runner's own input buffers (the FlashInfer part's :class:`RunnerInputs`: one runner, one
set of input buffers; the GDN builder reads column 0, and the speculative columns, of the block table as the
state indices, as ``mamba_cache_mode="none"`` does).

Stand-in: ``GDNAttentionMetadataBuilder.__init__`` imports ``_resolve_gdn_prefill_backend`` from the Qwen GDN
layer module, which imports vLLM's model layers (CUDA-only extensions at import). :func:`gdn_resolver_standin`
serves that one function, compiled from vLLM's own source of it, from a stand-in module for the block.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING, ContextManager, cast

from pytest_kvprofile.contract.protocol import Batch, WorkspaceDeclaration
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.engines.adapter import module_standin
from pytest_kvprofile.engines.contract_api import declared_support
from pytest_kvprofile.engines.vllm.config import UnexpressibleCase, model_dtype
from pytest_kvprofile.engines.vllm.flashinfer import DECLARATION_NAMES, VllmAdapter

if TYPE_CHECKING:
    from types import ModuleType

    from torch import Tensor
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import MambaSpec

    from pytest_kvprofile.engines.adapter import EngineObject
    from pytest_kvprofile.engines.vllm.flashinfer import VllmFlashInferBuilder
    from pytest_kvprofile.matrix.cases import Case

__all__ = ["GDN_LAYER_MODULE", "VllmGdnBuilder", "gdn_groups", "gdn_resolver_standin", "mamba_spec"]

GDN_LAYER_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_RESOLVER_FUNCTIONS = ("_resolve_gdn_prefill_backend", "_aiter_flydsl_unsupported_reasons")


def check_hybrid(case: Case) -> None:
    if not case.model.hybrid:
        raise UnexpressibleCase(f"case {case.id}: {case.model.name} has no GDN layers (not a hybrid model)")


def gdn_groups(case: Case) -> list[list[str]]:
    """The GDN layers' KV-cache groups, as vLLM's uniform-page-size grouping makes them: groups of as many layers
    as the model has full-attention layers, in layer order."""
    size = max(1, len(case.model.attention_layers))
    names = [f"model.layers.{i}.linear_attn" for i in case.model.linear_layers]
    return [names[i:i + size] for i in range(0, len(names), size)]


def mamba_spec(case: Case) -> MambaSpec:
    """The rank's GDN state spec, as Qwen3-Next's layer declares it (``MambaStateShapeCalculator``): the conv
    state and the recurrent state, sharded over TP, one block per request (``mamba_cache_mode="none"``), one
    speculative block per MTP token."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import MambaSpec

    model = case.model
    heads_k, heads_v, head_dim = model.linear_heads_k, model.linear_heads_v, model.linear_head_dim
    if heads_k is None or heads_v is None or head_dim is None:
        raise ValueError(f"{model.name} has no GDN layers (linear_heads_k, linear_heads_v, linear_head_dim): "
                         f"case {case.id} has no state for vLLM's GDN builder")
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        case.tp, heads_k, heads_v, head_dim, head_dim, model.linear_conv_kernel, case.mtp)
    dtype = getattr(torch, model_dtype(case))  # the state follows the model's dtype, not a quantized KV cache
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(dtype, "auto", "auto")
    return MambaSpec(block_size=case.envelope.max_model_len, shapes=shapes, dtypes=dtypes,
                     # kept as the string (vLLM's type is MambaAttentionBackendEnum): the harness's value, unchanged
                     mamba_type="gdn_attention",  # type: ignore[arg-type,unused-ignore]
                     num_speculative_blocks=case.mtp)


class _CurrentPlatform:
    """``current_platform`` as vLLM's modules see it when called (the stand-in platform inside a run)."""

    def __getattr__(self, name: str) -> object:
        import vllm.platforms

        platform = vllm.platforms.current_platform
        if name == "get_cuda_runtime_major" and not callable(getattr(type(platform), name, None)):
            return _cuda_runtime_major  # CudaPlatform's; the stand-in platform is a plain CUDA-kind Platform
        return getattr(platform, name)


def _cuda_runtime_major() -> int:
    """The CUDA runtime's major version, as ``CudaPlatform.get_cuda_runtime_major`` reads it (``torch.version``:
    the simulated device's 13.0 inside a run)."""
    import torch.version

    return int(str(torch.version.cuda or "0").split(".")[0])


def _resolver_module() -> ModuleType:
    """A module holding vLLM's own ``_resolve_gdn_prefill_backend`` (and the helper it calls), compiled from the
    installed layer module's source without running that module's imports."""
    import types
    from typing import Literal

    import vllm
    from vllm._aiter_ops import rocm_aiter_ops
    from vllm.config import VllmConfig
    from vllm.logger import init_logger

    path = Path(vllm.__file__).parent / "model_executor" / "layers" / "mamba" / "gdn" / "qwen_gdn_linear_attn.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in _RESOLVER_FUNCTIONS]
    if not any(n.name == _RESOLVER_FUNCTIONS[0] for n in body):
        raise ImportError(f"{path} defines no {_RESOLVER_FUNCTIONS[0]}; this vLLM's GDN builder is not supported")
    module = types.ModuleType(GDN_LAYER_MODULE)
    module.__file__ = str(path)  # the functions' frames name vLLM's own file and lines
    module.__dict__.update(current_platform=_CurrentPlatform(), rocm_aiter_ops=rocm_aiter_ops, Literal=Literal,
                           VllmConfig=VllmConfig, logger=init_logger(GDN_LAYER_MODULE),
                           xpu_gdn_kernel_available=lambda: False)
    # cast: list is invariant; a list of FunctionDef is a list of stmt, and nothing is added to it
    exec(compile(ast.Module(body=cast("list[ast.stmt]", body), type_ignores=[]), str(path), "exec"),  # noqa: S102
         module.__dict__)
    return module


def gdn_resolver_standin() -> ContextManager[None]:
    """For the block, ``GDN_LAYER_MODULE`` is a stand-in serving vLLM's ``_resolve_gdn_prefill_backend``, unless
    the real module is already imported (a CUDA build of vLLM)."""
    return module_standin(GDN_LAYER_MODULE, _resolver_module)


class VllmGdnBuilder(VllmAdapter):
    """vLLM's ``GDNAttentionMetadataBuilder`` as the V1 runner integrates it, sharing ``runner``'s input buffers
    (a :class:`~pytest_kvprofile.engines.vllm.flashinfer.VllmFlashInferBuilder` of the same case): one builder per
    micro-batch and KV-cache group, keyed ``(ubatch, group)``.

    Declares NEUTRAL, as the vLLM pull request does, unless the installed class declares something itself (the
    contract's or the pull request's classmethod on the case's config and state spec, mapped as the FlashInfer
    adapter maps it)."""

    name = "vllm-gdn"
    builder_label = "vLLM's GDNAttentionMetadataBuilder"

    def __init__(self, case: Case, runner: VllmFlashInferBuilder, builder_cls: type | None = None) -> None:
        check_hybrid(case)
        super().__init__(case, builder_cls)
        self.runner = runner
        self.groups = gdn_groups(case)

    def _cls(self) -> type:
        if self.builder_cls is None:
            from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

            self.builder_cls = GDNAttentionMetadataBuilder
        return self.builder_cls

    def get_persistent_workspace_memory_profiling_support(self) -> object:
        with self.standins():
            # NEUTRAL: what the pull request declares for GDN
            return declared_support(self._cls(), DECLARATION_NAMES, lambda: (self.config(), mamba_spec(self.case)),
                                    ProfilingSupport.NEUTRAL)

    def declared_workspace(self, case: Case) -> WorkspaceDeclaration:
        """No float arena and no int workspace: GDN plans no FlashInfer wrapper."""
        return WorkspaceDeclaration(float_bytes=0, int_bytes=0)

    # -- the adapter ---------------------------------------------------------------------------------------
    def builder_keys(self, ubatch: int) -> list[tuple[int, int]]:
        return [(ubatch, g) for g in range(len(self.groups))]

    def ubatch_of(self, key: tuple[int, int]) -> int:
        return int(key[0])

    def describe_key(self, key: tuple[int, int]) -> str:
        return f"ubatch {key[0]}, group {key[1]}"

    def construction_scope(self) -> ContextManager[ModuleType]:
        """The builder's constructor imports its prefill-backend resolver: :func:`gdn_resolver_standin`."""
        return self._scope(gdn_resolver_standin)

    def make_engine_builder(self, key: tuple[int, int]) -> EngineObject:
        import torch

        return self._cls()(mamba_spec(self.case), self.groups[key[1]], self.config(), torch.device("cuda"))

    def captures_attention(self) -> bool:
        """The runner's mode: it captures (or not) every attention group's graphs together."""
        return bool(self.runner.captures_attention())

    def ensure_inputs(self) -> None:
        if self.runner.inputs is None:
            self.runner._make_inputs()

    def engine_metadata(self, batch: Batch) -> EngineObject:
        """The runner's metadata of its padded batch (one runner, one set of input buffers)."""
        inputs = self.runner.inputs
        return inputs.metadata(inputs.padded(batch))

    def build_serving(self, builder: EngineObject, metadata: EngineObject) -> EngineObject:
        return builder.build(common_prefix_len=0, common_attn_metadata=metadata, **self._spec_args(metadata))

    def _spec_args(self, metadata: CommonAttentionMetadata) -> dict[str, Tensor]:
        """With MTP the runner hands GDN each request's accepted tokens and draft count: decode requests carry
        ``mtp`` drafts, prefill requests none (-1)."""
        if not self.case.mtp:
            return {}
        import torch

        qlens = metadata.query_start_loc_cpu.diff()
        drafts = torch.where(qlens == 1 + self.case.mtp, self.case.mtp, -1).to(torch.int32)
        return {"num_accepted_tokens": metadata.query_start_loc.diff(),
                "num_decode_draft_tokens_cpu": drafts}
