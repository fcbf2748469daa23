"""KV-cache dtypes a matrix may name: what one cached element costs, what the engine calls it, what plans it.

One table, so the bytes a token costs (KV capacity, costs in KV tokens), the element size FlashInfer's planners see
(``sizeof(DTypeKV)``: the decode tile and occupancy) and the string vLLM is configured with never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KV_DTYPES", "KvDtype", "kv_dtype", "kv_dtype_names"]


@dataclass(frozen=True)
class KvDtype:
    """One KV-cache element type.

    ``data_bits`` per element; block-scaled types (NVFP4) add one ``scale_bytes`` scale per ``scale_block``
    elements of a head's row. ``planner_bytes`` is ``sizeof(DTypeKV)`` in FlashInfer's FA2 kernels, 0 where FA2
    has no kernel for it (NVFP4 runs on trtllm-gen only). ``min_cc_major``: the GPUs whose tensor cores read it.
    """

    name: str
    data_bits: int
    vllm: str  # vLLM's --kv-cache-dtype for it
    torch: str  # the torch dtype a FlashInfer plan() is given as kv_data_type ("" where FA2 has none)
    planner_bytes: int
    scale_block: int = 0
    scale_bytes: int = 0
    min_cc_major: int = 0
    quantized: bool = False

    def row_bytes(self, elements: int) -> int:
        """Bytes of one head's row of ``elements`` values, scales included."""
        data = -(-elements * self.data_bits // 8)
        scales = -(-elements // self.scale_block) * self.scale_bytes if self.scale_block else 0
        return data + scales

    def fa2_torch_dtype(self, who: str) -> str:
        """The ``kv_data_type`` an FA2 ``plan()`` takes for this dtype; a ValueError naming ``who`` where FA2 has
        no kernel for it (NVFP4: trtllm-gen only), never another dtype in its place."""
        if not self.fa2:
            raise ValueError(f"{who}: KV dtype {self.name} has no FlashInfer FA2 kernel (trtllm-gen only)")
        return self.torch

    @property
    def fa2(self) -> bool:
        """Whether FlashInfer's FA2 prefill/decode kernels (and so its planners as sized here) take it."""
        return self.planner_bytes > 0


KV_DTYPES: dict[str, KvDtype] = {d.name: d for d in (
    KvDtype("bf16", 16, "auto", "bfloat16", 2),
    KvDtype("auto", 16, "auto", "bfloat16", 2),  # the model's dtype; the matrices' models are bf16
    KvDtype("fp16", 16, "auto", "float16", 2),
    KvDtype("fp32", 32, "auto", "float32", 4),
    KvDtype("fp8", 8, "fp8", "float8_e4m3fn", 1, quantized=True),  # vLLM's "fp8" is E4M3 on CUDA
    KvDtype("fp8_e4m3", 8, "fp8_e4m3", "float8_e4m3fn", 1, quantized=True),
    KvDtype("fp8_e5m2", 8, "fp8_e5m2", "float8_e5m2", 1, quantized=True),
    # NVFP4: E2M1 values, one E4M3 scale per 16 of a row; Blackwell tensor cores, trtllm-gen kernels only
    KvDtype("nvfp4", 4, "nvfp4", "", 0, scale_block=16, scale_bytes=1, min_cc_major=10, quantized=True),
)}


def kv_dtype_names() -> tuple[str, ...]:
    return tuple(KV_DTYPES)


def kv_dtype(name: str) -> KvDtype:
    """The table's entry; a ValueError naming the known ones otherwise."""
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r} (known: {', '.join(KV_DTYPES)})") from None
