"""vLLM's released ``FlashInferMetadataBuilder``, taught the reservation contract the way the open pull request
describes it, without changing a line of vLLM.

- It declares REQUIRED.
- Inside the profiling window it makes the runner's builders (one per micro-batch), reserves the shared float arena
  through the engine's workspace manager (``ctx.get_workspace``) and hands each builder its micro-batch's view with
  vLLM's own ``set_workspace_buffer``; then vLLM's unmodified ``build()`` plans one batch of every shape the engine
  will run (a prefill, a mixed and an eager decode step, and every captured decode size), which makes exactly the
  wrappers the enabled routes use, each with its int workspace, and tells which routes go to trtllm-gen.
- Where a route uses trtllm-gen it touches vLLM's process-wide trtllm-gen workspace inside the window.
- The lease keeps the builders, their wrappers and the trtllm-gen workspace; ``rebind`` hands each builder its
  view again after KV sizing (the pointer never moves); the engine locks the arena.

Two sizes of arena: ``vllm-flashinfer-reserving`` reserves vLLM's existing default, max(394 MiB, batched tokens x
rank query heads x head dim x 16 B), as the pull request does on purpose; ``vllm-flashinfer-reserving-exact``
reserves what FlashInfer's planner carves for the case (``pytest_kvprofile.sizing.for_case``).

``vllm-hybrid-gdn`` is a hybrid model's builder set (Qwen3-Next: full attention every 4th layer, Gated DeltaNet
linear attention on the others): the reserving FlashInfer builder for the full-attention layers plus vLLM's
released ``GDNAttentionMetadataBuilder`` for the GDN layers, declared NEUTRAL as the pull request declares it
(``pytest_kvprofile.engines.vllm.gdn``). Whether it is NEUTRAL is what the suite finds; run it on
``matrices/hybrid.yaml``.
"""

from __future__ import annotations

from typing import Any

from pytest_kvprofile import Backend, Batch, BuilderContext, ProfilingSupport, WorkspaceDeclaration
from pytest_kvprofile.attention.facts import FLASHINFER_INT_WORKSPACE_BYTES
from pytest_kvprofile.engines.batches import window_batches
from pytest_kvprofile.engines.vllm.facts import VLLM_DEFAULT_FLOAT_BYTES
from pytest_kvprofile.engines.vllm.flashinfer import VllmFlashInferBuilder, engine_refusal
from pytest_kvprofile.engines.vllm.gdn import VllmGdnBuilder
from pytest_kvprofile.engines.vllm.release import vllm_provenance
from pytest_kvprofile.engines.vllm.standins import VLLM_INSTALL_HINT
from pytest_kvprofile.sizing import for_case

__version__ = "0.1.0"
PREFILL_BYTES_PER_ELEM = 16  # vLLM's FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM


