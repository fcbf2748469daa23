"""KV-cache dtypes a matrix may name: what one cached element costs and what plans it.

One table, so the bytes a token costs (KV capacity, costs in KV tokens) and the element size FlashInfer's planners
see (``sizeof(DTypeKV)``: the decode tile and occupancy) never disagree. What each engine calls a dtype, and on which
GPUs it routes one to trtllm-gen only, are the engine's facts (``engines/<name>/facts.py``, read through
``matrix.engine_facts``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvprofile.matrix.engine_facts import route_policy

__all__ = ["KV_DTYPES", "KvDtype", "kv_dtype", "kv_dtype_names"]


@dataclass(frozen=True)
class KvDtype:
    """One KV-cache element type.

    ``data_bits`` per element; block-scaled types (NVFP4) add one ``scale_bytes`` scale per ``scale_block``
    elements of a head's row. ``planner_bytes`` is ``sizeof(DTypeKV)`` in FlashInfer's FA2 kernels (NVFP4: its
    packed ``uint8`` storage). ``min_cc_major``: the GPUs that can read it. ``fa2_max_head_dim``: the largest head
    FlashInfer builds its FA2 decode for (0: any). The GPUs on which the engine runs it on trtllm-gen only, never
    FA2, are the route policy's (``RoutePolicy.trtllm_only``).
    """

    name: str
    data_bits: int
    torch: str  # the torch dtype a FlashInfer plan() is given as kv_data_type ("" where FA2 has none)
    planner_bytes: int
    scale_block: int = 0
    scale_bytes: int = 0
    min_cc_major: int = 0
    quantized: bool = False
    fa2_max_head_dim: int = 0

    @property
    def model_torch(self) -> str:
        """The model's torch dtype over this cache: the cache's own where it is unquantized (the cache is the model's
        dtype), bfloat16 under a quantized one (a bf16 model, as --kv-cache-dtype puts it under one)."""
        return "bfloat16" if self.quantized else self.torch

    def row_bytes(self, elements: int) -> int:
        """Bytes of one head's row of ``elements`` values, scales included."""
        data = -(-elements * self.data_bits // 8)
        scales = -(-elements // self.scale_block) * self.scale_bytes if self.scale_block else 0
        return data + scales

    def fa2_refusal(self, compute_capability: tuple[int, int] | None, head_dim: int = 0) -> str | None:
        """Why the engine plans no FA2 route for this dtype on a GPU of ``compute_capability`` at ``head_dim`` (the
        larger of the QK and VO dims), so that its routes are trtllm-gen's; None where FA2 plans it. None for
        ``compute_capability``: a GPU where FA2 reads the dtype (callers of the one-argument form before NVFP4 ran
        off SM100)."""
        major, minor = compute_capability or (0, 0)
        trtllm_only = route_policy().trtllm_only_on(self.name, major)
        if trtllm_only is not None:
            return (f"KV dtype {self.name} runs on FlashInfer's trtllm-gen kernels only on sm_{major}{minor} "
                    f"({trtllm_only.why})")
        if self.fa2_max_head_dim and head_dim > self.fa2_max_head_dim:
            return (f"KV dtype {self.name} at head dim {head_dim}: FlashInfer builds its FA2 decode for it up to "
                    f"head dim {self.fa2_max_head_dim} only (larger heads: SM100+ kernels)")
        return None

    def fa2_torch_dtype(self, who: str, compute_capability: tuple[int, int] | None = None, head_dim: int = 0) -> str:
        """The ``kv_data_type`` an FA2 ``plan()`` takes for this dtype; a ValueError naming ``who`` where the engine
        plans no FA2 route for it (:meth:`fa2_refusal`), never another dtype in its place."""
        refusal = self.fa2_refusal(compute_capability, head_dim)
        if refusal is not None:
            raise ValueError(f"{who}: {refusal}")
        return self.torch


KV_DTYPES: dict[str, KvDtype] = {d.name: d for d in (
    KvDtype("bf16", 16, "bfloat16", 2),
    KvDtype("auto", 16, "bfloat16", 2),  # the model's dtype; the matrices' models are bf16
    KvDtype("fp16", 16, "float16", 2),
    KvDtype("fp32", 32, "float32", 4),
    KvDtype("fp8", 8, "float8_e4m3fn", 1, quantized=True),  # E4M3, as the engines read "fp8" on CUDA
    KvDtype("fp8_e4m3", 8, "float8_e4m3fn", 1, quantized=True),
    KvDtype("fp8_e5m2", 8, "float8_e5m2", 1, quantized=True),
    # NVFP4: E2M1 values, one E4M3 scale per 16 of a row, planned on FA2 as packed uint8 (FlashInfer's DTypeKV)
    KvDtype("nvfp4", 4, "uint8", 1, scale_block=16, scale_bytes=1, min_cc_major=8, quantized=True,
            fa2_max_head_dim=256),
)}


def kv_dtype_names() -> tuple[str, ...]:
    return tuple(KV_DTYPES)


def kv_dtype(name: str) -> KvDtype:
    """The table's entry; a ValueError naming the known ones otherwise."""
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r} (known: {', '.join(KV_DTYPES)})") from None
