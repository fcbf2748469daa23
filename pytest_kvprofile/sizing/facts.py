"""FlashInfer's and the engines' fixed sizes, still importable here for backends written against earlier releases.

Each is defined once, in ``pytest_kvprofile/attention/facts.py`` (FlashInfer's home in this package).
"""

from __future__ import annotations

from pytest_kvprofile.attention.facts import (
    FLASHINFER_INT_WORKSPACE_BYTES,
    FLASHINFER_RECOMMENDED_FLOAT_BYTES,
    SGLANG_FLOAT_BYTES,
    TENSORRT_LLM_FLOAT_BYTES,
    VLLM_DEFAULT_FLOAT_BYTES,
)

__all__ = [
    "FLASHINFER_INT_WORKSPACE_BYTES",
    "FLASHINFER_RECOMMENDED_FLOAT_BYTES",
    "SGLANG_FLOAT_BYTES",
    "TENSORRT_LLM_FLOAT_BYTES",
    "VLLM_DEFAULT_FLOAT_BYTES",
]
