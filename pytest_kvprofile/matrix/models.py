"""Model head layouts, and the per-rank view of them under TP/DCP/MTP (docs/contract.md, "Parallel layouts")."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvprofile.matrix.kv_dtypes import KvDtype, kv_dtype


@dataclass(frozen=True)
class ModelSpec:
    """The attention geometry of one model, as a matrix names it.

    ``head_dim``/``head_dim_vo`` are what the FlashInfer prefill wrapper is planned with. MLA-style
    models store a compressed latent in the KV cache, so ``kv_cache_heads`` and ``kv_cache_head_dim``
    describe the cache when they differ from the attention heads (DeepSeek: 1 x 576).
    """

    name: str
    heads_q: int
    heads_kv: int
    head_dim: int
    num_layers: int
    kv_dtype: str = "bf16"
    head_dim_vo: int | None = None
    attention: str = "mha"  # "mha" (MHA/GQA/MQA) or "mla"
    kv_cache_heads: int | None = None
    kv_cache_head_dim: int | None = None
    weights_gib: float = 0.0  # whole-model weights; a rank holds weights_gib / tp
    hidden_size: int | None = None
    # Hybrid models (Qwen3-Next-like): every ``full_attention_interval``-th layer is full attention, the others
    # Gated DeltaNet linear attention with ``linear_heads_k``/``linear_heads_v`` heads of ``linear_head_dim``.
    full_attention_interval: int | None = None
    linear_heads_k: int | None = None
    linear_heads_v: int | None = None
    linear_head_dim: int | None = None
    linear_conv_kernel: int = 4

    @property
    def dim_vo(self) -> int:
        return self.head_dim_vo if self.head_dim_vo is not None else self.head_dim

    @property
    def kv(self) -> KvDtype:
        """The KV-cache element type (``kv_dtype``)."""
        return kv_dtype(self.kv_dtype)

    @property
    def kv_dtype_bytes(self) -> int:
        """``sizeof(DTypeKV)`` as FlashInfer's FA2 planners see it (0: FA2 has no kernel for this dtype)."""
        return self.kv.planner_bytes

    @property
    def hidden(self) -> int:
        return self.hidden_size if self.hidden_size is not None else self.heads_q * self.head_dim

    @property
    def hybrid(self) -> bool:
        """Full-attention layers interleaved with GDN linear-attention layers."""
        return self.full_attention_interval is not None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The indices of the full-attention layers (every layer unless hybrid: layer i when (i + 1) % interval
        is 0, as Qwen3-Next's ``layer_types`` say)."""
        if self.full_attention_interval is None:
            return tuple(range(self.num_layers))
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.full_attention_interval == 0)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The indices of the GDN linear-attention layers (none unless hybrid)."""
        full = set(self.attention_layers)
        return tuple(i for i in range(self.num_layers) if i not in full)


@dataclass(frozen=True)
class RankHeads:
    """What one rank's wrappers see.

    ``heads_q_decode`` is larger than ``heads_q`` under DCP: queries are all-gathered across the DCP
    group, so the decode wrapper is planned with ``heads_q * dcp`` query heads (the engine plans it so).
    """

    heads_q: int
    heads_kv: int
    heads_q_decode: int
    kv_cache_heads: int
    kv_replicated: bool


def impossible_layout(model: ModelSpec, tp: int, dcp: int, mtp: int) -> str | None:
    """Why a (model, TP, DCP, MTP) combination cannot exist, or None if it can."""
    if tp < 1 or dcp < 1 or mtp < 0:
        return f"tp={tp}, dcp={dcp}, mtp={mtp}: tp and dcp must be >= 1 and mtp >= 0"
    if model.heads_q % tp:
        return f"tp={tp} does not divide the {model.heads_q} query heads of {model.name}"
    if model.heads_kv > tp and model.heads_kv % tp:
        return f"tp={tp} does not divide the {model.heads_kv} KV heads of {model.name}"
    if model.heads_kv < tp and tp % model.heads_kv:
        return f"{model.heads_kv} KV heads of {model.name} cannot be replicated evenly over tp={tp}"
    if dcp > tp or tp % dcp:
        return f"dcp={dcp} must divide tp={tp} (DCP runs inside the TP group)"
    if model.heads_q % model.heads_kv:
        return f"{model.heads_q} query heads of {model.name} are not a multiple of its {model.heads_kv} KV heads"
    for what, heads in (("GDN key", model.linear_heads_k), ("GDN value", model.linear_heads_v)):
        if heads is not None and heads % tp:
            return f"tp={tp} does not divide the {heads} {what} heads of {model.name}"
    return None


def rank_heads(model: ModelSpec, tp: int, dcp: int) -> RankHeads:
    """Per-rank head counts: q heads split over TP, KV heads split or replicated when fewer than TP."""
    reason = impossible_layout(model, tp, dcp, 0)
    if reason:
        raise ValueError(reason)
    heads_q = model.heads_q // tp
    heads_kv = max(1, model.heads_kv // tp)
    cache_heads = model.kv_cache_heads if model.kv_cache_heads is not None else model.heads_kv
    if model.kv_cache_heads is None:
        rank_cache_heads = heads_kv
    else:
        rank_cache_heads = cache_heads if cache_heads == 1 else max(1, cache_heads // tp)
    return RankHeads(
        heads_q=heads_q,
        heads_kv=heads_kv,
        heads_q_decode=heads_q * dcp,
        kv_cache_heads=rank_cache_heads,
        kv_replicated=model.heads_kv < tp,
    )


def kv_bytes_per_token(model: ModelSpec, tp: int, dcp: int) -> int:
    """KV-cache bytes one token costs on one rank, all full-attention layers (K and V; MLA stores one latent).

    A hybrid model's GDN layers keep a fixed state per request, not per token, so they cost no KV tokens here.

    Under DCP the sequence is sharded, so a rank stores 1/dcp of each sequence: the cost per token of
    the global sequence is divided by dcp (rounded up, so capacity is never overstated).
    """
    heads = rank_heads(model, tp, dcp)
    if model.attention == "mla":
        per_layer = heads.kv_cache_heads * model.kv.row_bytes(model.kv_cache_head_dim or model.head_dim)
    else:
        dim = model.kv_cache_head_dim or model.head_dim
        per_layer = 2 * heads.kv_cache_heads * model.kv.row_bytes(dim)
    total = per_layer * len(model.attention_layers)
    return -(-total // dcp)
