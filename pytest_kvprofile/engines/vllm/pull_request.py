"""vLLM's released ``FlashInferMetadataBuilder`` taught the open vLLM pull request's tri-state reservation API, written
here from the pull request's facts (docs/vllm.md, "The pull request's API"), so the suite can be run on that API
with any installed vLLM, and the adapter's recognition and runner order are tested on it.

- The support classmethod ``get_persistent_workspace_memory_profiling_support(vllm_config, kv_cache_spec)`` answers
  the pull request's enum: UNSUPPORTED with DCP or a non-causal spec, else REQUIRED.
- ``reserve_workspace_for_memory_profiling() -> int`` takes vLLM's default arena, max(394 MiB, batched tokens x
  rank query heads x head dim x 16 B), from vLLM's ``WorkspaceManager`` (nothing without one, as the pull request),
  hands it to the builder, and makes every wrapper a route reaches: prefill, eager decode and one CUDA-graph decode
  wrapper per capture size; where a route uses trtllm-gen, vLLM's process-wide trtllm-gen workspace too. It answers
  the bytes it reserved.
- ``rebind_workspace_after_reservation()`` hands the wrappers the micro-batch's arena again when its pointer or size
  moved (the pull request compares ``data_ptr()``, which is metadata, not a use of the old arena).
- ``reserve_workspace_for_cudagraph_capture() -> int`` makes the CUDA-graph wrappers again before capture.
- Off the profiling path (an MTP case) the builder still takes its arena from vLLM's manager, lazily on its first
  wrapper; vLLM's kernel warmup sizes it before the lock (docs/vllm.md, "Kernel warmup").

Two backends (``--kvprofile-backend pytest_kvprofile.engines.vllm.pull_request:backends``): ``vllm-pr-planned``
plans each wrapper once inside the window (one batch of every shape the engine runs, the largest last), so
FlashInfer's plan-time buffers exist at the closing measurement; ``vllm-pr-unplanned`` builds the wrappers without
planning them, as the pull request does, and those buffers first appear in serving (``persistent_memory_visible_at_
closing`` names their bytes and source lines).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import TYPE_CHECKING, Any, Callable

from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.engines.vllm.flashinfer import VLLM_POLICY, engine_refusal, make_vllm_builders
from pytest_kvprofile.engines.vllm.release import vllm_provenance
from pytest_kvprofile.engines.vllm.standins import VLLM_INSTALL_HINT, import_vllm_flashinfer

if TYPE_CHECKING:
    from types import ModuleType

    from torch import Tensor
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from pytest_kvprofile.attention.wrappers import PagedWrapper
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.matrix.cases import Case

__all__ = ["PersistentWorkspaceProfilingSupport", "backends", "pull_request_builder"]

PREFILL_BYTES_PER_ELEM = 16  # vLLM's FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM
BATCH_INVARIANT_BYTES = 2 << 30  # vLLM's FLASHINFER_WORKSPACE_BUFFER_SIZE_BATCH_INVARIANT


class PersistentWorkspaceProfilingSupport(enum.Enum):
    """The pull request's declaration (``vllm.v1.attention.backend``), for a vLLM that does not have it."""

    UNSUPPORTED = 0
    NEUTRAL = 1
    REQUIRED = 2


def _workspace_module() -> ModuleType:
    import vllm.v1.worker.workspace as workspace

    module: ModuleType = workspace
    return module