def vllm_default_arena(case: Any) -> int:
    """vLLM's own rule (``_get_workspace_buffer``): never below the configured default, else the prefill chunk's
    head footprint."""
    est = case.envelope.max_num_batched_tokens * (case.model.heads_q // case.tp) * case.model.head_dim
    return max(VLLM_DEFAULT_FLOAT_BYTES, est * PREFILL_BYTES_PER_ELEM)


def exact_arena(case: Any) -> int:
    """What FlashInfer's planner carves for the case, the number ``workspace_covers_planner`` sizes against."""
    return for_case(case).float_bytes


class ReservingFlashInferBuilder(VllmFlashInferBuilder):
    """The released builder plus the contract: REQUIRED, everything made inside the window, leased, rebound."""

    name = "vllm-flashinfer-reserving"

    def __init__(self, case: Any, arena_bytes: int) -> None:
        super().__init__(case)
        self.arena_bytes = arena_bytes
        self.trtllm_workspace: Any = None
        self.routes: set[str] = set()

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED

    def declared_workspace(self, case: Any) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=self.arena_bytes, int_bytes=FLASHINFER_INT_WORKSPACE_BYTES)

    def _hand_views(self, ctx: BuilderContext) -> list[Any]:
        views = []
        for ub, builder in sorted(self.builders.items()):
            view = ctx.get_workspace(self.arena_bytes, ub)
            builder.set_workspace_buffer(view.tensor)
            views.append(view)
        return views

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Any:
        made: list[Any] = []
        try:
            made = self.make_engine_builders(ctx.num_ubatches)
            views = self._hand_views(ctx)
            # every captured decode size first, then the eager routes at their most requests (engines/batches.py)
            for batch in window_batches(self.case):
                for ub in range(ctx.num_ubatches):
                    self.build(ctx, Batch(batch.kind, batch.num_reqs, batch.num_tokens, batch.cuda_graph, ub))
            if self.routes & {"prefill:trtllm-gen", "decode:trtllm-gen", "decode:xqa"}:
                with self.standins() as module:
                    self.trtllm_workspace = module._get_trtllm_workspace_buffer()
        except BaseException:
            for ub in [ub for ub, b in self.builders.items() if any(b is m for m in made)]:
                del self.builders[ub]  # nothing half-built stays: the first error is the one raised
            self.last_metadata = None  # it holds the last wrapper built (its int workspace) alive
            raise
        return ctx.lease([*self.builders.values(), *views, self.trtllm_workspace])

    def build(self, ctx: BuilderContext, batch: Batch) -> None:
        super().build(ctx, batch)
        self.routes.update(self._routes_of(self.last_metadata))

    @staticmethod
    def _routes_of(metadata: Any) -> set[str]:
        """The routes one build chose, read from vLLM's metadata (native FA2 or trtllm-gen/XQA)."""
        routes = set()
        prefill, decode = getattr(metadata, "prefill", None), getattr(metadata, "decode", None)
        if prefill is not None:
            routes.add("prefill:trtllm-gen" if type(prefill).__name__ == "TRTLLMPrefill" else "prefill:native")
        if decode is not None:
            kernel = getattr(getattr(decode, "kernel", None), "value", None)
            routes.add(f"decode:{kernel}" if kernel else "decode:native")
        return routes

    def rebind(self, ctx: BuilderContext) -> None:
        """After KV sizing: the builders exist (made in the window); hand each its view again."""
        self._hand_views(ctx)


def _make(arena: Any, name: str) -> Any:
    def make_builders(case: Any) -> list[Any]:
        builder = ReservingFlashInferBuilder(case, arena(case))
        builder.name = name
        return [builder]

    return make_builders


def _make_hybrid(case: Any) -> list[Any]:
    """The hybrid runner's builders: reserving FlashInfer (full attention) and vLLM's GDN builder, which shares
    the runner's input buffers with it."""
    flashinfer = ReservingFlashInferBuilder(case, vllm_default_arena(case))
    return [flashinfer, VllmGdnBuilder(case, flashinfer)]


def hybrid_refusal(case: Any) -> str | None:
    """vLLM's refusal of the layout, and a model without GDN layers (nothing for the GDN builder to serve)."""
    if not case.model.hybrid:
        return f"case {case.id}: {case.model.name} has no GDN layers; vllm-hybrid-gdn runs hybrid models only"
    return engine_refusal(case)


def backends() -> list[Backend]:
    return [
        Backend(name="vllm-flashinfer-reserving", make_builders=_make(vllm_default_arena, "vllm-flashinfer-reserving"),
                version=__version__, torch_mode=True, refuses_layout=engine_refusal, requires=("vllm",),
                install_hint=VLLM_INSTALL_HINT, provenance=vllm_provenance("vllm-flashinfer-reserving"),
                description="vLLM's FlashInferMetadataBuilder reserving vLLM's default arena inside the window"),
        Backend(name="vllm-flashinfer-reserving-exact",
                make_builders=_make(exact_arena, "vllm-flashinfer-reserving-exact"), version=__version__,
                torch_mode=True, refuses_layout=engine_refusal, requires=("vllm",), install_hint=VLLM_INSTALL_HINT,
                provenance=vllm_provenance("vllm-flashinfer-reserving-exact"),
                description="the same, reserving exactly what FlashInfer's planner carves for the case"),
    ]


def hybrid_backends() -> list[Backend]:
    """``vllm-hybrid-gdn``, its own entry point (run it on ``matrices/hybrid.yaml``; it refuses models without GDN
    layers)."""
    return [
        Backend(name="vllm-hybrid-gdn", make_builders=_make_hybrid, version=__version__, torch_mode=True,
                refuses_layout=hybrid_refusal, requires=("vllm",), install_hint=VLLM_INSTALL_HINT,
                provenance=vllm_provenance("vllm-hybrid-gdn"),
                description="a hybrid model's builders: the reserving FlashInfer builder (REQUIRED) and vLLM's "
                            "GDNAttentionMetadataBuilder declared NEUTRAL, as the pull request declares it"),
    ]