@functools.cache
def pull_request_builder(plan: bool) -> type:
    """The installed vLLM's ``FlashInferMetadataBuilder`` with the pull request's tri-state API; ``plan``: plan each
    wrapper once inside the window. Long because the subclass is made here, from the class the installed vLLM ships,
    so the pull request's methods sit inside it."""
    # Any: vLLM's builder class, read from the module imported now: mypy takes no base class from a variable
    base: Any = import_vllm_flashinfer().FlashInferMetadataBuilder

    class PullRequestFlashInferBuilder(base):  # type: ignore[misc]
        plans_in_window = plan

        @classmethod
        def get_persistent_workspace_memory_profiling_support(
                cls, vllm_config: VllmConfig, kv_cache_spec: object) -> PersistentWorkspaceProfilingSupport:
            if vllm_config.parallel_config.decode_context_parallel_size > 1:
                return PersistentWorkspaceProfilingSupport.UNSUPPORTED
            if getattr(kv_cache_spec, "non_causal", False):
                return PersistentWorkspaceProfilingSupport.UNSUPPORTED
            return PersistentWorkspaceProfilingSupport.REQUIRED

        @classmethod
        def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: Any) -> Any:  # Any: vLLM's spec and enum
            """The pull request's base: uniform (speculative) decode batches are graphed only where trtllm-gen or
            XQA decodes them; FA2's native decode graphs single-token decodes only, so an MTP case off trtllm-gen
            falls back to piecewise graphs and captures no attention."""
            from vllm.v1.attention.backend import AttentionCGSupport

            module = import_vllm_flashinfer()
            if vllm_config.parallel_config.decode_context_parallel_size > 1:
                return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
            heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
            if module.can_use_trtllm_attention(num_qo_heads=heads, num_kv_heads=kv_cache_spec.num_kv_heads,
                                               is_prefill=False):
                return AttentionCGSupport.UNIFORM_BATCH
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

        # -- the arena ---------------------------------------------------------------------------------
        def _default_arena_bytes(self) -> int:
            import vllm.envs as envs

            if envs.VLLM_BATCH_INVARIANT:
                return BATCH_INVARIANT_BYTES
            est: int = self.max_num_batched_tokens * self.num_qo_heads * self.head_dim * PREFILL_BYTES_PER_ELEM
            return max(int(envs.VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE), est)

        def _manager_arena(self) -> Any:  # Any: the arena tensor (or None) of vLLM's manager, an untyped global
            """This micro-batch's arena from vLLM's manager (the runner picks the slot), or None without one."""
            import torch

            workspace = _workspace_module()
            if not workspace.is_workspace_manager_initialized():
                return None
            (arena,) = workspace.current_workspace_manager().get_simultaneous(
                ((self._default_arena_bytes(),), torch.uint8))
            return arena

        def _get_workspace_buffer(self, *args: Any, **kwargs: Any) -> Any:  # Any: vLLM's untyped tensor
            """The pull request's builder takes its float arena from vLLM's manager whenever one is initialised, on
            the legacy path too, lazily on its first wrapper (``_allocate_workspace_buffer``)."""
            if getattr(self, "_workspace_buffer", None) is None:
                arena = self._manager_arena()
                if arena is not None:
                    self.set_workspace_buffer(arena)
            return super()._get_workspace_buffer(*args, **kwargs)

        def _wrappers(self) -> list[PagedWrapper]:
            found = [self._prefill_wrapper, self._decode_wrapper,
                     *getattr(self, "_decode_wrappers_cudagraph", {}).values()]
            return [w for w in found if w is not None]

        def _hand(self, arena: Tensor) -> None:
            """The arena to the builder and to every wrapper whose float workspace is elsewhere."""
            self.set_workspace_buffer(arena)
            for w in self._wrappers():
                held = w._float_workspace_buffer
                if held.data_ptr() != arena.data_ptr() or held.nbytes != arena.nbytes:
                    w.reset_workspace_buffer(arena, w._int_workspace_buffer)

        # -- the wrappers a route reaches -----------------------------------------------------------------
        def _capture_sizes(self) -> list[int]:
            if not getattr(self, "enable_cuda_graph", False):
                return []
            sizes = self.vllm_config.compilation_config.cudagraph_capture_sizes or []
            return [bs for bs in sorted(sizes) if 0 < bs <= self._decode_cudagraph_max_bs]

        def _make_wrappers(self) -> None:
            self._get_prefill_wrapper()
            self._get_decode_wrapper(self.vllm_config.scheduler_config.max_num_seqs)
            self._make_cudagraph_wrappers()

        def _make_cudagraph_wrappers(self) -> None:
            for bs in self._capture_sizes():
                self._get_decode_wrapper(bs, use_cudagraph=True)

        def _uses_trtllm_gen(self) -> bool:
            import torch

            return bool(getattr(self, "use_trtllm_decode_attention", False)) or \
                torch.cuda.get_device_capability()[0] == 10

        def _trtllm_bytes(self) -> int:
            if not self._uses_trtllm_gen():
                return 0
            return int(import_vllm_flashinfer()._get_trtllm_workspace_buffer().nbytes)

        def _reserved_bytes(self, trtllm: int) -> int:
            ints: int = sum(getattr(w, "_int_workspace_buffer", None) is not None and w._int_workspace_buffer.nbytes
                       for w in self._wrappers())
            return int(self._workspace_buffer.nbytes) + ints + trtllm

        # -- the pull request's API ----------------------------------------------------------------------
        def reserve_workspace_for_memory_profiling(self) -> int:
            arena = self._manager_arena()
            if arena is None:
                return 0
            self._hand(arena)
            self._make_wrappers()
            if self.plans_in_window and not getattr(self, "_planned", False):
                self._plan_every_shape()
                self._planned = True
            return self._reserved_bytes(self._trtllm_bytes())

        def reserve_workspace_for_cudagraph_capture(self) -> int:
            if self._manager_arena() is None:
                return 0
            self._make_cudagraph_wrappers()
            return self._reserved_bytes(self._trtllm_bytes())

        def rebind_workspace_after_reservation(self) -> None:
            arena = self._manager_arena()
            if arena is not None:
                self._hand(arena)

        # -- planning inside the window ----------------------------------------------------------------
        def _plan_every_shape(self) -> None:
            """One build of every shape the engine runs: each captured decode size, then a prefill and a mixed step
            of the whole token budget and the largest eager decode step, every request at full context (an eager
            wrapper's plan resizes its buffers for the batch, so the largest comes last)."""
            sched = self.vllm_config.scheduler_config
            budget, reqs = sched.max_num_batched_tokens, sched.max_num_seqs
            spec = self.vllm_config.speculative_config
            q = 1 + (spec.num_speculative_tokens if spec is not None else 0)  # query tokens of a decode request
            for bs in self._capture_sizes():  # capture sizes are tokens
                if bs % q == 0:
                    self.build_for_cudagraph_capture(self._metadata([q] * (bs // q)))
            prefills = max(1, min(reqs, budget))
            self.build(0, self._metadata([budget // prefills + (i < budget % prefills) for i in range(prefills)]))
            decodes = min(reqs, budget) // 2
            rest = budget - decodes
            mixed = [1] * decodes + [rest // max(1, prefills - decodes)] * max(1, prefills - decodes)
            self.build(0, self._metadata(mixed))
            self.build(0, self._metadata([q] * max(1, min(reqs, budget // q))))

        def _metadata(self, query_lens: list[int]) -> CommonAttentionMetadata:
            """vLLM's ``CommonAttentionMetadata`` of requests with ``query_lens`` at the model's full context, on
            input buffers the builder keeps (as a runner keeps its own): planning allocates only what FlashInfer's
            plan keeps."""
            import torch
            from vllm.v1.attention.backend import CommonAttentionMetadata

            sched = self.vllm_config.scheduler_config
            n, tokens = len(query_lens), sum(query_lens)
            seq_len = max(self.vllm_config.model_config.max_model_len, max(query_lens))
            pages = -(-seq_len // self.kv_cache_spec.block_size)
            if getattr(self, "_inputs", None) is None:
                reqs, budget = sched.max_num_seqs, sched.max_num_batched_tokens
                self._inputs = (torch.zeros(reqs + 1, dtype=torch.int32, device=self.device),
                                torch.zeros(reqs, dtype=torch.int32, device=self.device),
                                torch.arange(reqs * pages, dtype=torch.int32, device=self.device).view(reqs, pages),
                                torch.arange(budget, dtype=torch.int64, device=self.device))
            qsl_gpu, seq_gpu, block_table, slots = self._inputs
            qsl = torch.zeros(n + 1, dtype=torch.int32)
            qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
            seq_lens = torch.full((n,), seq_len, dtype=torch.int32)
            qsl_gpu[:n + 1].copy_(qsl)
            seq_gpu[:n].copy_(seq_lens)
            values = {
                "query_start_loc": qsl_gpu[:n + 1], "query_start_loc_cpu": qsl,
                "seq_lens": seq_gpu[:n], "seq_lens_cpu": seq_lens, "seq_lens_cpu_upper_bound": seq_lens,
                "num_computed_tokens_cpu": seq_lens - torch.tensor(query_lens, dtype=torch.int32),
                "num_reqs": n, "num_actual_tokens": tokens, "max_query_len": max(query_lens),
                "max_seq_len": seq_len, "block_table_tensor": block_table[:n], "slot_mapping": slots[:tokens],
                "causal": True,
            }
            fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
            return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in fields})

    PullRequestFlashInferBuilder.__qualname__ = PullRequestFlashInferBuilder.__name__ = (
        "PullRequestFlashInferBuilder" if plan else "PullRequestFlashInferBuilderUnplanned")
    return PullRequestFlashInferBuilder


def _make(plan: bool) -> Callable[[Case], list[Builder]]:
    def make_builders(case: Case) -> list[Builder]:
        return make_vllm_builders(case, builder_cls=pull_request_builder(plan))

    return make_builders


def backends() -> list[Backend]:
    """``vllm-pr-planned`` (plans each wrapper once in the window: opts in) and ``vllm-pr-unplanned`` (the pull
    request's own choice: FlashInfer's plan-time buffers are invisible to KV sizing)."""
    common = dict(torch_mode=True, refuses_layout=engine_refusal, requires=("vllm",), install_hint=VLLM_INSTALL_HINT,
                  policy=VLLM_POLICY, origin="builtin", provenance=vllm_provenance("vllm-pr"))
    return [
        Backend(name="vllm-pr-planned", make_builders=_make(True),
                description="vLLM's FlashInferMetadataBuilder with the pull request's tri-state API, planning each "
                            "wrapper once inside the window", **common),  # type: ignore[arg-type]
        Backend(name="vllm-pr-unplanned", make_builders=_make(False),
                description="the same, building its wrappers without planning them, as the pull request does",
                **common),  # type: ignore[arg-type]
    ]
